// Tests of QueuedWriter (common/rpc/queued_writer.h) on a real gRPC server on
// loopback: a Generation service whose Generate stream is driven by the test
// through the writer, read by a real client stub. Ordering, finish after the
// queue drains, concurrent enqueues, enqueues after Finish, cancellation.
#include "common/rpc/queued_writer.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "knapserve/v1/generation.grpc.pb.h"

namespace knapserve {
namespace {

using Response = v1::GenerateResponse;

// A server stream the test drives. The test owns it (OnDone only notifies),
// so it may call the writer after Finish and look at it afterwards.
class TestStream final : public grpc::ServerWriteReactor<Response> {
 public:
  void OnWriteDone(bool ok) override { writer.OnWriteDone(ok); }
  void OnCancel() override {
    writer.Cancel();
    cancelled.Notify();  // after Cancel: the test checks its effect at once
  }
  void OnDone() override { done.Notify(); }

  QueuedWriter<Response> writer{this};
  absl::Notification cancelled;
  absl::Notification done;
};

class TestService final : public v1::Generation::CallbackService {
 public:
  grpc::ServerWriteReactor<Response>* Generate(
      grpc::CallbackServerContext*, const v1::GenerateRequest*) override {
    auto stream = std::make_unique<TestStream>();
    TestStream* raw = stream.get();
    absl::MutexLock lock(&mu_);
    streams_.push_back(std::move(stream));
    return raw;
  }

  // The stream of the next call to arrive (waits up to 30 s; nullptr after).
  TestStream* NextStream() {
    absl::MutexLock lock(&mu_);
    const size_t want = taken_ + 1;
    auto arrived = [this, want]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return streams_.size() >= want;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&arrived), absl::Seconds(30)))
      return nullptr;
    return streams_[taken_++].get();
  }

 private:
  absl::Mutex mu_;
  std::vector<std::unique_ptr<TestStream>> streams_ ABSL_GUARDED_BY(mu_);
  size_t taken_ ABSL_GUARDED_BY(mu_) = 0;
};

Response Message(const std::string& text) {
  Response response;
  response.mutable_chunk()->set_text(text);
  return response;
}

struct Received {
  std::vector<std::string> texts;
  grpc::Status status;
};

class QueuedWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port_);
    builder.RegisterService(&service_);
    // Fixed flow-control windows: with BDP probing a client that never
    // reads could still take in megabytes, and the full-queue test would
    // drain its queue on a slow machine.
    builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_NE(port_, 0);
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    stub_ = v1::Generation::NewStub(
        grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port_),
                                  grpc::InsecureChannelCredentials(), args));
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  // Reads one whole call. `before_reading` runs after the call started and
  // before the first Read; `after_first` runs after the first message.
  Received Read(grpc::ClientContext* context,
                const std::function<void()>& before_reading,
                const std::function<void()>& after_first = nullptr) {
    Received out;
    auto reader = stub_->Generate(context, v1::GenerateRequest());
    if (before_reading) before_reading();
    Response response;
    while (reader->Read(&response)) {
      out.texts.push_back(response.chunk().text());
      if (out.texts.size() == 1 && after_first) after_first();
    }
    out.status = reader->Finish();
    return out;
  }

  TestService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Generation::Stub> stub_;
  int port_ = 0;
};

TEST_F(QueuedWriterTest, WritesInOrderAndFinishesAfterTheQueueDrains) {
  // 4000 messages of 1 KB: far more than the HTTP/2 window, so while the
  // client does not read, most of them wait in the queue.
  constexpr int kMessages = 4000;
  const std::string padding(1000, 'x');
  absl::Notification may_read;
  Received got;
  std::thread client([&] {
    grpc::ClientContext context;
    got = Read(&context, [&] { may_read.WaitForNotification(); });
  });
  TestStream* stream = service_.NextStream();
  ASSERT_NE(stream, nullptr);
  for (int i = 0; i < kMessages; ++i) {
    ASSERT_TRUE(stream->writer.Enqueue(Message(absl::StrCat(i, ":", padding))));
  }
  stream->writer.Finish(
      grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "after the last"));
  // Finish did not cut the queue: it is still waiting to be written.
  EXPECT_GT(stream->writer.pending(), 0u);
  EXPECT_FALSE(stream->done.HasBeenNotified());
  may_read.Notify();
  client.join();
  ASSERT_EQ(got.texts.size(), static_cast<size_t>(kMessages));
  for (int i = 0; i < kMessages; ++i) {
    ASSERT_EQ(got.texts[i], absl::StrCat(i, ":", padding)) << i;
  }
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(got.status.error_message(), "after the last");
  EXPECT_TRUE(stream->done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(stream->writer.pending(), 0u);
  EXPECT_FALSE(stream->writer.broken());
}

TEST_F(QueuedWriterTest,
       ConcurrentEnqueuesFromSeveralThreadsAllArriveInPerThreadOrder) {
  constexpr int kThreads = 8;
  constexpr int kPerThread = 300;
  Received got;
  std::thread client([&] {
    grpc::ClientContext context;
    got = Read(&context, nullptr);
  });
  TestStream* stream = service_.NextStream();
  ASSERT_NE(stream, nullptr);
  std::atomic<int> refused{0};
  std::vector<std::thread> producers;
  for (int t = 0; t < kThreads; ++t) {
    producers.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        if (!stream->writer.Enqueue(Message(absl::StrCat(t, ":", i))))
          refused.fetch_add(1);
      }
    });
  }
  for (std::thread& p : producers) p.join();
  stream->writer.Finish(grpc::Status::OK);
  client.join();
  EXPECT_EQ(refused.load(), 0);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  ASSERT_EQ(got.texts.size(), static_cast<size_t>(kThreads * kPerThread));
  std::vector<int> next(kThreads, 0);
  for (const std::string& text : got.texts) {
    std::vector<std::string> parts = absl::StrSplit(text, ':');
    ASSERT_EQ(parts.size(), 2u) << text;
    int t = 0;
    int i = 0;
    ASSERT_TRUE(absl::SimpleAtoi(parts[0], &t) &&
                absl::SimpleAtoi(parts[1], &i))
        << text;
    ASSERT_GE(t, 0);
    ASSERT_LT(t, kThreads);
    EXPECT_EQ(i, next[t]) << "thread " << t << " out of order";
    next[t] = i + 1;
  }
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(next[t], kPerThread) << t;
  EXPECT_TRUE(stream->done.WaitForNotificationWithTimeout(absl::Seconds(30)));
}

TEST_F(QueuedWriterTest, EnqueueAfterFinishIsDroppedAndTheFirstFinishWins) {
  absl::Notification may_read;
  Received got;
  std::thread client([&] {
    grpc::ClientContext context;
    got = Read(&context, [&] { may_read.WaitForNotification(); });
  });
  TestStream* stream = service_.NextStream();
  ASSERT_NE(stream, nullptr);
  for (const char* text : {"a", "b", "c"})
    EXPECT_TRUE(stream->writer.Enqueue(Message(text)));
  stream->writer.Finish(grpc::Status::OK);
  EXPECT_FALSE(stream->writer.Enqueue(Message("late")));
  stream->writer.Finish(
      grpc::Status(grpc::StatusCode::INTERNAL, "second finish"));
  may_read.Notify();
  client.join();
  EXPECT_EQ(got.texts, (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(got.status.ok()) << got.status.error_message();
  ASSERT_TRUE(stream->done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  // After the stream is done the writer still refuses, and never writes.
  EXPECT_FALSE(stream->writer.Enqueue(Message("after done")));
  EXPECT_EQ(stream->writer.pending(), 0u);
}

TEST_F(QueuedWriterTest,
       CancellationDropsTheQueueRefusesMoreAndTheStreamStillFinishes) {
  grpc::ClientContext context;
  absl::Notification first_read;
  Received got;
  std::thread client([&] {
    got = Read(&context, nullptr, [&] {
      first_read.Notify();
      context.TryCancel();
    });
  });
  TestStream* stream = service_.NextStream();
  ASSERT_NE(stream, nullptr);
  ASSERT_TRUE(stream->writer.Enqueue(Message("first")));
  ASSERT_TRUE(first_read.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(
      stream->cancelled.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(stream->writer.broken());
  EXPECT_FALSE(stream->writer.Enqueue(Message("after cancel")));
  EXPECT_FALSE(
      stream->done.HasBeenNotified());  // gRPC still waits for a Finish
  stream->writer.Finish(grpc::Status::OK);
  EXPECT_TRUE(stream->done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  client.join();
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(got.texts, std::vector<std::string>{"first"});
}

TEST_F(QueuedWriterTest, CancellationWhileAFinishWaitsForAFullQueueFinishes) {
  // The client never reads: the queue cannot drain, Finish waits; then the
  // client cancels, the write in flight fails, and the stream finishes.
  const std::string padding(1000, 'x');
  grpc::ClientContext context;
  absl::Notification cancel;
  Received got;
  std::thread client([&] {
    got = Read(&context, [&] {
      cancel.WaitForNotification();
      context.TryCancel();
    });
  });
  TestStream* stream = service_.NextStream();
  ASSERT_NE(stream, nullptr);
  for (int i = 0; i < 4000; ++i)
    ASSERT_TRUE(stream->writer.Enqueue(Message(padding)));
  stream->writer.Finish(grpc::Status::OK);
  EXPECT_FALSE(stream->done.HasBeenNotified());
  cancel.Notify();
  EXPECT_TRUE(stream->done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  client.join();
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(got.texts.size(), 4000u);
  EXPECT_TRUE(stream->writer.broken());
  EXPECT_EQ(stream->writer.pending(), 0u);
}

}  // namespace
}  // namespace knapserve

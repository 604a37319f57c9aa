// Continuous batching through the Generation gRPC service over real loopback
// gRPC (executor/api/generation_service.h, batch_engine.h): concurrent streams
// of mixed modes equal local generation, a request that can never fit the K/V
// pool is RESOURCE_EXHAUSTED, and a storm of cancellations, deadlines and
// Aborts leaves every K/V block free, as the metrics' gauges show.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "executor/api/executor_server.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::CachedModel;
using testing::StoriesTokenizer;

struct Got {
  grpc::Status status;
  std::vector<int32_t> ids;
  std::optional<v1::FinalResult> final;
};

Got Stream(v1::Generation::Stub& stub, const v1::GenerateRequest& request,
           grpc::ClientContext* context = nullptr,
           const std::function<void(int chunks)>& on_chunk = nullptr) {
  grpc::ClientContext local;
  if (context == nullptr) context = &local;
  Got out;
  auto reader = stub.Generate(context, request);
  v1::GenerateResponse response;
  int chunks = 0;
  while (reader->Read(&response)) {
    if (response.has_chunk()) {
      out.ids.insert(out.ids.end(), response.chunk().token_ids().begin(),
                     response.chunk().token_ids().end());
      if (on_chunk) on_chunk(++chunks);
    } else if (response.has_final()) {
      out.final = response.final();
    }
  }
  out.status = reader->Finish();
  return out;
}

struct Fixture {
  const LlamaModel* model = nullptr;
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<ExecutorServer> server;
  std::unique_ptr<v1::Generation::Stub> stub;
};

// A server over stories260k with a K/V pool of `blocks` blocks of 16.
void Start(Fixture& f, int64_t blocks, MetricsRegistry* metrics,
           int max_running = 8, RequestLimits limits = RequestLimits()) {
  f.model = CachedModel("stories260k");
  ASSERT_NE(f.model, nullptr);
  auto pool = KvPool::Create(
      *f.model, KvPoolOptions{blocks * f.model->KvBytesPerBlock(16), 16});
  ASSERT_TRUE(pool.ok()) << pool.status();
  f.pool = std::move(*pool);
  GenerationServiceOptions options;
  options.scheduler.max_running = max_running;
  options.scheduler.max_queue = 64;
  options.engine.max_batch_tokens = 32;
  options.kv_pool = f.pool.get();
  options.metrics = metrics;
  options.model_path = testing::Stories260kDir();
  options.limits = limits;
  // These tests count drafts and exit depths of streams that share one
  // process: no guard verdict (tests/executor/engine/guard_test.cc) may
  // turn a later stream plain, whatever this machine's timings.
  options.default_speculation.guard = false;
  auto server = ExecutorServer::Start(*f.model, *StoriesTokenizer(), options,
                                      "127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  f.server = std::move(*server);
  f.stub = v1::Generation::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", f.server->port()),
                          grpc::InsecureChannelCredentials()));
}

v1::GenerateRequest Request(const std::string& text, int max_new,
                            int mode = 0) {
  v1::GenerateRequest r;
  r.set_text(text);
  r.set_max_new_tokens(max_new);
  r.set_temperature(0);
  r.set_ignore_eos(true);
  if (mode == 1) {
    r.mutable_speculation()->set_mode(v1::SPECULATION_MODE_STATIC);
    r.mutable_speculation()->set_static_mask("a1,m3");
    r.mutable_speculation()->set_max_draft_tokens(3);
  } else if (mode == 2) {
    r.mutable_speculation()->set_mode(v1::SPECULATION_MODE_SPECBOUND);
    r.mutable_speculation()->set_specbound_lambda(0.5);
    r.mutable_speculation()->set_specbound_t0(2);
    r.mutable_speculation()->set_specbound_check_every(1);
    r.mutable_speculation()->set_max_draft_tokens(4);
  }
  return r;
}

double Gauge(const std::string& text, const std::string& name) {
  const std::string key = name + " ";
  const size_t at = text.find("\n" + key);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + 1 + key.size()));
}

TEST(GenerationServiceBatchingTest, MixedModeStreamsEqualLocalGeneration) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  MetricsRegistry metrics;
  Fixture f;
  Start(f, 400, &metrics);
  const std::vector<std::string> prompts = {
      "Once upon a time", "Zoo", "The little dog ran to the park and saw",
      "Lily"};
  // Modes by i % 3: off, static, specbound.
  std::vector<Got> got(9);
  std::vector<std::thread> threads;
  for (int i = 0; i < 9; ++i) {
    threads.emplace_back([&, i] {
      got[i] = Stream(*f.stub, Request(prompts[i % 4], 40 + 5 * i, i % 3));
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < 9; ++i) {
    ASSERT_TRUE(got[i].status.ok()) << i << got[i].status.error_message();
    GenerationRequest local;
    local.prompt_ids = *StoriesTokenizer()->Encode(prompts[i % 4], true);
    local.max_new_tokens = 40 + 5 * i;
    local.ignore_eos = true;
    auto want = Generate(*f.model, *StoriesTokenizer(), local);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(got[i].ids, want->output_ids) << i;
    ASSERT_TRUE(got[i].final.has_value());
    if (i % 3 != 0) {
      EXPECT_GT(got[i].final->speculation_stats().drafts(), 0) << i;
    }
    if (i % 3 == 2) {
      const v1::SpeculationStats& s = got[i].final->speculation_stats();
      EXPECT_EQ(s.mode(), v1::SPECULATION_MODE_SPECBOUND);
      EXPECT_GT(s.exit_depths_size(), 0) << i;
      EXPECT_GE(s.mean_exit_depth(), 1.0) << i;
    }
  }
  const std::string text = metrics.Render();
  EXPECT_NE(text.find("knapserve_specbound_exit_tokens_total{depth="),
            std::string::npos)
      << text;
  EXPECT_EQ(Gauge(text, "knapserve_kv_blocks_total"), 400) << text;
  EXPECT_EQ(Gauge(text, "knapserve_kv_blocks_used"), 0) << text;
  EXPECT_GT(Gauge(text, "knapserve_batch_steps"), 0) << text;
  // Exposed (-1 when missing); how many depends on timing.
  EXPECT_GE(Gauge(text, "knapserve_batch_budgeted_prefill_steps"), 0) << text;
}

TEST(GenerationServiceBatchingTest,
     ARequestThatCanNeverFitIsResourceExhausted) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Fixture f;
  Start(f, 4, nullptr);  // 64 positions in all
  const Got refused = Stream(*f.stub, Request("Once upon a time", 100));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.status.error_message();
  EXPECT_NE(refused.status.error_message().find("--kv-cache-memory"),
            std::string::npos)
      << refused.status.error_message();
  // What fits still runs.
  const Got fits = Stream(*f.stub, Request("Once upon a time", 20));
  EXPECT_TRUE(fits.status.ok()) << fits.status.error_message();
  EXPECT_EQ(fits.ids.size(), 20u);
}

// Oversize requests (a message over --max-request-bytes, too many prompt
// tokens, max_new_tokens, stop strings) each get a clear error naming the
// limit while a stream already running carries on to its normal end.
TEST(GenerationServiceBatchingTest,
     OversizeRequestsAreRefusedWhileOthersStream) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  RequestLimits limits;
  limits.max_request_bytes = 64 << 10;
  limits.max_prompt_tokens = 100;
  limits.max_new_tokens = 300;
  limits.max_stop_strings = 2;
  limits.max_stop_bytes = 8;
  Fixture f;
  Start(f, 200, nullptr, 8, limits);
  const v1::GenerateRequest runner = Request("Once upon a time", 250);
  auto want = Generate(*f.model, *StoriesTokenizer(), [&] {
    GenerationRequest local;
    local.prompt_ids = *StoriesTokenizer()->Encode("Once upon a time", true);
    local.max_new_tokens = 250;
    local.ignore_eos = true;
    return local;
  }());
  ASSERT_TRUE(want.ok()) << want.status();
  absl::Notification streaming;
  Got running;
  std::thread runner_thread([&] {
    running = Stream(*f.stub, runner, nullptr, [&](int chunks) {
      if (chunks == 3) streaming.Notify();
    });
  });
  ASSERT_TRUE(streaming.WaitForNotificationWithTimeout(absl::Seconds(60)));
  struct Case {
    v1::GenerateRequest request;
    grpc::StatusCode code;
    std::string says;
  };
  std::vector<Case> cases;
  cases.push_back({Request(std::string(100 << 10, 'a'), 10),
                   grpc::StatusCode::RESOURCE_EXHAUSTED, ""});
  {
    v1::GenerateRequest r = Request("x", 10);
    for (int i = 0; i < 101; ++i) r.mutable_token_ids()->add_ids(300);
    cases.push_back(
        {r, grpc::StatusCode::INVALID_ARGUMENT, "--max-prompt-tokens"});
  }
  cases.push_back({Request("Once upon a time", 301),
                   grpc::StatusCode::INVALID_ARGUMENT,
                   "--max-new-tokens-limit"});
  {
    v1::GenerateRequest r = Request("Once", 10);
    for (const char* stop : {"a", "b", "c"}) r.add_stop(stop);
    cases.push_back(
        {r, grpc::StatusCode::INVALID_ARGUMENT, "--max-stop-strings"});
  }
  {
    v1::GenerateRequest r = Request("Once", 10);
    r.add_stop("a much longer stop");
    cases.push_back(
        {r, grpc::StatusCode::INVALID_ARGUMENT, "--max-stop-bytes"});
  }
  for (const Case& c : cases) {
    const Got got = Stream(*f.stub, c.request);
    EXPECT_EQ(got.status.error_code(), c.code) << got.status.error_message();
    EXPECT_NE(got.status.error_message().find(c.says), std::string::npos)
        << got.status.error_message();
    EXPECT_TRUE(got.ids.empty());
  }
  runner_thread.join();
  EXPECT_TRUE(running.status.ok()) << running.status.error_message();
  EXPECT_EQ(running.ids, want->output_ids);
  // Within the limits a request still runs.
  const Got fits = Stream(*f.stub, Request("Once upon a time", 300));
  EXPECT_TRUE(fits.status.ok()) << fits.status.error_message();
}

// Cancellations, deadlines and Aborts in a storm, with more requests than
// the pool holds at once: afterwards every block is free and the server
// serves normally.
TEST(GenerationServiceBatchingTest, StopStormsLeaveNoBlockBehind) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  MetricsRegistry metrics;
  Fixture f;
  // Room for about three 200-token sequences at a time.
  Start(f, 40, &metrics, /*max_running=*/16);
  std::vector<std::thread> threads;
  std::atomic<int> oks{0};
  for (int i = 0; i < 24; ++i) {
    threads.emplace_back([&, i] {
      v1::GenerateRequest r = Request("Once upon a time", 190);
      r.set_request_id(absl::StrCat("storm-", i));
      grpc::ClientContext context;
      switch (i % 3) {
        case 0:  // deadline
          context.set_deadline(std::chrono::system_clock::now() +
                               std::chrono::milliseconds(5 + 7 * i));
          Stream(*f.stub, r, &context);
          break;
        case 1:  // client cancellation after a few chunks
          Stream(*f.stub, r, &context, [&](int chunks) {
            if (chunks == 1 + i % 4) context.TryCancel();
          });
          break;
        default: {  // Abort from another call
          const Got got = Stream(*f.stub, r, &context, [&](int chunks) {
            if (chunks != 2) return;
            grpc::ClientContext abort_context;
            v1::AbortRequest abort;
            abort.set_request_id(r.request_id());
            v1::AbortResponse response;
            f.stub->Abort(&abort_context, abort, &response);
          });
          if (got.status.ok()) ++oks;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_GT(oks.load(), 0);
  // The last stops land within a step.
  for (int i = 0; i < 200 && f.pool->sequences() > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(f.pool->used_blocks(), 0);
  EXPECT_EQ(f.pool->reserved_blocks(), 0);
  const std::string text = metrics.Render();
  EXPECT_EQ(Gauge(text, "knapserve_kv_blocks_used"), 0) << text;
  EXPECT_EQ(Gauge(text, "knapserve_kv_blocks_reserved"), 0) << text;
  EXPECT_EQ(Gauge(text, "knapserve_kv_sequences"), 0) << text;
  const Got after = Stream(*f.stub, Request("Zoo", 30));
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.ids.size(), 30u);
}

}  // namespace
}  // namespace knapserve

// QueuedWriter<Response>: the write side of one server-streaming gRPC call
// (a grpc::ServerWriteReactor<Response> or grpc::ServerBidiReactor<Request,
// Response>). gRPC allows one write in flight per stream; the services produce
// responses on their own threads whenever they like. This class sits between:
//
//   - Enqueue(response) from any thread: queued, written in order.
//   - One write in flight at a time; the reactor's OnWriteDone(ok) must call
//     OnWriteDone(ok) here, which starts the next write.
//   - Finish(status) from any thread: the stream finishes with `status` once
//     every response queued before it is written (or a write failed). The
//     first Finish wins; responses enqueued after it are dropped.
//   - Cancel() (from the reactor's OnCancel): queued responses are dropped and
//     new ones refused; a Finish already requested, or the next one, goes out
//     as soon as the write in flight (if any) completes.
//
//   class Stream : public grpc::ServerWriteReactor<Msg> {
//     QueuedWriter<Msg> writer_{this};
//     void OnWriteDone(bool ok) override { writer_.OnWriteDone(ok); }
//     void OnCancel() override { writer_.Cancel(); }
//     void OnDone() override { delete this; }
//   };
//
// Ownership: the reactor owns its writer (a member) and the writer borrows the
// reactor. gRPC may run OnDone, and so delete both, on another thread as soon
// as the reactor's Finish runs; the writer calls it last and touches nothing
// afterwards. So the owner's rule is: no Enqueue/Finish/Cancel may start after
// the owner's own Finish call returned, unless it knows OnDone has not run
// (calls made while Finish waits for the queue to drain are safe and dropped).
//
// Thread safety: every method from any thread. The reactor's StartWrite and
// Finish are never called under the writer's lock, since gRPC may run a
// reaction inline on the calling thread.
#ifndef KNAPSERVE_COMMON_RPC_QUEUED_WRITER_H_
#define KNAPSERVE_COMMON_RPC_QUEUED_WRITER_H_

#include <grpcpp/support/status.h>

#include <deque>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace knapserve {

template <typename Response>
class QueuedWriter {
 public:
  // `reactor`: anything with StartWrite(const Response*) and
  // Finish(grpc::Status), i.e. the stream's server reactor.
  template <typename Reactor>
  explicit QueuedWriter(Reactor* reactor)
      : reactor_(reactor),
        start_write_([](void* r, const Response* response) {
          static_cast<Reactor*>(r)->StartWrite(response);
        }),
        finish_([](void* r, grpc::Status status) {
          static_cast<Reactor*>(r)->Finish(std::move(status));
        }) {}

  QueuedWriter(const QueuedWriter&) = delete;
  QueuedWriter& operator=(const QueuedWriter&) = delete;

  // Queues `response` and starts writing it if no write is in flight.
  // Returns false (and drops it) once Finish or Cancel was called or a write
  // failed.
  bool Enqueue(Response response) ABSL_LOCKS_EXCLUDED(mu_) {
    void* reactor = reactor_;
    auto start_write = start_write_;
    const Response* next = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (finish_requested_ || broken_) return false;
      queue_.push_back(std::move(response));
      next = TakeNextWriteLocked();
    }
    // The queue's front stays put while it is in flight (deque::push_back
    // keeps references), so it is safe to write from outside the lock.
    if (next != nullptr) start_write(reactor, next);
    return true;
  }

  // Finishes the stream with `status` after the queued responses are
  // written. Later calls are ignored.
  void Finish(grpc::Status status) ABSL_LOCKS_EXCLUDED(mu_) {
    void* reactor = reactor_;
    auto finish = finish_;
    {
      absl::MutexLock lock(&mu_);
      if (finish_requested_) return;
      finish_requested_ = true;
      status_ = std::move(status);
      if (!ReadyToFinishLocked()) return;  // OnWriteDone finishes
      finished_ = true;
      status = std::move(*status_);
    }
    finish(reactor,
           std::move(status));  // last use of `this`: OnDone may delete it
  }

  // The reactor's OnWriteDone(ok): the write in flight completed (ok) or the
  // stream broke (!ok: every later write would fail too, so the queue is
  // dropped). Starts the next write, or finishes when asked to and drained.
  void OnWriteDone(bool ok) ABSL_LOCKS_EXCLUDED(mu_) {
    void* reactor = reactor_;
    auto start_write = start_write_;
    auto finish = finish_;
    const Response* next = nullptr;
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      if (writing_) {
        writing_ = false;
        queue_.pop_front();  // the response just written
      }
      if (!ok) {
        broken_ = true;
        queue_.clear();
      }
      next = TakeNextWriteLocked();
      if (next == nullptr) {
        if (!finish_requested_ || finished_ || !ReadyToFinishLocked()) return;
        finished_ = true;
        status = std::move(*status_);
      }
    }
    if (next != nullptr) {
      start_write(reactor, next);
      return;
    }
    finish(reactor, std::move(status));  // last use of `this`
  }

  // The reactor's OnCancel: drops what is queued and refuses new responses.
  // The stream still needs a Finish (gRPC runs OnDone only after one); it
  // goes out as soon as no write is in flight.
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_) {
    void* reactor = reactor_;
    auto finish = finish_;
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      broken_ = true;
      // The front is in flight while writing_: gRPC still reads it.
      while (queue_.size() > (writing_ ? 1u : 0u)) queue_.pop_back();
      if (!finish_requested_ || finished_ || !ReadyToFinishLocked()) return;
      finished_ = true;
      status = std::move(*status_);
    }
    finish(reactor, std::move(status));  // last use of `this`
  }

  // Whether responses can no longer reach the client: a write failed or
  // Cancel was called.
  bool broken() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return broken_;
  }

  // Responses queued and not yet written (the one in flight included).
  size_t pending() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return queue_.size();
  }

 private:
  // The front of the queue when a write may start now (marks it in flight),
  // else nullptr.
  const Response* TakeNextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || finished_ || broken_ || queue_.empty()) return nullptr;
    writing_ = true;
    return &queue_.front();
  }

  // No write in flight and nothing left that could still be written.
  bool ReadyToFinishLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !writing_ && (queue_.empty() || broken_);
  }

  // The reactor, type-erased; set once and read without the lock (copied to
  // locals before the lock is released, so the last call touches no member).
  void* const reactor_;
  void (*const start_write_)(void* reactor, const Response* response);
  void (*const finish_)(void* reactor, grpc::Status status);

  mutable absl::Mutex mu_;
  std::deque<Response> queue_
      ABSL_GUARDED_BY(mu_);  // front() is in flight while writing_
  std::optional<grpc::Status> status_
      ABSL_GUARDED_BY(mu_);  // set by the first Finish
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) =
      false;                                  // the reactor's Finish was called
  bool broken_ ABSL_GUARDED_BY(mu_) = false;  // a write failed, or Cancel
};

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_RPC_QUEUED_WRITER_H_

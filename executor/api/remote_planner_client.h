// RemotePlannerClient: the PlannerClient (common/plan/planner_client.h) that
// talks to a knapserve-planner over one long-lived knapserve.v1.Planner/Plan
// stream.
//
// Submit never blocks the decode thread: it queues the request (a newer
// request of the same sequence replaces a queued one, whose callback gets
// Cancelled) and a client thread encodes it (common/wire/plan_codec.h, K/V as a
// window of the prefix) and writes it. A reader thread matches answers to
// requests by (sequence, step) and runs their callbacks.
//
// Tracing (common/trace, when on): each request is a plan.encode span and a
// plan.send span (from the write to the answer, SpanKind client) in the
// trace of the request's traceparent; the request carries plan.send's
// traceparent to the planner, and the plan comes back with it
// (DraftPlan::traceparent).
//
// A planner still measuring its latency profile (it started without one)
// answers PLAN_ERROR_CODE_PROFILE_PENDING, which reaches the callback as
// ProfilePendingError: no failure. ProfilePending() is then true for
// profile_pending_retry, so sequences decode without a plan and take no
// snapshot; after that the next trigger sends one again (a plan clears it
// at once).
//
// Faults: when the stream breaks (planner down, restarted, network), every
// request in flight is answered Unavailable, and the client reconnects with
// exponential backoff (initial_backoff doubling up to max_backoff) while
// queued requests wait. The executor meanwhile decodes with its last plan.
//
// Ownership: owns its threads and channel; requests hold K/V handles until
// they are written. The destructor closes the stream and answers everything
// still pending with Unavailable. Thread safety: Submit and Forget from any
// thread; the counters from any thread. One absl::Mutex guards the queue, the
// requests in flight, the open stream's context and the broken/stopping
// flags; callbacks always run without it (they may Submit again).
#ifndef KNAPSERVE_EXECUTOR_API_REMOTE_PLANNER_CLIENT_H_
#define KNAPSERVE_EXECUTOR_API_REMOTE_PLANNER_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/plan/planner_client.h"
#include "common/trace/tracer.h"
#include "common/wire/plan_codec.h"
#include "knapserve/v1/planner.grpc.pb.h"

namespace knapserve {

struct RemotePlannerOptions {
  std::string address;  // host:port of the planner service
  int num_layers = 0;   // of the served model (parses masks in answers)
  KvWindowOptions window;
  std::chrono::milliseconds initial_backoff{100};
  std::chrono::milliseconds max_backoff{5000};
  // After a "profile pending" answer, how long ProfilePending() says so
  // before snapshots go to the planner again.
  std::chrono::milliseconds profile_pending_retry{2000};
  // A plan request that encodes to more bytes than this
  // (--max-plan-request-bytes) fails alone with ResourceExhausted and is
  // never sent; answers are read up to the same size.
  int max_message_bytes = 512 << 20;
  // TLS to the planner (with a client certificate for mutual TLS;
  // tools/tls_from_flags.h); nullptr = plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
};

class RemotePlannerClient : public PlannerClient {
 public:
  explicit RemotePlannerClient(RemotePlannerOptions options);
  ~RemotePlannerClient() override;

  void Submit(PlanRequest request, PlanCallback done) override
      ABSL_LOCKS_EXCLUDED(mu_);
  void Forget(uint64_t sequence_id) override ABSL_LOCKS_EXCLUDED(mu_);
  // True for profile_pending_retry after the planner answered "profile
  // pending", until then or until a plan arrives.
  bool ProfilePending() const override ABSL_LOCKS_EXCLUDED(mu_);

  // Answers "profile pending" received so far.
  int64_t profile_pending_answers() const ABSL_LOCKS_EXCLUDED(mu_);

  // Whether a stream is open now; how many times one was (re)opened; bytes of
  // encoded requests written; requests written.
  bool connected() const { return connected_.load(); }
  int64_t connections() const { return connections_.load(); }
  int64_t bytes_sent() const { return bytes_sent_.load(); }
  int64_t requests_sent() const { return requests_sent_.load(); }

 private:
  struct Queued {
    PlanRequest request;
    PlanCallback done;
  };
  using Key = std::pair<uint64_t, int64_t>;  // (sequence, step)

  // The client thread: connects, serves a stream until it breaks, backs off,
  // reconnects, until the destructor stops it.
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  // Writes queued requests until the stream breaks or the client stops
  // (client thread).
  void Serve(
      grpc::ClientReaderWriter<v1::PlanRequest, v1::PlanResponse>* stream)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Answers requests in flight until the stream ends, then marks it broken
  // (the reader thread Run starts per stream).
  void Read(grpc::ClientReaderWriter<v1::PlanRequest, v1::PlanResponse>* stream)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Answers every request in flight with `status`.
  void FailInFlight(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

  const RemotePlannerOptions options_;
  mutable absl::Mutex mu_;
  absl::CondVar cv_;  // signalled when the queue, broken_ or stopping_ change
  std::deque<uint64_t> order_
      ABSL_GUARDED_BY(mu_);  // sequences with a queued request
  std::map<uint64_t, Queued> queued_ ABSL_GUARDED_BY(mu_);  // one per sequence
  // A request on the stream: its callback, and the max_draft its plan's
  // gamma may not exceed.
  struct Pending {
    PlanCallback done;
    int max_draft = 0;
    trace::Span send_span;  // plan.send, ended when the answer arrives
  };
  std::map<Key, Pending> in_flight_
      ABSL_GUARDED_BY(mu_);  // written, not yet answered
  // The open stream's context (owned by Run's stack), for the destructor's
  // TryCancel; null between streams.
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool broken_ ABSL_GUARDED_BY(mu_) =
      false;  // the open stream's reader saw it end
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // the destructor runs
  // Until when ProfilePending() is true (after a "profile pending" answer).
  std::chrono::steady_clock::time_point profile_pending_until_
      ABSL_GUARDED_BY(mu_);
  int64_t profile_pending_answers_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<bool> connected_{false};
  std::atomic<int64_t> connections_{0};
  std::atomic<int64_t> bytes_sent_{0};
  std::atomic<int64_t> requests_sent_{0};
  std::thread thread_;
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_API_REMOTE_PLANNER_CLIENT_H_

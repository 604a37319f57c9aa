// InProcessPlanner: the PlannerClient (common/plan/planner_client.h) that
// solves in the executor's own process, on its own thread, so planning overlaps
// decoding.
//
// Requests are queued per sequence and solved one at a time, oldest sequence
// first. A sequence has at most one queued request: a newer one replaces it
// (the older callback gets Cancelled), since only the freshest snapshot
// matters. The solve reads the executor's K/V through the handles in the
// request (no copy). Policies: PlanPolicy::kKnapSpec -> SolveKnapSpec,
// kClasp -> SolveClasp, kStatic -> SolveStatic (planner/planner.h).
//
// On CPU the solve runs with `threads` OpenMP threads of its own, beside the
// decode threads; on CUDA the same code would run on the planner thread's
// current stream (not built here: Debian's LibTorch is CPU-only).
//
// Tracing (common/trace, when a tracer is installed): each request is a
// plan.queue span (its wait) and a plan.solve span, children of the
// request's traceparent; the solve's stages (planner/planner.h) are
// children of plan.solve.
//
// A planner may start without its latency profile (CreateWithoutProfile: a
// server that serves while the profile is measured in the background,
// planner/background_profile.h). Until SetProfile, ProfilePending() is true
// and every request is answered ProfilePendingError
// (common/plan/planner_client.h) by the worker; from then on it plans with
// the profile.
//
// Ownership: borrows the model (must outlive the planner); owns its copy of
// the latency profile and its worker thread. The destructor stops the worker
// after the running solve and answers queued requests with Unavailable.
// Exceptions: a solve that throws (a LibTorch check, any std::exception)
// answers its request with Internal and is counted; the planner goes on.
// Thread safety: Submit, Forget, Solve, SetProfile, profile() and the
// counters may be called from any thread. One absl::Mutex guards the queue,
// the counters, the profile and the stopping flag; solves and callbacks run
// without it (callbacks may Submit again; a solve holds its own reference to
// the profile).
#ifndef KNAPSERVE_PLANNER_INPROCESS_PLANNER_H_
#define KNAPSERVE_PLANNER_INPROCESS_PLANNER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/base/thread_priority.h"
#include "common/model/llama.h"
#include "common/plan/planner_client.h"
#include "planner/latency_profile.h"
#include "planner/planner.h"

namespace knapserve {

struct InProcessPlannerOptions {
  // tau, weights, reference-token cap, pooled (or lazy) alpha_hat,
  // keep_first_and_last
  // (max_draft comes with each request). CLaSp and static plans use its
  // keep_first_and_last and alpha_prior too.
  KnapSpecOptions knapspec;
  // CPU threads of the solve (OpenMP threads of the planner thread).
  int threads = 1;
  // Scheduling of the planner's threads (common/base/thread_priority.h). On
  // a CPU the solve competes with decoding for the same cores: nice 19 lets
  // the decode threads win most of the time, so plans come later rather
  // than decoding slower; idle (SCHED_IDLE) costs decoding less still, but
  // while decoding keeps every core busy no plan comes at all. The binaries
  // default to nice 19 when the decode's threads and the planner's
  // outnumber the cores (tools/cli_flags.h's PlannerPriorityFromFlags;
  // README.md has the measurements), else nice 0.
  ThreadPriority priority;
  // Cores the decode's passes leave to each solve while it runs
  // (common/model/parallel_for.h, ScopedSolveCores); 0 = none, the
  // binaries' default (--planner-cores, tools/cli_flags.h's
  // PlannerCoresFromFlags). With it a solve ends in its CPU time instead of
  // starving at nice 19, but the decode runs on fewer cores meanwhile:
  // planner/README.md has both sides measured.
  int reserve_cores = 0;
  // Fault injection for tests; empty (the default) in production. Runs on the
  // planner thread just before each solve, inside the solve's exception
  // boundary: what it throws fails that request as a LibTorch error in the
  // solve would.
  std::function<void(const PlanRequest& request)> before_solve_for_tests;
};

class InProcessPlanner : public PlannerClient {
 public:
  // FailedPrecondition when `profile` was measured for another model, device
  // or dtype (thread count differences are allowed: the profile says how the
  // decode ran, the planner has its own threads); InvalidArgument for bad
  // options.
  static absl::StatusOr<std::unique_ptr<InProcessPlanner>> Create(
      const LlamaModel& model, LatencyProfile profile,
      InProcessPlannerOptions options);
  // A planner whose profile comes later (SetProfile); InvalidArgument for
  // bad options.
  static absl::StatusOr<std::unique_ptr<InProcessPlanner>> CreateWithoutProfile(
      const LlamaModel& model, InProcessPlannerOptions options);
  ~InProcessPlanner() override;

  void Submit(PlanRequest request, PlanCallback done) override
      ABSL_LOCKS_EXCLUDED(mu_);
  void Forget(uint64_t sequence_id) override ABSL_LOCKS_EXCLUDED(mu_);
  bool ProfilePending() const override ABSL_LOCKS_EXCLUDED(mu_);

  // The profile lands: requests from now on are solved with it. The checks
  // of Create (FailedPrecondition, InvalidArgument); FailedPrecondition when
  // the planner already has one.
  absl::Status SetProfile(LatencyProfile profile) ABSL_LOCKS_EXCLUDED(mu_);

  // Solves `request` on the calling thread (what the worker does per
  // request); ProfilePendingError while the planner has no profile.
  absl::StatusOr<DraftPlan> Solve(const PlanRequest& request) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // The latency profile it plans with (immutable once set); nullptr while
  // pending.
  std::shared_ptr<const LatencyProfile> profile() const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Requests solved (or failed) so far, and requests replaced by newer ones.
  int64_t solved() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t replaced() const ABSL_LOCKS_EXCLUDED(mu_);
  // Requests waiting for the worker now.
  int64_t queued() const ABSL_LOCKS_EXCLUDED(mu_);
  // Solves that threw (a c10::Error, any std::exception): each request was
  // answered Internal and the planner went on.
  int64_t internal_errors() const { return internal_errors_.load(); }

 private:
  struct Pending {
    PlanRequest request;
    PlanCallback done;
    std::chrono::steady_clock::time_point queued_at;
  };

  InProcessPlanner(const LlamaModel& model,
                   std::shared_ptr<const LatencyProfile> profile,
                   InProcessPlannerOptions options);
  // The worker thread: solves queued requests until the destructor stops it.
  void Run() ABSL_LOCKS_EXCLUDED(mu_);

  const LlamaModel& model_;
  const InProcessPlannerOptions options_;

  mutable absl::Mutex mu_;
  // nullptr until the profile lands (CreateWithoutProfile, SetProfile).
  std::shared_ptr<const LatencyProfile> profile_ ABSL_GUARDED_BY(mu_);
  absl::CondVar cv_;  // signalled when a request is queued or stopping_ is set
  std::deque<uint64_t> order_
      ABSL_GUARDED_BY(mu_);  // sequences with a queued request
  absl::flat_hash_map<uint64_t, Pending> pending_
      ABSL_GUARDED_BY(mu_);  // one per sequence
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t solved_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t replaced_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> internal_errors_{0};
  std::thread worker_;  // last: started after everything above exists
};

}  // namespace knapserve

#endif  // KNAPSERVE_PLANNER_INPROCESS_PLANNER_H_

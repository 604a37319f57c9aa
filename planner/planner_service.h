// PlannerService: the knapserve.v1.Planner gRPC service (proto/knapserve/v1/
// planner.proto) in front of an InProcessPlanner.
//
// Each executor holds one long-lived Plan stream and multiplexes its
// sequences over it. Requests are decoded (common/wire/plan_codec.h), solved in
// order per planner (a newer request of the same sequence replaces a queued
// one; the replaced one is answered SUPERSEDED), and answered on the same
// stream in completion order (common/rpc/queued_writer.h writes them one at a
// time). Sequence ids are scoped to their stream: two executors may both use
// sequence "1". A request that cannot be decoded is answered at once with
// PLAN_ERROR_CODE_INVALID_ARGUMENT; a model fingerprint other than the
// planner's gets FINGERPRINT_MISMATCH. An exception while decoding (or inside
// the solve, see planner/inprocess_planner.h) answers that request with
// PLAN_ERROR_CODE_INTERNAL and is counted; the stream and the planner go on.
// The stream finishes OK once the executor half-closes and every answer is
// written.
//
// Tracing: a request's traceparent (PlanRequest.traceparent, the executor's
// plan.send span) parents the planner's plan.queue and plan.solve spans
// (planner/inprocess_planner.h), exported under this process's service.name.
//
// Metrics (when given a registry): knapserve_planner_server_requests_total,
// _received_bytes_total, _plans_total, _superseded_total (a queued request
// replaced by a newer one of its sequence), _failed_total{code} (an answer
// with an error), _profile_pending_total (answered "profile pending" while
// the planner's latency profile was still being measured: no failure), the
// histograms _solve_seconds and _queue_seconds of the plans it solved, and the
// gauge _queue_depth (requests waiting now).
//
// Ownership: borrows the InProcessPlanner and the metrics registry, which
// must outlive the server. A
// stream (its reactor) lives from Plan until gRPC's OnDone, which comes only
// after every solve it submitted has answered. Thread safety: gRPC calls in
// on its own threads, solve callbacks on the planner's; all stream state is
// guarded per stream.
#ifndef KNAPSERVE_PLANNER_PLANNER_SERVICE_H_
#define KNAPSERVE_PLANNER_PLANNER_SERVICE_H_

#include <atomic>
#include <cstdint>

#include "common/metrics/metrics.h"
#include "knapserve/v1/planner.grpc.pb.h"
#include "planner/inprocess_planner.h"

namespace knapserve {

class PlannerService final : public v1::Planner::CallbackService {
 public:
  // `num_layers` and `default_max_draft` resolve requests (the model's layer
  // count; max_draft_tokens 0 means the default).
  PlannerService(InProcessPlanner* planner, int num_layers,
                 int default_max_draft = 10,
                 MetricsRegistry* metrics = nullptr);

  grpc::ServerBidiReactor<v1::PlanRequest, v1::PlanResponse>* Plan(
      grpc::CallbackServerContext* context) override;

  // Requests received and answers written so far, over all streams.
  int64_t requests() const { return requests_.load(); }
  int64_t answers() const { return answers_.load(); }
  // Requests whose decoding threw (answered INTERNAL); solves that threw are
  // counted by the planner (InProcessPlanner::internal_errors).
  int64_t internal_errors() const { return internal_errors_.load(); }

 private:
  class Stream;
  // The registry's handles (null without a registry).
  struct Metrics {
    explicit Metrics(MetricsRegistry& registry);
    MetricsRegistry& registry;
    Counter& requests;
    Counter& received_bytes;
    Counter& plans;
    Counter& superseded;
    Histogram& solve_seconds;
    Histogram& queue_seconds;
  };
  // Counts a request's answer: a plan, a superseded request, or a failure
  // by code. Any thread.
  void RecordAnswer(const absl::StatusOr<DraftPlan>& plan);

  InProcessPlanner* planner_;
  const int num_layers_;
  const int default_max_draft_;
  std::atomic<uint64_t> next_internal_id_{1};
  std::atomic<int64_t> requests_{0};
  std::atomic<int64_t> answers_{0};
  std::atomic<int64_t> internal_errors_{0};
  std::unique_ptr<Metrics> metrics_;
};

}  // namespace knapserve

#endif  // KNAPSERVE_PLANNER_PLANNER_SERVICE_H_

// GenerationMetrics: the Generation service's Prometheus metrics
// (common/metrics/metrics.h): what they are called, and how a finished
// request updates them. Speculation counters keep vLLM's names and meaning
// (knapserve_spec_decode_*); planner, plan cache and guard metrics are ours.
//
// Per request: knapserve_requests_total{code=...} by final gRPC status,
// knapserve_request_internal_errors_total for requests that ended INTERNAL (an
// exception inside LibTorch or the generator), then tokens, latencies and the
// speculation and planning statistics of the result, if there is one, and
// for KNN-SSD requests the routed domain (knapserve_routed_requests_total
// {domain}) and the routing time. Gauges
// read the scheduler (running, queued), the batch engine (batch size, steps,
// requests waiting for K/V), the K/V pool (blocks total, used, reserved,
// free; sequences holding blocks) and the process's planning state (plan
// cache entries, planner CPU share) when rendered.
//
// Ownership: borrows the registry, the scheduler and the engine; the
// registry's gauges keep references to them, so it must not be rendered
// after they (the service) are gone. Shares the plan cache and budget.
// Thread safety: RecordRequest from any thread.
#ifndef KNAPSERVE_EXECUTOR_API_GENERATION_METRICS_H_
#define KNAPSERVE_EXECUTOR_API_GENERATION_METRICS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/metrics/metrics.h"
#include "executor/api/scheduler.h"
#include "executor/engine/batch_engine.h"
#include "executor/engine/generator.h"
#include "executor/planning/plan_cache.h"

namespace knapserve {

class GenerationMetrics {
 public:
  // Registers every family in `registry`.
  GenerationMetrics(MetricsRegistry& registry, const Scheduler& scheduler,
                    const BatchEngine& engine, const PlanningShared& planning);

  // A finished Generate call: its final status code and, when it produced a
  // result, that result; `ttft_seconds` and `total_seconds` from its arrival.
  void RecordRequest(absl::StatusCode code, const GenerationResult* result,
                     double ttft_seconds, double total_seconds);
  // Another choice of a request with n > 1 (RecordRequest counted the
  // request and its first choice): its generated tokens, speculation and
  // planning counters and inter-token latency; the prompt is not counted
  // again (it was prefilled once).
  void RecordChoice(const GenerationResult& choice);

 private:
  // The counters of one choice's result; the prompt's tokens too when
  // `count_prompt`.
  void AddResult(const GenerationResult& result, bool count_prompt);

  MetricsRegistry& registry_;
  Counter& internal_errors_;
  Counter& prompt_tokens_;
  Counter& generation_tokens_;
  Counter& drafts_;
  Counter& draft_tokens_;
  Counter& accepted_tokens_;
  Counter& plans_applied_;
  Counter& plan_failures_;
  Counter& planner_wait_;
  Histogram& ttft_;
  Histogram& itl_;
  Histogram& duration_;
  Histogram& solve_;
  Histogram& age_;
  Counter& cache_hits_;
  Counter& cache_misses_;
  Counter& budget_deferrals_;
  Counter& guard_fallbacks_;
  Counter& guard_probe_steps_;
  Counter& guard_plain_steps_;
  Counter& guard_inherited_steps_;
  Counter& guard_carried_steps_;
  Counter& guard_settle_steps_;
  Counter& guard_confirmations_;
  Counter& guard_cleared_losses_;
  Histogram& routing_;
  std::vector<Counter*> triggers_;  // no_plan, new_bucket, drift, recheck

  // knapserve_routed_requests_total{domain=...}.
  Counter& RoutedCounter(const std::string& domain);
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_API_GENERATION_METRICS_H_

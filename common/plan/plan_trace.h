// How plans and plan requests are described on trace spans (common/trace),
// the same way on both sides of the planner contract: the executor's
// plan.snapshot / plan.send / plan.apply and the planner's plan.solve.
//
//   knapserve.plan.policy, .step, .context_length, .max_draft,
//   .exit_threshold, .reference_tokens    (a request)
//   knapserve.plan.mask, .skipped_attention, .skipped_mlp, .gamma,
//   .alpha_hat, .alpha_smoothed, .predicted_tokens_per_second,
//   .predicted_tokens_per_step, .predicted_drafts_per_step,
//   .baseline_tokens_per_second, .candidates, .evaluated_candidates,
//   .solve_seconds, .queue_seconds        (a plan)
//
// Pure functions; a span that does not record costs one check.
#ifndef KNAPSERVE_COMMON_PLAN_PLAN_TRACE_H_
#define KNAPSERVE_COMMON_PLAN_PLAN_TRACE_H_

#include "common/plan/planner_client.h"
#include "common/trace/tracer.h"

namespace knapserve {

void SetPlanRequestAttributes(trace::Span& span, const PlanRequest& request);
void SetPlanAttributes(trace::Span& span, const DraftPlan& plan);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_PLAN_PLAN_TRACE_H_

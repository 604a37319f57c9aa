#include "common/plan/plan_trace.h"

namespace knapserve {

void SetPlanRequestAttributes(trace::Span& span, const PlanRequest& request) {
  if (!span.recording()) return;
  span.SetAttribute("knapserve.plan.policy", PlanPolicyName(request.policy));
  span.SetAttribute("knapserve.plan.step", request.step);
  span.SetAttribute("knapserve.plan.context_length", request.context_length);
  span.SetAttribute("knapserve.plan.max_draft", request.max_draft);
  span.SetAttribute("knapserve.plan.exit_threshold", request.exit_threshold);
  if (request.states.defined() && request.states.dim() == 3) {
    span.SetAttribute("knapserve.plan.reference_tokens",
                      static_cast<int64_t>(request.states.size(1)));
  }
}

void SetPlanAttributes(trace::Span& span, const DraftPlan& plan) {
  if (!span.recording()) return;
  int attention = 0;
  int mlp = 0;
  for (int layer = 0; layer < plan.mask.num_layers(); ++layer) {
    attention += plan.mask.skip_attention(layer) ? 1 : 0;
    mlp += plan.mask.skip_mlp(layer) ? 1 : 0;
  }
  span.SetAttribute("knapserve.plan.mask", plan.mask.ToString());
  span.SetAttribute("knapserve.plan.skipped_attention", attention);
  span.SetAttribute("knapserve.plan.skipped_mlp", mlp);
  span.SetAttribute("knapserve.plan.gamma", plan.gamma);
  span.SetAttribute("knapserve.plan.alpha_hat", plan.alpha_hat);
  span.SetAttribute("knapserve.plan.alpha_smoothed", plan.alpha_smoothed);
  span.SetAttribute("knapserve.plan.predicted_tokens_per_step",
                    plan.predicted_tokens_per_step);
  span.SetAttribute("knapserve.plan.predicted_drafts_per_step",
                    plan.predicted_drafts_per_step);
  span.SetAttribute("knapserve.plan.predicted_tokens_per_second",
                    plan.predicted_tpt);
  span.SetAttribute("knapserve.plan.baseline_tokens_per_second",
                    plan.baseline_tpt);
  span.SetAttribute("knapserve.plan.candidates", plan.num_candidates);
  span.SetAttribute("knapserve.plan.evaluated_candidates", plan.num_evaluated);
  span.SetAttribute("knapserve.plan.solve_seconds", plan.solve_seconds);
  span.SetAttribute("knapserve.plan.queue_seconds", plan.queue_seconds);
}

}  // namespace knapserve

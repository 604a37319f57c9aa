#include "executor/api/planning_json.h"

namespace knapserve {

nlohmann::json PlanningJson(const PlanningStats& s, double decode_seconds) {
  return {{"plan_cache_hits", s.cache_hits},
          {"plan_cache_misses", s.cache_misses},
          {"triggers",
           {{"no_plan", s.triggers_no_plan},
            {"new_bucket", s.triggers_new_bucket},
            {"drift", s.triggers_drift},
            {"recheck", s.triggers_recheck}}},
          {"budget_deferrals", s.budget_deferrals},
          {"solve_seconds", s.solve_seconds},
          {"planner_cpu_share",
           decode_seconds > 0 ? s.solve_seconds / decode_seconds : 0.0},
          {"process_planner_cpu_share", s.process_planner_cpu_share},
          {"guard",
           {{"checks", s.guard_checks},
            {"fallbacks", s.guard_fallbacks},
            {"probe_steps", s.guard_probe_steps},
            {"plain_steps", s.guard_plain_steps},
            {"inherited_steps", s.guard_inherited_steps},
            {"carried_steps", s.guard_carried_steps},
            {"settle_steps", s.guard_settle_steps},
            {"confirmations", s.guard_confirmations},
            {"cleared_losses", s.guard_cleared_losses},
            {"last_spec_tps", s.guard_last_spec_tps},
            {"last_plain_tps", s.guard_last_plain_tps}}},
          {"profile_pending", s.profile_pending},
          {"profile_pending_steps", s.profile_pending_steps}};
}

nlohmann::json AppliedPlansJson(absl::Span<const AppliedPlan> plans) {
  nlohmann::json out = nlohmann::json::array();
  for (const AppliedPlan& p : plans) {
    out.push_back(
        {{"step", p.applied_step},
         {"plan_step", p.plan_step},
         {"age_steps", p.age_steps},
         {"context_length", p.context_length},
         {"mask", p.mask},
         {"gamma", p.gamma},
         {"alpha_hat", p.alpha_hat},
         {"alpha_smoothed", p.alpha_smoothed},
         {"evidence_trials", p.evidence_trials},
         {"predicted_tpt", p.predicted_tpt},
         {"predicted_tokens_per_step", p.predicted_tokens_per_step},
         {"predicted_drafts_per_step", p.predicted_drafts_per_step},
         {"baseline_tpt", p.baseline_tpt},
         {"num_candidates", p.num_candidates},
         {"solve_seconds", p.solve_seconds},
         {"queue_seconds", p.queue_seconds},
         {"source", p.source},
         {"measured_steps", p.measured_steps},
         {"measured_tokens", p.measured_tokens},
         {"measured_seconds", p.measured_seconds},
         {"measured_tpt", p.measured_tpt()},
         {"measured_tpt_standard_error", p.measured_tpt_standard_error()},
         {"measured_tokens_sq", p.measured_tokens_sq},
         {"measured_token_seconds", p.measured_token_seconds},
         {"measured_seconds_sq", p.measured_seconds_sq},
         {"measured_drafted", p.measured_drafted},
         {"measured_accepted", p.measured_accepted},
         {"beside_solve_steps", p.beside_solve_steps},
         {"beside_solve_tokens", p.beside_solve_tokens},
         {"beside_solve_seconds", p.beside_solve_seconds},
         {"unsteady_steps", p.unsteady_steps},
         {"unsteady_tokens", p.unsteady_tokens},
         {"unsteady_seconds", p.unsteady_seconds},
         {"measured_plain_tpt", p.measured_plain_tpt},
         {"draft_cost_ratio", p.draft_cost_ratio},
         {"draft_calibrated_tpt", p.draft_calibrated_tpt()},
         {"calibrated_tpt", p.calibrated_tpt()}});
  }
  return out;
}

}  // namespace knapserve

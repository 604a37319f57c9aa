// Refining a cached plan with the drafting evidence of the requests that
// decode under it.
//
// A plan's gamma and its predictions (tokens and drafts per step, tokens per
// second) rest on per-token odds the planner measured on one snapshot's
// reference tokens: 16 tokens, so a share of 0.5 has a standard error of
// 0.125, and a plan predicted 2.05 tokens a step where its mask then made
// 2.40 (stories-24l, the README). Every request that drafts with the plan's
// mask sees many more tokens. DraftEvidence counts them as the step model
// (common/plan/step_forecast.h) defines its odds, and RefinePlan pools them
// with the reference tokens, then chooses gamma again over 0..D with the
// prices the planner used (DraftPlan::basis): the same objective, with more
// evidence. The mask stays: changing it takes a solve.
//
// The PlanCache (plan_cache.h) keeps one DraftEvidence per cached solve and
// calls RefinePlan as it grows.
//
// Plain structs and pure functions; thread-compatible.
#ifndef KNAPSERVE_EXECUTOR_PLANNING_PLAN_REFINEMENT_H_
#define KNAPSERVE_EXECUTOR_PLANNING_PLAN_REFINEMENT_H_

#include <cstdint>
#include <optional>

#include "common/plan/planner_client.h"

namespace knapserve {

// What the steps drafted with one mask showed of its per-token odds
// (ConfidenceStop, common/plan/step_forecast.h). A step with budget gamma
// that drafted m tokens (1 <= m <= gamma) of which the first j were
// accepted (0 <= j <= m) shows:
//   acceptance of drafts 1..min(j+1, m): j accepted, a rejection when j < m;
//   confidence of drafts 1..m-1 (each went on), and of draft m when
//     m < gamma (it stopped the draft; at m = gamma the draft ends anyway);
//   both, confident and accepted, of the drafts whose acceptance and
//     confidence were both seen: min(j, m-1) of them were.
struct DraftEvidence {
  int64_t accept_trials = 0;
  int64_t accepted = 0;
  int64_t go_on_trials = 0;
  int64_t went_on = 0;
  int64_t both_trials = 0;
  int64_t both = 0;

  // Adds one step. A step that drafted nothing (a batch dropped its drafts,
  // or it ran plainly) or whose counts are out of range adds nothing.
  void AddStep(int gamma, int drafted, int accepted_tokens);
};

// The plan with its odds pooled from its reference tokens and `evidence`,
//   share' = (share * r + successes) / (r + trials),
// smoothed with the planner's prior over r + trials tokens, and gamma chosen
// again over 0..D (D = basis.verify_seconds.size() - 1) by ForecastStep
// with the basis's prices: the highest tokens per second, the smallest gamma
// on ties, and gamma 0 unless a draft beats plain decoding (as the planner's
// grid). With basis.gamma_fixed only the predictions change. alpha_hat
// becomes share', alpha_smoothed the smoothed acceptance,
// predicted_tokens_per_step / predicted_drafts_per_step / predicted_tpt /
// baseline_tpt the forecast of the chosen gamma, evidence_trials
// evidence.accept_trials; everything else (mask, basis, solve fields) is
// kept. nullopt when the plan cannot be refined: gamma 0, or no basis.
std::optional<DraftPlan> RefinePlan(const DraftPlan& plan,
                                    const DraftEvidence& evidence);

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_PLANNING_PLAN_REFINEMENT_H_

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
// Prompts differ: in one bench run the first prompt under a plan accepted
// 0.98 of its drafts and the next ones 0.76-0.95, so odds pooled over every
// request over-promised the harder ones by 8-19%. RefinePlanForSequence gives
// one sequence its own odds: the other requests' pooled odds as a prior worth
// at most `prior_tokens` draft tokens, and the sequence's own drafting on
// top. The PlanController (plan_controller.h) uses it for the plan in force.
//
// Steps differ within a prompt too, so the evidence and the odds keep draft
// 1 of each step apart from drafts 2..gamma (DraftEvidence): one share over
// all drafts promised stories-24l-skip 4.2% more tokens per step than its
// steps made, by position 2.3% (tools/README.md).
//
// Plain structs and pure functions; thread-compatible.
#ifndef KNAPSERVE_EXECUTOR_PLANNING_PLAN_REFINEMENT_H_
#define KNAPSERVE_EXECUTOR_PLANNING_PLAN_REFINEMENT_H_

#include <cstdint>
#include <optional>

#include "common/plan/planner_client.h"

namespace knapserve {

// What the steps drafted with one mask showed of its per-token odds at one
// group of draft positions (ConfidenceStop, common/plan/step_forecast.h).
// Draft k of a step with budget gamma that drafted m tokens (1 <= k <= m <=
// gamma), of which the first j were accepted (0 <= j <= m), shows:
//   acceptance when k <= j + 1 (drafts 1..k-1 accepted): accepted if k <= j;
//   confidence when k < gamma (at k = gamma the draft ends anyway): it went
//     on if k < m;
//   both, confident and accepted, when both were seen: both if k <= j and
//     k < m.
struct DraftCounts {
  int64_t accept_trials = 0;
  int64_t accepted = 0;
  int64_t go_on_trials = 0;
  int64_t went_on = 0;
  int64_t both_trials = 0;
  int64_t both = 0;
};

// The counts of draft 1 of each step and of drafts 2..gamma, apart: a step
// reaches draft 2 only through an accepted draft 1, so where a text has easy
// runs and hard spots the later drafts are accepted more often, and one
// share over all of them promises more tokens a step than the steps make
// (common/plan/step_forecast.h, "Later draft positions"; on
// stories-24l-skip that was 4-5%).
struct DraftEvidence {
  DraftCounts first;  // draft 1 of each step
  DraftCounts later;  // drafts 2..gamma

  // Acceptance trials at every position (first and later).
  int64_t accept_trials() const {
    return first.accept_trials + later.accept_trials;
  }

  // Adds one step. A step that drafted nothing (a batch dropped its drafts,
  // or it ran plainly) or whose counts are out of range adds nothing.
  void AddStep(int gamma, int drafted, int accepted_tokens);
};

// The plan with its odds pooled from its reference tokens and `evidence`,
//   share' = (share * r + successes) / (r + trials),
// for draft 1 and for drafts 2..gamma apart (draft 1's counts pooled with the
// r reference tokens; the later drafts' with the pairs of consecutive
// reference tokens the basis carries, PlanBasis::later_*, over their own
// trials, or where it carries none with draft 1's pooled odds over r tokens),
// smoothed with the planner's prior over the tokens pooled, and gamma chosen
// again over 0..D
// (D = basis.verify_seconds.size() - 1) by ForecastStep with the basis's
// prices: the highest tokens per second, the smallest gamma on ties, and
// gamma 0 unless a draft beats plain decoding (as the planner's grid). With
// basis.gamma_fixed only the predictions change. alpha_hat becomes share'
// over every position (first and later counts together: what the
// PlanController's drift check compares a sequence's acceptance with),
// alpha_smoothed its smoothing; predicted_tokens_per_step /
// predicted_drafts_per_step / predicted_tpt / baseline_tpt are the forecast
// of the chosen gamma with the two groups' odds, evidence_trials
// evidence.accept_trials(); everything else (mask, basis, solve fields) is
// kept. nullopt when the plan cannot be refined: gamma 0, or no basis.
std::optional<DraftPlan> RefinePlan(const DraftPlan& plan,
                                    const DraftEvidence& evidence);

// Of `all`, the counts not in `part` (each at least 0, successes at most
// trials, per group): the other sequences' evidence when `part` is one
// sequence's share of the pool `all`.
DraftEvidence EvidenceWithout(const DraftEvidence& all,
                              const DraftEvidence& part);

// One sequence's plan: as RefinePlan, but each share is
//   share_seq = (share_others * w + own successes) / (w + own trials),
// where share_others pools the plan's reference tokens with the others'
// evidence (EvidenceWithout(pooled, own)) as RefinePlan pools them (over r +
// their trials tokens for draft 1; for drafts 2..gamma over the basis's pair
// trials, or r, + theirs), and w = min(those tokens, prior_tokens), per
// group of positions: however much the other requests
// drafted, after about prior_tokens draft tokens of its own a sequence's odds
// are mostly its own text's. Smoothed over w + own trials tokens; gamma chosen
// again as RefinePlan does. evidence_trials counts the others' and the own
// accept trials. With no own evidence it is RefinePlan(plan, pooled) when the
// pool holds at most prior_tokens - r trials. nullopt as RefinePlan.
std::optional<DraftPlan> RefinePlanForSequence(const DraftPlan& plan,
                                               const DraftEvidence& pooled,
                                               const DraftEvidence& own,
                                               int64_t prior_tokens);

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_PLANNING_PLAN_REFINEMENT_H_

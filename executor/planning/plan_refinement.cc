#include "executor/planning/plan_refinement.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "common/plan/step_forecast.h"

namespace knapserve {
namespace {

// (share * r + successes) / (r + trials), the share alone without tokens.
double PooledShare(double share, int64_t r, int64_t successes, int64_t trials) {
  const double tokens = static_cast<double>(std::max<int64_t>(0, r));
  const double total = tokens + static_cast<double>(trials);
  if (trials <= 0 || !(total > 0)) return std::clamp(share, 0.0, 1.0);
  return std::clamp(
      (std::clamp(share, 0.0, 1.0) * tokens + static_cast<double>(successes)) /
          total,
      0.0, 1.0);
}

}  // namespace

void DraftEvidence::AddStep(int gamma, int drafted, int accepted_tokens) {
  const int m = drafted;
  const int j = accepted_tokens;
  if (gamma < 1 || m < 1 || m > gamma || j < 0 || j > m) return;
  for (int k = 1; k <= m; ++k) {
    DraftCounts& counts = k == 1 ? first : later;
    if (k <= j + 1) {
      ++counts.accept_trials;
      counts.accepted += k <= j;
    }
    if (k < gamma) {
      ++counts.go_on_trials;
      counts.went_on += k < m;
      if (k <= j + 1) {
        ++counts.both_trials;
        counts.both += k <= j && k < m;
      }
    }
  }
}

namespace {

// A per-token share and the tokens it rests on.
struct Odds {
  double share = 0;
  int64_t tokens = 0;
};

// `share` over `prior` tokens (at most `prior_cap` of them count) pooled
// with successes of trials.
Odds Pool(const Odds& prior, int64_t prior_cap, int64_t successes,
          int64_t trials) {
  const int64_t w = std::min(std::max<int64_t>(0, prior.tokens),
                             std::max<int64_t>(0, prior_cap));
  return {PooledShare(prior.share, w, successes, trials), w + trials};
}

// The step model's three odds (common/plan/step_forecast.h) at one group of
// draft positions.
struct TokenOdds {
  Odds accept, go_on, both;
};

// `prior` (at most `prior_cap` tokens of each) pooled with `counts`.
TokenOdds PoolCounts(const TokenOdds& prior, int64_t prior_cap,
                     const DraftCounts& counts) {
  return {Pool(prior.accept, prior_cap, counts.accepted, counts.accept_trials),
          Pool(prior.go_on, prior_cap, counts.went_on, counts.go_on_trials),
          Pool(prior.both, prior_cap, counts.both, counts.both_trials)};
}

// Draft 1's odds and those of drafts 2..gamma, and the acceptance share over
// every position (the plan's alpha_hat).
struct StepOdds {
  TokenOdds first, later;
  Odds accept_all;
};

// The basis's reference odds, r tokens each.
TokenOdds ReferenceOdds(const PlanBasis& basis) {
  const int64_t r = std::max<int64_t>(0, basis.reference_tokens);
  return {{basis.accept_share, r},
          {basis.go_on_share, r},
          {basis.accept_and_go_on_share, r}};
}

// `prior` (at most `prior_cap` tokens of each odds) pooled with `evidence`,
// each group with its own.
StepOdds PoolEvidence(const StepOdds& prior, int64_t prior_cap,
                      const DraftEvidence& evidence) {
  return {PoolCounts(prior.first, prior_cap, evidence.first),
          PoolCounts(prior.later, prior_cap, evidence.later),
          Pool(prior.accept_all, prior_cap,
               evidence.first.accepted + evidence.later.accepted,
               evidence.accept_trials())};
}

// The basis's odds of drafts 2..gamma from pairs of consecutive reference
// tokens, each over its own trials (rounded: pooled candidates average
// them); nullopt when the planner measured none.
std::optional<TokenOdds> LaterReferenceOdds(const PlanBasis& basis) {
  if (!(basis.later_accept_trials > 0)) return std::nullopt;
  const int64_t accept_tokens = WholeTrials(basis.later_accept_trials);
  return TokenOdds{
      {basis.later_accept_share, accept_tokens},
      {basis.later_go_on_share, basis.later_go_on_trials > 0
                                    ? WholeTrials(basis.later_go_on_trials)
                                    : accept_tokens},
      {basis.later_accept_and_go_on_share, accept_tokens}};
}

// The basis's reference odds pooled with `evidence`: draft 1's with the
// reference tokens; the later drafts' with the planner's pairs of
// consecutive reference tokens where it measured them, else with draft 1's
// odds as their prior, at most r tokens of it. Until the later drafts are
// seen (a plan of gamma 1) they are taken to be as the prior says, so
// evidence that draft 1 is accepted can raise gamma; once seen, their own
// counts soon outweigh it.
StepOdds PooledOdds(const PlanBasis& basis, const DraftEvidence& evidence) {
  const TokenOdds reference = ReferenceOdds(basis);
  const int64_t r = reference.accept.tokens;
  const TokenOdds first = PoolCounts(reference, r, evidence.first);
  const std::optional<TokenOdds> later_reference = LaterReferenceOdds(basis);
  return {first,
          later_reference.has_value()
              ? PoolCounts(*later_reference,
                           std::max(later_reference->accept.tokens,
                                    later_reference->go_on.tokens),
                           evidence.later)
              : PoolCounts(first, r, evidence.later),
          Pool(reference.accept, r,
               evidence.first.accepted + evidence.later.accepted,
               evidence.accept_trials())};
}

// One group's smoothed odds as the step model takes them.
LaterDraftOdds Smoothed(const TokenOdds& odds, const AlphaPrior& prior) {
  return SmoothDraftOdds(odds.accept.share, odds.accept.tokens,
                         odds.go_on.share, odds.go_on.tokens, odds.both.share,
                         odds.both.tokens, prior);
}

// The plan with `odds` (smoothed with the basis's prior) and gamma chosen
// again over 0..D; nullopt for gamma 0 or no basis.
std::optional<DraftPlan> ChooseWithOdds(const DraftPlan& plan,
                                        const StepOdds& odds,
                                        int64_t evidence_trials) {
  const PlanBasis& basis = plan.basis;
  if (plan.gamma <= 0 || basis.verify_seconds.empty() ||
      !(basis.draft_seconds > 0)) {
    return std::nullopt;
  }
  const LaterDraftOdds first = Smoothed(odds.first, basis.prior);
  TptCandidate candidate;
  candidate.draft_seconds = basis.draft_seconds;
  candidate.alpha = first.alpha;
  if (basis.confidence_stop) candidate.stop = first.stop;
  // Without evidence both groups are the reference odds: the planner's own
  // candidate, and its closed form.
  const LaterDraftOdds later = Smoothed(odds.later, basis.prior);
  if (later.alpha != first.alpha ||
      (basis.confidence_stop &&
       (later.stop.go_on != first.stop.go_on ||
        later.stop.accept_and_go_on != first.stop.accept_and_go_on))) {
    candidate.later = later;
  }
  const std::vector<double>& verify = basis.verify_seconds;
  const int max_draft = static_cast<int>(verify.size()) - 1;
  const double baseline =
      ForecastStep(candidate, 0, verify).tokens_per_second();
  int gamma = std::min(plan.gamma, max_draft);
  if (!basis.gamma_fixed) {
    gamma = 0;
    double best = baseline * (1 + kMinSpeculationGain);
    for (int g = 1; g <= max_draft; ++g) {
      const double tps = ForecastStep(candidate, g, verify).tokens_per_second();
      if (tps > best) {
        best = tps;
        gamma = g;
      }
    }
  }
  const StepForecast forecast = ForecastStep(candidate, gamma, verify);
  DraftPlan refined = plan;
  refined.gamma = gamma;
  refined.alpha_hat = odds.accept_all.share;
  refined.alpha_smoothed =
      gamma > 0 ? SmoothAlpha(odds.accept_all.share, odds.accept_all.tokens,
                              basis.prior)
                : 0.0;
  refined.predicted_tokens_per_step = forecast.tokens;
  refined.predicted_drafts_per_step = forecast.drafts;
  refined.predicted_tpt = forecast.tokens_per_second();
  refined.baseline_tpt = baseline;
  refined.evidence_trials = evidence_trials;
  return refined;
}

// Of `all`, the counts not in `part`; trials first, then successes bounded
// by them.
DraftCounts CountsWithout(const DraftCounts& all, const DraftCounts& part) {
  const auto without = [](int64_t a, int64_t b) {
    return std::max<int64_t>(0, a - b);
  };
  DraftCounts out;
  out.accept_trials = without(all.accept_trials, part.accept_trials);
  out.accepted =
      std::min(out.accept_trials, without(all.accepted, part.accepted));
  out.go_on_trials = without(all.go_on_trials, part.go_on_trials);
  out.went_on = std::min(out.go_on_trials, without(all.went_on, part.went_on));
  out.both_trials = without(all.both_trials, part.both_trials);
  out.both = std::min(out.both_trials, without(all.both, part.both));
  return out;
}

}  // namespace

std::optional<DraftPlan> RefinePlan(const DraftPlan& plan,
                                    const DraftEvidence& evidence) {
  return ChooseWithOdds(plan, PooledOdds(plan.basis, evidence),
                        evidence.accept_trials());
}

DraftEvidence EvidenceWithout(const DraftEvidence& all,
                              const DraftEvidence& part) {
  DraftEvidence out;
  out.first = CountsWithout(all.first, part.first);
  out.later = CountsWithout(all.later, part.later);
  return out;
}

std::optional<DraftPlan> RefinePlanForSequence(const DraftPlan& plan,
                                               const DraftEvidence& pooled,
                                               const DraftEvidence& own,
                                               int64_t prior_tokens) {
  const DraftEvidence others = EvidenceWithout(pooled, own);
  const StepOdds prior = PooledOdds(plan.basis, others);
  return ChooseWithOdds(plan, PoolEvidence(prior, prior_tokens, own),
                        others.accept_trials() + own.accept_trials());
}

}  // namespace knapserve

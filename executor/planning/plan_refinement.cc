#include "executor/planning/plan_refinement.h"

#include <algorithm>
#include <vector>

#include "common/plan/step_forecast.h"

namespace knapserve {
namespace {

// (share * r + successes) / (r + trials), the share alone without tokens.
double PooledShare(double share, int64_t r, int64_t successes, int64_t trials) {
  const double tokens = static_cast<double>(std::max<int64_t>(0, r));
  const double total = tokens + static_cast<double>(trials);
  if (!(total > 0)) return std::clamp(share, 0.0, 1.0);
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
  accept_trials += j + (j < m ? 1 : 0);
  accepted += j;
  go_on_trials += m < gamma ? m : m - 1;
  went_on += m - 1;
  const int decided = std::min(j + 1, m);
  both_trials += decided - (decided == m && m == gamma ? 1 : 0);
  both += std::min(j, m - 1);
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

// The step model's three odds (common/plan/step_forecast.h).
struct TokenOdds {
  Odds accept, go_on, both;
};

// The basis's reference odds pooled with `evidence`.
TokenOdds PooledOdds(const PlanBasis& basis, const DraftEvidence& evidence) {
  const int64_t r = std::max<int64_t>(0, basis.reference_tokens);
  return {
      Pool({basis.accept_share, r}, r, evidence.accepted,
           evidence.accept_trials),
      Pool({basis.go_on_share, r}, r, evidence.went_on, evidence.go_on_trials),
      Pool({basis.accept_and_go_on_share, r}, r, evidence.both,
           evidence.both_trials)};
}

// The plan with `odds` (smoothed with the basis's prior) and gamma chosen
// again over 0..D; nullopt for gamma 0 or no basis.
std::optional<DraftPlan> ChooseWithOdds(const DraftPlan& plan,
                                        const TokenOdds& odds,
                                        int64_t evidence_trials) {
  const PlanBasis& basis = plan.basis;
  if (plan.gamma <= 0 || basis.verify_seconds.empty() ||
      !(basis.draft_seconds > 0)) {
    return std::nullopt;
  }
  TptCandidate candidate;
  candidate.draft_seconds = basis.draft_seconds;
  candidate.alpha =
      SmoothAlpha(odds.accept.share, odds.accept.tokens, basis.prior);
  if (basis.confidence_stop) {
    const double go_on =
        SmoothAlpha(odds.go_on.share, odds.go_on.tokens, basis.prior);
    const double both =
        SmoothAlpha(odds.both.share, odds.both.tokens, basis.prior);
    candidate.stop =
        ConfidenceStop{go_on, std::min({both, go_on, candidate.alpha})};
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
  refined.alpha_hat = odds.accept.share;
  refined.alpha_smoothed = gamma > 0 ? candidate.alpha : 0.0;
  refined.predicted_tokens_per_step = forecast.tokens;
  refined.predicted_drafts_per_step = forecast.drafts;
  refined.predicted_tpt = forecast.tokens_per_second();
  refined.baseline_tpt = baseline;
  refined.evidence_trials = evidence_trials;
  return refined;
}

}  // namespace

std::optional<DraftPlan> RefinePlan(const DraftPlan& plan,
                                    const DraftEvidence& evidence) {
  return ChooseWithOdds(plan, PooledOdds(plan.basis, evidence),
                        evidence.accept_trials);
}

DraftEvidence EvidenceWithout(const DraftEvidence& all,
                              const DraftEvidence& part) {
  // Trials first, then successes bounded by them.
  const auto without = [](int64_t a, int64_t b) {
    return std::max<int64_t>(0, a - b);
  };
  DraftEvidence out;
  out.accept_trials = without(all.accept_trials, part.accept_trials);
  out.accepted =
      std::min(out.accept_trials, without(all.accepted, part.accepted));
  out.go_on_trials = without(all.go_on_trials, part.go_on_trials);
  out.went_on = std::min(out.go_on_trials, without(all.went_on, part.went_on));
  out.both_trials = without(all.both_trials, part.both_trials);
  out.both = std::min(out.both_trials, without(all.both, part.both));
  return out;
}

std::optional<DraftPlan> RefinePlanForSequence(const DraftPlan& plan,
                                               const DraftEvidence& pooled,
                                               const DraftEvidence& own,
                                               int64_t prior_tokens) {
  const DraftEvidence others = EvidenceWithout(pooled, own);
  const TokenOdds prior = PooledOdds(plan.basis, others);
  const TokenOdds odds{
      Pool(prior.accept, prior_tokens, own.accepted, own.accept_trials),
      Pool(prior.go_on, prior_tokens, own.went_on, own.go_on_trials),
      Pool(prior.both, prior_tokens, own.both, own.both_trials)};
  return ChooseWithOdds(plan, odds, others.accept_trials + own.accept_trials);
}

}  // namespace knapserve

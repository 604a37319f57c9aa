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

std::optional<DraftPlan> RefinePlan(const DraftPlan& plan,
                                    const DraftEvidence& evidence) {
  const PlanBasis& basis = plan.basis;
  if (plan.gamma <= 0 || basis.verify_seconds.empty() ||
      !(basis.draft_seconds > 0)) {
    return std::nullopt;
  }
  const int64_t r = basis.reference_tokens;
  const double accept = PooledShare(basis.accept_share, r, evidence.accepted,
                                    evidence.accept_trials);
  TptCandidate candidate;
  candidate.draft_seconds = basis.draft_seconds;
  candidate.alpha =
      SmoothAlpha(accept, r + evidence.accept_trials, basis.prior);
  if (basis.confidence_stop) {
    const double go_on =
        SmoothAlpha(PooledShare(basis.go_on_share, r, evidence.went_on,
                                evidence.go_on_trials),
                    r + evidence.go_on_trials, basis.prior);
    const double both =
        SmoothAlpha(PooledShare(basis.accept_and_go_on_share, r, evidence.both,
                                evidence.both_trials),
                    r + evidence.both_trials, basis.prior);
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
  refined.alpha_hat = accept;
  refined.alpha_smoothed = gamma > 0 ? candidate.alpha : 0.0;
  refined.predicted_tokens_per_step = forecast.tokens;
  refined.predicted_drafts_per_step = forecast.drafts;
  refined.predicted_tpt = forecast.tokens_per_second();
  refined.baseline_tpt = baseline;
  refined.evidence_trials = evidence.accept_trials;
  return refined;
}

}  // namespace knapserve

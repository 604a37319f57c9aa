#include "common/plan/step_forecast.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace knapserve {

double ExpectedTokensPerStep(double alpha, int gamma) {
  if (gamma <= 0) return 1.0;
  if (1.0 - alpha < 1e-9) return gamma + 1.0;
  return (1.0 - std::pow(alpha, gamma + 1)) / (1.0 - alpha);
}

StepForecast ForecastStep(const TptCandidate& candidate, int gamma,
                          absl::Span<const double> verify_seconds) {
  StepForecast f;
  if (gamma <= 0) {
    f.seconds = verify_seconds[0];
    return f;
  }
  if (!candidate.stop.has_value() && !candidate.later.has_value()) {
    // Exactly TokensPerSecond's terms.
    f.tokens = ExpectedTokensPerStep(candidate.alpha, gamma);
    f.drafts = gamma;
    f.seconds = gamma * candidate.draft_seconds + verify_seconds[gamma];
    return f;
  }
  // Draft 1's odds, and those of drafts 2..gamma: accepted, confident
  // (c), confident and accepted (b). Without a stop c = 1 and b = alpha.
  struct PositionOdds {
    double alpha, go_on, both;
  };
  const auto position_odds = [&candidate](double alpha,
                                          const ConfidenceStop& stop) {
    return candidate.stop.has_value()
               ? PositionOdds{alpha, stop.go_on, stop.accept_and_go_on}
               : PositionOdds{alpha, 1.0, alpha};
  };
  const PositionOdds first =
      position_odds(candidate.alpha, candidate.stop.value_or(ConfidenceStop()));
  const PositionOdds later =
      candidate.later.has_value()
          ? position_odds(candidate.later->alpha, candidate.later->stop)
          : first;
  double reach = 1;    // P(draft k is made)
  double carried = 1;  // P(drafts 1..k-1 accepted and confident)
  double verify = 0;   // sum_k P(m = k) t_verify(n, k+1)
  for (int k = 1; k <= gamma; ++k) {
    const PositionOdds& odds = k == 1 ? first : later;
    f.drafts += reach;
    f.tokens += odds.alpha * carried;
    const double ends_here = k < gamma ? reach * (1 - odds.go_on) : reach;
    verify += ends_here * verify_seconds[k];
    reach *= odds.go_on;
    carried *= odds.both;
  }
  f.seconds = f.drafts * candidate.draft_seconds + verify;
  return f;
}

absl::Status ValidateAlphaPrior(const AlphaPrior& prior) {
  if (!(prior.hits >= 0) || !std::isfinite(prior.hits)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "alpha_prior.hits must be finite and >= 0, got ", prior.hits));
  }
  if (!(prior.misses >= 0) || !std::isfinite(prior.misses)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "alpha_prior.misses must be finite and >= 0, got ", prior.misses));
  }
  return absl::OkStatus();
}

int64_t WholeTrials(double trials) {
  return std::max<int64_t>(1, std::llround(trials));
}

LaterDraftOdds SmoothDraftOdds(double accept_share, int64_t accept_tokens,
                               double go_on_share, int64_t go_on_tokens,
                               double both_share, int64_t both_tokens,
                               const AlphaPrior& prior) {
  LaterDraftOdds out;
  out.alpha = SmoothAlpha(accept_share, accept_tokens, prior);
  out.stop.go_on = SmoothAlpha(go_on_share, go_on_tokens, prior);
  out.stop.accept_and_go_on = std::min(
      {SmoothAlpha(both_share, both_tokens, prior), out.stop.go_on, out.alpha});
  return out;
}

double SmoothAlpha(double share, int64_t r, const AlphaPrior& prior) {
  const double s = std::clamp(share, 0.0, 1.0);
  const double tokens = static_cast<double>(std::max<int64_t>(0, r));
  const double total = tokens + prior.hits + prior.misses;
  if (!(total > 0)) return s;
  return (s * tokens + prior.hits) / total;
}

}  // namespace knapserve

#include "planner/tpt.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace knapserve {

double ExpectedTokensPerStep(double alpha, int gamma) {
  if (gamma <= 0) return 1.0;
  if (1.0 - alpha < 1e-9) return gamma + 1.0;
  return (1.0 - std::pow(alpha, gamma + 1)) / (1.0 - alpha);
}

double TokensPerSecond(double alpha, int gamma, double draft_seconds, double verify_seconds) {
  const double draft = gamma > 0 ? gamma * draft_seconds : 0.0;
  return ExpectedTokensPerStep(alpha, gamma) / (draft + verify_seconds);
}

absl::StatusOr<TptChoice> MaximizeTpt(absl::Span<const TptCandidate> candidates,
                                      absl::Span<const double> verify_seconds, int max_draft) {
  if (max_draft < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_draft must be >= 1, got ", max_draft));
  }
  if (static_cast<int>(verify_seconds.size()) < max_draft + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("verify table has ", verify_seconds.size(),
                     " entries, needs max_draft + 1 = ", max_draft + 1));
  }
  for (int t = 0; t <= max_draft; ++t) {
    if (!(verify_seconds[t] > 0) || !std::isfinite(verify_seconds[t])) {
      return absl::InvalidArgumentError(
          absl::StrCat("verify time for ", t + 1, " tokens must be positive and finite"));
    }
  }
  for (size_t i = 0; i < candidates.size(); ++i) {
    const TptCandidate& c = candidates[i];
    if (!(c.alpha >= 0 && c.alpha <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("candidate ", i, ": alpha_hat ", c.alpha, " outside [0, 1]"));
    }
    if (!(c.draft_seconds > 0) || !std::isfinite(c.draft_seconds)) {
      return absl::InvalidArgumentError(
          absl::StrCat("candidate ", i, ": draft time must be positive and finite"));
    }
  }
  TptChoice best;
  best.baseline_tpt = TokensPerSecond(0, 0, 0, verify_seconds[0]);
  best.tpt = best.baseline_tpt;
  for (size_t i = 0; i < candidates.size(); ++i) {
    for (int gamma = 1; gamma <= max_draft; ++gamma) {
      const double tpt = TokensPerSecond(candidates[i].alpha, gamma, candidates[i].draft_seconds,
                                         verify_seconds[gamma]);
      if (tpt > best.tpt) {
        best.candidate = static_cast<int>(i);
        best.gamma = gamma;
        best.tpt = tpt;
      }
    }
  }
  return best;
}

}  // namespace knapserve

#include "planner/tpt.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"

namespace knapserve {
namespace {

absl::Status CheckGrid(absl::Span<const double> verify_seconds, int max_draft) {
  if (max_draft < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_draft must be >= 1, got ", max_draft));
  }
  if (static_cast<int>(verify_seconds.size()) < max_draft + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("verify table has ", verify_seconds.size(),
                     " entries, needs max_draft + 1 = ", max_draft + 1));
  }
  for (int t = 0; t <= max_draft; ++t) {
    if (!(verify_seconds[t] > 0) || !std::isfinite(verify_seconds[t])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "verify time for ", t + 1, " tokens must be positive and finite"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDraftSeconds(size_t candidate, double draft_seconds) {
  if (!(draft_seconds > 0) || !std::isfinite(draft_seconds)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "candidate ", candidate, ": draft time must be positive and finite"));
  }
  return absl::OkStatus();
}

absl::Status CheckAlpha(size_t candidate, double alpha) {
  if (!(alpha >= 0 && alpha <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "candidate ", candidate, ": alpha_hat ", alpha, " outside [0, 1]"));
  }
  return absl::OkStatus();
}

// Folds candidate i's gamma row into `best` with MaximizeTpt's order: a
// strictly higher TPT wins, and at an equal TPT the lower candidate index (the
// one MaximizeTpt would have met first) wins; within a candidate the first
// gamma. The TPT a draft must exceed to replace plain decoding.
double BaselineToBeat(const TptChoice& best) {
  return best.baseline_tpt * (1.0 + kMinSpeculationGain);
}

absl::Status CheckStop(size_t candidate, double alpha,
                       const std::optional<ConfidenceStop>& stop) {
  if (!stop.has_value()) return absl::OkStatus();
  const double c = stop->go_on;
  const double b = stop->accept_and_go_on;
  if (!(c >= 0 && c <= 1) || !(b >= 0 && b <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("candidate ", candidate, ": confidence stop shares go_on ",
                     c, ", accept_and_go_on ", b, " outside [0, 1]"));
  }
  // Smoothed shares of the same r tokens keep this order; the slack only
  // absorbs rounding.
  if (b > std::min(alpha, c) + 1e-12) {
    return absl::InvalidArgumentError(
        absl::StrCat("candidate ", candidate, ": accept_and_go_on ", b,
                     " exceeds alpha ", alpha, " or go_on ", c));
  }
  return absl::OkStatus();
}

// The later positions' odds as CheckAlpha and CheckStop check draft 1's
// (their stop only where draft 1 has one: ForecastStep ignores it otherwise).
absl::Status CheckLater(size_t candidate, bool has_stop,
                        const std::optional<LaterDraftOdds>& later) {
  if (!later.has_value()) return absl::OkStatus();
  if (absl::Status s = CheckAlpha(candidate, later->alpha); !s.ok()) return s;
  if (!has_stop) return absl::OkStatus();
  return CheckStop(candidate, later->alpha, later->stop);
}

void Consider(int i, const TptCandidate& candidate,
              absl::Span<const double> verify_seconds, int max_draft,
              TptChoice& best) {
  for (int gamma = 1; gamma <= max_draft; ++gamma) {
    const double tpt =
        ForecastStep(candidate, gamma, verify_seconds).tokens_per_second();
    bool wins = false;
    if (best.candidate < 0) {
      wins = tpt > BaselineToBeat(best);
    } else {
      wins = tpt > best.tpt || (tpt == best.tpt && i < best.candidate);
    }
    if (wins) {
      best.candidate = i;
      best.gamma = gamma;
      best.tpt = tpt;
    }
  }
}

}  // namespace

double TokensPerSecond(double alpha, int gamma, double draft_seconds,
                       double verify_seconds) {
  const double draft = gamma > 0 ? gamma * draft_seconds : 0.0;
  return ExpectedTokensPerStep(alpha, gamma) / (draft + verify_seconds);
}

absl::StatusOr<TptChoice> MaximizeTpt(absl::Span<const TptCandidate> candidates,
                                      absl::Span<const double> verify_seconds,
                                      int max_draft) {
  if (absl::Status s = CheckGrid(verify_seconds, max_draft); !s.ok()) return s;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (absl::Status s = CheckAlpha(i, candidates[i].alpha); !s.ok()) return s;
    if (absl::Status s = CheckDraftSeconds(i, candidates[i].draft_seconds);
        !s.ok())
      return s;
    if (absl::Status s = CheckStop(i, candidates[i].alpha, candidates[i].stop);
        !s.ok())
      return s;
    if (absl::Status s =
            CheckLater(i, candidates[i].stop.has_value(), candidates[i].later);
        !s.ok())
      return s;
  }
  TptChoice best;
  best.baseline_tpt = TokensPerSecond(0, 0, 0, verify_seconds[0]);
  best.tpt = best.baseline_tpt;
  for (size_t i = 0; i < candidates.size(); ++i) {
    Consider(static_cast<int>(i), candidates[i], verify_seconds, max_draft,
             best);
  }
  best.num_evaluated = static_cast<int>(candidates.size());
  return best;
}

absl::StatusOr<TptChoice> MaximizeTptLazily(
    absl::Span<const double> draft_seconds, double alpha_upper,
    absl::Span<const double> verify_seconds, int max_draft,
    bool confidence_stop, const OddsFunction& odds_of) {
  if (absl::Status s = CheckGrid(verify_seconds, max_draft); !s.ok()) return s;
  if (!(alpha_upper >= 0 && alpha_upper <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("alpha_upper ", alpha_upper, " outside [0, 1]"));
  }
  const size_t count = draft_seconds.size();
  std::vector<double> bound(count, 0.0);
  for (size_t i = 0; i < count; ++i) {
    if (absl::Status s = CheckDraftSeconds(i, draft_seconds[i]); !s.ok())
      return s;
    double cheapest_verify = verify_seconds[1];
    for (int gamma = 1; gamma <= max_draft; ++gamma) {
      if (!confidence_stop) {
        bound[i] = std::max(
            bound[i], TokensPerSecond(alpha_upper, gamma, draft_seconds[i],
                                      verify_seconds[gamma]));
        continue;
      }
      // Any stop: E[m] drafts (1 <= E[m] <= gamma) commit at most
      // min(1 + alpha_upper * E[m], tokens without a stop at alpha_upper)
      // and cost at least E[m] * t_draft + the cheapest verification. Each
      // ratio is monotone in E[m], so the largest of their minimum is at
      // E[m] = 1, gamma, or where the two token bounds cross.
      cheapest_verify = std::min(cheapest_verify, verify_seconds[gamma]);
      const double unstopped = ExpectedTokensPerStep(alpha_upper, gamma);
      const double crossing =
          alpha_upper > 0 ? (unstopped - 1) / alpha_upper : 1.0;
      for (const double drafts : {1.0, static_cast<double>(gamma),
                                  std::clamp(crossing, 1.0, 1.0 * gamma)}) {
        bound[i] = std::max(bound[i],
                            std::min(1 + alpha_upper * drafts, unstopped) /
                                (drafts * draft_seconds[i] + cheapest_verify));
      }
    }
    // A relative margin far above rounding error: the closed form of
    // ExpectedTokensPerStep near alpha = 1 may round a hair above the value at
    // alpha_upper, and a bound must never be below what it bounds.
    bound[i] *= 1.0 + 1e-9;
  }
  std::vector<int> order(count);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&bound](int a, int b) { return bound[a] > bound[b]; });

  TptChoice best;
  best.baseline_tpt = TokensPerSecond(0, 0, 0, verify_seconds[0]);
  best.tpt = best.baseline_tpt;
  for (int i : order) {
    // Later candidates have no higher bound and, at an equal bound, a higher
    // index: none of them can win once this one cannot.
    if (best.candidate < 0) {
      if (bound[i] <= BaselineToBeat(best)) break;
    } else {
      if (bound[i] < best.tpt) break;
      if (bound[i] == best.tpt && i > best.candidate) break;
    }
    absl::StatusOr<DraftOdds> odds = odds_of(i);
    if (!odds.ok()) return odds.status();
    ++best.num_evaluated;
    const double alpha = odds->alpha;
    if (absl::Status s = CheckAlpha(i, alpha); !s.ok()) return s;
    if (alpha > alpha_upper + 1e-12) {
      return absl::InvalidArgumentError(
          absl::StrCat("candidate ", i, ": alpha ", alpha,
                       " above alpha_upper ", alpha_upper));
    }
    if (odds->stop.has_value() && !confidence_stop) {
      return absl::InvalidArgumentError(absl::StrCat(
          "candidate ", i, ": a confidence stop in a search without one"));
    }
    if (absl::Status s = CheckStop(i, alpha, odds->stop); !s.ok()) return s;
    if (absl::Status s = CheckLater(i, odds->stop.has_value(), odds->later);
        !s.ok())
      return s;
    if (odds->later.has_value() && odds->later->alpha > alpha_upper + 1e-12) {
      return absl::InvalidArgumentError(
          absl::StrCat("candidate ", i, ": later drafts' alpha ",
                       odds->later->alpha, " above alpha_upper ", alpha_upper));
    }
    Consider(i, TptCandidate{alpha, draft_seconds[i], odds->stop, odds->later},
             verify_seconds, max_draft, best);
  }
  return best;
}

absl::StatusOr<TptChoice> MaximizeTptLazily(
    absl::Span<const double> draft_seconds, double alpha_upper,
    absl::Span<const double> verify_seconds, int max_draft,
    const AlphaFunction& alpha_of) {
  return MaximizeTptLazily(draft_seconds, alpha_upper, verify_seconds,
                           max_draft,
                           /*confidence_stop=*/false,
                           [&alpha_of](int i) -> absl::StatusOr<DraftOdds> {
                             absl::StatusOr<double> alpha = alpha_of(i);
                             if (!alpha.ok()) return alpha.status();
                             return DraftOdds{*alpha, std::nullopt};
                           });
}

}  // namespace knapserve

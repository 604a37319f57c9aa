// Tokens per time (TPT), the KnapSpec objective (DESIGN.md section 1).
//
// One speculation step drafts gamma tokens with a sub-network S (each draft
// token costs t_draft(S)) and verifies gamma+1 tokens with the full model.
// With per-token acceptance alpha, the expected number of tokens it commits is
// (1 - alpha^(gamma+1)) / (1 - alpha), so
//
//   TPT(S, gamma) = (1 - a^(gamma+1)) / (1 - a) / (gamma * t_draft(S) + t_verify(n, gamma+1))
//
// and plain autoregressive decoding (gamma = 0) gives 1 / t_verify(n, 1).
// MaximizeTpt searches the grid candidates x gamma in 1..D and reports "no
// speculation" when nothing beats autoregressive decoding.
//
// Pure functions of their arguments; thread-safe.
#ifndef KNAPSERVE_PLANNER_TPT_H_
#define KNAPSERVE_PLANNER_TPT_H_

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace knapserve {

// (1 - a^(gamma+1)) / (1 - a): tokens one step commits in expectation, with
// its limit gamma + 1 at a = 1 (used when 1 - a < 1e-9). gamma >= 0, a in [0, 1].
double ExpectedTokensPerStep(double alpha, int gamma);

// TPT(S, gamma) in tokens per second. gamma = 0 ignores draft_seconds.
double TokensPerSecond(double alpha, int gamma, double draft_seconds, double verify_seconds);

// One draft sub-network as the TPT search sees it.
struct TptCandidate {
  double alpha = 0;          // alpha_hat, in [0, 1]
  double draft_seconds = 0;  // t_draft(S) per draft token, > 0
};

// The maximizer of the grid.
struct TptChoice {
  int candidate = -1;       // index into the candidates; -1 = no speculation
  int gamma = 0;            // 0 = no speculation
  double tpt = 0;           // predicted tokens per second of the choice
  double baseline_tpt = 0;  // 1 / t_verify(n, 1)
};

// verify_seconds[t - 1] = t_verify(n, t) for t = 1..max_draft+1 (more entries
// are ignored). Returns the (candidate, gamma) with the highest TPT over
// gamma in 1..max_draft; the first one found wins ties (candidates in order,
// gamma increasing). A choice must beat the autoregressive baseline strictly,
// else the result is {-1, 0, baseline, baseline}. InvalidArgument for
// max_draft < 1, a short or non-positive verify table, alpha outside [0, 1]
// or draft_seconds <= 0.
absl::StatusOr<TptChoice> MaximizeTpt(absl::Span<const TptCandidate> candidates,
                                      absl::Span<const double> verify_seconds, int max_draft);

}  // namespace knapserve

#endif  // KNAPSERVE_PLANNER_TPT_H_

// Tokens per time (TPT), the KnapSpec objective.
//
// One speculation step drafts gamma tokens with a sub-network S (each draft
// token costs t_draft(S)) and verifies gamma+1 tokens with the full model.
// With per-token acceptance alpha, the expected number of tokens it commits is
// (1 - alpha^(gamma+1)) / (1 - alpha), so
//
//   TPT(S, gamma) = (1 - a^(gamma+1)) / (1 - a) / (gamma * t_draft(S) +
//   t_verify(n, gamma+1))
//
// and plain autoregressive decoding (gamma = 0) gives 1 / t_verify(n, 1).
// The planner passes whole-step prices (latency_profile.h): t_verify
// includes the engine's per-step work outside the pass (o_step) and t_draft
// its per-draft-token work (o_draft), so the objective is tokens per second
// of the step as the engine runs it, not of its passes alone.
//
// MaximizeTpt searches the grid candidates x gamma in 1..D and reports "no
// speculation" when nothing beats autoregressive decoding; MaximizeTptLazily
// finds the same maximizer while measuring alpha for as few candidates as it
// can (see there).
//
// The step model behind it (a draft's confidence stop, ForecastStep) and the
// smoothing of acceptance estimates (SmoothAlpha) live in
// common/plan/step_forecast.h, which the executor shares to re-choose a cached
// plan's gamma from its drafting evidence (executor/planning/
// plan_refinement.h).
//
// Pure functions of their arguments; thread-safe.
#ifndef KNAPSERVE_PLANNER_TPT_H_
#define KNAPSERVE_PLANNER_TPT_H_

#include <cstdint>
#include <functional>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/plan/step_forecast.h"

namespace knapserve {

// TPT(S, gamma) in tokens per second. gamma = 0 ignores draft_seconds.
double TokensPerSecond(double alpha, int gamma, double draft_seconds,
                       double verify_seconds);

// What one draft does per position: its acceptance and, when the request
// stops drafts on low confidence, the stop's odds (nullopt: no stop, every
// draft runs to gamma); and the odds of draft positions 2..gamma when they
// were measured apart (nullopt: as draft 1's; TptCandidate::later).
struct DraftOdds {
  double alpha = 0;
  std::optional<ConfidenceStop> stop;
  std::optional<LaterDraftOdds> later = std::nullopt;
};

// The maximizer of the grid.
struct TptChoice {
  int candidate = -1;       // index into the candidates; -1 = no speculation
  int gamma = 0;            // 0 = no speculation
  double tpt = 0;           // predicted tokens per second of the choice
  double baseline_tpt = 0;  // 1 / t_verify(n, 1)
  int num_evaluated = 0;    // candidates whose alpha was looked at
};

// verify_seconds[t - 1] = t_verify(n, t) for t = 1..max_draft+1 (more entries
// are ignored). Returns the (candidate, gamma) with the highest TPT over
// gamma in 1..max_draft; the first one found wins ties (candidates in order,
// gamma increasing). A choice must beat the autoregressive baseline by more
// than kMinSpeculationGain (common/plan/step_forecast.h), else the result is
// {-1, 0, baseline, baseline}. num_evaluated is the number of candidates.
// InvalidArgument for max_draft < 1, a short or non-positive verify table,
// alpha outside [0, 1], draft_seconds <= 0 or a stop whose shares are outside
// [0, 1] or whose accept_and_go_on exceeds alpha or go_on (draft 1's, and the
// later positions' where a candidate has them).
absl::StatusOr<TptChoice> MaximizeTpt(absl::Span<const TptCandidate> candidates,
                                      absl::Span<const double> verify_seconds,
                                      int max_draft);

// Returns candidate i's acceptance in [0, alpha_upper] (measuring it on
// demand); errors abort the search and are returned as they are.
using AlphaFunction = std::function<absl::StatusOr<double>(int candidate)>;

// The same choice as MaximizeTpt over {alpha_of(i), draft_seconds[i]} for
// every i (same candidate, gamma, tpt and tie-breaking), but alpha_of is
// called lazily: candidates are visited in decreasing order of their best
// possible TPT (the grid maximum at alpha = alpha_upper, which bounds every
// TPT of the candidate because TPT grows with alpha), and the search stops as
// soon as that bound can no longer beat the best TPT found so far (or, before
// any candidate won, the autoregressive baseline). alpha_of is called at most
// once per candidate; num_evaluated counts the calls. alpha_upper must bound
// every value alpha_of returns (InvalidArgument naming the candidate if one
// exceeds it), e.g. SmoothAlpha(1.0, r, prior). Other errors as MaximizeTpt.
absl::StatusOr<TptChoice> MaximizeTptLazily(
    absl::Span<const double> draft_seconds, double alpha_upper,
    absl::Span<const double> verify_seconds, int max_draft,
    const AlphaFunction& alpha_of);

// The same search for drafts that may stop on low confidence: odds_of returns
// candidate i's DraftOdds. With confidence_stop false no candidate may carry
// a stop (InvalidArgument) and the search is the one above. With it true the
// bound of a candidate allows any stop: E[m] drafts commit at most
// min(1 + alpha_upper * E[m], ExpectedTokensPerStep(alpha_upper, gamma))
// tokens in E[m] * t_draft plus at least the cheapest verification of
// 2..gamma+1 tokens. The search may measure more candidates but still
// returns MaximizeTpt's choice over the same odds. DraftOdds::later may give
// drafts 2..gamma odds of their own: their alpha must not exceed alpha_upper
// either (InvalidArgument naming the candidate), so the bound holds for them
// too, and with a stop their accept_and_go_on must not exceed their alpha or
// go_on (as draft 1's).
using OddsFunction = std::function<absl::StatusOr<DraftOdds>(int candidate)>;
absl::StatusOr<TptChoice> MaximizeTptLazily(
    absl::Span<const double> draft_seconds, double alpha_upper,
    absl::Span<const double> verify_seconds, int max_draft,
    bool confidence_stop, const OddsFunction& odds_of);

}  // namespace knapserve

#endif  // KNAPSERVE_PLANNER_TPT_H_

// The expected outcome of one speculative decode step, and the smoothing of
// the acceptance estimates it takes: the model behind the planner's TPT
// objective (planner/tpt.h, which searches masks and gamma with it) and
// behind the executor's refinement of a cached plan from its drafting
// evidence (executor/planning/plan_refinement.h). It lives here, in the
// executor <-> planner contract, so both use one formula.
//
// A step drafts m <= gamma tokens with a sub-network S (each costs
// t_draft(S)) and verifies m + 1 tokens with the full model (t_verify(n,
// m+1), whole-step prices: planner/latency_profile.h). With per-token
// acceptance alpha and no stop (m = gamma) it commits
// (1 - alpha^(gamma+1)) / (1 - alpha) tokens in expectation.
//
// The draft's confidence stop. The engine ends a draft after a token whose
// top-1 probability is below the request's exit_threshold (the token itself
// is still verified), so a step with budget gamma drafts m <= gamma tokens.
// With, per position, c = P(the draft is confident: drafting goes on) and
// b = P(confident and accepted), and positions independent,
//
//   P(m = k) = c^(k-1) (1 - c) for k < gamma,  P(m = gamma) = c^(gamma-1)
//   E[committed] = 1 + alpha (1 + b + ... + b^(gamma-1))
//   E[seconds]   = E[m] t_draft(S) + sum_k P(m = k) t_verify(n, k+1)
//
// (draft k is accepted only if drafts 1..k-1 were accepted and confident).
// With no stop (c = 1, b = alpha) this is the plain formula. ForecastStep
// computes it; planner/tpt.h's MaximizeTpt uses it for candidates that carry
// a stop.
//
// Later draft positions. A step reaches draft k >= 2 only through accepted
// drafts 1..k-1, so where a text has easy runs and hard spots, draft 2 and
// later are accepted more often than draft 1: in half the steps all 4 drafts
// are accepted and in the other half the first is rejected, the share over
// all drafts is 4 / 5 = 0.8 and predicts 3.36 tokens a step, but the steps
// make 3. TptCandidate::later gives positions 2..gamma odds of their own
// (alpha', c', b'):
//
//   P(draft k is made)       = c c'^(k-2)                    (k >= 2)
//   P(drafts 1..k accepted,
//     1..k-1 confident)      = alpha (k = 1),  b b'^(k-2) alpha'  (k >= 2)
//
// Each of the planner's reference tokens is a draft right after the true
// prefix, like draft 1; the planner estimates alpha', c', b' from pairs of
// consecutive reference tokens (a token right after an accepted one,
// planner/knapsack.h LaterDraftCounts), and the executor's refinement pools
// them with what drafting shows (executor/planning/plan_refinement.h).
// Without this, a mask at 1000 tokens of context on stories-24l was priced
// as if its second draft were accepted as rarely as its first, chose gamma 1
// and ran at 1.02x where the same mask at gamma 2 ran at 1.07x.
//
// Acceptance estimates. alpha is measured as the share of r reference tokens
// on which the draft's argmax equals the full model's. With r = 5 that share
// can only be 0, 0.2, ..., 1, and 1.0 makes every extra draft token look free
// of rejections, so the grid drives gamma to D. SmoothAlpha replaces the raw
// share by the posterior mean under a Beta(hits, misses) prior,
//
//   alpha = (share * r + hits) / (r + hits + misses),
//
// Laplace's rule of succession for the default Beta(1, 1) (uniform) prior:
// 5 of 5 becomes 6/7 = 0.857, 16 of 16 becomes 17/18 = 0.944, and the
// estimate approaches the raw share as r grows. We smooth rather than demand
// more tokens because every reference token costs solve time (the DP is linear
// in r) and the uniform prior is the least informative one that keeps alpha
// strictly inside (0, 1) for any finite r.
//
// Pure functions of their arguments; thread-safe.
#ifndef KNAPSERVE_COMMON_PLAN_STEP_FORECAST_H_
#define KNAPSERVE_COMMON_PLAN_STEP_FORECAST_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace knapserve {

// (1 - a^(gamma+1)) / (1 - a): tokens one step commits in expectation, with
// its limit gamma + 1 at a = 1 (used when 1 - a < 1e-9). gamma >= 0, a in [0,
// 1].
double ExpectedTokensPerStep(double alpha, int gamma);

// The Beta(hits, misses) prior of SmoothAlpha. {0, 0} turns smoothing off
// (the raw share is used).
struct AlphaPrior {
  double hits = 1;    // pseudo-tokens accepted
  double misses = 1;  // pseudo-tokens rejected
};

// InvalidArgument naming alpha_prior.hits / alpha_prior.misses when one is
// negative or not finite.
absl::Status ValidateAlphaPrior(const AlphaPrior& prior);

// (share * r + hits) / (r + hits + misses), share clamped to [0, 1], r >= 0.
// With r + hits + misses == 0 (nothing known) the share itself (clamped).
double SmoothAlpha(double share, int64_t r, const AlphaPrior& prior);

// The confidence stop's odds at one draft position (shares of the reference
// tokens, smoothed like alpha).
struct ConfidenceStop {
  double go_on = 1;  // c: the draft is confident, drafting goes on; [0, 1]
  // b: confident and accepted; in [0, min(alpha, go_on)].
  double accept_and_go_on = 1;
};

// The odds of draft positions 2..gamma when they differ from draft 1's.
struct LaterDraftOdds {
  double alpha = 0;     // alpha': accepted, given drafts 1..k-1 accepted
  ConfidenceStop stop;  // c', b'; used only when the candidate has a stop
};

// Trials as whole tokens for SmoothAlpha: rounded, at least 1 (shares
// pooled over candidates average their trials, so they need not be whole).
int64_t WholeTrials(double trials);

// One group of draft positions' odds from raw shares, each over its own
// tokens, smoothed with `prior` as SmoothAlpha smooths alpha;
// accept_and_go_on clamped to at most alpha and go_on (the shares may rest
// on different trials, and the step model needs b <= min(alpha, c)). The
// planner (planner/planner.h SmoothedLaterOdds) and the executor's
// refinement (executor/planning/plan_refinement.h) both smooth with it, so
// a plan refined without evidence is the planner's own.
LaterDraftOdds SmoothDraftOdds(double accept_share, int64_t accept_tokens,
                               double go_on_share, int64_t go_on_tokens,
                               double both_share, int64_t both_tokens,
                               const AlphaPrior& prior);

// One draft sub-network as the TPT search sees it.
struct TptCandidate {
  double alpha = 0;          // acceptance (smoothed alpha_hat), in [0, 1]
  double draft_seconds = 0;  // t_draft(S) per draft token, > 0
  std::optional<ConfidenceStop> stop = std::nullopt;  // nullopt: to gamma
  // nullopt: every draft position has draft 1's odds (alpha, stop).
  std::optional<LaterDraftOdds> later = std::nullopt;
};

// The expected outcome of one step of (candidate, gamma).
struct StepForecast {
  double tokens = 1;   // committed tokens
  double drafts = 0;   // draft tokens made (E[m])
  double seconds = 0;  // drafting plus verifying m + 1 tokens
  double tokens_per_second() const {
    return seconds > 0 ? tokens / seconds : 0;
  }
};

// Speculation must beat plain decoding by more than this relative margin
// (a chosen gamma's tokens/s above baseline * (1 + kMinSpeculationGain)),
// and the online guard's default margin (GuardOptions::margin,
// executor/planning/plan_controller.h, and --guard_margin): the guard keeps a
// setting only while it measures at least that much above plain decoding, so a
// plan that predicts less is a loss even when its prediction is right; drafting
// with it cost the guard's probes and judged steps for nothing. On
// stories-24l-skip at 1000 tokens (2-core Zen 4 VM) knapspec and the
// sequences' refinements chose gamma 1-3 plans that predicted 0.7-3% over
// plain decoding; they measured 0.78-1.0x until the guard held them plain.
// The planner's search (planner/tpt.h) and the executor's refinement
// (plan_refinement.h) both apply it, so both choose alike.
inline constexpr double kMinSpeculationGain = 0.03;

// The step of `candidate` with budget gamma (0: plain decoding, one
// verification of one token) under the model above. verify_seconds[t - 1] =
// t_verify(n, t) for t = 1..gamma+1. Inputs are not checked (MaximizeTpt
// does): alpha and the stop's shares in [0, 1], gamma < verify_seconds.size().
StepForecast ForecastStep(const TptCandidate& candidate, int gamma,
                          absl::Span<const double> verify_seconds);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_PLAN_STEP_FORECAST_H_

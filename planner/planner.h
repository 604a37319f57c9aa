// The planner core: policies that turn one snapshot of reference states into
// a draft plan (which sublayers the draft skips, how many tokens it drafts).
//
//   SolveKnapSpec  the KnapSpec knapsack DP over sublayers + the TPT grid
//   SolveClasp     the CLaSp baseline: whole layers, exactly M skipped, DP on
//                  the last reference token only
//   SolveStatic    a fixed mask; only gamma is chosen (by the TPT grid)
//
//   PlanInputs in;
//   in.states = snapshot.states;  in.first_position = snapshot.positions[0];
//   in.target_argmax = snapshot.target_argmax;
//   in.prefix_kv = &kv;  in.prefix_len = snapshot.positions[0];
//   in.context_length = snapshot.context_length;  in.step = snapshot.step;
//   ASSIGN_OR_RETURN(DraftPlan plan, SolveKnapSpec(model, profile, in,
//   KnapSpecOptions()));
//
// When the calling thread has a current trace context (common/trace/
// tracer.h, ScopedContext; the in-process planner sets plan.solve's), each
// stage of a solve is a child span: plan.solve.check_inputs,
// .profile_prices, .knapsack_dp and .tpt_grid for KnapSpec; .layer_dp,
// .evaluate_mask and .tpt_grid for CLaSp; .evaluate_mask and .tpt_grid for
// a static mask.
//
// The functions are plain C++ (no gRPC, no executor types) and keep no state.
// They only read the model, the profile and the inputs, so several may run at
// once (each on its own thread); the caller keeps the prefix K/V unchanged
// while a solve reads it. Errors: InvalidArgument for bad options or inputs
// (naming the field), FailedPrecondition for a profile measured for another
// model, device or dtype, Internal if torch throws.
#ifndef KNAPSERVE_PLANNER_PLANNER_H_
#define KNAPSERVE_PLANNER_PLANNER_H_

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model/layer_mask.h"
#include "common/plan/planner_client.h"
#include "planner/knapsack.h"
#include "planner/latency_profile.h"
#include "planner/tpt.h"

namespace knapserve {

class LlamaModel;
struct LayerKv;

// One snapshot of reference states (executor/engine/reference_states.h holds
// the same data; this is the planner's own plain copy of the shape of it).
// Nothing is owned but `states` and the ids; prefix_kv must outlive the solve.
struct PlanInputs {
  // The full model's hidden states at all 2L+1 boundaries for r tokens,
  // [2L+1, r, hidden]; moved to the model's device and dtype if needed.
  torch::Tensor states;
  // Position of the first reference token; the r tokens are at consecutive
  // positions first_position .. first_position + r - 1.
  int64_t first_position = 0;
  // The full model's argmax at each of the r tokens (alpha_hat's target).
  std::vector<int32_t> target_argmax;
  // The full model's K/V (one entry per layer, [kv_heads, capacity,
  // head_dim]); entries [0, prefix_len) must be valid. Entry i holds
  // position i, or kv_positions[i] when kv_positions is set (a window of the
  // prefix from a remote executor: K is already rotated, so attention needs
  // the entries, not their positions). The entries may extend past
  // first_position (the executor's cache also holds the reference tokens'
  // own K/V): every policy measures a draft on reference token i as the
  // first draft token of a step, attending to the entries before its
  // position (KvEntriesBefore) and to itself; CLaSp's DP on the last
  // reference token attends to the entries before it. Fewer entries make
  // the drafts attend to fewer positions. Null iff prefix_len == 0.
  const std::vector<LayerKv>* prefix_kv = nullptr;
  int64_t prefix_len = 0;
  // Ascending positions of the prefix_len entries; empty: 0 .. prefix_len-1.
  std::vector<int64_t> kv_positions;
  // Context length n at the snapshot; 0 means first_position + r.
  int64_t context_length = 0;
  // Tokens the plan is expected to decode while it is in force (0 = price it
  // at the snapshot). A plan made at context n serves contexts n .. n + T, so
  // every policy prices it at the mean context over its life,
  // PricingContextLength() = n + plan_lifetime_tokens / 2: the integer
  // weights, t_draft and t_verify all use that length. Costs are linear in n
  // (piecewise for t_verify), so the mean cost over the plan's life is the
  // cost at its mean context. The executor fills it with the plan interval in
  // steps (each step commits at least one token; PlanRequest carries it).
  int64_t plan_lifetime_tokens = 0;
  // Decode step of the plan boundary, echoed in DraftPlan::step.
  int64_t step = 0;
  // The request's draft confidence stop (SpeculationConfig::exit_threshold,
  // in [0, 1]): a draft ends after a token whose top-1 probability is below
  // it. > 0 makes every policy measure, besides alpha_hat, how often the
  // draft is confident on the reference tokens and price the shorter drafts
  // (common/plan/step_forecast.h ForecastStep); 0 prices drafts that always run
  // to gamma.
  double exit_threshold = 0;
};

// The number of leading K/V entries of `inputs` that hold positions before
// `position` (all of them at most prefix_len).
int64_t KvEntriesBefore(const PlanInputs& inputs, int64_t position);

// The context length every policy prices a plan at: (context_length, or
// first_position + r when it is 0) + plan_lifetime_tokens / 2.
int64_t PricingContextLength(const PlanInputs& inputs);

// The runner every policy measures drafts with, on the first r (>= 1)
// reference tokens of `inputs`: token i attends to the full model's K/V
// entries before its own position (KvEntriesBefore; the reference tokens'
// own entries included where the inputs hold them) and to itself, as the
// first draft token of a step does. A draft run on its own K/V over r tokens
// in a row (the other choice) grows less sure with every token, so plans
// expected drafts to stop sooner than the engine's did. The runner reads
// inputs.prefix_kv, which must outlive it. Errors as
// ModelSublayerRunner::Create.
absl::StatusOr<ModelSublayerRunner> ReferenceRunner(const LlamaModel& model,
                                                    const PlanInputs& inputs,
                                                    int64_t r);

struct KnapSpecOptions {
  double tau = 0.5;  // DP cells below this mean cosine are dropped
  // Integer sublayer weights: the largest weight, and the largest relative
  // error of the weights' attention:MLP ratio (ComputeSublayerWeights in
  // planner/knapsack.h says how and bounds the DP's width: with the defaults
  // w_attn + w_mlp <= 17).
  int weight_cap = kDefaultWeightCap;
  double weight_tolerance = kDefaultWeightTolerance;
  int max_draft = 10;               // D: gamma in 1..D
  bool keep_first_and_last = true;  // never skip layer 0 or layer L-1
  // The largest share of the model's sublayer weight a draft may skip
  // (KnapsackOptions::max_skipped_share, planner/knapsack.h), in (0, 1]. The
  // plans of stories-24l and stories-24l-skip sit at the reference's 0.5:
  // on stories-24l-skip (trained with sublayer dropout) 2/3 drafted at
  // 1.37-1.42x of plain decoding against 1.24-1.31x (short prompts, warm
  // plan cache, two runs each), but on stories-24l it was no better (1.17-
  // 1.30x against 1.27-1.32x), and 1.0 was worse on both (1.17x on
  // stories-24l-skip: alpha_hat on 16 reference tokens is too optimistic
  // for the deepest masks). Those runs predate pool_alpha; with it, 2/3 did
  // not pay in an A/B run (1.15x against 1.26x on stories-24l-skip short:
  // the pooled shares of the deeper masks promise less).
  // knapserve's --knapspec-max-skip sets it.
  double max_skipped_share = 0.5;
  // The DP uses at most this many reference tokens (the first ones); 0 = all
  // r. The solve
  // is linear in r, while the binomial standard error of alpha_hat,
  // sqrt(a (1 - a) / r), shrinks only as 1/sqrt(r): at a = 0.7 it is 0.11 at
  // r = 16 and 0.08 at r = 30, for 1.9x the solve time (README: 0.52 s at
  // r = 10, 1.37 s at r = 30 on smollm2). 16 keeps alpha_hat's resolution at
  // 1/16 and the smoothing prior's weight (2 pseudo-tokens) small.
  int max_reference_tokens = 16;
  // Smoothing of alpha_hat before the TPT grid (planner/tpt.h).
  AlphaPrior alpha_prior;
  // Pool the candidates' measured shares along their cosine order
  // (PoolSharesByCosine, planner/knapsack.h) before the TPT grid: the grid
  // then weighs each candidate by its block's share, not by its own 16-token
  // share, the best of dozens of which is the luckiest (the winner's curse:
  // the plan drafts worse than it promised, its drift trigger fires and the
  // sequence pays another solve). Pooling needs every candidate's share, so
  // it measures them all in one batch (lazy_alpha does not apply): one more
  // LM-head row per candidate and reference token, small beside the DP's
  // sublayer rows (every live cell runs every sublayer).
  bool pool_alpha = true;
  // Without pool_alpha: measure alpha_hat lazily, in decreasing order of
  // each candidate's best possible TPT, stopping once that bound cannot beat
  // the best found (MaximizeTptLazily); false measures every candidate in
  // one batch. Both give the same plan; lazy runs the LM head for fewer
  // candidates.
  bool lazy_alpha = true;
};

// The odds of draft positions 2..gamma that every policy prices with
// (common/plan/step_forecast.h TptCandidate::later), from the pairs of
// consecutive reference tokens (planner/knapsack.h LaterDraftCounts): each
// ratio smoothed with `prior` over its own trials, rounded to whole tokens
// (at least 1; pooled candidates average their counts), as SmoothAlpha
// smooths alpha; accept_and_go_on clamped to at most alpha' and go_on (the
// two rest on different trials), and the stop left at its default without a
// confidence stop. nullopt when no pair reached a later draft (r = 1, or no
// token accepted and confident before the last): the later drafts then take
// draft 1's odds. The executor's refinement smooths the plan's basis alike
// (executor/planning/plan_refinement.h), so a plan refined without evidence
// is the planner's own.
std::optional<LaterDraftOdds> SmoothedLaterOdds(const LaterDraftCounts& counts,
                                                const AlphaPrior& prior,
                                                bool confidence_stop);

// KnapSpec: weights from the profile at n = PricingContextLength(inputs), the
// sublayer DP on the first max_reference_tokens reference tokens, the smoothed
// alpha_hat of the candidates that can still win (lazy) or of all of them,
// and the TPT grid over candidates x gamma in 1..D (drafts 2..gamma priced
// with SmoothedLaterOdds). num_candidates counts the
// surviving DP cells (including j = 0), num_evaluated those whose alpha_hat
// was measured. alpha_hat is the share of the chosen mask that the grid
// used: its raw share, or with pool_alpha its block's pooled share; with
// gamma 0 it is 1 (the full model accepts its own tokens) and mean_cosine is
// the no-skip cell's.
absl::StatusOr<DraftPlan> SolveKnapSpec(const LlamaModel& model,
                                        const LatencyProfile& profile,
                                        const PlanInputs& inputs,
                                        const KnapSpecOptions& options);

struct ClaspOptions {
  int num_skipped_layers = 0;       // M, required (>= 1)
  int max_draft = 10;               // D for the TPT grid
  int gamma = 0;                    // > 0: fixed gamma instead of the TPT grid
  bool keep_first_and_last = true;  // never skip layer 0 or layer L-1
  AlphaPrior alpha_prior;           // smoothing of alpha_hat for the TPT grid
};

// CLaSp: the whole-layer DP (exactly M layers skipped, no pruning) on the
// last reference token's states only (r = 1, attending to the prefix K/V up to
// it); the chosen mask's alpha_hat is then measured on all r tokens and gamma
// comes from the TPT grid with the smoothed alpha_hat (and SmoothedLaterOdds)
// at PricingContextLength(inputs) (or ClaspOptions::gamma). num_candidates is
// 1.
absl::StatusOr<DraftPlan> SolveClasp(const LlamaModel& model,
                                     const LatencyProfile& profile,
                                     const PlanInputs& inputs,
                                     const ClaspOptions& options);

struct StaticOptions {
  int max_draft = 10;      // D for the TPT grid
  AlphaPrior alpha_prior;  // smoothing of alpha_hat for the TPT grid
};

// A fixed mask: alpha_hat measured on the r reference tokens, gamma from the
// TPT grid (smoothed alpha_hat and SmoothedLaterOdds,
// PricingContextLength(inputs)).
// InvalidArgument when the mask's layer count is not the model's.
absl::StatusOr<DraftPlan> SolveStatic(const LlamaModel& model,
                                      const LatencyProfile& profile,
                                      const PlanInputs& inputs,
                                      const LayerMask& mask,
                                      const StaticOptions& options);

}  // namespace knapserve

#endif  // KNAPSERVE_PLANNER_PLANNER_H_

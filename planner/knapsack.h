// The KnapSpec knapsack DP over sublayer skips, and the
// whole-layer variant the CLaSp baseline uses.
//
// A target with L layers is 2L sublayers (2i = attention i, 2i+1 = MLP i).
// Given the full model's hidden states X at all 2L+1 boundaries for r
// reference tokens, the DP builds, for every skipped weight j, one draft
// sub-network and the hidden states it produces:
//
//   g[0][0] = X[0]
//   g[i][j] = the better of  f_i(g[i-1][j])         (execute sublayer i)
//                       and  g[i-1][j - w_i]        (skip it)
//
// "Better" is the higher mean (over the r tokens) cosine similarity to X[i].
// Cells below tau are dropped, except j = 0 (the no-skip path, which is the
// full model and so always survives). All live cells of one boundary run as
// one batched call of the sublayer ([B, r, d]). Backtracking from every
// surviving g[2L][j] gives one candidate mask per skipped weight; alpha_hat is
// the share of the r tokens whose argmax from g[2L][j] equals the full model's.
//
// The DP runs over a SublayerRunner, so it can be tested without a model:
// ModelSublayerRunner is the real one (BranchAttention / Mlp / Logits of a
// LlamaModel); tests supply synthetic ones.
//
// Thread safety: the functions keep no state; concurrent calls are safe when
// their runners are (ModelSublayerRunner is: it only reads the model and the
// prefix K/V).
#ifndef KNAPSERVE_PLANNER_KNAPSACK_H_
#define KNAPSERVE_PLANNER_KNAPSACK_H_

#include <torch/types.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model/layer_mask.h"

namespace knapserve {

class LlamaModel;
struct LayerKv;

// Applies single sublayers of some decoder to batches of candidate hidden
// states. Implementations must be usable from the calling thread only for the
// duration of one DP; they do not own the caller's tensors.
class SublayerRunner {
 public:
  virtual ~SublayerRunner() = default;
  // 2L: sublayer 2i is attention i, 2i+1 is MLP i.
  virtual int num_sublayers() const = 0;
  // Sublayer `sublayer` (residual included) applied to h [B, r, d] -> [B, r,
  // d]: B independent candidate branches of the same r reference tokens.
  virtual absl::StatusOr<torch::Tensor> Apply(int sublayer,
                                              const torch::Tensor& h) const = 0;
  // The argmax token of the output head for final hidden states h [B, r, d],
  // as int64 [B, r].
  virtual absl::StatusOr<torch::Tensor> TopTokens(
      const torch::Tensor& h) const = 0;
  // The argmax token ([B, r] int64) and its softmax probability ([B, r]
  // float64) for final hidden states h [B, r, d]. The default runs TopTokens
  // and reports probability 1 (a runner without an output distribution: its
  // drafts are always confident).
  struct Top {
    torch::Tensor ids;
    torch::Tensor probability;
  };
  virtual absl::StatusOr<Top> TopTokensWithProbability(
      const torch::Tensor& h) const;
};

// The real runner: the first `num_layers` layers of a LlamaModel. Attention
// sublayers run BranchAttention (each branch's tokens attend to the prefix
// K/V [0, prefix_len) and causally to their own branch, at positions
// first_position..; or, with Options::row_prefix_limits, each token to the
// full model's K/V before it and itself), MLP sublayers run Mlp, TopTokens
// runs Logits + argmax.
// Does not own the model or the prefix K/V; both must outlive it.
class ModelSublayerRunner final : public SublayerRunner {
 public:
  struct Options {
    // Layers used (the runner covers sublayers 0..2*num_layers-1); <= 0 means
    // all.
    int num_layers = 0;
    // Attention batches whose score tensors would exceed this many bytes are
    // run in several chunks of branches (results are identical). 0 picks
    // 16 MiB on CPU and 1 GiB on CUDA. Small on CPU on purpose: score tensors
    // below glibc's mmap threshold (32 MiB) are reused from the heap instead
    // of being mapped, page-faulted and zeroed on every call, which made
    // long-context solves ~3x slower (smollm2-135m shape, n = 4096, r = 30).
    int64_t max_attention_bytes = 0;
    // LM-head calls are chunked to at most this many bytes of logits.
    int64_t max_logits_bytes = int64_t{64} << 20;
    // Empty: every token attends to the prefix [0, prefix_len) and causally
    // to its own branch's tokens (the draft runs on its own K/V). Else one
    // entry per reference token (inputs must have exactly that many): token
    // i attends to prefix entries [0, row_prefix_limits[i]) and to itself,
    // as the first draft token of a step does (LlamaModel::BranchAttention).
    // Non-decreasing, limit i at most prefix_len and first_position + i (no
    // entry of the token's own position or later).
    std::vector<int64_t> row_prefix_limits;
  };

  // InvalidArgument for a prefix that does not fit: prefix_len < 0,
  // prefix_len > first_position (without row_prefix_limits; with them, the
  // limits' bounds above), a prefix with the wrong layer count or too little
  // capacity, or num_layers above the model's.
  static absl::StatusOr<ModelSublayerRunner> Create(
      const LlamaModel& model, const std::vector<LayerKv>* prefix,
      int64_t prefix_len, int64_t first_position, const Options& options);
  static absl::StatusOr<ModelSublayerRunner> Create(
      const LlamaModel& model, const std::vector<LayerKv>* prefix,
      int64_t prefix_len, int64_t first_position) {
    return Create(model, prefix, prefix_len, first_position, Options());
  }

  int num_sublayers() const override { return 2 * num_layers_; }
  absl::StatusOr<torch::Tensor> Apply(int sublayer,
                                      const torch::Tensor& h) const override;
  absl::StatusOr<torch::Tensor> TopTokens(
      const torch::Tensor& h) const override;
  // One LM-head pass for both (chunked like TopTokens); the probability is
  // the float32 softmax's largest entry, as the engine's confidence stop
  // computes it.
  absl::StatusOr<Top> TopTokensWithProbability(
      const torch::Tensor& h) const override;

 private:
  // The LM head over h's rows in chunks: the argmax ids and, when asked, the
  // softmax probability of each.
  absl::StatusOr<Top> Head(const torch::Tensor& h, bool with_probability) const;

  ModelSublayerRunner(const LlamaModel& model,
                      const std::vector<LayerKv>* prefix, int64_t prefix_len,
                      int64_t first_position, int num_layers,
                      const Options& options)
      : model_(&model),
        prefix_(prefix),
        prefix_len_(prefix_len),
        first_position_(first_position),
        num_layers_(num_layers),
        options_(options) {}

  const LlamaModel* model_;
  const std::vector<LayerKv>* prefix_;  // may be null when prefix_len_ == 0
  int64_t prefix_len_;
  int64_t first_position_;
  int num_layers_;
  Options options_;
};

// What the reference tokens show of draft positions 2..gamma
// (common/plan/step_forecast.h, "Later draft positions"). Each reference
// token is a draft made right after the true prefix, like a step's draft 1.
// But a step reaches draft k >= 2 only through an accepted draft k-1, and a
// text has easy runs and hard spots: token i+1 after an accepted token i is
// the nearest thing the reference tokens hold to draft 2 after an accepted
// draft 1 (the step's draft would attend to the draft's own K/V at i, the
// reference token attends to the full model's). So over the r - 1 pairs of
// consecutive reference tokens (i, i+1), counted as the executor counts a
// step's drafts (executor/planning/plan_refinement.h DraftCounts):
//   accept_trials: i accepted and confident (draft i+1 reached through an
//                  accepted draft); accepted: of those, i+1 accepted;
//                  accept_and_go_on: of those, i+1 accepted and confident;
//   go_on_trials:  i confident (draft i+1 made); went_on: of those, i+1
//                  confident.
// Without an exit threshold every token is confident. Counts, kept as doubles
// so PoolSharesByCosine can average them over a block of candidates.
struct LaterDraftCounts {
  double accept_trials = 0;
  double accepted = 0;
  double accept_and_go_on = 0;
  double go_on_trials = 0;
  double went_on = 0;
};

// One draft sub-network found by a DP, with what the DP measured about it.
struct SkipCandidate {
  LayerMask mask;          // over runner.num_sublayers() / 2 layers
  int skipped_weight = 0;  // sum of the skipped sublayers' (or layers') weights
  double mean_cosine = 0;  // mean over the r tokens, at the last boundary
  // Share of the r tokens whose argmax matches the target; -1 when no target
  // ids were given.
  double alpha_hat = -1;
  // With an exit threshold (EvaluateMasks): the share of the r tokens whose
  // top-1 probability reaches it (drafting would go on after them), and the
  // share that also matches the target; -1 when not measured.
  double go_on_share = -1;
  double accept_and_go_on_share = -1;
  // Pairs of consecutive reference tokens (DraftShares::later), counted at the
  // exit threshold EvaluateMasks was given (the DPs, RunSkipDp with target
  // ids, count at none: every token confident); all zero when no target ids
  // were given.
  LaterDraftCounts later;
  // Mean cosine at every DP boundary along this candidate's path: 2L+1
  // entries for the sublayer DP (entry 0 is the embeddings, 1.0), L+1 for the
  // whole-layer DP.
  std::vector<double> path_cosines;
};

// One step of the generic DP: `num_sublayers` consecutive sublayers starting
// at `first_sublayer`, executed or skipped together. Skipping adds `weight`.
struct SkipUnit {
  int first_sublayer = 0;
  int num_sublayers = 1;
  int weight = 1;
  bool skippable = true;
};

struct SkipDpOptions {
  // Cells j = 0..max_weight (total skipped weight).
  int max_weight = 0;
  // Cells with a mean cosine below tau are dropped (never j = 0).
  double tau = -std::numeric_limits<double>::infinity();
};

// Counters of one DP, for logs and benchmarks.
struct SkipDpStats {
  int64_t sublayer_calls = 0;  // batched Apply calls
  int64_t branch_rows = 0;     // sum of B over those calls
  int max_live_cells = 0;
};

// The generic DP. `units` must cover sublayers 0..runner.num_sublayers()-1
// in order, each exactly once, weights >= 1. reference: [2L+1, r, d];
// target_argmax: r ids, or empty to skip alpha_hat. Returns the surviving
// final cells' candidates in increasing skipped weight (j = 0 first).
// InvalidArgument for inconsistent shapes or units; runner errors pass through.
// If final_states is not null it receives the candidates' hidden states after
// the last sublayer, [num_candidates, r, d] in the same order (for measuring
// alpha_hat later with MeasureAlphaHats).
absl::StatusOr<std::vector<SkipCandidate>> RunSkipDp(
    const SublayerRunner& runner, const torch::Tensor& reference,
    absl::Span<const int32_t> target_argmax, absl::Span<const SkipUnit> units,
    const SkipDpOptions& options, SkipDpStats* stats = nullptr,
    torch::Tensor* final_states = nullptr);

// alpha_hat of B candidates from their final hidden states [B, r, d]: the
// share of the r tokens whose LM-head argmax equals target_argmax (r ids).
// InvalidArgument when the shapes disagree; runner errors pass through.
absl::StatusOr<std::vector<double>> MeasureAlphaHats(
    const SublayerRunner& runner, const torch::Tensor& final_states,
    absl::Span<const int32_t> target_argmax);

// What a draft does on the reference tokens, as raw shares of the r tokens.
struct DraftShares {
  double accept = 0;  // argmax equals the target's (alpha_hat)
  // top-1 probability >= the exit threshold (1 with threshold <= 0)
  double go_on = 1;
  double accept_and_go_on = 0;  // both (accept with threshold <= 0)
  LaterDraftCounts later = {};  // pairs of consecutive tokens
};

// The shares of B candidates from their final hidden states [B, r, d] (one
// LM-head pass). exit_threshold <= 0 stops no draft: go_on = 1 and
// accept_and_go_on = accept without computing probabilities. target_argmax
// must hold r >= 1 ids; errors as MeasureAlphaHats.
absl::StatusOr<std::vector<DraftShares>> MeasureDraftShares(
    const SublayerRunner& runner, const torch::Tensor& final_states,
    absl::Span<const int32_t> target_argmax, double exit_threshold);

// The DP's candidates' shares pooled where their order contradicts their
// cosine (the pool-adjacent-violators fit): a draft whose hidden states stay
// closer to the full model's should not be accepted less often. Measured on
// the same r reference tokens (16 by default), each share carries a
// binomial error of about 0.1, and the best of dozens of such estimates is
// the luckiest, not the best: on stories-24l-skip at 1k context a mask
// measured 14 of 16 among neighbours at 10-12 of 16 was chosen, and drafted
// at 0.63. Candidates in cosine order (highest first; ties in index order)
// take the mean of their block, where the blocks are the least-squares
// non-increasing fit of `accept` with equal weights; go_on and
// accept_and_go_on take their block's means too, and so do the later counts
// (their ratios are then the block's pooled ratios). The result has the input's
// order and size. InvalidArgument when the sizes differ.
absl::StatusOr<std::vector<DraftShares>> PoolSharesByCosine(
    absl::Span<const DraftShares> shares, absl::Span<const double> cosines);

// Integer knapsack weights of the two sublayer kinds.
struct SublayerWeights {
  int attention = 1;
  int mlp = 1;
};

// The default tolerance and cap of ComputeSublayerWeights (KnapSpecOptions
// uses them).
inline constexpr double kDefaultWeightTolerance = 0.1;
inline constexpr int kDefaultWeightCap = 16;

// Integer weights whose ratio is faithful to the two kinds' costs. With x =
// t_dearer / t_cheaper >= 1, the cheaper kind weighs q and the dearer p =
// round(x * q), for the smallest q = 1, 2, ... with p <= cap whose relative
// ratio error |p / q - x| / min(p / q, x) is at most `tolerance` (the
// denominator makes the error the same for the attention:MLP and the
// MLP:attention ratio). When no such pair fits under the cap (x far above
// cap, or a tiny tolerance), the pair with p <= cap and the least error wins
// (the smaller q on ties): then the dearer weight is `cap` and its cost
// share is understated.
//
// Why faithful: the DP's cell j collects skip sets of skipped weight j and
// keeps the one with the best cosine, so two sublayers of the same weight
// compete as if they cost the same. Rounding attention:MLP = 1.3 to 1:1 (or
// capping 8 at 5, as the old cap-5 rounding did) merges sets whose real costs
// differ by 30%.
//
// Why cheap: the DP has L * (w_attn + w_mlp) * share + 1 cells (share =
// KnapsackOptions::max_skipped_share, 0.5 by default), so its width grows
// with the weight sum. Since |p/q - x| <= 1/(2q), q <= ceil(1/(2 tolerance))
// suffices, and with the defaults (tolerance 0.1, cap 16) w_attn + w_mlp <= cap
// + 1 = 17 for every ratio, and <= 11 for ratios up to 5 (the old rounding with
// cap 5 allowed 6). Tested in knapsack_test.
//
// Non-positive or non-finite times count as equal costs ({1, 1}); cap < 1
// counts as 1, tolerance < 0 as 0.
SublayerWeights ComputeSublayerWeights(
    double attention_seconds, double mlp_seconds, int cap,
    double tolerance = kDefaultWeightTolerance);

struct KnapsackOptions {
  double tau = 0.5;
  // Never skip layer 0 or the last layer (as the KnapSpec reference code).
  bool keep_first_and_last = true;
  // The largest share of the model's weight K = L * (w_attn + w_mlp) a mask
  // may skip, in (0, 1]: the DP's cells are j = 0..floor(share * K), so its
  // work grows with it. 0.5 is the KnapSpec reference's bound.
  double max_skipped_share = 0.5;
};

// InvalidArgument, naming max_skipped_share, for a share outside (0, 1].
absl::Status CheckSkippedShare(double share);

// The KnapSpec DP: one unit per sublayer weighing weights.attention or
// weights.mlp, budget K = L * (w_attn + w_mlp), skipped weight <= floor(
// max_skipped_share * K). InvalidArgument when nothing is skippable (L <= 2
// with keep_first_and_last), weights < 1 or a share outside (0, 1];
// otherwise as RunSkipDp (final_states too).
absl::StatusOr<std::vector<SkipCandidate>> SolveKnapsack(
    const SublayerRunner& runner, const torch::Tensor& reference,
    absl::Span<const int32_t> target_argmax, SublayerWeights weights,
    const KnapsackOptions& options, SkipDpStats* stats = nullptr,
    torch::Tensor* final_states = nullptr);

// The whole-layer DP of CLaSp: a layer's attention and MLP are skipped
// together, each skipped layer weighs 1, and the candidate with exactly
// `num_skipped_layers` skipped is returned. No pruning (CLaSp has no tau).
// InvalidArgument when num_skipped_layers < 1 or exceeds the skippable layers
// (L, or L - 2 with keep_first_and_last).
absl::StatusOr<SkipCandidate> SolveLayerSkip(
    const SublayerRunner& runner, const torch::Tensor& reference,
    absl::Span<const int32_t> target_argmax, int num_skipped_layers,
    bool keep_first_and_last, SkipDpStats* stats = nullptr);

// Runs the sub-networks `masks` over the reference tokens and measures each
// like a DP candidate (path_cosines has 2L+1 entries; skipped_weight sums
// `weights` over the skipped sublayers). Batched: each sublayer runs once over
// the masks that keep it. With target ids it counts the later drafts' pairs
// (SkipCandidate::later); exit_threshold > 0 also measures go_on_share and
// accept_and_go_on_share (MeasureDraftShares).
// InvalidArgument when a mask's layer count or the shapes do not match.
absl::StatusOr<std::vector<SkipCandidate>> EvaluateMasks(
    const SublayerRunner& runner, const torch::Tensor& reference,
    absl::Span<const int32_t> target_argmax, absl::Span<const LayerMask> masks,
    SublayerWeights weights = {}, double exit_threshold = 0);
// The same for one mask.
absl::StatusOr<SkipCandidate> EvaluateMask(
    const SublayerRunner& runner, const torch::Tensor& reference,
    absl::Span<const int32_t> target_argmax, const LayerMask& mask,
    SublayerWeights weights = {}, double exit_threshold = 0);

// Mean over the r tokens of the per-token cosine similarity between each of
// B candidates h [B, r, d] and the reference x [r, d], as B doubles
// (computed in float32, or float64 for float64 inputs).
std::vector<double> MeanCosines(const torch::Tensor& h, const torch::Tensor& x);

}  // namespace knapserve

#endif  // KNAPSERVE_PLANNER_KNAPSACK_H_

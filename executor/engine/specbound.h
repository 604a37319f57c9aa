// SpecBound (--spec specbound): self-speculative drafting by early exit, with
// a depth bound and a width bound.
//
// One decode step of a SpecBound sequence with committed positions [0, n)
// and `last` (the newest token, not in the K/V yet) has rows
// [last, d_1, ..., d_m] at positions n, n+1, ..., n+m:
//
//   1. Drafting. The newest row runs the model upward from layer 0 in one
//      pass. Every `check_every` layers (SpecBoundConfig::check_every) and
//      at the depth bound, inside that pass (BatchSequence::after_layer),
//      after layer l, its exit head (common/model/exit_heads.h: the model's
//      own final norm and LM head, or trained heads) gives logits z_l, and
//      the pass stops the row (BatchSequence::stop) when the top-1 probability
//      of softmax(z_l / T_l) reaches lambda, where the exit temperature T_l
//      falls linearly from T_0 after layer 0 to 1 after the last layer
//      (ExitTemperature). The exit's draft is argmax(z_l / T_l) when greedy,
//      else a sample from the sampler's distribution (its own temperature
//      and top-p) of z_l / T_l, which is the q_j rejection sampling gets.
//      The draft becomes the next row, which starts at layer 0.
//      Bounds: a row that reaches the depth bound without exiting ends
//      drafting (it is verified, not drafted from); m reaching the width
//      bound (max_draft, or fewer near the output or K/V limit) ends it too.
//   2. The cache of hidden states: each row keeps its hidden state at the
//      depth it reached. When the newest row is to run layer l, earlier rows
//      that have not run layer l yet (those that exited lower) run it in
//      the same pass (their K/V at layer l is what it attends to): each
//      group of rows at one depth d joins the pass at layer d as a
//      BatchSequence of its own, and every group stops where the newest row
//      exits (they share its stop flag). Depths never increase along the
//      rows, so the lagging rows are a suffix, in groups of one depth each;
//      no row runs a layer twice.
//   3. Alignment. Before verification, rows shallower than the deepest (row
//      0's depth D) are brought up to D, a few rows at a time (each pass
//      takes the shallowest suffix up to the next depth).
//   4. Verification runs layers [D, L) over all rows from their states at D
//      (a partial pass, common/model/llama.h's BatchSequence::first_layer),
//      so no layer below D is computed twice; its logits are bit-identical
//      to a full pass (the row-wise path), so acceptance
//      (executor/engine/speculation_step.h) gives exactly plain decoding's
//      greedy output and the model's sampling distribution.
//
// Every pass goes through LlamaModel::ForwardBatch, so several SpecBound
// sequences (and other modes' draft rounds) share passes: one round per
// draft token, one per alignment stage, then the common main pass.
//
// Ownership: SpecBoundRows owns its rows' states; it borrows nothing.
// Thread safety: one thread at a time (the sequence's step thread).
#ifndef KNAPSERVE_EXECUTOR_ENGINE_SPECBOUND_H_
#define KNAPSERVE_EXECUTOR_ENGINE_SPECBOUND_H_

#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "common/model/llama.h"

namespace knapserve {

// T_l = 1 + (t0 - 1) * (L - 1 - l) / (L - 1) for the exit after layer l
// (0-based) of L layers: t0 after layer 0, 1 after the last (t0 for L = 1).
double ExitTemperature(double t0, int layer, int num_layers);

// The exit checks of a draft row: after depth (layers run) k, 2k, ... below
// the depth bound, and at the depth bound. The next check depth after
// `depth` (< depth_bound).
int NextCheckDepth(int depth, int check_every, int depth_bound);
// Whether a row that has run `depth` layers (1 <= depth <= depth_bound) is
// checked there.
bool IsCheckDepth(int depth, int check_every, int depth_bound);

// The rows of one SpecBound step and their hidden-state cache (see the file
// comment).
class SpecBoundRows {
 public:
  // Starts a step: row 0 is `last` at position `first_position`, depth 0.
  void Begin(int64_t first_position, int32_t last);
  // Appends a draft row (depth 0).
  void AddRow(int32_t token);

  int rows() const { return static_cast<int>(tokens_.size()); }
  int depth(int row) const { return depth_[row]; }
  // [1, hidden] state of `row` after depth(row) layers (undefined at 0).
  torch::Tensor state(int row) const;
  // Row 0's depth: the deepest of the step.
  int max_depth() const { return depth_.empty() ? 0 : depth_[0]; }

  // The draft pass that takes the newest row (at depth 0) up to at most
  // `to`, with the earlier rows that lag below `to`: one BatchSequence per
  // group of rows at one depth, oldest first, the newest row last, each
  // with tokens or input_states, start_pos, first_layer and last_layer = to
  // (K/V, logits, output_states, stop and after_layer are the caller's).
  // ApplyDraftPass records its outputs.
  std::vector<BatchSequence> DraftPass(int to);
  // The output states of the last DraftPass's inputs and the depth each
  // reached (BatchSequence::reached_layer), in the same order.
  void ApplyDraftPass(absl::Span<const torch::Tensor> output_states,
                      absl::Span<const int> reached);
  // The next alignment pass (the shallowest rows up to the next depth);
  // false when every row is at max_depth().
  bool AlignPass(BatchSequence& input);
  // The verification's input: every row's state at max_depth() (which must
  // be > 0 and shared by all rows), from layer max_depth() to the last.
  void VerifyPass(BatchSequence& input);
  // Records the output states of the last DraftPass or AlignPass.
  void Apply(const torch::Tensor& output_states);

 private:
  void Fill(int first, int from, int to, BatchSequence& input);

  int64_t first_position_ = 0;
  std::vector<int32_t> tokens_;
  std::vector<int> depth_;
  std::vector<torch::Tensor> states_;  // per row [1, hidden]
  // The rows and depth of the last pass, for Apply.
  int pass_first_ = 0;
  int pass_rows_ = 0;
  int pass_to_ = 0;
  torch::Tensor pass_input_;  // keeps the pass's input alive
  // The last DraftPass's groups: first row of each (the newest row last)
  // and their inputs, kept alive until ApplyDraftPass.
  std::vector<int> group_first_;
  std::vector<torch::Tensor> group_inputs_;
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_ENGINE_SPECBOUND_H_

// The pieces of one lossless self-speculative decode step that do not
// depend on how forward passes are run: choosing a draft token, accepting
// drafts against the full model, and the counters. The one decode loop
// (executor/engine/sequence.h's Sequence and RunBatchStep) runs the passes, for
// one sequence or many per pass, and calls these, so every path accepts
// exactly alike.
//
// A step starts from the sequence's committed K/V (positions [0, n)) and
// `last`, the newest generated token, which is not in the K/V yet. It
//   1. drafts up to gamma tokens autoregressively with the masked sub-network
//      (skipped sublayers compute nothing; a skipped attention writes no K/V),
//      stopping early when the draft's top-1 probability falls below the exit
//      threshold (ChooseDraft);
//   2. verifies [last, drafts...] with ONE full-model pass, which
//      overwrites those positions' K/V in every layer;
//   3. accepts (AcceptDrafts, FinishVerification): greedy keeps the longest
//      prefix of drafts equal to the target's argmax plus the target's token
//      at the first mismatch (or a bonus token after a full accept); coupled
//      sampling (Sampler::coupled(), the default with a seed) does the same
//      with the target's coupled draws (Sampler::DrawAt, noise keyed by the
//      seed and the token's position), so the text equals plain decoding's;
//      other sampling uses speculative rejection sampling (accept with
//      min(1, p/q), resample from norm(max(0, p - q)), bonus from p). Each
//      keeps the output distribution exactly the target's;
//   4. rolls the K/V back by moving the sequence's committed length (no
//      copy): rejected positions are overwritten later.
// With gamma 0 (or an empty budget) a step is a plain autoregressive step.
//
// Ownership: the functions borrow their arguments for the call only.
// Thread safety: none of them keeps state; a Sampler and a SpeculationStats
// belong to one sequence and its step thread.
#ifndef KNAPSERVE_EXECUTOR_ENGINE_SPECULATION_STEP_H_
#define KNAPSERVE_EXECUTOR_ENGINE_SPECULATION_STEP_H_

#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "executor/engine/sampler.h"

namespace knapserve {

// Counters of one sequence, with vLLM's meaning: a draft is one speculation
// step that proposed at least one token.
struct SpeculationStats {
  int64_t drafts = 0;
  int64_t draft_tokens = 0;
  int64_t accepted_tokens = 0;
  std::vector<int64_t>
      accepted_per_position;  // [j]: drafts whose j-th token was accepted
  double draft_seconds = 0;
  double verify_seconds = 0;
  // SpecBound (executor/engine/specbound.h) only: exit_depths[d - 1] counts the
  // draft tokens that exited after d layers; depth_bound_stops the steps
  // whose drafting ended at a row that reached the depth bound without
  // exiting, width_bound_stops those that ended at the width bound (the
  // step's draft budget: max_draft, or less near the output or K/V limit).
  std::vector<int64_t> exit_depths;
  int64_t depth_bound_stops = 0;
  int64_t width_bound_stops = 0;
  // Mean layers run by an exited draft token (0 when none).
  double mean_exit_depth() const;
  // accepted_tokens / draft_tokens (0 when nothing was drafted).
  double acceptance_rate() const;
  // 1 + accepted_tokens / drafts: tokens committed per verification.
  double mean_acceptance_length() const;
};

// What one step committed (FinishVerification's answer).
struct StepResult {
  std::vector<int32_t> tokens;  // committed this step, in order (>= 1)
  int drafted = 0;              // draft tokens proposed
  int accepted = 0;             // of which accepted
  // When requested: the verification pass's hidden states at all 2L+1
  // boundaries for the committed positions, [2L+1, accepted+1, hidden], and
  // those positions' first index (positions first_position ...).
  torch::Tensor boundary_states;
  int64_t first_position = 0;
  // The full model's argmax at each captured position (alpha_hat's target).
  std::vector<int32_t> target_argmax;
};

// The draft token for sequence position `position` from the draft's
// processed logits, already scaled as the draft wants them: argmax when
// greedy, the coupled draw when coupled, else a sequential draw from the
// sampler's distribution, which is appended to `draft_dists` (q_j, for
// rejection sampling).
int32_t DrawDraft(Sampler& sampler, const torch::Tensor& logits,
                  int64_t position, std::vector<torch::Tensor>& draft_dists);

// Picks the draft token for sequence position `position` from the draft's
// logits ([vocab] float32, already through the sequence's logits processors
// with the history of that position) with DrawDraft. Returns the token and
// sets `confident` to whether the draft's top-1 probability reaches
// `exit_threshold` (drafting goes on only then).
int32_t ChooseDraft(Sampler& sampler, const torch::Tensor& logits,
                    int64_t position, double exit_threshold,
                    std::vector<torch::Tensor>& draft_dists, bool& confident);

// What verification decided.
struct Acceptance {
  int64_t accepted = 0;  // leading drafts kept
  int32_t next = -1;     // the target's token after them (correction/bonus)
};
// Verification of `drafts` against the full model's logits ([m+1, vocab]
// float32; row j predicts the token at sequence position `position` + j,
// after draft j-1, and went through the logits processors with drafts
// 0..j-1 as history) and their argmax (`target`, m+1 ids): greedy keeps the
// longest matching prefix; coupled sampling keeps the longest prefix equal
// to the target's coupled draws; other sampling runs speculative rejection
// sampling with `draft_dists`.
Acceptance AcceptDrafts(Sampler& sampler, const std::vector<int32_t>& drafts,
                        const std::vector<torch::Tensor>& draft_dists,
                        const torch::Tensor& logits, const int64_t* target,
                        int64_t position);

// Adds one verification's counts to `stats` (nothing when m == 0).
void RecordVerification(SpeculationStats& stats, int64_t drafted,
                        int64_t accepted);

// The end of a verification: accepts `drafts` against the full model's
// `logits` ([m+1, vocab]), records the counts in `stats`, and returns the
// step's result (committed tokens, counts; with `capture`, the committed
// positions' rows of `states` and the target's argmax). `first_position` is
// the position of the step's input token `last`, so row j predicts position
// first_position + 1 + j. The caller keeps K/V positions
// [0, first_position + result.accepted + 1).
StepResult FinishVerification(Sampler& sampler,
                              const std::vector<int32_t>& drafts,
                              const std::vector<torch::Tensor>& draft_dists,
                              const torch::Tensor& logits,
                              const torch::Tensor& states,
                              int64_t first_position, bool capture,
                              SpeculationStats& stats);

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_ENGINE_SPECULATION_STEP_H_

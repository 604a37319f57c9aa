// BatchCostModel: the executor's question to the planner's latency model when
// several sequences share every forward pass (continuous batching): does
// drafting still pay at this batch?
//
// Alone, verifying gamma+1 tokens costs little more than one token, because
// a decode step is dominated by reading the weights. In a batch of B
// sequences the main pass already has B rows; with drafts it has
// sum(gamma_i + 1) rows, plus gamma draft passes of up to B rows each, and
// once the pass is compute-bound those rows are no longer nearly free. The
// batch engine (executor/engine/batch_engine.h) asks before every step and
// decodes plainly (no drafts) when the answer is no, the way vLLM disables
// speculation above a batch size, but priced from the measured profile
// (planner/batch_cost.h implements it) instead of a fixed threshold.
//
// Thread safety: implementations are immutable; DraftsPay may be called
// from any thread.
#ifndef KNAPSERVE_COMMON_PLAN_BATCH_COST_MODEL_H_
#define KNAPSERVE_COMMON_PLAN_BATCH_COST_MODEL_H_

#include <cstdint>

#include "absl/types/span.h"
#include "common/model/layer_mask.h"

namespace knapserve {

// One decoding sequence of the next step as the cost model sees it.
struct BatchMember {
  int gamma = 0;          // drafts it would propose (0: a plain row)
  double acceptance = 0;  // its per-token acceptance estimate, in [0, 1]
  const LayerMask* mask = nullptr;  // its draft mask (gamma > 0), borrowed
};

class BatchCostModel {
 public:
  virtual ~BatchCostModel() = default;
  // Whether the members of one step, at about `context_length` positions,
  // commit more tokens per second with their drafts than all decoding
  // plainly (one row each).
  virtual bool DraftsPay(int64_t context_length,
                         absl::Span<const BatchMember> members) const = 0;
};

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_PLAN_BATCH_COST_MODEL_H_

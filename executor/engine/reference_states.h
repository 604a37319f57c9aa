// Reference states for the planner: the full model's
// hidden states at all 2L+1 sublayer boundaries for the tokens committed
// during the m verification steps after each plan boundary. They are cut out
// of verification passes that run anyway; no extra forward is made.
//
// ReferenceStateCollector decides which steps capture (the first m steps of
// every plan interval of T steps) and glues their pieces into one snapshot.
// Not thread-safe; one per sequence.
#ifndef KNAPSERVE_EXECUTOR_ENGINE_REFERENCE_STATES_H_
#define KNAPSERVE_EXECUTOR_ENGINE_REFERENCE_STATES_H_

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "executor/engine/speculation_step.h"

namespace knapserve {

// One snapshot, ready to hand to a planner.
struct ReferenceStates {
  torch::Tensor states;            // [2L+1, r, hidden], model dtype and device
  std::vector<int64_t> positions;  // the r tokens' positions
  std::vector<int32_t>
      target_argmax;           // the full model's argmax at each of them
  int64_t context_length = 0;  // committed length when the snapshot closed
  int64_t step = 0;            // decode step index of the plan boundary
};

class ReferenceStateCollector {
 public:
  // interval: T (>= 1) steps between plan boundaries; steps: m (>= 1) steps
  // captured after each boundary. Step 0 is a boundary.
  ReferenceStateCollector(int64_t interval, int64_t steps);

  // Whether decode step `step` (0-based) should capture states.
  bool Wants(int64_t step) const;
  // Adds a captured step. Returns the snapshot when this step completes one.
  std::optional<ReferenceStates> Add(int64_t step, const StepResult& result,
                                     int64_t context_length);

 private:
  int64_t interval_;
  int64_t steps_;
  std::vector<torch::Tensor> pieces_;
  ReferenceStates pending_;
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_ENGINE_REFERENCE_STATES_H_

#include "executor/engine/reference_states.h"

#include <c10/core/InferenceMode.h>

namespace knapserve {

ReferenceStateCollector::ReferenceStateCollector(int64_t interval,
                                                 int64_t steps)
    : interval_(std::max<int64_t>(1, interval)),
      steps_(std::max<int64_t>(1, steps)) {}

bool ReferenceStateCollector::Wants(int64_t step) const {
  return step % interval_ < steps_;
}

std::optional<ReferenceStates> ReferenceStateCollector::Add(
    int64_t step, const StepResult& result, int64_t context_length) {
  c10::InferenceMode guard;
  if (!Wants(step) || !result.boundary_states.defined()) return std::nullopt;
  const int64_t offset = step % interval_;
  if (offset == 0) {  // a new boundary: start over
    pieces_.clear();
    pending_ = ReferenceStates();
    pending_.step = step;
  }
  pieces_.push_back(result.boundary_states);
  const int64_t rows = result.boundary_states.size(1);
  for (int64_t i = 0; i < rows; ++i)
    pending_.positions.push_back(result.first_position + i);
  pending_.target_argmax.insert(pending_.target_argmax.end(),
                                result.target_argmax.begin(),
                                result.target_argmax.end());
  if (offset + 1 < steps_) return std::nullopt;
  pending_.states = torch::cat(pieces_, 1);
  pending_.context_length = context_length;
  pieces_.clear();
  ReferenceStates done = std::move(pending_);
  pending_ = ReferenceStates();
  return done;
}

}  // namespace knapserve

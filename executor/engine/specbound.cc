#include "executor/engine/specbound.h"

#include <algorithm>

namespace knapserve {

double ExitTemperature(double t0, int layer, int num_layers) {
  if (num_layers <= 1) return t0;
  return 1.0 + (t0 - 1.0) * static_cast<double>(num_layers - 1 - layer) /
                   static_cast<double>(num_layers - 1);
}

int NextCheckDepth(int depth, int check_every, int depth_bound) {
  return std::min(depth_bound, (depth / check_every + 1) * check_every);
}

bool IsCheckDepth(int depth, int check_every, int depth_bound) {
  return depth > 0 &&
         NextCheckDepth(depth - 1, check_every, depth_bound) == depth;
}

void SpecBoundRows::Begin(int64_t first_position, int32_t last) {
  first_position_ = first_position;
  tokens_.assign(1, last);
  depth_.assign(1, 0);
  states_.assign(1, torch::Tensor());
  pass_rows_ = 0;
  pass_input_ = torch::Tensor();
}

void SpecBoundRows::AddRow(int32_t token) {
  tokens_.push_back(token);
  depth_.push_back(0);
  states_.emplace_back();
}

torch::Tensor SpecBoundRows::state(int row) const { return states_[row]; }

void SpecBoundRows::Fill(int first, int from, int to, BatchSequence& input) {
  pass_first_ = first;
  pass_rows_ = rows() - first;
  pass_to_ = to;
  input.start_pos = first_position_ + first;
  input.first_layer = from;
  input.last_layer = to;
  if (from == 0) {
    // Only the newest row can be at depth 0 (every earlier row ran at least
    // to its exit check).
    TORCH_CHECK(pass_rows_ == 1, "SpecBound: ", pass_rows_, " rows at depth 0");
    input.tokens = absl::MakeConstSpan(&tokens_[first], 1);
    pass_input_ = torch::Tensor();
    return;
  }
  std::vector<torch::Tensor> parts(states_.begin() + first, states_.end());
  pass_input_ = parts.size() == 1 ? parts[0] : torch::cat(parts, 0);
  input.input_states = pass_input_;
}

std::vector<BatchSequence> SpecBoundRows::DraftPass(int to) {
  const int newest = rows() - 1;
  TORCH_CHECK(depth_[newest] == 0, "SpecBound: the newest row is at depth ",
              depth_[newest], ", a draft pass starts at 0");
  TORCH_CHECK(to > 0, "SpecBound: draft pass to depth ", to);
  // Earlier rows below `to`: a suffix (depths never increase along the
  // rows), in groups of one depth each.
  int first = newest;
  while (first > 0 && depth_[first - 1] < to) --first;
  group_first_.clear();
  group_inputs_.clear();
  std::vector<BatchSequence> inputs;
  for (int r = first; r < newest;) {
    int end = r;
    while (end < newest && depth_[end] == depth_[r]) ++end;
    BatchSequence input;
    input.start_pos = first_position_ + r;
    input.first_layer = depth_[r];
    input.last_layer = to;
    std::vector<torch::Tensor> parts(states_.begin() + r,
                                     states_.begin() + end);
    group_inputs_.push_back(parts.size() == 1 ? parts[0]
                                              : torch::cat(parts, 0));
    input.input_states = group_inputs_.back();
    group_first_.push_back(r);
    inputs.push_back(std::move(input));
    r = end;
  }
  BatchSequence input;
  input.start_pos = first_position_ + newest;
  input.first_layer = 0;
  input.last_layer = to;
  input.tokens = absl::MakeConstSpan(&tokens_[newest], 1);
  group_first_.push_back(newest);
  inputs.push_back(std::move(input));
  return inputs;
}

void SpecBoundRows::ApplyDraftPass(
    absl::Span<const torch::Tensor> output_states,
    absl::Span<const int> reached) {
  TORCH_CHECK(output_states.size() == group_first_.size() &&
                  reached.size() == group_first_.size(),
              "SpecBound: ", output_states.size(), " outputs for ",
              group_first_.size(), " draft pass groups");
  for (size_t g = 0; g < group_first_.size(); ++g) {
    const int first = group_first_[g];
    const int end = g + 1 < group_first_.size() ? group_first_[g + 1] : rows();
    // A group the pass stopped before it joined kept its depth and states.
    if (reached[g] <= depth_[first]) continue;
    TORCH_CHECK(output_states[g].size(0) == end - first,
                "SpecBound: pass "
                "returned ",
                output_states[g].size(0), " rows, expected ", end - first);
    for (int r = first; r < end; ++r) {
      states_[r] = output_states[g].narrow(0, r - first, 1);
      depth_[r] = reached[g];
    }
  }
  group_first_.clear();
  group_inputs_.clear();
}

bool SpecBoundRows::AlignPass(BatchSequence& input) {
  const int last = rows() - 1;
  const int from = depth_[last];
  if (from == max_depth()) return false;
  int first = last;
  while (depth_[first - 1] == from) --first;  // row 0 is deeper
  Fill(first, from, depth_[first - 1], input);
  return true;
}

void SpecBoundRows::VerifyPass(BatchSequence& input) {
  const int d = max_depth();
  TORCH_CHECK(d > 0, "SpecBound: verification from depth 0");
  for (int r = 0; r < rows(); ++r)
    TORCH_CHECK(depth_[r] == d, "SpecBound: row ", r, " not aligned");
  Fill(0, d, -1, input);
  pass_rows_ = 0;
}

void SpecBoundRows::Apply(const torch::Tensor& output_states) {
  TORCH_CHECK(output_states.size(0) == pass_rows_, "SpecBound: pass returned ",
              output_states.size(0), " rows, expected ", pass_rows_);
  for (int i = 0; i < pass_rows_; ++i) {
    states_[pass_first_ + i] = output_states.narrow(0, i, 1);
    depth_[pass_first_ + i] = pass_to_;
  }
  pass_rows_ = 0;
  pass_input_ = torch::Tensor();
}

}  // namespace knapserve

#include "planner/batch_cost.h"

#include <algorithm>
#include <utility>

#include "planner/tpt.h"

namespace knapserve {

ProfileBatchCost::ProfileBatchCost(LatencyProfile profile, int num_layers)
    : profile_(std::move(profile)), num_layers_(num_layers) {}

double ProfileBatchCost::PassSeconds(int64_t context_length, int rows,
                                     int sequences) const {
  rows = std::max(rows, 1);
  const int table = profile_.max_draft + 1;
  double seconds =
      profile_.VerifySeconds(context_length, std::min(rows, table));
  if (rows > table) {
    // Past the table: along its last step per row (never negative).
    const double per_row =
        table >= 2
            ? std::max(0.0,
                       profile_.VerifySeconds(context_length, table) -
                           profile_.VerifySeconds(context_length, table - 1))
            : profile_.VerifySeconds(context_length, 1);
    seconds += per_row * (rows - table);
  }
  const double attention_per_position = std::max(0.0, profile_.attention.b);
  seconds += std::max(0, sequences - 1) * num_layers_ * attention_per_position *
             static_cast<double>(context_length);
  return seconds;
}

double ProfileBatchCost::StepTokensPerSecond(
    int64_t context_length, absl::Span<const BatchMember> members,
    bool drafting) const {
  const int n = static_cast<int>(members.size());
  if (n == 0) return 0;
  // The engine's own work per sequence and step, and per draft token.
  const double overhead = n * profile_.StepOverheadSeconds(context_length);
  if (!drafting) return n / (PassSeconds(context_length, n, n) + overhead);
  int rows = 0;
  int max_gamma = 0;
  double tokens = 0;
  double fraction_sum = 0;
  int drafting_members = 0;
  const double one = profile_.VerifySeconds(context_length, 1);
  for (const BatchMember& m : members) {
    const int gamma = m.mask != nullptr ? std::max(m.gamma, 0) : 0;
    rows += gamma + 1;
    max_gamma = std::max(max_gamma, gamma);
    tokens += ExpectedTokensPerStep(std::clamp(m.acceptance, 0.0, 1.0), gamma);
    if (gamma > 0) {
      fraction_sum +=
          one > 0 ? profile_.DraftSeconds(*m.mask, context_length) / one : 1;
      ++drafting_members;
    }
  }
  double seconds = PassSeconds(context_length, rows, n) + overhead +
                   (rows - n) * profile_.DraftOverheadSeconds(context_length);
  if (drafting_members > 0) {
    const double fraction = fraction_sum / drafting_members;
    for (int round = 1; round <= max_gamma; ++round) {
      int in_round = 0;
      for (const BatchMember& m : members) {
        if (m.mask != nullptr && m.gamma >= round) ++in_round;
      }
      seconds += fraction * PassSeconds(context_length, in_round, in_round);
    }
  }
  return seconds > 0 ? tokens / seconds : 0;
}

bool ProfileBatchCost::DraftsPay(int64_t context_length,
                                 absl::Span<const BatchMember> members) const {
  return StepTokensPerSecond(context_length, members, /*drafting=*/true) >
         StepTokensPerSecond(context_length, members, /*drafting=*/false);
}

void DeferredBatchCost::SetProfile(LatencyProfile profile) {
  auto cost =
      std::make_shared<const ProfileBatchCost>(std::move(profile), num_layers_);
  absl::MutexLock lock(&mu_);
  cost_ = std::move(cost);
}

bool DeferredBatchCost::has_profile() const {
  absl::MutexLock lock(&mu_);
  return cost_ != nullptr;
}

bool DeferredBatchCost::DraftsPay(int64_t context_length,
                                  absl::Span<const BatchMember> members) const {
  std::shared_ptr<const ProfileBatchCost> cost;
  {
    absl::MutexLock lock(&mu_);
    cost = cost_;
  }
  return cost == nullptr || cost->DraftsPay(context_length, members);
}

}  // namespace knapserve

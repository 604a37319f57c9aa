// ProfileBatchCost: common/plan/batch_cost_model.h's question answered from
// a measured latency profile (planner/latency_profile.h) and the TPT model
// (planner/tpt.h).
//
// The price of one batched pass over R rows from S sequences at context n:
//
//   PassSeconds(n, R, S) = t_verify(n, R) + (S - 1) * L * b_attn * n
//
// t_verify(n, R) is the profile's multi-token pass for R <= max_draft + 1
// rows, and beyond that grows along its last measured step per row (a pass
// that has become compute-bound grows linearly in its rows). The second term
// is the attention over S separate caches instead of one: every layer's
// attention reads each sequence's own n positions (b_attn is the
// per-position slope of the profile's attention fit).
//
// A step of the members, drafting: gamma_max draft rounds, round r a masked
// pass over the members with gamma >= r, priced at PassSeconds over those
// rows times the mean draft fraction t_draft(S_i, n) / t_verify(n, 1); then
// one main pass over sum(gamma_i + 1) rows. It commits
// sum ExpectedTokensPerStep(alpha_i, gamma_i) tokens. Plain: one pass over B
// rows committing B tokens. Both add the engine's work outside the passes
// (the profile's o_step per member and o_draft per draft row). Drafting pays
// when its tokens per second exceed plain's.
//
// Thread safety: immutable after construction; const methods from any
// thread. Owns a copy of the profile. DeferredBatchCost (below) is the one
// whose profile comes later.
#ifndef KNAPSERVE_PLANNER_BATCH_COST_H_
#define KNAPSERVE_PLANNER_BATCH_COST_H_

#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/plan/batch_cost_model.h"
#include "planner/latency_profile.h"

namespace knapserve {

class ProfileBatchCost final : public BatchCostModel {
 public:
  ProfileBatchCost(LatencyProfile profile, int num_layers);

  bool DraftsPay(int64_t context_length,
                 absl::Span<const BatchMember> members) const override;

  // PassSeconds(n, rows, sequences) of the file comment.
  double PassSeconds(int64_t context_length, int rows, int sequences) const;
  // Predicted tokens per second of the members' next step, with their drafts
  // (drafting = true) or all plain.
  double StepTokensPerSecond(int64_t context_length,
                             absl::Span<const BatchMember> members,
                             bool drafting) const;

 private:
  const LatencyProfile profile_;
  const int num_layers_;
};

// A ProfileBatchCost whose profile may come later: a server that serves
// while its profile is measured in the background
// (planner/background_profile.h). Until SetProfile every step's drafts pay
// (as with no cost model: each sequence follows its own mode; planned ones
// decode plainly anyway while the planner has no profile); from then on
// ProfileBatchCost answers.
//
// Thread safety: DraftsPay from any thread (the engine's step thread),
// SetProfile from any other; one absl::Mutex guards the model in force,
// which is immutable once set.
class DeferredBatchCost final : public BatchCostModel {
 public:
  explicit DeferredBatchCost(int num_layers) : num_layers_(num_layers) {}

  // The profile lands; a second call replaces the first.
  void SetProfile(LatencyProfile profile) ABSL_LOCKS_EXCLUDED(mu_);
  bool has_profile() const ABSL_LOCKS_EXCLUDED(mu_);

  bool DraftsPay(int64_t context_length,
                 absl::Span<const BatchMember> members) const override
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const int num_layers_;
  mutable absl::Mutex mu_;
  std::shared_ptr<const ProfileBatchCost> cost_ ABSL_GUARDED_BY(mu_);
};

}  // namespace knapserve

#endif  // KNAPSERVE_PLANNER_BATCH_COST_H_

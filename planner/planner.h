// The planner core: policies that turn one snapshot of reference states into
// a draft plan (which sublayers the draft skips, how many tokens it drafts).
//
//   SolveKnapSpec  the KnapSpec knapsack DP over sublayers + the TPT grid
//                  (DESIGN.md section 1)
//   SolveClasp     the CLaSp baseline: whole layers, exactly M skipped, DP on
//                  the last reference token only
//   SolveStatic    a fixed mask; only gamma is chosen (by the TPT grid)
//
//   PlanInputs in;
//   in.states = snapshot.states;  in.first_position = snapshot.positions[0];
//   in.target_argmax = snapshot.target_argmax;
//   in.prefix_kv = &kv;  in.prefix_len = snapshot.positions[0];
//   in.context_length = snapshot.context_length;  in.step = snapshot.step;
//   ASSIGN_OR_RETURN(DraftPlan plan, SolveKnapSpec(model, profile, in, KnapSpecOptions()));
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
#include <vector>

#include "absl/status/statusor.h"
#include "common/layer_mask.h"
#include "common/planner_client.h"
#include "planner/latency_profile.h"

namespace knapserve {

class LlamaModel;
struct LayerKv;

// One snapshot of reference states (executor/reference_states.h holds the
// same data; this is the planner's own plain copy of the shape of it).
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
  // head_dim]); positions [0, prefix_len) must be valid. prefix_len may
  // extend past first_position (the executor's cache also holds the
  // reference tokens' own K/V): KnapSpec uses min(prefix_len, first_position),
  // CLaSp min(prefix_len, position of the last reference token). A shorter
  // prefix_len makes the DP attend to fewer positions. Null iff prefix_len == 0.
  const std::vector<LayerKv>* prefix_kv = nullptr;
  int64_t prefix_len = 0;
  // Context length n for the latency model; 0 means first_position + r.
  int64_t context_length = 0;
  // Decode step of the plan boundary, echoed in DraftPlan::step.
  int64_t step = 0;
};

struct KnapSpecOptions {
  double tau = 0.5;                 // DP cells below this mean cosine are dropped
  int weight_cap = 5;               // largest integer weight of the dearer sublayer kind
  int max_draft = 10;               // D: gamma in 1..D
  bool keep_first_and_last = true;  // never skip layer 0 or layer L-1
};

// KnapSpec: weights from the profile at n = context_length, the sublayer DP
// on all r reference tokens, alpha_hat for every surviving candidate, and
// the TPT grid over candidates x gamma in 1..D. num_candidates counts the
// surviving DP cells (including j = 0).
absl::StatusOr<DraftPlan> SolveKnapSpec(const LlamaModel& model, const LatencyProfile& profile,
                                        const PlanInputs& inputs, const KnapSpecOptions& options);

struct ClaspOptions {
  int num_skipped_layers = 0;       // M, required (>= 1)
  int max_draft = 10;               // D for the TPT grid
  int gamma = 0;                    // > 0: fixed gamma instead of the TPT grid
  bool keep_first_and_last = true;  // never skip layer 0 or layer L-1
};

// CLaSp: the whole-layer DP (exactly M layers skipped, no pruning) on the
// last reference token's states only (r = 1, attending to the prefix K/V up to
// it); the chosen mask's alpha_hat is then measured on all r tokens and gamma
// comes from the TPT grid (or ClaspOptions::gamma). num_candidates is 1.
absl::StatusOr<DraftPlan> SolveClasp(const LlamaModel& model, const LatencyProfile& profile,
                                     const PlanInputs& inputs, const ClaspOptions& options);

struct StaticOptions {
  int max_draft = 10;  // D for the TPT grid
};

// A fixed mask: alpha_hat measured on the r reference tokens, gamma from the
// TPT grid. InvalidArgument when the mask's layer count is not the model's.
absl::StatusOr<DraftPlan> SolveStatic(const LlamaModel& model, const LatencyProfile& profile,
                                      const PlanInputs& inputs, const LayerMask& mask,
                                      const StaticOptions& options);

}  // namespace knapserve

#endif  // KNAPSERVE_PLANNER_PLANNER_H_

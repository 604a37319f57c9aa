// The executor <-> planner contract in plain C++: what a
// plan request carries, what a plan says, and the PlannerClient interface the
// executor talks to.
//
// The executor depends only on this header. Implementations: the in-process
// planner (planner/inprocess_planner.h: solves on its own thread, reads the
// executor's K/V directly, no copies) and, across processes, a gRPC client
// for the Planner service. The binaries in tools/ pick one and hand it to the
// executor; the executor never knows which policy or transport runs.
//
// Ownership: a PlanRequest owns its tensors by reference count. `kv` holds
// handles to the sequence's K/V storage (no copy): positions [0, kv_length)
// of it are committed and never rewritten while the sequence lives, and the
// handles keep the storage alive until the request is done, even if the
// sequence finishes first.
#ifndef KNAPSERVE_COMMON_PLAN_PLANNER_CLIENT_H_
#define KNAPSERVE_COMMON_PLAN_PLANNER_CLIENT_H_

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model/layer_mask.h"
#include "common/model/llama.h"
#include "common/plan/step_forecast.h"

namespace knapserve {

// Which policy decides the draft.
enum class PlanPolicy {
  kStatic,    // a given mask; only gamma is chosen
  kKnapSpec,  // the sublayer knapsack DP + TPT grid
  kClasp,     // whole layers, exactly M skipped, DP on the last token
  kOff,       // no speculation: gamma 0 without solving (tests, A/B runs)
};
// "static", "knapspec", "clasp", "off".
std::string PlanPolicyName(PlanPolicy policy);
absl::StatusOr<PlanPolicy> ParsePlanPolicy(const std::string& name);

// What a plan's choice of gamma rests on, so that the executor can choose it
// again as the drafting evidence of the requests under it accumulates
// (executor/planning/plan_refinement.h): the latency model's whole-step
// prices at the plan's context and the shares the planner measured on its
// reference tokens. Empty
// verify_seconds: the plan cannot be refined (gamma 0, or a planner that
// did not send it).
struct PlanBasis {
  // t_verify(n, t) for t = 1..D+1: seconds of a step that verifies t tokens.
  std::vector<double> verify_seconds;
  double draft_seconds = 0;      // t_draft(S) per draft token of the mask
  int64_t reference_tokens = 0;  // r: tokens the shares were measured on
  // The acceptance share on them (the solve's DraftPlan::alpha_hat).
  double accept_share = 0;
  AlphaPrior prior;  // the planner's smoothing of the shares
  // The draft confidence stop's raw shares on the reference tokens
  // (ConfidenceStop before smoothing); false: drafts run to gamma.
  bool confidence_stop = false;
  double go_on_share = 1;
  double accept_and_go_on_share = 0;
  // The request fixed gamma (kStatic with a gamma of its own): a refinement
  // updates the predictions but keeps it.
  bool gamma_fixed = false;
  // Draft positions 2..gamma as the pairs of consecutive reference tokens
  // show them (planner/knapsack.h LaterDraftCounts): raw shares and the
  // trials behind each (averaged over pooled candidates, so not always
  // whole; at most reference_tokens - 1). later_accept_trials 0: no pair
  // reached a later draft (or a planner that does not measure them); drafts
  // 2..gamma are then taken to have draft 1's odds.
  // later_accept_and_go_on_share rests on later_accept_trials; without a
  // confidence stop it equals later_accept_share and later_go_on_share is 1.
  double later_accept_trials = 0;
  double later_accept_share = 0;
  double later_accept_and_go_on_share = 0;
  double later_go_on_trials = 0;
  double later_go_on_share = 1;
};

// What a policy decided. gamma == 0 means "no speculation" (autoregressive
// decoding is predicted to be faster than any draft); the mask then carries no
// meaning.
struct DraftPlan {
  LayerMask mask;
  int gamma = 0;
  double predicted_tpt =
      0;  // tokens per second of (mask, gamma) by the latency model
  // Of the chosen mask on the reference tokens: its share (KnapSpec with
  // pooling: the share pooled with its neighbours', planner/planner.h
  // KnapSpecOptions::pool_alpha).
  double alpha_hat = 0;
  // The acceptance predicted_tpt assumes: alpha_hat smoothed by the planner's
  // Beta prior (common/plan/step_forecast.h SmoothAlpha); 0 with gamma 0.
  double alpha_smoothed = 0;
  // What predicted_tpt expects of one step (common/plan/step_forecast.h
  // ForecastStep): committed tokens and draft tokens made, fewer than gamma
  // when drafts stop on low confidence (PlanRequest::exit_threshold). 1 and 0
  // with gamma 0.
  double predicted_tokens_per_step = 1;
  double predicted_drafts_per_step = 0;
  int num_candidates = 0;  // candidates the policy weighed
  // Candidates whose alpha_hat was measured (KnapSpec without pooling
  // measures lazily, in order of their best possible TPT); <=
  // num_candidates.
  int num_evaluated = 0;
  double solve_seconds = 0;  // wall time of the solve
  double queue_seconds = 0;  // time the request waited before its solve began
  int64_t step = 0;          // PlanRequest::step, echoed
  // Extras for logs and metrics.
  double baseline_tpt =
      0;  // 1 / t_verify(n, 1): autoregressive tokens per second
  double mean_cosine = 0;  // of the chosen mask, at the last boundary
  // What gamma and the predictions rest on (empty with gamma 0).
  PlanBasis basis;
  // Draft tokens of executor-side evidence behind the odds the predictions
  // use (accept trials, executor/planning/plan_refinement.h); 0: the
  // planner's reference tokens alone.
  int64_t evidence_trials = 0;
  // The W3C traceparent of the span that delivered this plan to the
  // executor (common/trace): the remote client's plan.send, then the
  // executor's plan.receive, whose plan.apply spans hang from it; "" when
  // not traced.
  std::string traceparent;
};

// A prefix K/V held by reference: a sequence's blocks in the executor's
// paged pool (executor/engine/kv_pool.h's SequenceKv::Snapshot). Positions
// [0, length) stay valid while it lives, and the blocks count against the
// pool's memory until the last holder drops it. The consumer copies them
// out with Contiguous() on its own thread (the planner's, or the remote
// client's sender), so the decode thread never copies a prefix.
class KvSnapshot {
 public:
  virtual ~KvSnapshot() = default;
  // Per layer, K and V of [kv_heads, length, head_dim]. Any thread.
  virtual std::vector<LayerKv> Contiguous() const = 0;
};

// One plan request: a snapshot of reference states plus what the DP's
// attention needs.
struct PlanRequest {
  uint64_t sequence_id = 0;
  int64_t step = 0;            // decode step of the plan boundary
  int64_t context_length = 0;  // committed length when the snapshot closed
  // Tokens the plan will decode while in force (e.g. the plan interval T in
  // steps); the planner prices the plan at context_length +
  // plan_lifetime_tokens / 2, the mean context over its life. 0: price it at
  // context_length (the old behaviour).
  int64_t plan_lifetime_tokens = 0;
  PlanPolicy policy = PlanPolicy::kKnapSpec;
  std::string static_mask;  // kStatic: the mask ("a3,m7")
  int clasp_layers = 0;     // kClasp: M, the layers to skip (>= 1)
  int max_draft = 10;       // D: gamma in 1..D
  // The request's draft confidence stop (SpeculationConfig::exit_threshold,
  // [0, 1]); the planner prices drafts that end early (planner/planner.h
  // PlanInputs::exit_threshold). 0: drafts always run to gamma.
  double exit_threshold = 0;
  std::string
      model_fingerprint;  // ModelConfig::Fingerprint() of the executor's model

  // The full model's hidden states at all 2L+1 sublayer boundaries for r
  // tokens at positions first_position .. first_position+r-1: [2L+1, r,
  // hidden].
  torch::Tensor states;
  int64_t first_position = 0;
  // The full model's argmax at each of the r tokens; empty: the planner
  // computes them from the last boundary's states.
  std::vector<int32_t> target_argmax;

  // K/V of the prefix, one entry per layer ([kv_heads, capacity, head_dim]);
  // positions [0, kv_length) are valid. Empty with kv_length == 0 when the
  // planner must do without.
  std::vector<LayerKv> kv;
  int64_t kv_length = 0;
  // Instead of `kv`: the same positions [0, kv_length) by reference, copied
  // out by the consumer (ResolvedKv). Null when `kv` holds them.
  std::shared_ptr<const KvSnapshot> kv_snapshot;
  // The position each K/V entry holds, ascending, when the entries are a
  // window rather than positions 0 .. kv_length - 1 (a request decoded from
  // the wire: common/wire/plan_codec.h); empty: contiguous.
  std::vector<int64_t> kv_positions;

  // The W3C traceparent of the span this request belongs to (common/trace:
  // the executor's plan.snapshot; across gRPC, the remote client's
  // plan.send): the planner's spans become its children. "" when not traced.
  std::string traceparent;
};

// The request's prefix K/V as tensors: `kv` when given, else a copy out of
// `kv_snapshot` (made now, on the calling thread), else empty.
std::vector<LayerKv> ResolvedKv(const PlanRequest& request);

using PlanCallback = std::function<void(absl::StatusOr<DraftPlan> plan)>;

// The executor's view of a planner. Implementations are thread-safe: many
// sequences submit from many threads.
class PlannerClient {
 public:
  virtual ~PlannerClient() = default;

  // Queues `request` and returns at once; never waits for a solve. `done`
  // runs exactly once, on a planner-owned thread, with the plan or the error
  // (FailedPrecondition for a model the planner does not serve, InvalidArgument
  // for a bad request, Unavailable when the planner is gone, Cancelled when a
  // newer request of the same sequence replaced this one before it ran).
  virtual void Submit(PlanRequest request, PlanCallback done) = 0;

  // Drops any queued request of `sequence_id` (its callback gets Cancelled).
  // A solve already running finishes and reports normally.
  virtual void Forget(uint64_t sequence_id) = 0;

  // True while this planner cannot plan because its latency profile is
  // still being measured (a server that started serving before it had one:
  // tools/executor_from_flags.h). Planned sequences then take no snapshot
  // and decode plainly (unless a plan or their own skip mask is in force),
  // counting those steps (PlanningStats::profile_pending_steps). The
  // in-process planner says so until its profile lands; the remote client
  // for a while after the planner answered ProfilePendingError, after which
  // a snapshot goes out again (decode plainly, retry later). Any thread;
  // cheap (called before every step of a planned sequence).
  virtual bool ProfilePending() const { return false; }
};

// The answer to a plan request while the planner's latency profile is still
// being measured: Unavailable with `message`, marked (a status payload) so that
// IsProfilePending recognizes it after it crossed the wire
// (PLAN_ERROR_CODE_PROFILE_PENDING). Not a failure: the executor decodes
// without a plan and asks again later; it is not counted in plan_failures.
absl::Status ProfilePendingError(std::string_view message);
bool IsProfilePending(const absl::Status& status);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_PLAN_PLANNER_CLIENT_H_

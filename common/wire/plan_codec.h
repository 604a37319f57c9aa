// Plan codec: the plain C++ planner contract (common/plan/planner_client.h) <->
// its wire form (proto/knapserve/v1/planner.proto), for the gRPC planner
// client in the executor and the Planner service.
//
// A PlanRequest's K/V travels as a window: the first `leading` positions of
// the prefix (before the first reference token) plus the last `window`
// positions before it, per layer. The receiver packs the window into
// contiguous [kv_heads, P, head_dim] tensors: the keys are stored after RoPE,
// and every window position precedes the reference tokens, so attention over
// the packed window equals attention over those positions. When leading +
// window cover the prefix, the window is exact.
//
// Errors: InvalidArgument naming the field for anything a peer can get wrong
// (see DecodePlanRequest). Thread safety: pure functions.
#ifndef KNAPSERVE_COMMON_WIRE_PLAN_CODEC_H_
#define KNAPSERVE_COMMON_WIRE_PLAN_CODEC_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/plan/planner_client.h"
#include "knapserve/v1/planner.pb.h"

namespace knapserve {

// Which prefix K/V positions a request carries.
struct KvWindowOptions {
  int64_t leading = 4;  // positions 0 .. leading-1 (attention sinks)
  int64_t window =
      1024;  // the last `window` positions before the reference tokens
};

// Encodes `request` with the K/V window `options` selects from request.kv
// (positions [0, min(kv_length, first_position))). Reference states travel in
// their own dtype; sequence_id as its decimal string.
absl::Status EncodePlanRequest(const PlanRequest& request,
                               const KvWindowOptions& options,
                               v1::PlanRequest* out);

// Decodes a request for a planner serving a model with `num_layers` layers.
// The K/V window comes back packed (kv_length = its number of positions);
// kv_context.all_in_memory is refused (no shared memory across processes).
// InvalidArgument names the field: a non-numeric sequence_id, missing or
// malformed tensors, positions not ascending or not matching r, a window of
// the wrong layer count or shape, max_draft_tokens 0 resolved by
// `default_max_draft`.
absl::StatusOr<PlanRequest> DecodePlanRequest(const v1::PlanRequest& proto,
                                              int num_layers,
                                              int default_max_draft);

// A solved plan (or the status of a failed solve) as a PlanResponse for the
// request (sequence_id, step).
v1::PlanResponse EncodePlanResponse(uint64_t sequence_id, int64_t step,
                                    const absl::StatusOr<DraftPlan>& plan);

// The plan a PlanResponse carries, or its error as a Status (the codes map
// back: FINGERPRINT_MISMATCH -> FailedPrecondition, SUPERSEDED -> Cancelled,
// RESOURCE_EXHAUSTED -> ResourceExhausted, ...). `num_layers` parses the mask.
// A gamma above `max_gamma` (the request's max_draft: a planner may not ask
// the executor for longer drafts than it offered) is InvalidArgument.
absl::StatusOr<DraftPlan> DecodePlanResponse(const v1::PlanResponse& proto,
                                             int num_layers, int max_gamma);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_WIRE_PLAN_CODEC_H_

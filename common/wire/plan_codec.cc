#include "common/wire/plan_codec.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/wire/tensor_codec.h"

namespace knapserve {
namespace {

// InvalidArgument naming `field` unless `tensor` is floating-point with only
// finite values: NaN or Inf in states or K/V would make every cosine of the
// planner's DP NaN (found by tests/fuzz/fuzz_plan_codec).
absl::Status CheckFiniteFloats(const torch::Tensor& tensor,
                               const std::string& field) {
  if (!tensor.is_floating_point()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": must be floating-point, got ",
                     c10::toString(tensor.scalar_type())));
  }
  if (tensor.numel() > 0 && !torch::isfinite(tensor).all().item<bool>()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": holds NaN or infinite values"));
  }
  return absl::OkStatus();
}

v1::PlannerPolicy WirePolicy(PlanPolicy policy) {
  switch (policy) {
    case PlanPolicy::kKnapSpec:
      return v1::PLANNER_POLICY_KNAPSPEC;
    case PlanPolicy::kClasp:
      return v1::PLANNER_POLICY_CLASP;
    case PlanPolicy::kStatic:
      return v1::PLANNER_POLICY_STATIC;
    case PlanPolicy::kOff:
      return v1::PLANNER_POLICY_OFF;
  }
  return v1::PLANNER_POLICY_UNSPECIFIED;
}

absl::StatusOr<PlanPolicy> PolicyFromWire(v1::PlannerPolicy policy) {
  switch (policy) {
    case v1::PLANNER_POLICY_UNSPECIFIED:  // the planner's default
    case v1::PLANNER_POLICY_KNAPSPEC:
      return PlanPolicy::kKnapSpec;
    case v1::PLANNER_POLICY_CLASP:
      return PlanPolicy::kClasp;
    case v1::PLANNER_POLICY_STATIC:
      return PlanPolicy::kStatic;
    case v1::PLANNER_POLICY_OFF:
      return PlanPolicy::kOff;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("policy: unknown value ", static_cast<int>(policy)));
  }
}

v1::PlanErrorCode WireErrorCode(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kFailedPrecondition:
      return v1::PLAN_ERROR_CODE_FINGERPRINT_MISMATCH;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return v1::PLAN_ERROR_CODE_INVALID_ARGUMENT;
    case absl::StatusCode::kUnimplemented:
      return v1::PLAN_ERROR_CODE_UNSUPPORTED;
    case absl::StatusCode::kCancelled:
      return v1::PLAN_ERROR_CODE_SUPERSEDED;
    case absl::StatusCode::kResourceExhausted:
      return v1::PLAN_ERROR_CODE_RESOURCE_EXHAUSTED;
    default:
      return v1::PLAN_ERROR_CODE_INTERNAL;
  }
}

absl::Status StatusFromWire(const v1::PlanError& error) {
  // Every error says what went wrong, even when the planner sent no words
  // (found by tests/fuzz/fuzz_plan_codec).
  const std::string m = error.message().empty()
                            ? absl::StrCat("the planner sent error ",
                                           v1::PlanErrorCode_Name(error.code()),
                                           " without a message")
                            : error.message();
  switch (error.code()) {
    case v1::PLAN_ERROR_CODE_FINGERPRINT_MISMATCH:
      return absl::FailedPreconditionError(m);
    case v1::PLAN_ERROR_CODE_INVALID_ARGUMENT:
      return absl::InvalidArgumentError(m);
    case v1::PLAN_ERROR_CODE_UNSUPPORTED:
      return absl::UnimplementedError(m);
    case v1::PLAN_ERROR_CODE_SUPERSEDED:
      return absl::CancelledError(m);
    case v1::PLAN_ERROR_CODE_RESOURCE_EXHAUSTED:
      return absl::ResourceExhaustedError(m);
    case v1::PLAN_ERROR_CODE_PROFILE_PENDING:
      return ProfilePendingError(m);
    default:
      return absl::InternalError(m);
  }
}

// The prefix positions a window of `options` keeps out of [0, prefix).
std::vector<int64_t> WindowPositions(int64_t prefix,
                                     const KvWindowOptions& options) {
  std::vector<int64_t> positions;
  const int64_t leading =
      std::min(prefix, std::max<int64_t>(0, options.leading));
  for (int64_t p = 0; p < leading; ++p) positions.push_back(p);
  const int64_t tail_start =
      std::max(leading, prefix - std::max<int64_t>(0, options.window));
  for (int64_t p = tail_start; p < prefix; ++p) positions.push_back(p);
  return positions;
}

}  // namespace

absl::Status EncodePlanRequest(const PlanRequest& request,
                               const KvWindowOptions& options,
                               v1::PlanRequest* out) {
  c10::InferenceMode guard;
  out->Clear();
  out->set_sequence_id(std::to_string(request.sequence_id));
  out->set_step(static_cast<uint64_t>(std::max<int64_t>(0, request.step)));
  out->set_context_length(request.context_length);
  out->set_plan_lifetime_tokens(request.plan_lifetime_tokens);
  out->set_exit_threshold(request.exit_threshold);
  out->set_traceparent(request.traceparent);
  out->set_model_fingerprint(request.model_fingerprint);
  out->set_policy(WirePolicy(request.policy));
  if (request.policy == PlanPolicy::kClasp)
    out->set_clasp_skip_layers(request.clasp_layers);
  out->set_static_mask(request.static_mask);
  out->set_max_draft_tokens(
      static_cast<uint32_t>(std::max(0, request.max_draft)));
  RETURN_IF_ERROR(
      Annotate(EncodeTensor(request.states, out->mutable_reference_states()),
               "reference_states"));
  const int64_t r = request.states.dim() >= 2 ? request.states.size(1) : 0;
  for (int64_t i = 0; i < r; ++i)
    out->add_reference_positions(request.first_position + i);
  for (int32_t id : request.target_argmax) out->add_reference_token_ids(id);

  v1::KvWindow* window = out->mutable_kv_context()->mutable_window();
  // A prefix held by reference is copied out here (the encoding thread).
  const std::vector<LayerKv> kv = ResolvedKv(request);
  const int64_t prefix = std::min(request.kv_length, request.first_position);
  std::vector<int64_t> positions =
      kv.empty() ? std::vector<int64_t>() : WindowPositions(prefix, options);
  window->set_leading_positions(
      std::min(prefix, std::max<int64_t>(0, options.leading)));
  window->set_window_positions(static_cast<int64_t>(positions.size()) -
                               window->leading_positions());
  // The committed reference positions before the last one (the K/V CLaSp's
  // DP on the last reference token attends to beyond the prefix).
  const int64_t reference_kv =
      kv.empty()
          ? 0
          : std::clamp<int64_t>(request.kv_length - request.first_position, 0,
                                std::max<int64_t>(0, r - 1));
  for (int64_t i = 0; i < reference_kv; ++i) {
    positions.push_back(request.first_position + i);
  }
  window->set_reference_positions_with_kv(reference_kv);
  for (int64_t p : positions) window->add_positions(p);
  if (!kv.empty()) {
    torch::Tensor index = torch::tensor(positions, torch::kInt64);
    for (const LayerKv& layer : kv) {
      v1::LayerKv* wire = window->add_layers();
      const torch::Tensor idx = index.to(layer.k.device());
      RETURN_IF_ERROR(
          EncodeTensor(layer.k.index_select(1, idx), wire->mutable_k()));
      RETURN_IF_ERROR(
          EncodeTensor(layer.v.index_select(1, idx), wire->mutable_v()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<PlanRequest> DecodePlanRequest(const v1::PlanRequest& proto,
                                              int num_layers,
                                              int default_max_draft) {
  c10::InferenceMode guard;
  PlanRequest request;
  if (!absl::SimpleAtoi(proto.sequence_id(), &request.sequence_id)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence_id: '", proto.sequence_id(), "' is not a decimal integer"));
  }
  request.step = static_cast<int64_t>(proto.step());
  if (proto.context_length() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "context_length: must be >= 1, got ", proto.context_length()));
  }
  request.context_length = proto.context_length();
  if (proto.plan_lifetime_tokens() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan_lifetime_tokens: must be >= 0, got ",
                     proto.plan_lifetime_tokens()));
  }
  request.plan_lifetime_tokens = proto.plan_lifetime_tokens();
  // Trace context only: a malformed one is ignored where it is parsed
  // (common/trace), and one longer than any W3C version needs is dropped.
  if (proto.traceparent().size() <= 256) {
    request.traceparent = proto.traceparent();
  }
  if (proto.model_fingerprint().empty()) {
    return absl::InvalidArgumentError("model_fingerprint: required");
  }
  request.model_fingerprint = proto.model_fingerprint();
  ASSIGN_OR_RETURN(request.policy, PolicyFromWire(proto.policy()));
  request.clasp_layers =
      proto.has_clasp_skip_layers() ? proto.clasp_skip_layers() : 0;
  request.static_mask = proto.static_mask();
  if (!(proto.exit_threshold() >= 0 && proto.exit_threshold() <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "exit_threshold: must be in [0, 1], got ", proto.exit_threshold()));
  }
  request.exit_threshold = proto.exit_threshold();
  request.max_draft = proto.max_draft_tokens() > 0
                          ? static_cast<int>(proto.max_draft_tokens())
                          : default_max_draft;
  if (!proto.has_reference_states())
    return absl::InvalidArgumentError("reference_states: required");
  ASSIGN_OR_RETURN(request.states,
                   DecodeTensor(proto.reference_states(), "reference_states"));
  if (request.states.dim() != 3 ||
      request.states.size(0) != 2 * num_layers + 1 ||
      request.states.size(1) < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reference_states: shape ", c10::str(request.states.sizes()),
        ", want [2L+1 = ", 2 * num_layers + 1, ", r >= 1, hidden]"));
  }
  RETURN_IF_ERROR(CheckFiniteFloats(request.states, "reference_states"));
  const int64_t r = request.states.size(1);
  if (proto.reference_positions_size() != r) {
    return absl::InvalidArgumentError(
        absl::StrCat("reference_positions: ", proto.reference_positions_size(),
                     " entries for r = ", r));
  }
  for (int64_t i = 0; i < r; ++i) {
    if (proto.reference_positions(i) != proto.reference_positions(0) + i) {
      return absl::InvalidArgumentError(
          "reference_positions: must be consecutive and ascending");
    }
  }
  request.first_position = proto.reference_positions(0);
  if (request.first_position < 0) {
    return absl::InvalidArgumentError("reference_positions: negative");
  }
  if (proto.reference_token_ids_size() != 0 &&
      proto.reference_token_ids_size() != r) {
    return absl::InvalidArgumentError(
        absl::StrCat("reference_token_ids: ", proto.reference_token_ids_size(),
                     " entries for r = ", r, " (or send none)"));
  }
  request.target_argmax.assign(proto.reference_token_ids().begin(),
                               proto.reference_token_ids().end());

  if (!proto.has_kv_context())
    return absl::InvalidArgumentError("kv_context: required");
  if (proto.kv_context().has_all_in_memory()) {
    return absl::InvalidArgumentError(
        "kv_context.all_in_memory: only an in-process planner shares the "
        "executor's memory");
  }
  const v1::KvWindow& window = proto.kv_context().window();
  const int64_t reference_kv = window.reference_positions_with_kv();
  if (reference_kv < 0 || reference_kv > r - 1 ||
      reference_kv > window.positions_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_context.window.reference_positions_with_kv: ", reference_kv,
        " (must be in [0, r - 1 = ", r - 1, "] and at most the ",
        window.positions_size(), " positions)"));
  }
  const int prefix_entries =
      window.positions_size() - static_cast<int>(reference_kv);
  for (int i = 0; i < window.positions_size(); ++i) {
    const int64_t p = window.positions(i);
    if (i >= prefix_entries) {
      // The reference positions with K/V: first_position, first_position + 1...
      const int64_t want = request.first_position + (i - prefix_entries);
      if (p != want) {
        return absl::InvalidArgumentError(
            absl::StrCat("kv_context.window.positions[", i, "]: ", p, " (the ",
                         i - prefix_entries,
                         "th reference position with K/V is ", want, ")"));
      }
      continue;
    }
    if (p < 0 || p >= request.first_position ||
        (i > 0 && p <= window.positions(i - 1))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv_context.window.positions[", i, "]: ", p,
          " (must ascend strictly and precede the first reference position ",
          request.first_position, ")"));
    }
  }
  if (window.layers_size() == 0 && window.positions_size() == 0)
    return request;  // no K/V
  if (window.layers_size() != num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_context.window.layers: ", window.layers_size(),
                     " for a model with ", num_layers, " layers"));
  }
  const int64_t n = window.positions_size();
  for (int i = 0; i < num_layers; ++i) {
    const std::string field = absl::StrCat("kv_context.window.layers[", i, "]");
    LayerKv layer;
    ASSIGN_OR_RETURN(layer.k, DecodeTensor(window.layers(i).k(), field + ".k"));
    ASSIGN_OR_RETURN(layer.v, DecodeTensor(window.layers(i).v(), field + ".v"));
    if (layer.k.dim() != 3 || layer.k.size(1) != n ||
        !layer.k.sizes().equals(layer.v.sizes()) ||
        layer.k.scalar_type() != layer.v.scalar_type()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": k ", c10::str(layer.k.sizes()), " and v ",
                       c10::str(layer.v.sizes()), " must both be [kv_heads, ",
                       n, " positions, head_dim] of one dtype"));
    }
    RETURN_IF_ERROR(CheckFiniteFloats(layer.k, field + ".k"));
    RETURN_IF_ERROR(CheckFiniteFloats(layer.v, field + ".v"));
    request.kv.push_back(std::move(layer));
  }
  request.kv_length = n;
  request.kv_positions.assign(window.positions().begin(),
                              window.positions().end());
  return request;
}

namespace {

// A share on the wire: in [0, 1].
absl::Status CheckShare(const char* name, double share) {
  if (!(share >= 0 && share <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("basis.", name, " must be in [0, 1], got ", share));
  }
  return absl::OkStatus();
}

absl::StatusOr<PlanBasis> DecodePlanBasis(const v1::PlanBasis& proto, int gamma,
                                          int max_gamma) {
  PlanBasis basis;
  const int size = proto.verify_seconds_size();
  if (size < gamma + 1 || size > std::max(0, max_gamma) + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "basis.verify_seconds: ", size, " entries, want ", gamma + 1,
        " .. max_draft_tokens + 1 = ", std::max(0, max_gamma) + 1));
  }
  for (double seconds : proto.verify_seconds()) {
    if (!(seconds > 0) || !std::isfinite(seconds)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "basis.verify_seconds must be finite and > 0, got ", seconds));
    }
  }
  basis.verify_seconds.assign(proto.verify_seconds().begin(),
                              proto.verify_seconds().end());
  if (!(proto.draft_seconds() > 0) || !std::isfinite(proto.draft_seconds())) {
    return absl::InvalidArgumentError(
        absl::StrCat("basis.draft_seconds must be finite and > 0, got ",
                     proto.draft_seconds()));
  }
  basis.draft_seconds = proto.draft_seconds();
  if (proto.reference_tokens() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "basis.reference_tokens must be >= 0, got ", proto.reference_tokens()));
  }
  basis.reference_tokens = proto.reference_tokens();
  basis.prior = AlphaPrior{proto.prior_hits(), proto.prior_misses()};
  RETURN_IF_ERROR(ValidateAlphaPrior(basis.prior));
  RETURN_IF_ERROR(CheckShare("accept_share", proto.accept_share()));
  RETURN_IF_ERROR(CheckShare("go_on_share", proto.go_on_share()));
  RETURN_IF_ERROR(
      CheckShare("accept_and_go_on_share", proto.accept_and_go_on_share()));
  basis.confidence_stop = proto.confidence_stop();
  basis.go_on_share = proto.go_on_share();
  basis.accept_and_go_on_share = proto.accept_and_go_on_share();
  basis.gamma_fixed = proto.gamma_fixed();
  basis.accept_share = proto.accept_share();
  for (const auto& [name, trials] :
       {std::pair<const char*, double>{"later_accept_trials",
                                       proto.later_accept_trials()},
        {"later_go_on_trials", proto.later_go_on_trials()}}) {
    // Pairs of the reference tokens: at most r - 1 (which also keeps the
    // refinement's token counts far from int64 overflow).
    const double most =
        static_cast<double>(std::max<int64_t>(0, basis.reference_tokens - 1));
    if (!(trials >= 0 && trials <= most)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "basis.", name, " must be in [0, reference_tokens - 1 = ", most,
          "], got ", trials));
    }
  }
  if (proto.later_accept_trials() > 0) {
    RETURN_IF_ERROR(
        CheckShare("later_accept_share", proto.later_accept_share()));
    RETURN_IF_ERROR(CheckShare("later_accept_and_go_on_share",
                               proto.later_accept_and_go_on_share()));
    RETURN_IF_ERROR(CheckShare("later_go_on_share", proto.later_go_on_share()));
    basis.later_accept_trials = proto.later_accept_trials();
    basis.later_accept_share = proto.later_accept_share();
    basis.later_accept_and_go_on_share = proto.later_accept_and_go_on_share();
    basis.later_go_on_trials = proto.later_go_on_trials();
    basis.later_go_on_share = proto.later_go_on_share();
  }
  return basis;
}

}  // namespace

v1::PlanResponse EncodePlanResponse(uint64_t sequence_id, int64_t step,
                                    const absl::StatusOr<DraftPlan>& plan) {
  v1::PlanResponse out;
  out.set_sequence_id(std::to_string(sequence_id));
  out.set_step(static_cast<uint64_t>(std::max<int64_t>(0, step)));
  if (!plan.ok()) {
    out.mutable_error()->set_code(IsProfilePending(plan.status())
                                      ? v1::PLAN_ERROR_CODE_PROFILE_PENDING
                                      : WireErrorCode(plan.status().code()));
    out.mutable_error()->set_message(std::string(plan.status().message()));
    return out;
  }
  if (plan->gamma > 0) out.set_mask(plan->mask.ToString());
  out.set_gamma(static_cast<uint32_t>(std::max(0, plan->gamma)));
  out.set_predicted_tokens_per_second(plan->predicted_tpt);
  out.set_alpha_hat(plan->alpha_hat);
  out.set_num_candidates(plan->num_candidates);
  out.set_alpha_smoothed(plan->alpha_smoothed);
  out.set_num_evaluated_candidates(plan->num_evaluated);
  out.set_predicted_tokens_per_step(plan->predicted_tokens_per_step);
  out.set_predicted_draft_tokens_per_step(plan->predicted_drafts_per_step);
  out.set_solve_seconds(plan->solve_seconds);
  out.set_queue_seconds(plan->queue_seconds);
  const PlanBasis& basis = plan->basis;
  if (plan->gamma > 0 && !basis.verify_seconds.empty()) {
    v1::PlanBasis& b = *out.mutable_basis();
    b.mutable_verify_seconds()->Add(basis.verify_seconds.begin(),
                                    basis.verify_seconds.end());
    b.set_draft_seconds(basis.draft_seconds);
    b.set_reference_tokens(basis.reference_tokens);
    b.set_prior_hits(basis.prior.hits);
    b.set_prior_misses(basis.prior.misses);
    b.set_confidence_stop(basis.confidence_stop);
    b.set_go_on_share(basis.go_on_share);
    b.set_accept_and_go_on_share(basis.accept_and_go_on_share);
    b.set_gamma_fixed(basis.gamma_fixed);
    b.set_accept_share(basis.accept_share);
    if (basis.later_accept_trials > 0) {
      b.set_later_accept_trials(basis.later_accept_trials);
      b.set_later_accept_share(basis.later_accept_share);
      b.set_later_accept_and_go_on_share(basis.later_accept_and_go_on_share);
      b.set_later_go_on_trials(basis.later_go_on_trials);
      b.set_later_go_on_share(basis.later_go_on_share);
    }
  }
  return out;
}

absl::StatusOr<DraftPlan> DecodePlanResponse(const v1::PlanResponse& proto,
                                             int num_layers, int max_gamma) {
  if (proto.has_error()) return StatusFromWire(proto.error());
  DraftPlan plan;
  ASSIGN_OR_RETURN(plan.mask, LayerMask::Parse(proto.mask(), num_layers));
  // gamma is uint32 on the wire: a large one wrapped to a negative int
  // (found by tests/fuzz/fuzz_plan_codec).
  if (proto.gamma() > static_cast<uint32_t>(std::max(0, max_gamma))) {
    return absl::InvalidArgumentError(absl::StrCat("gamma: ", proto.gamma(),
                                                   " exceeds the requested "
                                                   "max_draft_tokens ",
                                                   max_gamma));
  }
  plan.gamma = static_cast<int>(proto.gamma());
  plan.predicted_tpt = proto.predicted_tokens_per_second();
  plan.alpha_hat = proto.alpha_hat();
  plan.num_candidates = proto.num_candidates();
  plan.alpha_smoothed = proto.alpha_smoothed();
  plan.num_evaluated = proto.num_evaluated_candidates();
  plan.predicted_tokens_per_step = proto.predicted_tokens_per_step();
  plan.predicted_drafts_per_step = proto.predicted_draft_tokens_per_step();
  plan.solve_seconds = proto.solve_seconds();
  plan.queue_seconds = proto.queue_seconds();
  plan.step = static_cast<int64_t>(proto.step());
  if (proto.has_basis() && plan.gamma > 0) {
    ASSIGN_OR_RETURN(plan.basis,
                     DecodePlanBasis(proto.basis(), plan.gamma, max_gamma));
  }
  return plan;
}

}  // namespace knapserve

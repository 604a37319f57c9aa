#include "executor/api/generation_codec.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/base/status.h"

namespace knapserve {
namespace {

constexpr absl::string_view kModePrefix = "SPECULATION_MODE_";

}  // namespace

v1::SpeculationMode ToWireMode(SpeculationMode mode) {
  v1::SpeculationMode wire = v1::SPECULATION_MODE_UNSPECIFIED;
  // The mode table's names are fixed at build time and the codec test checks
  // that each has a wire value; UNSPECIFIED is only left for a missing one.
  v1::SpeculationMode_Parse(
      absl::StrCat(kModePrefix,
                   absl::AsciiStrToUpper(SpeculationModeName(mode))),
      &wire);
  return wire;
}

absl::StatusOr<SpeculationMode> FromWireMode(v1::SpeculationMode wire,
                                             SpeculationMode unspecified) {
  if (wire == v1::SPECULATION_MODE_UNSPECIFIED) return unspecified;
  const std::string name = v1::SpeculationMode_IsValid(wire)
                               ? v1::SpeculationMode_Name(wire)
                               : std::string();
  if (absl::StartsWith(name, kModePrefix)) {
    absl::StatusOr<SpeculationMode> mode = ParseSpeculationMode(
        absl::AsciiStrToLower(name.substr(kModePrefix.size())));
    if (mode.ok()) return mode;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("speculation.mode: unknown value ", static_cast<int>(wire)));
}

v1::FinishReason ToWireFinishReason(FinishReason reason) {
  switch (reason) {
    case FinishReason::kEos:
      return v1::FINISH_REASON_EOS;
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kStopSequence:
      return v1::FINISH_REASON_STOP_SEQUENCE;
    case FinishReason::kAborted:
      return v1::FINISH_REASON_ABORTED;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

absl::StatusOr<GenerationRequest> DecodeGenerateRequest(
    const v1::GenerateRequest& wire, const GenerateRequestDefaults& defaults,
    const LlamaModel& model, const Tokenizer& tokenizer) {
  GenerationRequest request;
  switch (wire.prompt_case()) {
    case v1::GenerateRequest::kText: {
      if (wire.text().empty())
        return absl::InvalidArgumentError("prompt.text: empty");
      absl::StatusOr<std::vector<int32_t>> ids =
          tokenizer.Encode(wire.text(), /*add_special_tokens=*/true);
      if (!ids.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("prompt.text: ", ids.status().message()));
      }
      request.prompt_ids = std::move(*ids);
      break;
    }
    case v1::GenerateRequest::kTokenIds:
      if (defaults.limits.max_prompt_tokens > 0 &&
          wire.token_ids().ids_size() > defaults.limits.max_prompt_tokens) {
        return absl::InvalidArgumentError(absl::StrCat(
            "prompt.token_ids: ", wire.token_ids().ids_size(),
            " tokens, more than this server's limit of ",
            defaults.limits.max_prompt_tokens, " (--max-prompt-tokens)"));
      }
      request.prompt_ids.assign(wire.token_ids().ids().begin(),
                                wire.token_ids().ids().end());
      if (request.prompt_ids.empty()) {
        return absl::InvalidArgumentError("prompt.token_ids: empty");
      }
      break;
    default:
      return absl::InvalidArgumentError("prompt: set text or token_ids");
  }
  const RequestLimits& limits = defaults.limits;
  if (limits.max_prompt_tokens > 0 &&
      static_cast<int64_t>(request.prompt_ids.size()) >
          limits.max_prompt_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt: ", request.prompt_ids.size(),
                     " tokens, more than this server's limit of ",
                     limits.max_prompt_tokens, " (--max-prompt-tokens)"));
  }
  request.max_new_tokens = wire.has_max_new_tokens() ? wire.max_new_tokens()
                                                     : defaults.max_new_tokens;
  if (limits.max_new_tokens > 0 &&
      request.max_new_tokens > limits.max_new_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens: ", request.max_new_tokens,
                     ", more than this server's limit of ",
                     limits.max_new_tokens, " (--max-new-tokens-limit)"));
  }
  if (limits.max_stop_strings > 0 &&
      wire.stop_size() > limits.max_stop_strings) {
    return absl::InvalidArgumentError(
        absl::StrCat("stop: ", wire.stop_size(),
                     " strings, more than this server's limit of ",
                     limits.max_stop_strings, " (--max-stop-strings)"));
  }
  for (int i = 0; i < wire.stop_size(); ++i) {
    if (limits.max_stop_bytes > 0 &&
        static_cast<int64_t>(wire.stop(i).size()) > limits.max_stop_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop[", i, "]: ", wire.stop(i).size(),
                       " bytes, more than this server's limit of ",
                       limits.max_stop_bytes, " (--max-stop-bytes)"));
    }
  }
  if (limits.max_stop_token_ids > 0 &&
      wire.stop_token_ids_size() > limits.max_stop_token_ids) {
    return absl::InvalidArgumentError(
        absl::StrCat("stop_token_ids: ", wire.stop_token_ids_size(),
                     " ids, more than this server's limit of ",
                     limits.max_stop_token_ids, " (--max-stop-token-ids)"));
  }
  if (wire.has_temperature()) request.sampling.temperature = wire.temperature();
  if (wire.has_top_k()) request.sampling.top_k = wire.top_k();
  if (wire.has_top_p()) request.sampling.top_p = wire.top_p();
  if (wire.has_seed()) request.sampling.seed = wire.seed();
  if (wire.has_min_p()) request.sampling.min_p = wire.min_p();
  if (wire.has_repetition_penalty())
    request.sampling.repetition_penalty = wire.repetition_penalty();
  if (wire.has_presence_penalty())
    request.sampling.presence_penalty = wire.presence_penalty();
  if (wire.has_frequency_penalty())
    request.sampling.frequency_penalty = wire.frequency_penalty();
  request.sampling.logit_bias.insert(wire.logit_bias().begin(),
                                     wire.logit_bias().end());
  if (wire.has_min_tokens()) request.sampling.min_tokens = wire.min_tokens();
  for (const v1::TokenIds& word : wire.bad_words()) {
    request.sampling.bad_words.emplace_back(word.ids().begin(),
                                            word.ids().end());
  }
  request.ignore_eos = wire.has_ignore_eos() && wire.ignore_eos();
  request.logprobs = wire.logprobs();
  request.top_logprobs = wire.top_logprobs();
  request.prompt_logprobs = wire.prompt_logprobs();
  if (wire.has_n()) request.n = wire.n();
  if (wire.has_best_of()) request.best_of = wire.best_of();
  request.stop_strings.assign(wire.stop().begin(), wire.stop().end());
  request.stop_token_ids.assign(wire.stop_token_ids().begin(),
                                wire.stop_token_ids().end());
  request.speculation = defaults.speculation;
  const v1::SpeculationOptions& spec = wire.speculation();
  ASSIGN_OR_RETURN(request.speculation.mode,
                   FromWireMode(spec.mode(), defaults.speculation.mode));
  if (spec.has_max_draft_tokens())
    request.speculation.max_draft = spec.max_draft_tokens();
  if (spec.has_static_mask()) request.speculation.skip = spec.static_mask();
  if (spec.has_exit_threshold())
    request.speculation.exit_threshold = spec.exit_threshold();
  SpecBoundConfig& specbound = request.speculation.specbound;
  if (spec.has_specbound_lambda()) specbound.lambda = spec.specbound_lambda();
  if (spec.has_specbound_t0()) specbound.t0 = spec.specbound_t0();
  if (spec.has_specbound_depth_bound()) {
    specbound.depth_bound = static_cast<int>(
        std::min<uint32_t>(spec.specbound_depth_bound(), 1u << 30));
  }
  if (spec.has_specbound_check_every()) {
    specbound.check_every = static_cast<int>(
        std::min<uint32_t>(spec.specbound_check_every(), 1u << 30));
  }
  // The heads themselves are the server's (defaults); a client only picks.
  if (spec.has_specbound_trained_heads())
    specbound.trained_heads = spec.specbound_trained_heads();
  if (IsPlanned(request.speculation.mode) && !defaults.have_planner) {
    return absl::FailedPreconditionError(absl::StrCat(
        "speculation.mode: ", SpeculationModeName(request.speculation.mode),
        " needs a planner, and this executor runs without one (--planner "
        "none)"));
  }
  RETURN_IF_ERROR(ValidateGenerationRequest(request, model));
  return request;
}

namespace {

void AddTopLogprobs(absl::Span<const TokenLogprob> alternatives,
                    v1::TopLogprobs& out) {
  for (const TokenLogprob& alt : alternatives) {
    out.add_token_ids(alt.id);
    out.add_logprobs(alt.logprob);
  }
}

}  // namespace

v1::GenerateResponse EncodeChunk(std::string_view request_id,
                                 absl::Span<const int32_t> ids,
                                 std::string_view text,
                                 const StepLogprobs& logprobs, int index) {
  v1::GenerateResponse response;
  v1::Chunk* chunk = response.mutable_chunk();
  chunk->set_index(index);
  chunk->mutable_token_ids()->Add(ids.begin(), ids.end());
  chunk->mutable_logprobs()->Add(logprobs.chosen.begin(),
                                 logprobs.chosen.end());
  for (const std::vector<TokenLogprob>& alternatives : logprobs.top) {
    AddTopLogprobs(alternatives, *chunk->add_top_logprobs());
  }
  chunk->set_text(std::string(text));
  chunk->set_request_id(std::string(request_id));
  return response;
}

v1::GenerateResponse EncodeFinal(std::string_view request_id,
                                 const GenerationResult& r,
                                 SpeculationMode mode,
                                 const ServiceTimings& timings) {
  v1::GenerateResponse response;
  v1::FinalResult* final = response.mutable_final();
  final->set_request_id(std::string(request_id));
  final->set_finish_reason(ToWireFinishReason(r.finish_reason));
  final->set_stop_sequence(r.matched_stop);
  final->set_seed(r.seed);
  final->set_index(r.index);
  if (r.cumulative_logprob.has_value()) {
    final->set_cumulative_logprob(*r.cumulative_logprob);
  }
  final->mutable_prompt_logprobs()->Add(r.prompt_logprobs.begin(),
                                        r.prompt_logprobs.end());
  for (const std::vector<TokenLogprob>& alternatives : r.prompt_top_logprobs) {
    AddTopLogprobs(alternatives, *final->add_prompt_top_logprobs());
  }
  final->mutable_usage()->set_prompt_tokens(
      static_cast<int32_t>(r.stats.prompt_tokens));
  final->mutable_usage()->set_completion_tokens(
      static_cast<int32_t>(r.stats.completion_tokens));
  v1::Timings* t = final->mutable_timings();
  t->set_queue_seconds(timings.queue_seconds);
  t->set_time_to_first_token_seconds(timings.first_token_seconds);
  t->set_mean_inter_token_latency_seconds(
      r.stats.completion_tokens > 1
          ? r.stats.decode_seconds /
                static_cast<double>(r.stats.completion_tokens - 1)
          : 0.0);
  t->set_total_seconds(timings.total_seconds);
  t->set_prefill_seconds(r.stats.prefill_seconds);
  t->set_draft_seconds(r.stats.draft_seconds);
  t->set_verify_seconds(r.stats.verify_seconds);
  t->set_planner_wait_seconds(r.stats.waiting_seconds);
  t->set_routing_seconds(r.stats.routing_seconds);
  v1::SpeculationStats* s = final->mutable_speculation_stats();
  s->set_mode(ToWireMode(mode));
  s->set_drafts(static_cast<int32_t>(r.speculation.drafts));
  s->set_draft_tokens(static_cast<int32_t>(r.speculation.draft_tokens));
  s->set_accepted_tokens(static_cast<int32_t>(r.speculation.accepted_tokens));
  for (int64_t n : r.speculation.accepted_per_position) {
    s->add_accepted_per_position(static_cast<int32_t>(n));
  }
  s->set_mean_acceptance_length(r.speculation.mean_acceptance_length());
  for (int64_t n : r.speculation.exit_depths)
    s->add_exit_depths(static_cast<int32_t>(n));
  s->set_depth_bound_stops(
      static_cast<int32_t>(r.speculation.depth_bound_stops));
  s->set_width_bound_stops(
      static_cast<int32_t>(r.speculation.width_bound_stops));
  s->set_mean_exit_depth(r.speculation.mean_exit_depth());
  s->set_plans_applied(static_cast<int32_t>(r.plans.size()));
  s->set_routed_domain(r.routed_domain);
  s->set_routing_similarity(r.routing_similarity);
  for (const AppliedPlan& p : r.plans) {
    v1::AppliedPlan* wire = s->add_plans();
    wire->set_step(static_cast<uint64_t>(p.applied_step));
    wire->set_mask(p.mask);
    wire->set_gamma(static_cast<uint32_t>(p.gamma));
    wire->set_alpha_hat(p.alpha_hat);
    wire->set_alpha_smoothed(p.alpha_smoothed);
    wire->set_evidence_trials(
        static_cast<uint64_t>(std::max<int64_t>(0, p.evidence_trials)));
    wire->set_predicted_tokens_per_step(p.predicted_tokens_per_step);
    wire->set_predicted_draft_tokens_per_step(p.predicted_drafts_per_step);
    wire->set_predicted_tokens_per_second(p.predicted_tpt);
    wire->set_solve_seconds(p.solve_seconds);
    wire->set_age_steps(static_cast<uint64_t>(p.age_steps));
    wire->set_source(p.source);
    wire->set_plan_step(
        static_cast<uint64_t>(std::max<int64_t>(0, p.plan_step)));
    wire->set_context_length(p.context_length);
    wire->set_baseline_tokens_per_second(p.baseline_tpt);
    wire->set_num_candidates(p.num_candidates);
    wire->set_measured_steps(static_cast<uint64_t>(p.measured_steps));
    wire->set_measured_tokens(static_cast<uint64_t>(p.measured_tokens));
    wire->set_measured_seconds(p.measured_seconds);
    wire->set_measured_tokens_squared(p.measured_tokens_sq);
    wire->set_measured_token_seconds(p.measured_token_seconds);
    wire->set_measured_seconds_squared(p.measured_seconds_sq);
    wire->set_draft_cost_ratio(p.draft_cost_ratio);
    wire->set_measured_draft_tokens(static_cast<uint64_t>(p.measured_drafted));
    wire->set_measured_accepted_tokens(
        static_cast<uint64_t>(p.measured_accepted));
    wire->set_queue_seconds(p.queue_seconds);
    wire->set_measured_plain_tokens_per_second(p.measured_plain_tpt);
    wire->set_beside_solve_steps(static_cast<uint64_t>(p.beside_solve_steps));
    wire->set_beside_solve_tokens(static_cast<uint64_t>(p.beside_solve_tokens));
    wire->set_beside_solve_seconds(p.beside_solve_seconds);
    wire->set_unsteady_steps(static_cast<uint64_t>(p.unsteady_steps));
    wire->set_unsteady_tokens(static_cast<uint64_t>(p.unsteady_tokens));
    wire->set_unsteady_seconds(p.unsteady_seconds);
  }
  t->set_decode_seconds(r.stats.decode_seconds);
  const PlanningStats& planning = r.planning;
  v1::PlanningStats* w = final->mutable_planning();
  w->set_plan_cache_hits(planning.cache_hits);
  w->set_plan_cache_misses(planning.cache_misses);
  w->set_triggers_no_plan(planning.triggers_no_plan);
  w->set_triggers_new_bucket(planning.triggers_new_bucket);
  w->set_triggers_drift(planning.triggers_drift);
  w->set_triggers_recheck(planning.triggers_recheck);
  w->set_budget_deferrals(planning.budget_deferrals);
  w->set_solve_seconds(planning.solve_seconds);
  w->set_planner_cpu_share(r.stats.decode_seconds > 0
                               ? planning.solve_seconds / r.stats.decode_seconds
                               : 0.0);
  w->set_process_planner_cpu_share(planning.process_planner_cpu_share);
  w->set_guard_checks(planning.guard_checks);
  w->set_guard_fallbacks(planning.guard_fallbacks);
  w->set_guard_probe_steps(planning.guard_probe_steps);
  w->set_guard_plain_steps(planning.guard_plain_steps);
  w->set_guard_last_spec_tokens_per_second(planning.guard_last_spec_tps);
  w->set_guard_last_plain_tokens_per_second(planning.guard_last_plain_tps);
  w->set_plan_requests(r.stats.plan_requests);
  w->set_plan_failures(r.stats.plan_failures);
  w->set_last_plan_error(r.last_plan_error);
  w->set_profile_pending(planning.profile_pending);
  w->set_profile_pending_steps(planning.profile_pending_steps);
  w->set_guard_inherited_steps(planning.guard_inherited_steps);
  w->set_guard_carried_steps(planning.guard_carried_steps);
  w->set_guard_settle_steps(planning.guard_settle_steps);
  w->set_guard_confirmations(planning.guard_confirmations);
  w->set_guard_cleared_losses(planning.guard_cleared_losses);
  return response;
}

PlanningStats DecodePlanningStats(const v1::PlanningStats& w) {
  PlanningStats s;
  s.cache_hits = w.plan_cache_hits();
  s.cache_misses = w.plan_cache_misses();
  s.triggers_no_plan = w.triggers_no_plan();
  s.triggers_new_bucket = w.triggers_new_bucket();
  s.triggers_drift = w.triggers_drift();
  s.triggers_recheck = w.triggers_recheck();
  s.budget_deferrals = w.budget_deferrals();
  s.solve_seconds = w.solve_seconds();
  s.process_planner_cpu_share = w.process_planner_cpu_share();
  s.guard_checks = w.guard_checks();
  s.guard_fallbacks = w.guard_fallbacks();
  s.guard_probe_steps = w.guard_probe_steps();
  s.guard_plain_steps = w.guard_plain_steps();
  s.guard_last_spec_tps = w.guard_last_spec_tokens_per_second();
  s.guard_last_plain_tps = w.guard_last_plain_tokens_per_second();
  s.profile_pending = w.profile_pending();
  s.profile_pending_steps = w.profile_pending_steps();
  s.guard_inherited_steps = w.guard_inherited_steps();
  s.guard_carried_steps = w.guard_carried_steps();
  s.guard_settle_steps = w.guard_settle_steps();
  s.guard_confirmations = w.guard_confirmations();
  s.guard_cleared_losses = w.guard_cleared_losses();
  return s;
}

AppliedPlan DecodeAppliedPlan(const v1::AppliedPlan& w) {
  AppliedPlan p;
  p.applied_step = static_cast<int64_t>(w.step());
  p.plan_step = static_cast<int64_t>(w.plan_step());
  p.age_steps = static_cast<int64_t>(w.age_steps());
  p.mask = w.mask();
  p.gamma = static_cast<int>(w.gamma());
  p.alpha_hat = w.alpha_hat();
  p.alpha_smoothed = w.alpha_smoothed();
  p.evidence_trials = static_cast<int64_t>(w.evidence_trials());
  p.predicted_tokens_per_step = w.predicted_tokens_per_step();
  p.predicted_drafts_per_step = w.predicted_draft_tokens_per_step();
  p.predicted_tpt = w.predicted_tokens_per_second();
  p.baseline_tpt = w.baseline_tokens_per_second();
  p.num_candidates = w.num_candidates();
  p.solve_seconds = w.solve_seconds();
  p.queue_seconds = w.queue_seconds();
  p.context_length = w.context_length();
  p.source = w.source();
  p.measured_steps = static_cast<int64_t>(w.measured_steps());
  p.measured_tokens = static_cast<int64_t>(w.measured_tokens());
  p.measured_seconds = w.measured_seconds();
  p.measured_tokens_sq = w.measured_tokens_squared();
  p.measured_token_seconds = w.measured_token_seconds();
  p.measured_seconds_sq = w.measured_seconds_squared();
  p.draft_cost_ratio = w.draft_cost_ratio();
  p.measured_drafted = static_cast<int64_t>(w.measured_draft_tokens());
  p.measured_accepted = static_cast<int64_t>(w.measured_accepted_tokens());
  p.measured_plain_tpt = w.measured_plain_tokens_per_second();
  p.beside_solve_steps = static_cast<int64_t>(w.beside_solve_steps());
  p.beside_solve_tokens = static_cast<int64_t>(w.beside_solve_tokens());
  p.beside_solve_seconds = w.beside_solve_seconds();
  p.unsteady_steps = static_cast<int64_t>(w.unsteady_steps());
  p.unsteady_tokens = static_cast<int64_t>(w.unsteady_tokens());
  p.unsteady_seconds = w.unsteady_seconds();
  return p;
}

v1::ModelInfo EncodeModelInfo(const LlamaModel& model,
                              const ServiceInfo& service) {
  const ModelConfig& c = model.config();
  v1::ModelInfo info;
  info.set_model_path(service.model_path);
  info.set_model_name(
      service.model_path.substr(service.model_path.find_last_of('/') + 1));
  info.set_model_type(c.model_type);
  info.set_num_layers(model.num_layers());
  info.set_hidden_size(static_cast<int32_t>(c.hidden_size));
  info.set_num_attention_heads(static_cast<int32_t>(c.num_attention_heads));
  info.set_num_key_value_heads(static_cast<int32_t>(c.num_key_value_heads));
  info.set_head_dim(static_cast<int32_t>(c.head_dim));
  info.set_vocab_size(static_cast<int32_t>(c.vocab_size));
  info.set_max_context(model.max_context());
  info.set_dtype(DtypeName(model.dtype()));
  info.set_device(model.device().str());
  info.set_model_fingerprint(c.Fingerprint());
  for (int32_t id : c.eos_token_ids) info.add_eos_token_ids(id);
  info.set_default_speculation_mode(
      ToWireMode(service.default_speculation.mode));
  info.set_default_max_draft_tokens(static_cast<uint32_t>(
      std::max(0, service.default_speculation.max_draft)));
  info.set_plan_interval_steps(
      static_cast<int32_t>(service.default_speculation.plan_interval));
  info.set_planner_mode(service.planner_mode);
  info.set_planner_address(service.planner_address);
  return info;
}

}  // namespace knapserve

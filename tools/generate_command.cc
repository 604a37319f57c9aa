// `knapserve generate`: local generation, streamed to stdout or as one JSON.
#include <grpcpp/grpcpp.h>

#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/trace/span_context.h"
#include "executor/api/generation_codec.h"
#include "executor/api/planning_json.h"
#include "knapserve/v1/generation.grpc.pb.h"
#include "tools/bench_util.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/tls_from_flags.h"

ABSL_FLAG(std::string, traceparent, "",
          "generate --server: a W3C traceparent "
          "(00-<32 hex trace id>-<16 hex span id>-01) sent as gRPC metadata, "
          "so the server's trace of the request continues the caller's.");

ABSL_FLAG(std::string, dump_logits, "",
          "generate (local): write the full model's raw logits (before the "
          "logits processors and sampling) of every generated position to "
          "this file, as JSON: {vocab_size, eos_token_ids, prompt_ids, "
          "output_ids, logits: [[...] per output id]} (for an outside check "
          "of the processors, tests/testing/check_logits_processors.py).");

namespace knapserve {
namespace {

// --dump-logits: the raw logits of `result` (one row per output id).
absl::Status DumpLogits(const std::string& path, const LlamaModel& model,
                        const std::vector<int32_t>& prompt_ids,
                        const GenerationResult& result) {
  const torch::Tensor logits = result.output_logits.contiguous();
  nlohmann::json rows = nlohmann::json::array();
  for (int64_t i = 0; i < logits.size(0); ++i) {
    const float* row = logits[i].data_ptr<float>();
    rows.push_back(std::vector<float>(row, row + logits.size(1)));
  }
  const nlohmann::json dump = {{"vocab_size", model.config().vocab_size},
                               {"eos_token_ids", model.config().eos_token_ids},
                               {"prompt_ids", prompt_ids},
                               {"output_ids", result.output_ids},
                               {"logits", std::move(rows)}};
  std::ofstream out(path);
  out << dump.dump() << "\n";
  out.close();
  if (!out) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dump-logits: cannot write ", path));
  }
  return absl::OkStatus();
}

// --server: the same request over gRPC to a knapserve executor.
absl::Status GenerateRemote(const std::string& address) {
  ASSIGN_OR_RETURN(v1::GenerateRequest request, WireRequestFromFlags());
  request.set_text(absl::GetFlag(FLAGS_prompt));
  const std::string traceparent = absl::GetFlag(FLAGS_traceparent);
  if (!traceparent.empty() && !trace::ParseTraceparent(traceparent)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--traceparent: '", traceparent,
        "' is not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)"));
  }

  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   ClientCredentialsFromFlags());
  auto stub = v1::Generation::NewStub(
      grpc::CreateChannel(address, OrInsecure(credentials)));
  grpc::ClientContext context;
  if (!traceparent.empty()) context.AddMetadata("traceparent", traceparent);
  auto reader = stub->Generate(&context, request);
  const bool json = absl::GetFlag(FLAGS_json);
  std::vector<int32_t> ids;
  std::string text;
  std::vector<float> logprobs;
  nlohmann::json top_logprobs = nlohmann::json::array();
  v1::FinalResult final;
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    if (response.has_chunk()) {
      ids.insert(ids.end(), response.chunk().token_ids().begin(),
                 response.chunk().token_ids().end());
      logprobs.insert(logprobs.end(), response.chunk().logprobs().begin(),
                      response.chunk().logprobs().end());
      for (const v1::TopLogprobs& top : response.chunk().top_logprobs()) {
        nlohmann::json alternatives = nlohmann::json::array();
        for (int k = 0; k < top.token_ids_size() && k < top.logprobs_size();
             ++k) {
          alternatives.push_back({top.token_ids(k), top.logprobs(k)});
        }
        top_logprobs.push_back(std::move(alternatives));
      }
      text += response.chunk().text();
      if (!json) std::cout << response.chunk().text() << std::flush;
    } else if (response.has_final()) {
      final = response.final();
    }
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) {
    if (!json) std::cout << std::endl;
    return absl::Status(
        static_cast<absl::StatusCode>(status.error_code()),
        absl::StrCat("server ", address, ": ", status.error_message()));
  }
  if (!json) {
    std::cout << std::endl;
    return absl::OkStatus();
  }
  const v1::Timings& t = final.timings();
  const v1::SpeculationStats& s = final.speculation_stats();
  nlohmann::json out = {
      {"server", address},
      {"request_id", final.request_id()},
      {"output_ids", ids},
      {"text", text},
      {"finish_reason", v1::FinishReason_Name(final.finish_reason())},
      {"seed", final.seed()},
      {"prompt_tokens", final.usage().prompt_tokens()},
      {"completion_tokens", final.usage().completion_tokens()},
      {"queue_seconds", t.queue_seconds()},
      {"time_to_first_token_seconds", t.time_to_first_token_seconds()},
      {"mean_inter_token_latency_seconds",
       t.mean_inter_token_latency_seconds()},
      {"total_seconds", t.total_seconds()},
      {"decode_tokens_per_s", t.mean_inter_token_latency_seconds() > 0
                                  ? 1.0 / t.mean_inter_token_latency_seconds()
                                  : 0.0},
      {"planner_wait_seconds", t.planner_wait_seconds()},
      {"speculation",
       {{"drafts", s.drafts()},
        {"draft_tokens", s.draft_tokens()},
        {"accepted_tokens", s.accepted_tokens()},
        {"accepted_per_position",
         std::vector<int32_t>(s.accepted_per_position().begin(),
                              s.accepted_per_position().end())},
        {"mean_acceptance_length", s.mean_acceptance_length()},
        {"plans_applied", s.plans_applied()}}},
  };
  if (request.logprobs()) out["output_logprobs"] = logprobs;
  if (request.top_logprobs() > 0) out["output_top_logprobs"] = top_logprobs;
  if (s.exit_depths_size() > 0 || s.depth_bound_stops() > 0) {
    out["speculation"]["specbound"] = {
        {"mean_exit_depth", s.mean_exit_depth()},
        {"exit_depths",
         std::vector<int32_t>(s.exit_depths().begin(), s.exit_depths().end())},
        {"depth_bound_stops", s.depth_bound_stops()},
        {"width_bound_stops", s.width_bound_stops()}};
  }
  // The planning statistics as in-process --json prints them (same keys,
  // same meaning: executor/api/planning_json.h), from the final message.
  const v1::PlanningStats& p = final.planning();
  out["decode_seconds"] = t.decode_seconds();
  out["plan_requests"] = p.plan_requests();
  out["plan_failures"] = p.plan_failures();
  out["planning"] = PlanningJson(DecodePlanningStats(p), t.decode_seconds());
  if (!p.last_plan_error().empty())
    out["last_plan_error"] = p.last_plan_error();
  std::vector<AppliedPlan> plans;
  for (const v1::AppliedPlan& plan : s.plans())
    plans.push_back(DecodeAppliedPlan(plan));
  out["plans"] = AppliedPlansJson(plans);
  std::cout << out.dump() << std::endl;
  return absl::OkStatus();
}

absl::Status Generate() {
  const std::string dump_logits = absl::GetFlag(FLAGS_dump_logits);
  if (const std::string server = absl::GetFlag(FLAGS_server); !server.empty()) {
    if (!dump_logits.empty()) {
      return absl::InvalidArgumentError(
          "--dump-logits: only for local generation (a server does not send "
          "logits)");
    }
    return GenerateRemote(server);
  }
  ASSIGN_OR_RETURN(Engine engine, LoadEngineFromFlags());
  ASSIGN_OR_RETURN(std::vector<int32_t> prompt_ids,
                   engine.tokenizer->Encode(absl::GetFlag(FLAGS_prompt),
                                            /*add_special_tokens=*/true));
  ASSIGN_OR_RETURN(GenerationRequest request,
                   GenerationRequestFromFlags(prompt_ids));
  ApplyExitHeads(engine, request.speculation);
  request.return_logits = !dump_logits.empty();
  const bool json = absl::GetFlag(FLAGS_json);
  StreamCallback stream = nullptr;
  if (!json) {
    stream = [](absl::Span<const int32_t>, std::string_view text,
                const StepLogprobs&) {
      std::cout << text << std::flush;
      return true;
    };
  }
  ASSIGN_OR_RETURN(
      PlannerHandle planner,
      PlannerClientFromFlags(engine, request.speculation.mode, "generate"));
  PlanningShared shared =
      PlanningShared::Create(absl::GetFlag(FLAGS_plan_refine_trials));
  shared.router = engine.router;
  ASSIGN_OR_RETURN(
      GenerationResult result,
      knapserve::Generate(*engine.model, *engine.tokenizer, request, stream,
                          nullptr, planner.get(), &shared));
  if (!dump_logits.empty()) {
    RETURN_IF_ERROR(DumpLogits(dump_logits, *engine.model, prompt_ids, result));
  }
  if (!json) {
    std::cout << std::endl;
    if (!result.last_plan_error.empty()) {
      std::cerr << "knapserve generate: " << result.stats.plan_failures
                << " plan(s) failed, decoding went on with the last plan; last "
                   "error: "
                << result.last_plan_error << std::endl;
    }
    return absl::OkStatus();
  }
  nlohmann::json out = {
      {"model", engine.model_dir},
      {"dtype", DtypeName(engine.model->dtype())},
      {"prompt_ids", prompt_ids},
      {"output_ids", result.output_ids},
      {"text", result.text},
      {"finish_reason", FinishReasonName(result.finish_reason)},
      {"seed", result.seed},
      {"prompt_tokens", result.stats.prompt_tokens},
      {"completion_tokens", result.stats.completion_tokens},
      {"prefill_seconds", result.stats.prefill_seconds},
      {"decode_seconds", result.stats.decode_seconds},
      {"total_seconds", result.stats.total_seconds},
      {"prefill_tokens_per_s", result.stats.prefill_tokens_per_second()},
      {"decode_tokens_per_s", result.stats.decode_tokens_per_second()},
  };
  if (!result.matched_stop.empty()) out["stop"] = result.matched_stop;
  if (request.logprobs) out["output_logprobs"] = result.output_logprobs;
  if (request.top_logprobs > 0) {
    nlohmann::json top = nlohmann::json::array();
    for (const std::vector<TokenLogprob>& alternatives :
         result.output_top_logprobs) {
      nlohmann::json position = nlohmann::json::array();
      for (const TokenLogprob& alt : alternatives) {
        position.push_back({alt.id, alt.logprob});
      }
      top.push_back(std::move(position));
    }
    out["output_top_logprobs"] = std::move(top);
  }
  out["spec"] = SpeculationModeName(request.speculation.mode);
  out["mask"] = result.mask;
  if (IsRouted(request.speculation.mode)) {
    out["routed_domain"] = result.routed_domain;
    out["routing_similarity"] = result.routing_similarity;
    out["routing_seconds"] = result.stats.routing_seconds;
  }
  out["max_draft"] = request.speculation.max_draft;
  out["draft_seconds"] = result.stats.draft_seconds;
  out["verify_seconds"] = result.stats.verify_seconds;
  out["waiting_seconds"] = result.stats.waiting_seconds;
  out["steps"] = result.stats.steps;
  const SpeculationStats& s = result.speculation;
  out["speculation"] = {{"drafts", s.drafts},
                        {"draft_tokens", s.draft_tokens},
                        {"accepted_tokens", s.accepted_tokens},
                        {"accepted_per_position", s.accepted_per_position},
                        {"acceptance_rate", s.acceptance_rate()},
                        {"mean_acceptance_length", s.mean_acceptance_length()}};
  if (DraftsByEarlyExit(request.speculation.mode)) {
    const SpecBoundConfig& c = request.speculation.specbound;
    out["speculation"]["specbound"] = {
        {"heads", c.trained_heads ? "trained" : "training-free"},
        {"lambda", c.lambda},
        {"t0", c.t0},
        {"depth_bound",
         c.depth_bound > 0 ? c.depth_bound : engine.model->num_layers()},
        {"width_bound", request.speculation.max_draft},
        {"check_every", c.check_every},
        {"mean_exit_depth", s.mean_exit_depth()},
        {"exit_depths", s.exit_depths},
        {"depth_bound_stops", s.depth_bound_stops},
        {"width_bound_stops", s.width_bound_stops}};
  }
  if (planner.local != nullptr) {
    out["profile"] = {{"origin", planner.profile.origin},
                      {"path", planner.profile.path}};
  }
  out["plan_requests"] = result.stats.plan_requests;
  out["plan_failures"] = result.stats.plan_failures;
  out["planning"] = PlanningJson(result.planning, result.stats.decode_seconds);
  if (!result.last_plan_error.empty())
    out["last_plan_error"] = result.last_plan_error;
  out["plans"] = AppliedPlansJson(result.plans);
  std::cout << out.dump() << std::endl;
  return absl::OkStatus();
}

}  // namespace

int RunGenerate() { return ExitCode(Generate(), "generate"); }

}  // namespace knapserve

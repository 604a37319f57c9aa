#include "executor/generation_service.h"

#include <deque>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/base/clock.h"

namespace knapserve {
namespace {

v1::FinishReason WireFinishReason(FinishReason reason) {
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


}  // namespace

v1::SpeculationMode ToWireMode(SpeculationMode mode) {
  switch (mode) {
    case SpeculationMode::kOff:
      return v1::SPECULATION_MODE_OFF;
    case SpeculationMode::kStatic:
      return v1::SPECULATION_MODE_STATIC;
    case SpeculationMode::kKnapSpec:
      return v1::SPECULATION_MODE_KNAPSPEC;
    case SpeculationMode::kClasp:
      return v1::SPECULATION_MODE_CLASP;
  }
  return v1::SPECULATION_MODE_UNSPECIFIED;
}

// The executor's metric families: speculation counters
// with vLLM's meaning, planner overhead ours alone.
struct GenerationService::Metrics {
  Metrics(MetricsRegistry& r, const Scheduler& scheduler, const PlanningShared& planning)
      : registry(r),
        prompt_tokens(r.AddCounter("knapserve_prompt_tokens_total", "Prompt tokens prefilled.")),
        generation_tokens(
            r.AddCounter("knapserve_generation_tokens_total", "Tokens generated.")),
        drafts(r.AddCounter("knapserve_spec_decode_num_drafts_total",
                            "Speculation steps that proposed at least one token.")),
        draft_tokens(r.AddCounter("knapserve_spec_decode_num_draft_tokens_total",
                                  "Draft tokens proposed.")),
        accepted_tokens(r.AddCounter("knapserve_spec_decode_num_accepted_tokens_total",
                                     "Draft tokens accepted.")),
        plans_applied(r.AddCounter("knapserve_planner_plans_applied_total",
                                   "Plans applied at a step boundary.")),
        plan_failures(r.AddCounter("knapserve_planner_failures_total",
                                   "Plan requests answered with an error (last plan kept).")),
        planner_wait(r.AddCounter("knapserve_planner_wait_seconds_total",
                                  "Decode-thread time spent on planning (it never blocks).")),
        ttft(r.AddHistogram("knapserve_time_to_first_token_seconds",
                            "Arrival to first token, queue included.",
                            {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10})),
        itl(r.AddHistogram("knapserve_inter_token_latency_seconds",
                           "Mean time per token after the first, per request.",
                           {0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25})),
        duration(r.AddHistogram("knapserve_request_duration_seconds",
                                "Arrival to the last message.",
                                {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120})),
        solve(r.AddHistogram("knapserve_planner_solve_seconds", "Planner solve time per plan.",
                             {0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10})),
        age(r.AddHistogram("knapserve_planner_plan_age_steps",
                           "Steps between a plan's boundary and its application.",
                           {1, 2, 4, 8, 16, 32, 64, 128, 256})),
        cache_hits(r.AddCounter("knapserve_plan_cache_hits_total",
                                "Context buckets entered with a cached plan (no solve).")),
        cache_misses(r.AddCounter("knapserve_plan_cache_misses_total",
                                  "Context buckets entered without a cached plan.")),
        budget_deferrals(r.AddCounter("knapserve_planner_budget_deferrals_total",
                                      "Plan triggers that waited for the planner CPU budget.")),
        guard_fallbacks(r.AddCounter("knapserve_guard_fallbacks_total",
                                     "Times the online guard switched a sequence to plain "
                                     "decoding because its plan measured slower.")),
        guard_probe_steps(r.AddCounter("knapserve_guard_probe_steps_total",
                                       "Plain steps the guard ran to measure the plain rate.")),
        guard_plain_steps(r.AddCounter("knapserve_guard_plain_steps_total",
                                       "Steps decoded plainly because a plan lost.")) {
    for (const char* kind : {"no_plan", "new_bucket", "drift"}) {
      triggers.push_back(&r.AddCounter("knapserve_plan_triggers_total",
                                       "Replanning triggers by kind.",
                                       absl::StrCat("kind=\"", kind, "\"")));
    }
    std::shared_ptr<PlannerBudget> budget = planning.budget;
    r.AddGauge("knapserve_planner_cpu_share",
               "Planner solve seconds over decode seconds, process-wide (the --planner-budget "
               "quantity).",
               [budget] { return budget->share(); });
    std::shared_ptr<PlanCache> cache = planning.cache;
    r.AddGauge("knapserve_plan_cache_entries", "Plans in the executor's plan cache.",
               [cache] { return static_cast<double>(cache->size()); });
    r.AddGauge("knapserve_running_requests", "Requests decoding now.",
               [&scheduler] { return scheduler.running(); });
    r.AddGauge("knapserve_queued_requests", "Requests waiting for a slot.",
               [&scheduler] { return scheduler.queued(); });
  }
  MetricsRegistry& registry;
  Counter& prompt_tokens;
  Counter& generation_tokens;
  Counter& drafts;
  Counter& draft_tokens;
  Counter& accepted_tokens;
  Counter& plans_applied;
  Counter& plan_failures;
  Counter& planner_wait;
  Histogram& ttft;
  Histogram& itl;
  Histogram& duration;
  Histogram& solve;
  Histogram& age;
  Counter& cache_hits;
  Counter& cache_misses;
  Counter& budget_deferrals;
  Counter& guard_fallbacks;
  Counter& guard_probe_steps;
  Counter& guard_plain_steps;
  std::vector<Counter*> triggers;  // no_plan, new_bucket, drift
};

void GenerationService::Record(const grpc::Status& status, const GenerationResult* result,
                               double ttft, double total) {
  if (metrics_ == nullptr) return;
  Metrics& m = *metrics_;
  static const char* kCodes[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                                 "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                 "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
                                 "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  const int code = static_cast<int>(status.error_code());
  m.registry
      .AddCounter("knapserve_requests_total", "Generate calls by final gRPC status.",
                  absl::StrCat("code=\"", code >= 0 && code <= 16 ? kCodes[code] : "UNKNOWN",
                               "\""))
      .Add();
  if (result == nullptr) return;
  m.prompt_tokens.Add(static_cast<double>(result->stats.prompt_tokens));
  m.generation_tokens.Add(static_cast<double>(result->stats.completion_tokens));
  m.drafts.Add(static_cast<double>(result->speculation.drafts));
  m.draft_tokens.Add(static_cast<double>(result->speculation.draft_tokens));
  m.accepted_tokens.Add(static_cast<double>(result->speculation.accepted_tokens));
  const std::vector<int64_t>& per = result->speculation.accepted_per_position;
  for (size_t j = 0; j < per.size(); ++j) {
    m.registry
        .AddCounter("knapserve_spec_decode_num_accepted_tokens_per_pos_total",
                    "Accepted draft tokens by draft position (0-based).",
                    absl::StrCat("position=\"", j, "\""))
        .Add(static_cast<double>(per[j]));
  }
  m.plans_applied.Add(static_cast<double>(result->plans.size()));
  m.plan_failures.Add(static_cast<double>(result->stats.plan_failures));
  m.planner_wait.Add(result->stats.waiting_seconds);
  for (const AppliedPlan& p : result->plans) {
    if (p.source != "solve") continue;  // cached and shared plans were solved for others
    m.solve.Observe(p.solve_seconds);
    m.age.Observe(static_cast<double>(p.age_steps));
  }
  const PlanningStats& planning = result->planning;
  m.cache_hits.Add(static_cast<double>(planning.cache_hits));
  m.cache_misses.Add(static_cast<double>(planning.cache_misses));
  m.triggers[0]->Add(static_cast<double>(planning.triggers_no_plan));
  m.triggers[1]->Add(static_cast<double>(planning.triggers_new_bucket));
  m.triggers[2]->Add(static_cast<double>(planning.triggers_drift));
  m.budget_deferrals.Add(static_cast<double>(planning.budget_deferrals));
  m.guard_fallbacks.Add(static_cast<double>(planning.guard_fallbacks));
  m.guard_probe_steps.Add(static_cast<double>(planning.guard_probe_steps));
  m.guard_plain_steps.Add(static_cast<double>(planning.guard_plain_steps));
  m.ttft.Observe(ttft);
  if (result->stats.completion_tokens > 1) {
    m.itl.Observe(result->stats.decode_seconds /
                  static_cast<double>(result->stats.completion_tokens - 1));
  }
  m.duration.Observe(total);
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

// One Generate stream. Responses are queued and written one at a time; the
// worker that runs the generation calls Close() last, and the stream finishes
// when the queue is empty, so the call outlives every use by the worker.
class GenerationService::Call final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  Call(GenerationService* service, grpc::CallbackServerContext* context, std::string request_id)
      : service_(service),
        context_(context),
        request_id_(std::move(request_id)),
        arrived_(std::chrono::steady_clock::now()) {}

  const std::string& request_id() const { return request_id_; }

  // Whether the sequence must stop: client cancelled, deadline passed, aborted.
  bool ShouldStop() const {
    return cancelled_.load() || aborted_.load() ||
           context_->deadline() < std::chrono::system_clock::now();
  }
  void MarkAborted() { aborted_ = true; }

  void Run(GenerationRequest request) {
    if (ShouldStop()) return Close(StopStatus());
    const double queue_seconds = SecondsSince(arrived_);
    std::optional<double> first_token_seconds;
    StepLock& turns = service_->step_lock_;
    auto on_tokens = [&](absl::Span<const int32_t> ids, std::string_view text) {
      // Between steps: let the other running sequences take their turn.
      turns.Release();
      turns.Acquire();
      if (!first_token_seconds) first_token_seconds = SecondsSince(arrived_);
      v1::GenerateResponse response;
      v1::Chunk* chunk = response.mutable_chunk();
      chunk->mutable_token_ids()->Add(ids.begin(), ids.end());
      chunk->set_text(std::string(text));
      chunk->set_request_id(request_id_);
      Push(std::move(response));
      return !ShouldStop();
    };
    turns.Acquire();
    absl::StatusOr<GenerationResult> result =
        knapserve::Generate(service_->model_, service_->tokenizer_, request, on_tokens, nullptr,
                            service_->options_.planner, &service_->planning_);
    turns.Release();
    if (!result.ok()) return Close(ToGrpcStatus(result.status()));
    grpc::Status status = grpc::Status::OK;
    if (result->finish_reason == FinishReason::kAborted && !aborted_.load()) {
      status = StopStatus();  // cancelled or past the deadline: no final message
    } else {
      Push(FinalMessage(*result, request, queue_seconds, first_token_seconds.value_or(0)));
    }
    service_->Record(status, &*result, first_token_seconds.value_or(0), SecondsSince(arrived_));
    recorded_ = true;
    Close(status);
  }

  // Ends the stream with `status` once every queued response is written.
  // The caller must not touch the call afterwards.
  void Close(grpc::Status status) {
    if (!recorded_) service_->Record(status, nullptr, 0, SecondsSince(arrived_));
    recorded_ = true;
    {
      std::lock_guard<std::mutex> lock(mu_);
      finish_ = std::move(status);
      if (writing_ || (!queue_.empty() && !broken_)) return;  // OnWriteDone finishes
      finished_ = true;
    }
    Finish(*finish_);
  }

  void OnWriteDone(bool ok) override {
    bool finish = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.pop_front();
      writing_ = false;
      if (!ok) {
        broken_ = true;
        cancelled_ = true;
      }
      if (finish_.has_value() && !finished_ && (queue_.empty() || broken_)) {
        finished_ = true;
        finish = true;
      }
    }
    if (finish) {
      Finish(*finish_);
      return;
    }
    WriteNext();
  }

  void OnCancel() override { cancelled_ = true; }

  void OnDone() override {
    {
      std::lock_guard<std::mutex> lock(service_->calls_mu_);
      auto it = service_->calls_.find(request_id_);
      if (it != service_->calls_.end() && it->second == this) service_->calls_.erase(it);
    }
    delete this;
  }

 private:
  grpc::Status StopStatus() const {
    if (context_->deadline() < std::chrono::system_clock::now()) {
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline exceeded");
    }
    return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
  }

  void Push(v1::GenerateResponse response) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_) return;
      queue_.push_back(std::move(response));
    }
    WriteNext();
  }

  void WriteNext() {
    const v1::GenerateResponse* next = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (writing_ || queue_.empty() || broken_ || finished_) return;
      writing_ = true;
      next = &queue_.front();
    }
    StartWrite(next);
  }

  v1::GenerateResponse FinalMessage(const GenerationResult& r, const GenerationRequest& request,
                                    double queue_seconds, double first_token_seconds) const {
    v1::GenerateResponse response;
    v1::FinalResult* final = response.mutable_final();
    final->set_request_id(request_id_);
    final->set_finish_reason(WireFinishReason(r.finish_reason));
    final->set_stop_sequence(r.matched_stop);
    final->set_seed(r.seed);
    final->mutable_usage()->set_prompt_tokens(static_cast<int32_t>(r.stats.prompt_tokens));
    final->mutable_usage()->set_completion_tokens(static_cast<int32_t>(r.stats.completion_tokens));
    v1::Timings* t = final->mutable_timings();
    t->set_queue_seconds(queue_seconds);
    t->set_time_to_first_token_seconds(first_token_seconds);
    t->set_mean_inter_token_latency_seconds(
        r.stats.completion_tokens > 1
            ? r.stats.decode_seconds / static_cast<double>(r.stats.completion_tokens - 1)
            : 0.0);
    t->set_total_seconds(SecondsSince(arrived_));
    t->set_prefill_seconds(r.stats.prefill_seconds);
    t->set_draft_seconds(r.stats.draft_seconds);
    t->set_verify_seconds(r.stats.verify_seconds);
    t->set_planner_wait_seconds(r.stats.waiting_seconds);
    v1::SpeculationStats* s = final->mutable_speculation_stats();
    s->set_mode(ToWireMode(request.speculation.mode));
    s->set_drafts(static_cast<int32_t>(r.speculation.drafts));
    s->set_draft_tokens(static_cast<int32_t>(r.speculation.draft_tokens));
    s->set_accepted_tokens(static_cast<int32_t>(r.speculation.accepted_tokens));
    for (int64_t n : r.speculation.accepted_per_position) {
      s->add_accepted_per_position(static_cast<int32_t>(n));
    }
    s->set_mean_acceptance_length(r.speculation.mean_acceptance_length());
    s->set_plans_applied(static_cast<int32_t>(r.plans.size()));
    for (const AppliedPlan& p : r.plans) {
      v1::AppliedPlan* wire = s->add_plans();
      wire->set_step(static_cast<uint64_t>(p.applied_step));
      wire->set_mask(p.mask);
      wire->set_gamma(static_cast<uint32_t>(p.gamma));
      wire->set_alpha_hat(p.alpha_hat);
      wire->set_predicted_tokens_per_second(p.predicted_tpt);
      wire->set_solve_seconds(p.solve_seconds);
      wire->set_age_steps(static_cast<uint64_t>(p.age_steps));
    }
    return response;
  }

  GenerationService* service_;
  grpc::CallbackServerContext* context_;
  const std::string request_id_;
  const std::chrono::steady_clock::time_point arrived_;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> aborted_{false};
  std::mutex mu_;
  std::deque<v1::GenerateResponse> queue_;  // front() is in flight while writing_
  std::optional<grpc::Status> finish_;
  bool writing_ = false;
  bool broken_ = false;
  bool finished_ = false;
  bool recorded_ = false;  // metrics taken (by Run or Close; one thread at a time)
};

GenerationService::GenerationService(const LlamaModel& model, const Tokenizer& tokenizer,
                                     GenerationServiceOptions options)
    : model_(model),
      tokenizer_(tokenizer),
      options_(std::move(options)),
      planning_(options_.planning.cache != nullptr ? options_.planning : PlanningShared::Create()),
      scheduler_(options_.scheduler) {
  if (options_.metrics != nullptr) {
    metrics_ = std::make_unique<Metrics>(*options_.metrics, scheduler_, planning_);
  }
}

GenerationService::~GenerationService() { scheduler_.Drain(std::chrono::hours(1)); }

absl::StatusOr<GenerationRequest> GenerationService::ToGenerationRequest(
    const v1::GenerateRequest& wire) const {
  GenerationRequest request;
  switch (wire.prompt_case()) {
    case v1::GenerateRequest::kText: {
      if (wire.text().empty()) return absl::InvalidArgumentError("prompt.text: empty");
      absl::StatusOr<std::vector<int32_t>> ids =
          tokenizer_.Encode(wire.text(), /*add_special_tokens=*/true);
      if (!ids.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("prompt.text: ", ids.status().message()));
      }
      request.prompt_ids = std::move(*ids);
      break;
    }
    case v1::GenerateRequest::kTokenIds:
      request.prompt_ids.assign(wire.token_ids().ids().begin(), wire.token_ids().ids().end());
      if (request.prompt_ids.empty()) {
        return absl::InvalidArgumentError("prompt.token_ids: empty");
      }
      break;
    default:
      return absl::InvalidArgumentError("prompt: set text or token_ids");
  }
  request.max_new_tokens =
      wire.has_max_new_tokens() ? wire.max_new_tokens() : options_.default_max_new_tokens;
  if (wire.has_temperature()) request.sampling.temperature = wire.temperature();
  if (wire.has_top_k()) request.sampling.top_k = wire.top_k();
  if (wire.has_top_p()) request.sampling.top_p = wire.top_p();
  if (wire.has_seed()) request.sampling.seed = wire.seed();
  request.ignore_eos = wire.has_ignore_eos() && wire.ignore_eos();
  request.stop_strings.assign(wire.stop().begin(), wire.stop().end());
  request.stop_token_ids.assign(wire.stop_token_ids().begin(), wire.stop_token_ids().end());
  request.speculation = options_.default_speculation;
  const v1::SpeculationOptions& spec = wire.speculation();
  switch (spec.mode()) {
    case v1::SPECULATION_MODE_UNSPECIFIED:
      break;
    case v1::SPECULATION_MODE_OFF:
      request.speculation.mode = SpeculationMode::kOff;
      break;
    case v1::SPECULATION_MODE_STATIC:
      request.speculation.mode = SpeculationMode::kStatic;
      break;
    case v1::SPECULATION_MODE_KNAPSPEC:
      request.speculation.mode = SpeculationMode::kKnapSpec;
      break;
    case v1::SPECULATION_MODE_CLASP:
      request.speculation.mode = SpeculationMode::kClasp;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("speculation.mode: unknown value ", static_cast<int>(spec.mode())));
  }
  if (spec.has_max_draft_tokens()) request.speculation.max_draft = spec.max_draft_tokens();
  if (spec.has_static_mask()) request.speculation.skip = spec.static_mask();
  if (spec.has_exit_threshold()) request.speculation.exit_threshold = spec.exit_threshold();
  if (IsPlanned(request.speculation.mode) && options_.planner == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("speculation.mode: ", SpeculationModeName(request.speculation.mode),
                     " needs a planner, and this executor runs without one (--planner none)"));
  }
  RETURN_IF_ERROR(ValidateGenerationRequest(request, model_));
  return request;
}

grpc::ServerWriteReactor<v1::GenerateResponse>* GenerationService::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* wire) {
  std::string id = wire->request_id();
  if (id.empty()) id = absl::StrCat("req-", next_id_.fetch_add(1));
  Call* call = new Call(this, context, id);
  absl::StatusOr<GenerationRequest> request = ToGenerationRequest(*wire);
  if (!request.ok()) {
    call->Close(ToGrpcStatus(request.status()));
    return call;
  }
  {
    std::lock_guard<std::mutex> lock(calls_mu_);
    if (!calls_.emplace(id, call).second) {
      call->Close(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                               absl::StrCat("request_id: '", id, "' is already running")));
      return call;
    }
  }
  absl::Status admitted = scheduler_.Submit(
      [call, request = std::move(*request)]() mutable { call->Run(std::move(request)); });
  if (!admitted.ok()) call->Close(ToGrpcStatus(admitted));
  return call;
}

grpc::ServerUnaryReactor* GenerationService::Abort(grpc::CallbackServerContext* context,
                                                   const v1::AbortRequest* request,
                                                   v1::AbortResponse* response) {
  {
    std::lock_guard<std::mutex> lock(calls_mu_);
    auto it = calls_.find(request->request_id());
    response->set_found(it != calls_.end());
    if (it != calls_.end()) it->second->MarkAborted();
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* GenerationService::GetModelInfo(grpc::CallbackServerContext* context,
                                                          const v1::GetModelInfoRequest*,
                                                          v1::GetModelInfoResponse* response) {
  const ModelConfig& c = model_.config();
  v1::ModelInfo* info = response->mutable_model_info();
  info->set_model_path(options_.model_path);
  info->set_model_name(options_.model_path.substr(options_.model_path.find_last_of('/') + 1));
  info->set_model_type(c.model_type);
  info->set_num_layers(model_.num_layers());
  info->set_hidden_size(static_cast<int32_t>(c.hidden_size));
  info->set_num_attention_heads(static_cast<int32_t>(c.num_attention_heads));
  info->set_num_key_value_heads(static_cast<int32_t>(c.num_key_value_heads));
  info->set_head_dim(static_cast<int32_t>(c.head_dim));
  info->set_vocab_size(static_cast<int32_t>(c.vocab_size));
  info->set_max_context(model_.max_context());
  info->set_dtype(DtypeName(model_.dtype()));
  info->set_device(model_.device().str());
  info->set_model_fingerprint(c.Fingerprint());
  for (int32_t id : c.eos_token_ids) info->add_eos_token_ids(id);
  info->set_default_speculation_mode(ToWireMode(options_.default_speculation.mode));
  info->set_default_max_draft_tokens(
      static_cast<uint32_t>(std::max(0, options_.default_speculation.max_draft)));
  info->set_plan_interval_steps(static_cast<int32_t>(options_.default_speculation.plan_interval));
  info->set_planner_mode(options_.planner_mode);
  info->set_planner_address(options_.planner_address);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace knapserve

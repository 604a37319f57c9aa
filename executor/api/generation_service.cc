#include "executor/api/generation_service.h"

#include <grpcpp/security/auth_context.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/clock.h"
#include "common/base/random_id.h"
#include "common/base/status.h"
#include "common/model/exception_status.h"
#include "common/rpc/queued_writer.h"
#include "common/trace/tracer.h"

namespace knapserve {
namespace {

// The last component of a model folder ("" for none).
std::string ModelName(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// The owner of a gRPC call (see the header): the client's identity when
// its certificate was verified (mutual TLS), else its connection.
std::string CallerOf(const grpc::ServerContextBase& context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    std::string identity =
        absl::StrCat("identity:", auth->GetPeerIdentityPropertyName(), "=");
    for (const grpc::string_ref& name : auth->GetPeerIdentity()) {
      absl::StrAppend(&identity, absl::string_view(name.data(), name.size()),
                      ";");
    }
    return identity;
  }
  return absl::StrCat("peer:", context.peer());
}

}  // namespace

// One Generate stream. The worker that runs the generation enqueues its
// responses and calls Close last; the writer finishes the stream once they
// are written, so the call outlives every use by the worker.
class GenerationService::Call final
    : public grpc::ServerWriteReactor<v1::GenerateResponse>,
      public GenerationSink {
 public:
  Call(GenerationService* service, grpc::CallbackServerContext* context,
       std::string request_id)
      : service_(service),
        context_(context),
        request_id_(std::move(request_id)),
        owner_(CallerOf(*context)),
        arrived_(std::chrono::steady_clock::now()) {}

  const std::string& request_id() const override { return request_id_; }
  const std::string& owner() const override { return owner_; }

  // GenerationSink: client cancelled, deadline passed, aborted.
  bool ShouldStop() const override {
    return cancelled_.load() || aborted() ||
           context_->deadline() < std::chrono::system_clock::now();
  }
  absl::Status StopStatus() const override {
    if (context_->deadline() < std::chrono::system_clock::now()) {
      return absl::DeadlineExceededError("deadline exceeded");
    }
    return absl::CancelledError("cancelled by the client");
  }
  // On the engine's step thread: only queues the chunk.
  void OnTokens(int index, absl::Span<const int32_t> ids, std::string_view text,
                const StepLogprobs& logprobs) override {
    writer_.Enqueue(EncodeChunk(request_id_, ids, text, logprobs, index));
  }

  // On a scheduler worker: generates, streams, closes.
  void Run(GenerationRequest request) {
    const SpeculationMode mode = request.speculation.mode;
    GenerationOutcome outcome =
        service_->RunOnWorker(std::move(request), arrived_, *this);
    if (outcome.status.ok()) {
      writer_.Enqueue(
          EncodeFinal(request_id_, *outcome.result, mode, outcome.timings));
      for (const GenerationResult& choice : outcome.other_choices) {
        writer_.Enqueue(
            EncodeFinal(request_id_, choice, mode, outcome.timings));
      }
    }
    Close(outcome.status,
          outcome.result.has_value() ? &*outcome.result : nullptr,
          outcome.timings.first_token_seconds, outcome.other_choices);
  }

  // Records the request's metrics and ends the stream with `status` once
  // every queued response is written. The caller must not touch the call
  // afterwards (gRPC may delete it at once).
  void Close(const absl::Status& status,
             const GenerationResult* result = nullptr,
             double first_token_seconds = 0,
             absl::Span<const GenerationResult> other_choices = {}) {
    service_->RecordRequest(status, result, first_token_seconds, arrived_,
                            other_choices);
    trace().Finish(status, result);
    // The id is free before the client can see the end: a client that sends
    // the same id again right after must not find it "already running"
    // (OnDone, which also removes it, may come much later).
    service_->RemoveCall(this);
    writer_.Finish(ToGrpcStatus(status));
  }

  void OnWriteDone(bool ok) override {
    if (!ok) cancelled_ = true;  // the client is gone: stop decoding
    writer_.OnWriteDone(ok);
  }

  void OnCancel() override {
    cancelled_ = true;
    writer_.Cancel();
  }

  void OnDone() override {
    GenerationService* service = service_;
    service->RemoveCall(this);
    delete this;
    service->CallEnded();  // last: the service may be destroyed right after
  }

 private:
  GenerationService* const service_;
  grpc::CallbackServerContext* const context_;
  const std::string request_id_;
  const std::string owner_;
  const std::chrono::steady_clock::time_point arrived_;
  std::atomic<bool> cancelled_{false};
  QueuedWriter<v1::GenerateResponse> writer_{this};
};

GenerationOutcome GenerationService::RunOnWorker(
    GenerationRequest request, std::chrono::steady_clock::time_point arrived,
    GenerationSink& sink) {
  GenerationOutcome outcome;
  try {
    outcome.status = Serve(std::move(request), arrived, sink, outcome);
  } catch (...) {
    outcome.status = CurrentExceptionAsInternal("generation failed");
  }
  if (!outcome.status.ok()) outcome.result.reset();
  return outcome;
}

absl::Status GenerationService::Serve(
    GenerationRequest request, std::chrono::steady_clock::time_point arrived,
    GenerationSink& sink, GenerationOutcome& outcome) {
  ServiceTimings& timings = outcome.timings;
  if (sink.ShouldStop()) return sink.StopStatus();
  timings.queue_seconds = SecondsSince(arrived);
  sink.trace().Begin(request);
  if (options_.before_step_for_tests) {
    request.before_step_for_tests = [hook = options_.before_step_for_tests,
                                     id = sink.request_id()](int64_t step) {
      hook(id, step);
    };
  }
  bool first = true;
  const int candidates = std::max(request.n, request.best_of);
  // best_of > n: the n best candidates are known only at the end, so
  // nothing streams before (their outputs follow as one chunk each).
  const bool select = candidates > request.n;
  const bool asked_logprobs = request.logprobs;
  if (select) request.logprobs = true;  // the selection's measure
  // The callbacks run on the engine's step thread while this worker waits
  // in Generate: they only hand the chunk over and say whether to go on.
  auto on_tokens = [&](int index) -> StreamCallback {
    return [&, index](absl::Span<const int32_t> ids, std::string_view text,
                      const StepLogprobs& logprobs) {
      if (first) {
        timings.first_token_seconds = SecondsSince(arrived);
        first = false;
      }
      if (!select) sink.OnTokens(index, ids, text, logprobs);
      return !sink.ShouldStop();
    };
  };
  auto should_stop = [&sink] { return sink.ShouldStop(); };
  std::vector<GenerationResult> choices;
  if (candidates == 1) {
    ASSIGN_OR_RETURN(
        choices.emplace_back(),
        engine_->Generate(request, on_tokens(0), nullptr, should_stop));
  } else {
    ASSIGN_OR_RETURN(choices, engine_->GenerateChoices(request, candidates,
                                                       on_tokens, should_stop));
  }
  for (size_t i = 0; i < choices.size(); ++i) {
    GenerationResult& choice = choices[i];
    choice.index = static_cast<int>(i);
    if (choice.finish_reason == FinishReason::kAborted && !sink.aborted()) {
      return sink.StopStatus();  // cancelled or past the deadline
    }
    if (request.logprobs) {
      double sum = 0;
      for (float logprob : choice.output_logprobs) sum += logprob;
      choice.cumulative_logprob = sum;
    }
  }
  if (select) {
    // The n most likely candidates, best first (ties: the earlier one);
    // candidates an Abort cut short, or that produced nothing, come last.
    auto complete = [](const GenerationResult& r) {
      return r.finish_reason != FinishReason::kAborted && !r.output_ids.empty();
    };
    std::stable_sort(choices.begin(), choices.end(),
                     [&](const GenerationResult& a, const GenerationResult& b) {
                       if (complete(a) != complete(b)) return complete(a);
                       return *a.cumulative_logprob > *b.cumulative_logprob;
                     });
    choices.resize(request.n);
    for (size_t k = 0; k < choices.size(); ++k) {
      GenerationResult& choice = choices[k];
      choice.index = static_cast<int>(k);
      if (!asked_logprobs) {
        choice.output_logprobs.clear();
        choice.output_top_logprobs.clear();
      }
      StepLogprobs logprobs{choice.output_logprobs, choice.output_top_logprobs,
                            choice.prompt_logprobs, choice.prompt_top_logprobs};
      sink.OnTokens(choice.index, choice.output_ids, choice.text, logprobs);
    }
  }
  outcome.result = std::move(choices[0]);
  outcome.other_choices.assign(std::make_move_iterator(choices.begin() + 1),
                               std::make_move_iterator(choices.end()));
  timings.total_seconds = SecondsSince(arrived);
  return absl::OkStatus();
}

void GenerationService::RecordRequest(
    const absl::Status& status, const GenerationResult* result,
    double first_token_seconds, std::chrono::steady_clock::time_point arrived,
    absl::Span<const GenerationResult> other_choices) {
  if (metrics_ != nullptr) {
    metrics_->RecordRequest(status.code(), result, first_token_seconds,
                            SecondsSince(arrived));
    for (const GenerationResult& choice : other_choices) {
      metrics_->RecordChoice(choice);
    }
  }
}

GenerationService::GenerationService(const LlamaModel& model,
                                     const Tokenizer& tokenizer,
                                     GenerationServiceOptions options)
    : model_(model),
      tokenizer_(tokenizer),
      options_(std::move(options)),
      model_name_(ModelName(options_.model_path)),
      planning_(options_.planning.cache != nullptr ? options_.planning
                                                   : PlanningShared::Create()),
      request_defaults_{options_.default_max_new_tokens,
                        options_.default_speculation,
                        options_.planner != nullptr, options_.limits},
      scheduler_(options_.scheduler) {
  KvPool* pool = options_.kv_pool;
  if (pool == nullptr) {
    absl::StatusOr<std::unique_ptr<KvPool>> own = KvPool::Create(
        model_,
        KvPoolOptions{
            DefaultKvCacheBytes(model_, options_.scheduler.max_running), 16});
    if (!own.ok()) {
      // The default is at least one sequence's worth; failing here means
      // the machine cannot hold even that.
      std::fprintf(stderr, "knapserve: %s\n", own.status().ToString().c_str());
      std::abort();
    }
    own_pool_ = std::move(*own);
    pool = own_pool_.get();
  }
  BatchEngineOptions engine = options_.engine;
  engine.max_running = options_.scheduler.max_running;
  engine_ = std::make_unique<BatchEngine>(model_, tokenizer_, *pool,
                                          options_.planner, planning_, engine);
  if (options_.metrics != nullptr) {
    metrics_ = std::make_unique<GenerationMetrics>(
        *options_.metrics, scheduler_, *engine_, planning_);
  }
}

GenerationService::~GenerationService() {
  scheduler_.Drain(std::chrono::hours(1));
  // Every Call points at this service until its OnDone returns, which gRPC
  // may deliver on its own thread after the server has shut down. Wait for
  // them; a reactor gRPC never finishes is reported, not waited on forever.
  absl::MutexLock lock(&calls_mu_);
  auto all_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_) {
    return calls_alive_ == 0;
  };
  if (!calls_mu_.AwaitWithTimeout(absl::Condition(&all_done),
                                  absl::Seconds(30))) {
    std::fprintf(stderr,
                 "knapserve: %lld gRPC calls still not done 30 s after "
                 "shutdown\n",
                 static_cast<long long>(calls_alive_));
  }
}

void GenerationService::CallCreated() {
  absl::MutexLock lock(&calls_mu_);
  ++calls_alive_;
}

void GenerationService::CallEnded() {
  absl::MutexLock lock(&calls_mu_);
  --calls_alive_;
}

bool GenerationService::AddCall(GenerationSink* call) {
  absl::MutexLock lock(&calls_mu_);
  return calls_.emplace(CallKey(call->owner(), call->request_id()), call)
      .second;
}

void GenerationService::RemoveCall(GenerationSink* call) {
  absl::MutexLock lock(&calls_mu_);
  auto it = calls_.find(CallKey(call->owner(), call->request_id()));
  if (it != calls_.end() && it->second == call) calls_.erase(it);
}

absl::Status GenerationService::Submit(
    GenerationRequest request, std::shared_ptr<LocalGenerationSink> sink) {
  const std::string& id = sink->request_id();
  const auto arrived = std::chrono::steady_clock::now();
  if (!AddCall(sink.get())) {
    const absl::Status taken = absl::InvalidArgumentError(
        absl::StrCat("request_id: '", id, "' is already running"));
    RecordRequest(taken, nullptr, 0, arrived);
    sink->trace().Finish(taken, nullptr);
    return taken;
  }
  absl::Status admitted = scheduler_.Submit(
      [this, sink, arrived, request = std::move(request)]() mutable {
        GenerationOutcome outcome =
            RunOnWorker(std::move(request), arrived, *sink);
        const GenerationResult* result =
            outcome.result.has_value() ? &*outcome.result : nullptr;
        RecordRequest(outcome.status, result,
                      outcome.timings.first_token_seconds, arrived,
                      outcome.other_choices);
        sink->trace().Finish(outcome.status, result);
        RemoveCall(sink.get());
        sink->OnFinished(std::move(outcome));
      });
  if (!admitted.ok()) {
    RecordRequest(admitted, nullptr, 0, arrived);
    sink->trace().Finish(admitted, nullptr);
    RemoveCall(sink.get());
  }
  return admitted;
}

void GenerationService::RecordRefused(const absl::Status& status) {
  RecordRequest(status, nullptr, 0, std::chrono::steady_clock::now());
}

grpc::ServerWriteReactor<v1::GenerateResponse>* GenerationService::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* wire) {
  std::string id = wire->request_id();
  if (id.empty()) id = UnguessableId("req-");
  Call* call = new Call(this, context, id);
  CallCreated();
  if (trace::GlobalTracer() != nullptr) {
    const auto& metadata = context->client_metadata();
    const auto header = metadata.find("traceparent");
    call->trace().Start(
        header == metadata.end()
            ? std::string_view()
            : std::string_view(header->second.data(), header->second.size()),
        id, "grpc", "text_completion", model_name_);
  }
  absl::StatusOr<GenerationRequest> request =
      DecodeGenerateRequest(*wire, request_defaults_, model_, tokenizer_);
  if (!request.ok()) {
    call->Close(request.status());
    return call;
  }
  if (!AddCall(call)) {
    call->Close(absl::InvalidArgumentError(
        absl::StrCat("request_id: '", id, "' is already running")));
    return call;
  }
  absl::Status admitted =
      scheduler_.Submit([call, request = std::move(*request)]() mutable {
        call->Run(std::move(request));
      });
  if (!admitted.ok()) call->Close(admitted);
  return call;
}

grpc::ServerUnaryReactor* GenerationService::Abort(
    grpc::CallbackServerContext* context, const v1::AbortRequest* request,
    v1::AbortResponse* response) {
  {
    absl::MutexLock lock(&calls_mu_);
    // Only the caller's own requests (see the header): another caller's id
    // is answered as an unknown one.
    auto it = calls_.find(CallKey(CallerOf(*context), request->request_id()));
    response->set_found(it != calls_.end());
    if (it != calls_.end()) it->second->MarkAborted();
  }
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* GenerationService::GetModelInfo(
    grpc::CallbackServerContext* context, const v1::GetModelInfoRequest*,
    v1::GetModelInfoResponse* response) {
  ServiceInfo service;
  service.model_path = options_.model_path;
  service.default_speculation = options_.default_speculation;
  service.planner_mode = options_.planner_mode;
  service.planner_address = options_.planner_address;
  *response->mutable_model_info() = EncodeModelInfo(model_, service);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace knapserve

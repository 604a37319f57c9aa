#include "executor/generation_service.h"

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/clock.h"
#include "common/model/exception_status.h"
#include "common/rpc/queued_writer.h"

namespace knapserve {

// One Generate stream. The worker that runs the generation enqueues its
// responses and calls Close last; the writer finishes the stream once they
// are written, so the call outlives every use by the worker.
class GenerationService::Call final
    : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  Call(GenerationService* service, grpc::CallbackServerContext* context,
       std::string request_id)
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

  // On a scheduler worker: generates, streams, closes. Nothing it runs may
  // throw past here (an exception ends this stream with INTERNAL).
  void Run(GenerationRequest request) {
    std::optional<GenerationResult> result;
    double first_token_seconds = 0;
    absl::Status status;
    try {
      status = Serve(std::move(request), result, first_token_seconds);
    } catch (...) {
      status = CurrentExceptionAsInternal("generation failed");
    }
    Close(status, result.has_value() ? &*result : nullptr, first_token_seconds);
  }

  // Records the request's metrics and ends the stream with `status` once
  // every queued response is written. The caller must not touch the call
  // afterwards (gRPC may delete it at once).
  void Close(const absl::Status& status,
             const GenerationResult* result = nullptr,
             double first_token_seconds = 0) {
    if (service_->metrics_ != nullptr) {
      service_->metrics_->RecordRequest(
          status.code(), result, first_token_seconds, SecondsSince(arrived_));
    }
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
    service_->RemoveCall(this);
    delete this;
  }

 private:
  absl::Status StopStatus() const {
    if (context_->deadline() < std::chrono::system_clock::now()) {
      return absl::DeadlineExceededError("deadline exceeded");
    }
    return absl::CancelledError("cancelled by the client");
  }

  // The generation itself: takes step turns, streams chunks, queues the final
  // message. `result` is set when the generation returned one.
  absl::Status Serve(GenerationRequest request,
                     std::optional<GenerationResult>& result,
                     double& first_token_seconds) {
    if (ShouldStop()) return StopStatus();
    const double queue_seconds = SecondsSince(arrived_);
    if (service_->options_.before_step_for_tests) {
      request.before_step_for_tests =
          [hook = service_->options_.before_step_for_tests,
           id = request_id_](int64_t step) { hook(id, step); };
    }
    bool first = true;
    // on_tokens runs on the engine's step thread while this worker waits in
    // Generate: it only queues the chunk and says whether to go on.
    auto on_tokens = [&](absl::Span<const int32_t> ids, std::string_view text) {
      if (first) {
        first_token_seconds = SecondsSince(arrived_);
        first = false;
      }
      writer_.Enqueue(EncodeChunk(request_id_, ids, text));
      return !ShouldStop();
    };
    absl::StatusOr<GenerationResult> generated = service_->engine_->Generate(
        request, on_tokens, nullptr, [this] { return ShouldStop(); });
    if (!generated.ok()) return generated.status();
    result = std::move(*generated);
    if (result->finish_reason == FinishReason::kAborted && !aborted_.load()) {
      return StopStatus();  // cancelled or past the deadline: no final message
    }
    const ServiceTimings timings{queue_seconds, first_token_seconds,
                                 SecondsSince(arrived_)};
    writer_.Enqueue(
        EncodeFinal(request_id_, *result, request.speculation.mode, timings));
    return absl::OkStatus();
  }

  GenerationService* const service_;
  grpc::CallbackServerContext* const context_;
  const std::string request_id_;
  const std::chrono::steady_clock::time_point arrived_;
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> aborted_{false};
  QueuedWriter<v1::GenerateResponse> writer_{this};
};

GenerationService::GenerationService(const LlamaModel& model,
                                     const Tokenizer& tokenizer,
                                     GenerationServiceOptions options)
    : model_(model),
      tokenizer_(tokenizer),
      options_(std::move(options)),
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
}

bool GenerationService::AddCall(Call* call) {
  absl::MutexLock lock(&calls_mu_);
  return calls_.emplace(call->request_id(), call).second;
}

void GenerationService::RemoveCall(Call* call) {
  absl::MutexLock lock(&calls_mu_);
  auto it = calls_.find(call->request_id());
  if (it != calls_.end() && it->second == call) calls_.erase(it);
}

grpc::ServerWriteReactor<v1::GenerateResponse>* GenerationService::Generate(
    grpc::CallbackServerContext* context, const v1::GenerateRequest* wire) {
  std::string id = wire->request_id();
  if (id.empty()) id = absl::StrCat("req-", next_id_.fetch_add(1));
  Call* call = new Call(this, context, id);
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
    auto it = calls_.find(request->request_id());
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

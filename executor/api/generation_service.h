// GenerationService: the public knapserve.v1.Generation gRPC service
// (proto/knapserve/v1/generation.proto) over one model. It does the call
// flow only: the wire mapping is executor/api/generation_codec.h, the metrics
// executor/api/generation_metrics.h, the write queue
// common/rpc/queued_writer.h.
//
// Generate decodes and validates the request (INVALID_ARGUMENT naming the
// field; FAILED_PRECONDITION for a planned mode on an executor without a
// planner), admits it through the Scheduler (RESOURCE_EXHAUSTED when the
// queue is full, UNAVAILABLE while draining), decodes it in the shared
// batch of executor/engine/batch_engine.h (RESOURCE_EXHAUSTED when it could
// never fit the K/V pool) and streams one Chunk per decode step, then one
// FinalResult. All running sequences share every forward pass (continuous
// batching); a scheduler worker only waits for its sequence. Client
// cancellation, a passed deadline or Abort(request_id) stop the sequence
// within one step, also while it waits for K/V blocks; its blocks go back
// to the pool at once. Abort
// ends the stream with FINISH_REASON_ABORTED; cancellation and deadlines end
// it with CANCELLED and DEADLINE_EXCEEDED.
//
// Request ids belong to their caller. A request id is registered under its
// owner (GenerationSink::owner): for gRPC the client's authenticated
// identity when it presented a certificate (mutual TLS), else its
// connection (grpc::ServerContext::peer(); a client that keeps its channel
// keeps its connection); for HTTP the front door. A client-chosen id is
// unique only within its owner, and Abort(request_id) reaches only the
// caller's own requests: another caller's id answers found = false, as an
// unknown one does. Ids the server chooses ("req-" and 32 hex digits) are
// unguessable (common/base/random_id.h).
//
// Tracing (common/trace, when a tracer is installed): every request, from
// either front end, is a `generate` span with queue, prefill and decode
// children (executor/api/request_trace.h), child of the client's W3C
// traceparent (gRPC metadata "traceparent", the HTTP header of that name);
// its plan spans hang from decode.
//
// Exceptions: an exception inside LibTorch or the generator (caught at each
// step by executor/engine/generator.h, and again around the whole request here)
// ends that one stream with INTERNAL after the chunks it already streamed,
// counts knapserve_request_internal_errors_total and frees its K/V blocks; the
// other streams go on.
//
// Ownership: borrows the model, tokenizer, planner client and metrics
// registry (they must outlive the service), and the K/V pool when
// options.kv_pool is set; owns the scheduler and its workers, the batch
// engine and its step thread, and its own K/V pool otherwise. A call (its
// reactor) lives from Generate until gRPC's OnDone. Thread safety: gRPC calls
// in from its threads; requests run on scheduler workers.
#ifndef KNAPSERVE_EXECUTOR_API_GENERATION_SERVICE_H_
#define KNAPSERVE_EXECUTOR_API_GENERATION_SERVICE_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics/metrics.h"
#include "common/model/llama.h"
#include "common/plan/planner_client.h"
#include "common/text/tokenizer.h"
#include "executor/api/generation_codec.h"
#include "executor/api/generation_metrics.h"
#include "executor/api/request_trace.h"
#include "executor/api/scheduler.h"
#include "executor/engine/batch_engine.h"
#include "executor/engine/generator.h"
#include "executor/engine/kv_pool.h"
#include "knapserve/v1/generation.grpc.pb.h"

namespace knapserve {

struct GenerationServiceOptions {
  SchedulerOptions scheduler;  // max_running is also the batch's size limit
  // The batched step loop (--max-batch-tokens, the plain batch size).
  BatchEngineOptions engine;
  // The K/V pool (--kv-cache-memory); nullptr: the service makes one of
  // DefaultKvCacheBytes(model, max_running).
  KvPool* kv_pool = nullptr;
  // Defaults for fields a request leaves unset.
  int64_t default_max_new_tokens = 256;
  // What one request may ask for (--max-request-bytes, --max-prompt-tokens,
  // ...); see executor/api/generation_codec.h.
  RequestLimits limits;
  SpeculationConfig default_speculation;  // mode, max_draft, plan interval, ...
  // Where plans come from (nullptr: planned modes are refused).
  PlannerClient* planner = nullptr;
  v1::PlannerMode planner_mode = v1::PLANNER_MODE_NONE;
  std::string planner_address;
  std::string model_path;
  // Where request, token, speculation and planner metrics go (nullptr: none).
  MetricsRegistry* metrics = nullptr;
  // The process's plan cache, planner budget, plain-rate and draft-cost tables,
  // shared by every request (empty: the service makes its own).
  PlanningShared planning;
  // Fault injection for tests; empty (the default) in production. Installed
  // as every request's GenerationRequest::before_step_for_tests with the
  // request's id: it runs on the engine's step thread before each decode
  // step of that request, and what it throws fails that request only.
  std::function<void(std::string_view request_id, int64_t step)>
      before_step_for_tests;
};

// What a generation needs from the front end that carries it: a gRPC stream
// (GenerationService's own calls) or an HTTP response
// (executor/api/http_front_door.h). A sink is registered under its request id
// while its generation is queued or runs, so Abort(request_id) reaches
// either kind. Thread safety: ShouldStop, StopStatus and the abort flag
// from any thread; OnTokens on the engine's step thread, one call at a time.
class GenerationSink {
 public:
  virtual ~GenerationSink() = default;
  virtual const std::string& request_id() const = 0;
  // Who sent the request (see the file comment): "identity:<name>" (a
  // client certificate), "peer:<connection>" (gRPC otherwise) or "http".
  // The id registry and Abort are scoped by it.
  virtual const std::string& owner() const = 0;
  // Whether the sequence must stop now: the client went away, its deadline
  // passed, or it was aborted. Checked at least once per decode step.
  virtual bool ShouldStop() const = 0;
  // Why it stopped when it stopped without an Abort (CANCELLED,
  // DEADLINE_EXCEEDED).
  virtual absl::Status StopStatus() const = 0;
  // One decode step's new tokens of choice `index` (see StreamCallback; 0
  // unless the request asked for n > 1). Must not block on the client: the
  // whole batch waits for it.
  virtual void OnTokens(int index, absl::Span<const int32_t> ids,
                        std::string_view text,
                        const StepLogprobs& logprobs) = 0;

  // Abort(request_id): the sequence ends within one step with finish
  // reason aborted.
  void MarkAborted() { aborted_ = true; }
  bool aborted() const { return aborted_.load(); }

  // The request's trace (executor/api/request_trace.h): the front end starts
  // it when the request arrives, the service begins and finishes it.
  RequestTrace& trace() { return trace_; }

 private:
  std::atomic<bool> aborted_{false};
  RequestTrace trace_;
};

// How a generation ended: OK with its result, or the error that ended it
// (the result is then empty); timings from the request's arrival.
struct GenerationOutcome {
  absl::Status status;
  std::optional<GenerationResult> result;  // choice 0
  // Choices 1..n-1 when the request asked for n > 1, in index order.
  std::vector<GenerationResult> other_choices;
  ServiceTimings timings;
};

// A sink for a front end other than gRPC, run through
// GenerationService::Submit.
class LocalGenerationSink : public GenerationSink {
 public:
  // Exactly once, after the last OnTokens, on a scheduler worker.
  virtual void OnFinished(GenerationOutcome outcome) = 0;
};

class GenerationService final : public v1::Generation::CallbackService {
 public:
  GenerationService(const LlamaModel& model, const Tokenizer& tokenizer,
                    GenerationServiceOptions options);
  ~GenerationService() override;

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context,
      const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context,
                                  const v1::AbortRequest* request,
                                  v1::AbortResponse* response) override
      ABSL_LOCKS_EXCLUDED(calls_mu_);
  grpc::ServerUnaryReactor* GetModelInfo(
      grpc::CallbackServerContext* context,
      const v1::GetModelInfoRequest* request,
      v1::GetModelInfoResponse* response) override;

  // Runs `request` for another front end of this process (the HTTP front
  // door) exactly as a Generate call: the same admission, batch, request-id
  // registry (Abort), metrics and drain. The request must be decoded and
  // validated already (DecodeGenerateRequest's checks). Returns the refusal
  // (InvalidArgument for a request id already running, ResourceExhausted
  // for a full queue, Unavailable while draining), and then never calls
  // `sink`; otherwise sink->OnFinished runs exactly once, later, on a
  // scheduler worker. Any thread.
  absl::Status Submit(GenerationRequest request,
                      std::shared_ptr<LocalGenerationSink> sink)
      ABSL_LOCKS_EXCLUDED(calls_mu_);
  // Counts a request refused before Submit (bad fields) in the request
  // metrics, as a refused Generate call is.
  void RecordRefused(const absl::Status& status);

  const LlamaModel& model() const { return model_; }
  const Tokenizer& tokenizer() const { return tokenizer_; }
  const GenerateRequestDefaults& request_defaults() const {
    return request_defaults_;
  }

  // Refuses new requests and waits up to `timeout` for running ones.
  bool Drain(std::chrono::milliseconds timeout) {
    return scheduler_.Drain(timeout);
  }
  const Scheduler& scheduler() const { return scheduler_; }
  const BatchEngine& engine() const { return *engine_; }

 private:
  class Call;
  friend class Call;

  // A registered request: (owner, request id).
  using CallKey = std::pair<std::string, std::string>;
  // Registers `call` under its owner and request id; false when its owner
  // already has a queued or running request with that id.
  bool AddCall(GenerationSink* call) ABSL_LOCKS_EXCLUDED(calls_mu_);
  void RemoveCall(GenerationSink* call) ABSL_LOCKS_EXCLUDED(calls_mu_);
  // On a scheduler worker: runs the generation, streaming to `sink`. Nothing
  // it runs may throw past here (an exception is an INTERNAL outcome).
  GenerationOutcome RunOnWorker(GenerationRequest request,
                                std::chrono::steady_clock::time_point arrived,
                                GenerationSink& sink);
  absl::Status Serve(GenerationRequest request,
                     std::chrono::steady_clock::time_point arrived,
                     GenerationSink& sink, GenerationOutcome& outcome);
  void RecordRequest(const absl::Status& status, const GenerationResult* result,
                     double first_token_seconds,
                     std::chrono::steady_clock::time_point arrived,
                     absl::Span<const GenerationResult> other_choices = {});
  // Counts a Call from its creation until its OnDone has finished with it:
  // the destructor waits for the count to reach zero, because gRPC may run a
  // reactor's OnDone after the server itself is gone.
  void CallCreated() ABSL_LOCKS_EXCLUDED(calls_mu_);
  void CallEnded() ABSL_LOCKS_EXCLUDED(calls_mu_);

  const LlamaModel& model_;
  const Tokenizer& tokenizer_;
  const GenerationServiceOptions options_;
  // gen_ai.request.model of gRPC requests: the model folder's name.
  const std::string model_name_;
  const PlanningShared planning_;  // options_.planning, or the service's own
  const GenerateRequestDefaults request_defaults_;
  Scheduler scheduler_;
  std::unique_ptr<KvPool> own_pool_;     // when options.kv_pool is null
  std::unique_ptr<BatchEngine> engine_;  // every running sequence's steps
  absl::Mutex calls_mu_;
  absl::flat_hash_map<CallKey, GenerationSink*> calls_
      ABSL_GUARDED_BY(calls_mu_);  // queued or running, by owner and id
  int64_t calls_alive_ ABSL_GUARDED_BY(calls_mu_) = 0;  // created, not done
  std::unique_ptr<GenerationMetrics> metrics_;  // null without options.metrics
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_API_GENERATION_SERVICE_H_

// GenerationService: the public knapserve.v1.Generation gRPC service
// (proto/knapserve/v1/generation.proto) over one model.
//
// Generate validates the request (INVALID_ARGUMENT naming the field;
// FAILED_PRECONDITION for knapspec/clasp on an executor without a planner),
// admits it through the Scheduler (RESOURCE_EXHAUSTED when the queue is full,
// UNAVAILABLE while draining), decodes with executor/generator.h and streams
// one Chunk per decode step, then one FinalResult. Running sequences take
// turns through a FIFO StepLock: one prefill or decode step at a time, each
// with all of torch's threads. Client cancellation, a
// passed deadline or Abort(request_id) stop the sequence within one step; its
// KV cache is freed when the generation returns. Abort ends the stream with
// FINISH_REASON_ABORTED; cancellation and deadlines end it with CANCELLED and
// DEADLINE_EXCEEDED.
//
// Ownership: borrows the model, tokenizer and planner client (they must
// outlive the service); owns the scheduler and its workers. Thread safety:
// gRPC calls in from its threads; requests run on scheduler workers.
#ifndef KNAPSERVE_EXECUTOR_GENERATION_SERVICE_H_
#define KNAPSERVE_EXECUTOR_GENERATION_SERVICE_H_

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "common/metrics/metrics.h"
#include "common/model/llama.h"
#include "common/plan/planner_client.h"
#include "common/text/tokenizer.h"
#include "executor/generator.h"
#include "executor/scheduler.h"
#include "knapserve/v1/generation.grpc.pb.h"

namespace knapserve {

struct GenerationServiceOptions {
  SchedulerOptions scheduler;
  // Defaults for fields a request leaves unset.
  int64_t default_max_new_tokens = 256;
  SpeculationConfig default_speculation;  // mode, max_draft, plan interval, ...
  // Where plans come from (nullptr: knapspec/clasp are refused).
  PlannerClient* planner = nullptr;
  v1::PlannerMode planner_mode = v1::PLANNER_MODE_NONE;
  std::string planner_address;
  std::string model_path;
  // Where request, token, speculation and planner metrics go (nullptr: none).
  MetricsRegistry* metrics = nullptr;
  // The process's plan cache, planner budget and plain-rate table, shared by
  // every request (empty: the service makes its own).
  PlanningShared planning;
};

class GenerationService final : public v1::Generation::CallbackService {
 public:
  GenerationService(const LlamaModel& model, const Tokenizer& tokenizer,
                    GenerationServiceOptions options);
  ~GenerationService() override;

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* Abort(grpc::CallbackServerContext* context,
                                  const v1::AbortRequest* request,
                                  v1::AbortResponse* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::GetModelInfoResponse* response) override;

  // Refuses new requests and waits up to `timeout` for running ones.
  bool Drain(std::chrono::milliseconds timeout) { return scheduler_.Drain(timeout); }
  const Scheduler& scheduler() const { return scheduler_; }

  // The GenerationRequest a wire request describes, or INVALID_ARGUMENT /
  // FAILED_PRECONDITION naming the field. Exposed for tests.
  absl::StatusOr<GenerationRequest> ToGenerationRequest(const v1::GenerateRequest& request) const;

 private:
  class Call;
  friend class Call;
  struct Metrics;
  // Records a finished request (status code) and, when it produced a result,
  // its tokens, timings and speculation statistics.
  void Record(const grpc::Status& status, const GenerationResult* result, double ttft,
              double total);

  const LlamaModel& model_;
  const Tokenizer& tokenizer_;
  const GenerationServiceOptions options_;
  const PlanningShared planning_;  // options_.planning, or the service's own
  Scheduler scheduler_;
  StepLock step_lock_;  // running sequences take turns, one decode step each
  std::mutex calls_mu_;
  absl::flat_hash_map<std::string, Call*> calls_;  // live calls by request id
  std::atomic<uint64_t> next_id_{1};
  std::unique_ptr<Metrics> metrics_;  // null without options.metrics
};

// SpeculationMode <-> its wire enum (the client and the service share it).
v1::SpeculationMode ToWireMode(SpeculationMode mode);

// absl::Status -> grpc::Status, code for code.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_GENERATION_SERVICE_H_

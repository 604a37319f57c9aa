// The Generation service's wire mapping (proto/knapserve/v1/generation.proto
// <-> the executor's C++ types): speculation modes and finish reasons to and
// from their proto enums, a GenerateRequest decoded and validated into a
// GenerationRequest, the Chunk / FinalResult / ModelInfo messages, and
// absl::Status -> grpc::Status. The service (executor/api/generation_service.h)
// and gRPC clients in tools/ use it; nothing here touches a stream.
//
// Speculation modes map by name: SpeculationModeName(mode) "knapspec" is
// SPECULATION_MODE_KNAPSPEC on the wire, so the mode table
// (executor/engine/speculation_mode.h) stays the one place that lists modes.
//
// Stateless functions; thread safety: any thread.
#ifndef KNAPSERVE_EXECUTOR_API_GENERATION_CODEC_H_
#define KNAPSERVE_EXECUTOR_API_GENERATION_CODEC_H_

#include <grpcpp/support/status.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model/llama.h"
#include "common/text/tokenizer.h"
#include "executor/engine/generator.h"
#include "knapserve/v1/generation.pb.h"

namespace knapserve {

// SpeculationMode <-> its wire enum. FromWireMode: UNSPECIFIED means
// `unspecified` (the server's default); a value that names no mode is
// InvalidArgument naming speculation.mode.
v1::SpeculationMode ToWireMode(SpeculationMode mode);
absl::StatusOr<SpeculationMode> FromWireMode(v1::SpeculationMode wire,
                                             SpeculationMode unspecified);

// FinishReason -> its wire enum (never UNSPECIFIED).
v1::FinishReason ToWireFinishReason(FinishReason reason);

// absl::Status -> grpc::Status, code for code (the numbering is the same).
grpc::Status ToGrpcStatus(const absl::Status& status);

// What a request leaves unset takes from these.
// What one request may ask for, beyond what the model's context allows. A
// request over a limit is InvalidArgument naming the field and the limit;
// nothing of it runs. 0 = no limit of its own (the context still bounds
// prompt and new tokens). The gRPC message size limit (max_request_bytes)
// is applied by the server (executor/api/executor_server.h): a larger message
// is RESOURCE_EXHAUSTED before it is decoded.
struct RequestLimits {
  int64_t max_request_bytes = 4 << 20;  // --max-request-bytes
  int64_t max_prompt_tokens = 0;        // --max-prompt-tokens
  int64_t max_new_tokens = 0;           // --max-new-tokens-limit
  int64_t max_stop_strings = 16;        // --max-stop-strings
  int64_t max_stop_bytes = 256;         // --max-stop-bytes, each string
  int64_t max_stop_token_ids = 64;      // --max-stop-token-ids
};

struct GenerateRequestDefaults {
  int64_t max_new_tokens = 256;
  SpeculationConfig speculation;
  // Whether the executor has a planner: planned modes are FailedPrecondition
  // without one.
  bool have_planner = false;
  RequestLimits limits;
};

// The GenerationRequest a wire request describes (the prompt tokenized, the
// defaults applied), validated against the model (ValidateGenerationRequest):
// InvalidArgument naming the field, FailedPrecondition for a planned mode
// without a planner.
absl::StatusOr<GenerationRequest> DecodeGenerateRequest(
    const v1::GenerateRequest& wire, const GenerateRequestDefaults& defaults,
    const LlamaModel& model, const Tokenizer& tokenizer);

// One step's Chunk message, of choice `index`.
v1::GenerateResponse EncodeChunk(std::string_view request_id,
                                 absl::Span<const int32_t> ids,
                                 std::string_view text,
                                 const StepLogprobs& logprobs = {},
                                 int index = 0);

// Timings only the service knows (measured from the request's arrival).
struct ServiceTimings {
  double queue_seconds = 0;        // arrival to the start of its generation
  double first_token_seconds = 0;  // arrival to the first streamed token
  double total_seconds = 0;        // arrival to the final message
};

// The FinalResult message of a finished generation in `mode`.
v1::GenerateResponse EncodeFinal(std::string_view request_id,
                                 const GenerationResult& result,
                                 SpeculationMode mode,
                                 const ServiceTimings& timings);

// A FinalResult's planning statistics and applied plans back in the
// executor's types, for gRPC clients that print them the way local
// generation does (`knapserve generate --server --json`,
// executor/api/planning_json.h). PlanningStats.plan_requests,
// plan_failures and last_plan_error have no place in PlanningStats (they
// are GenerationStats' and GenerationResult's); read them from `wire`.
PlanningStats DecodePlanningStats(const v1::PlanningStats& wire);
AppliedPlan DecodeAppliedPlan(const v1::AppliedPlan& wire);

// What GetModelInfo says about the model and the service's defaults.
struct ServiceInfo {
  std::string model_path;
  SpeculationConfig default_speculation;
  v1::PlannerMode planner_mode = v1::PLANNER_MODE_NONE;
  std::string planner_address;
};
v1::ModelInfo EncodeModelInfo(const LlamaModel& model,
                              const ServiceInfo& service);

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_API_GENERATION_CODEC_H_

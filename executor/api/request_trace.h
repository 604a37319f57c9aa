// RequestTrace: the trace of one generation request (common/trace), the
// same for the gRPC service and the HTTP front door.
//
//   generate (server span; child of the client's W3C traceparent, if any)
//   |- queue    arrival -> the sequence's first pass (scheduler queue and
//   |           K/V admission)
//   |- prefill  the prompt's passes and the first token
//   `- decode   first token -> end; the plan spans of the request
//               (plan.snapshot, plan.apply) hang from it
//
// queue and prefill are reconstructed from the generation's measured times
// when it ends; decode is started when the request reaches a worker so that
// its context can parent the plan spans (GenerationRequest::trace_parent),
// and moved back to the first token at the end.
//
// generate carries the OpenTelemetry gen_ai.* attributes that apply
// (gen_ai.system = "knapserve", gen_ai.operation.name, gen_ai.request.model,
// .max_tokens, .temperature, .top_p, gen_ai.response.id,
// gen_ai.response.finish_reasons, gen_ai.usage.input_tokens,
// .output_tokens) and knapserve.* ones (front door, speculation mode,
// acceptance rate, mean accepted length, drafts, plans applied). A request
// that fails or is refused ends generate with status ERROR and the message.
//
// Off (no tracer installed, or not sampled) every method is a no-op.
// Thread safety: one thread at a time, in order: Start (the front door's
// thread), Begin (the scheduler worker), Finish (whoever ends the request);
// the scheduler's hand-off orders them.
#ifndef KNAPSERVE_EXECUTOR_API_REQUEST_TRACE_H_
#define KNAPSERVE_EXECUTOR_API_REQUEST_TRACE_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "common/trace/tracer.h"
#include "executor/engine/generator.h"

namespace knapserve {

class RequestTrace {
 public:
  RequestTrace() = default;
  RequestTrace(const RequestTrace&) = delete;
  RequestTrace& operator=(const RequestTrace&) = delete;

  // The request arrived: starts generate now. `traceparent`: the incoming
  // header ("" or malformed: a new trace). `front_door`: "grpc" or "http";
  // `operation`: gen_ai.operation.name ("text_completion", "chat");
  // `model`: gen_ai.request.model.
  void Start(std::string_view traceparent, std::string_view request_id,
             std::string_view front_door, std::string_view operation,
             std::string_view model);
  // The request reached a worker: records its parameters and starts decode,
  // whose context it puts into request.trace_parent.
  void Begin(GenerationRequest& request);
  // The request ended with `status` (and `result` when it ran to its end):
  // adds queue, prefill and decode, and ends generate. Later calls do
  // nothing.
  void Finish(const absl::Status& status, const GenerationResult* result);

  // generate's context (invalid when off).
  const trace::SpanContext& context() const { return root_.context(); }

 private:
  trace::Span root_;
  trace::Span decode_;
  int64_t start_unix_nanos_ = 0;  // when Start ran: the arrival
  int64_t begin_unix_nanos_ = 0;  // when Begin ran
  bool finished_ = false;         // Finish ran
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_API_REQUEST_TRACE_H_

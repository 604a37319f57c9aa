// What a finished span holds, and its OTLP/HTTP JSON encoding.
//
// EncodeOtlpJson writes one ExportTraceServiceRequest in the protobuf JSON
// mapping that OTLP/HTTP JSON receivers (the OpenTelemetry Collector, Tempo,
// Jaeger) accept:
//
//   {"resourceSpans": [{
//     "resource": {"attributes": [{"key": "service.name",
//                                  "value": {"stringValue": "knapserve"}}]},
//     "scopeSpans": [{"scope": {"name": "knapserve"}, "spans": [{
//       "traceId": "<32 hex>", "spanId": "<16 hex>", "parentSpanId": "...",
//       "name": "generate", "kind": 2,
//       "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "...",
//       "attributes": [{"key": "gen_ai.usage.output_tokens",
//                       "value": {"intValue": "64"}}],
//       "status": {"code": 2, "message": "..."}}]}]}]}
//
// Ids are lower-case hex (OTLP's JSON exception to base64), 64-bit integers
// are decimal strings, enums are integers, non-finite doubles are "NaN",
// "Infinity" and "-Infinity". A root span has no parentSpanId.
//
// Plain values and a pure function; thread-safe.
#ifndef KNAPSERVE_COMMON_TRACE_SPAN_DATA_H_
#define KNAPSERVE_COMMON_TRACE_SPAN_DATA_H_

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "common/trace/span_context.h"

namespace knapserve::trace {

// An attribute's value: OTLP's string, int, double, bool and (for
// semantic-convention lists such as gen_ai.response.finish_reasons) an
// array of strings.
using AttributeValue =
    std::variant<std::string, int64_t, double, bool, std::vector<std::string>>;
using Attribute = std::pair<std::string, AttributeValue>;

// OTLP's SpanKind numbers.
enum class SpanKind : int {
  kInternal = 1,
  kServer = 2,
  kClient = 3,
};

// OTLP's StatusCode numbers.
enum class StatusCode : int { kUnset = 0, kOk = 1, kError = 2 };

struct SpanData {
  SpanContext context;
  SpanId parent_span_id{};  // all zero for a root
  std::string name;
  SpanKind kind = SpanKind::kInternal;
  int64_t start_unix_nanos = 0;
  int64_t end_unix_nanos = 0;
  std::vector<Attribute> attributes;
  StatusCode status = StatusCode::kUnset;
  std::string status_message;
};

// One ExportTraceServiceRequest holding `spans` under one resource (its
// attributes, service.name among them) and the instrumentation scope
// `scope_name`.
std::string EncodeOtlpJson(const std::vector<Attribute>& resource,
                           const std::string& scope_name,
                           const std::vector<SpanData>& spans);

}  // namespace knapserve::trace

#endif  // KNAPSERVE_COMMON_TRACE_SPAN_DATA_H_

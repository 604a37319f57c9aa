// Fuzz target: what tracing takes from clients and peers
// (common/trace/span_context.h, span_data.h): the W3C traceparent of a
// Generate call (gRPC metadata, the HTTP header) or a plan request, and
// client bytes on a span (a request id) in the OTLP JSON. The first byte
// picks: even, the rest is a traceparent; an accepted one is valid, formats
// to 55 characters that parse back to the same context, and (version 00)
// equals the input without surrounding spaces and tabs, but for the flags'
// other bits. Odd, the rest split at its first NUL is a span name and a
// string attribute; their OTLP JSON parses as JSON.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "common/trace/span_context.h"
#include "common/trace/span_data.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace knapserve::fuzz;
  using namespace knapserve::trace;
  if (size == 0) return 0;
  const std::string_view text = AsText(data + 1, size - 1);
  if (data[0] % 2 == 0) {
    const std::optional<SpanContext> context = ParseTraceparent(text);
    if (!context.has_value()) return 0;
    FUZZ_CHECK(context->valid());
    const std::string header = FormatTraceparent(*context);
    FUZZ_CHECK_MSG(header.size() == 55, header);
    FUZZ_CHECK_MSG(ParseTraceparent(header) == context, header);
    std::string_view trimmed = text;
    while (!trimmed.empty() &&
           (trimmed.front() == ' ' || trimmed.front() == '\t'))
      trimmed.remove_prefix(1);
    while (!trimmed.empty() &&
           (trimmed.back() == ' ' || trimmed.back() == '\t'))
      trimmed.remove_suffix(1);
    if (trimmed.substr(0, 2) == "00") {
      FUZZ_CHECK_MSG(trimmed.substr(0, 53) == header.substr(0, 53), header);
    }
    return 0;
  }
  const size_t nul = text.find('\0');
  SpanData span;
  span.context = {RandomTraceId(), RandomSpanId(), true};
  span.name = std::string(text.substr(0, nul));
  span.attributes.emplace_back(
      "knapserve.request_id",
      std::string(nul == std::string_view::npos ? "" : text.substr(nul + 1)));
  span.status = StatusCode::kError;
  span.status_message = span.name;
  const std::string json = EncodeOtlpJson({}, "knapserve", {span});
  const nlohmann::json parsed = nlohmann::json::parse(json, nullptr, false);
  FUZZ_CHECK_MSG(!parsed.is_discarded(), json);
  FUZZ_CHECK(parsed["resourceSpans"][0]["scopeSpans"][0]["spans"].size() == 1);
  return 0;
}

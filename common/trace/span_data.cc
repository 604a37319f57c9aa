#include "common/trace/span_data.h"

#include <cmath>
#include <nlohmann/json.hpp>

namespace knapserve::trace {
namespace {

nlohmann::json DoubleValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  return v;
}

nlohmann::json Value(const AttributeValue& value) {
  struct Visitor {
    nlohmann::json operator()(const std::string& s) const {
      return {{"stringValue", s}};
    }
    nlohmann::json operator()(int64_t i) const {
      return {{"intValue", std::to_string(i)}};
    }
    nlohmann::json operator()(double d) const {
      return {{"doubleValue", DoubleValue(d)}};
    }
    nlohmann::json operator()(bool b) const { return {{"boolValue", b}}; }
    nlohmann::json operator()(const std::vector<std::string>& list) const {
      nlohmann::json values = nlohmann::json::array();
      for (const std::string& s : list) values.push_back({{"stringValue", s}});
      return {{"arrayValue", {{"values", std::move(values)}}}};
    }
  };
  return std::visit(Visitor(), value);
}

nlohmann::json Attributes(const std::vector<Attribute>& attributes) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [key, value] : attributes) {
    out.push_back({{"key", key}, {"value", Value(value)}});
  }
  return out;
}

}  // namespace

std::string EncodeOtlpJson(const std::vector<Attribute>& resource,
                           const std::string& scope_name,
                           const std::vector<SpanData>& spans) {
  nlohmann::json encoded = nlohmann::json::array();
  for (const SpanData& span : spans) {
    nlohmann::json s = {
        {"traceId", ToHex(span.context.trace_id)},
        {"spanId", ToHex(span.context.span_id)},
        {"name", span.name},
        {"kind", static_cast<int>(span.kind)},
        {"startTimeUnixNano", std::to_string(span.start_unix_nanos)},
        {"endTimeUnixNano", std::to_string(span.end_unix_nanos)},
        {"attributes", Attributes(span.attributes)},
    };
    if (IsValid(span.parent_span_id)) {
      s["parentSpanId"] = ToHex(span.parent_span_id);
    }
    if (span.status != StatusCode::kUnset) {
      s["status"] = {{"code", static_cast<int>(span.status)}};
      if (!span.status_message.empty())
        s["status"]["message"] = span.status_message;
    }
    encoded.push_back(std::move(s));
  }
  const nlohmann::json request = {
      {"resourceSpans",
       {{{"resource", {{"attributes", Attributes(resource)}}},
         {"scopeSpans",
          {{{"scope", {{"name", scope_name}}},
            {"spans", std::move(encoded)}}}}}}}};
  // Invalid UTF-8 in a name or a value (a client's request id) is replaced
  // rather than thrown: the exporter thread must not throw.
  return request.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace knapserve::trace

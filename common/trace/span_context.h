// Identities of spans and their W3C Trace Context form.
//
// A trace is 16 random bytes, a span 8; a SpanContext names one span of one
// trace and says whether the trace is sampled (recorded and exported). It
// crosses process boundaries as the W3C `traceparent` header
// (https://www.w3.org/TR/trace-context/):
//
//   00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01
//   version trace id (32 hex)          span id (16 hex) flags (01: sampled)
//
// FormatTraceparent writes version 00; ParseTraceparent reads version 00 and
// the future versions the specification allows (their first four fields),
// and returns nullopt for anything malformed (wrong length, upper-case or
// non-hex digits, version ff, an all-zero trace or span id), which callers
// then ignore: a bad header from a client starts a new trace rather than
// failing the request.
//
// Plain values, no state; thread-safe. The random ids come from a generator
// per thread.
#ifndef KNAPSERVE_COMMON_TRACE_SPAN_CONTEXT_H_
#define KNAPSERVE_COMMON_TRACE_SPAN_CONTEXT_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace knapserve::trace {

using TraceId = std::array<uint8_t, 16>;
using SpanId = std::array<uint8_t, 8>;

// All-zero ids are invalid (W3C).
bool IsValid(const TraceId& id);
bool IsValid(const SpanId& id);

// Lower-case hex: 32 characters for a trace id, 16 for a span id.
std::string ToHex(const TraceId& id);
std::string ToHex(const SpanId& id);

// Random non-zero ids (a generator per thread, seeded from std::random_device).
TraceId RandomTraceId();
SpanId RandomSpanId();

struct SpanContext {
  TraceId trace_id{};
  SpanId span_id{};
  bool sampled = false;
  // Both ids non-zero. A default SpanContext is invalid: "no parent".
  bool valid() const { return IsValid(trace_id) && IsValid(span_id); }
  bool operator==(const SpanContext& other) const = default;
};

// The W3C traceparent of `context` ("" when it is invalid).
std::string FormatTraceparent(const SpanContext& context);
// The context a traceparent header names; nullopt when malformed (see the
// file comment). Leading and trailing spaces and tabs are allowed.
std::optional<SpanContext> ParseTraceparent(std::string_view header);

}  // namespace knapserve::trace

#endif  // KNAPSERVE_COMMON_TRACE_SPAN_CONTEXT_H_

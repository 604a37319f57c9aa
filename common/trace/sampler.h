// Sampler: whether a new span is recorded and exported, as OpenTelemetry's
// OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG configure it:
//
//   always_on                   every span
//   always_off                  none
//   traceidratio                a share `arg` (0..1) of traces, decided by the
//                               trace id alone, so every process that sees a
//                               trace decides the same way
//   parentbased_always_on       a span with a parent follows the parent's
//   parentbased_always_off      sampled flag; a root follows the named sampler
//   parentbased_traceidratio
//
// The default is parentbased_always_on (OpenTelemetry's). traceidratio
// samples a trace when its last 8 bytes, read as a big-endian integer, are
// below arg * 2^64.
//
// A plain value; ShouldSample is const and thread-safe.
#ifndef KNAPSERVE_COMMON_TRACE_SAMPLER_H_
#define KNAPSERVE_COMMON_TRACE_SAMPLER_H_

#include <string>

#include "absl/status/statusor.h"
#include "common/trace/span_context.h"

namespace knapserve::trace {

class Sampler {
 public:
  enum class Root { kAlwaysOn, kAlwaysOff, kRatio };

  // parentbased_always_on.
  Sampler() = default;
  // The sampler OTEL_TRACES_SAMPLER names ("" is the default), with
  // OTEL_TRACES_SAMPLER_ARG (the ratio of the traceidratio samplers, 1 when
  // empty). InvalidArgument for an unknown name or a ratio that is not a
  // number in [0, 1].
  static absl::StatusOr<Sampler> Parse(const std::string& name,
                                       const std::string& arg);

  // Whether a span of trace `trace_id` is sampled, given its parent
  // (invalid for a root).
  bool ShouldSample(const SpanContext& parent, const TraceId& trace_id) const;

  // "parentbased_traceidratio" and the like; the ratio for kRatio.
  std::string Describe() const;

 private:
  bool parent_based_ = true;
  Root root_ = Root::kAlwaysOn;
  double ratio_ = 1.0;
};

}  // namespace knapserve::trace

#endif  // KNAPSERVE_COMMON_TRACE_SAMPLER_H_

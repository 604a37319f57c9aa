#include "common/trace/sampler.h"

#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace knapserve::trace {

absl::StatusOr<Sampler> Sampler::Parse(const std::string& name,
                                       const std::string& arg) {
  Sampler sampler;
  const std::string n = absl::AsciiStrToLower(absl::StripAsciiWhitespace(name));
  if (n.empty() || n == "parentbased_always_on") {
    sampler.parent_based_ = true;
    sampler.root_ = Root::kAlwaysOn;
  } else if (n == "always_on") {
    sampler.parent_based_ = false;
    sampler.root_ = Root::kAlwaysOn;
  } else if (n == "always_off") {
    sampler.parent_based_ = false;
    sampler.root_ = Root::kAlwaysOff;
  } else if (n == "parentbased_always_off") {
    sampler.parent_based_ = true;
    sampler.root_ = Root::kAlwaysOff;
  } else if (n == "traceidratio" || n == "parentbased_traceidratio") {
    sampler.parent_based_ = n != "traceidratio";
    sampler.root_ = Root::kRatio;
    const std::string a(absl::StripAsciiWhitespace(arg));
    if (!a.empty()) {
      double ratio = 0;
      if (!absl::SimpleAtod(a, &ratio) || !(ratio >= 0 && ratio <= 1)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "OTEL_TRACES_SAMPLER_ARG: '", arg, "' is not a ratio in [0, 1]"));
      }
      sampler.ratio_ = ratio;
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("OTEL_TRACES_SAMPLER: unknown sampler '", name,
                     "' (supported: always_on, always_off, traceidratio, "
                     "parentbased_always_on, parentbased_always_off, "
                     "parentbased_traceidratio)"));
  }
  return sampler;
}

bool Sampler::ShouldSample(const SpanContext& parent,
                           const TraceId& trace_id) const {
  if (parent_based_ && parent.valid()) return parent.sampled;
  switch (root_) {
    case Root::kAlwaysOn:
      return true;
    case Root::kAlwaysOff:
      return false;
    case Root::kRatio: {
      if (ratio_ >= 1) return true;
      if (ratio_ <= 0) return false;
      uint64_t low = 0;
      for (size_t i = 8; i < 16; ++i) low = low << 8 | trace_id[i];
      // ratio * 2^64 as a long double keeps the comparison exact enough.
      const long double bound =
          std::ldexp(static_cast<long double>(ratio_), 64);
      return static_cast<long double>(low) < bound;
    }
  }
  return true;
}

std::string Sampler::Describe() const {
  std::string root;
  switch (root_) {
    case Root::kAlwaysOn:
      root = "always_on";
      break;
    case Root::kAlwaysOff:
      root = "always_off";
      break;
    case Root::kRatio:
      root = absl::StrCat("traceidratio ", ratio_);
      break;
  }
  return parent_based_ ? "parentbased_" + root : root;
}

}  // namespace knapserve::trace

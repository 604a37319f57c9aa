#include "common/plan/planner_client.h"

#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace knapserve {
namespace {

// The payload that marks ProfilePendingError (its value is unused).
constexpr char kProfilePendingPayload[] =
    "type.knapserve.dev/knapserve.v1.ProfilePending";

}  // namespace

absl::Status ProfilePendingError(std::string_view message) {
  absl::Status status = absl::UnavailableError(std::string(message));
  status.SetPayload(kProfilePendingPayload, absl::Cord("1"));
  return status;
}

bool IsProfilePending(const absl::Status& status) {
  return absl::IsUnavailable(status) &&
         status.GetPayload(kProfilePendingPayload).has_value();
}

std::vector<LayerKv> ResolvedKv(const PlanRequest& request) {
  if (!request.kv.empty() || request.kv_snapshot == nullptr) return request.kv;
  return request.kv_snapshot->Contiguous();
}

std::string PlanPolicyName(PlanPolicy policy) {
  switch (policy) {
    case PlanPolicy::kStatic:
      return "static";
    case PlanPolicy::kKnapSpec:
      return "knapspec";
    case PlanPolicy::kClasp:
      return "clasp";
    case PlanPolicy::kOff:
      return "off";
  }
  return "unknown";
}

absl::StatusOr<PlanPolicy> ParsePlanPolicy(const std::string& name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "static") return PlanPolicy::kStatic;
  if (n == "knapspec") return PlanPolicy::kKnapSpec;
  if (n == "clasp") return PlanPolicy::kClasp;
  if (n == "off") return PlanPolicy::kOff;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown plan policy '", name,
                   "' (supported: static, knapspec, clasp, off)"));
}

}  // namespace knapserve

#include "executor/engine/speculation_mode.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace knapserve {
namespace {

// The one table of speculation modes (see the header before adding a row),
// in listing order: off first (every comparison's baseline), then the
// cheaper modes.
const std::vector<SpeculationModeInfo>& Table() {
  static const std::vector<SpeculationModeInfo> kModes = {
      //  mode  name  drafts planned routed early_exit policy max_draft
      {SpeculationMode::kOff, "off", false, false, false, false,
       PlanPolicy::kOff, 5},
      {SpeculationMode::kStatic, "static", true, false, false, false,
       PlanPolicy::kStatic, 5},
      {SpeculationMode::kClasp, "clasp", true, true, false, false,
       PlanPolicy::kClasp, 10},
      {SpeculationMode::kKnapSpec, "knapspec", true, true, false, false,
       PlanPolicy::kKnapSpec, 10},
      // A routed request drafts with its domain's (mask, gamma); max_draft
      // only caps that gamma, so the default leaves the anchors' choice.
      {SpeculationMode::kKnn, "knn", true, false, true, false,
       PlanPolicy::kStatic, 10},
      // The width bound (executor/README.md, SpecBound, says how it was
      // chosen).
      {SpeculationMode::kSpecBound, "specbound", true, false, false, true,
       PlanPolicy::kOff, 6},
  };
  return kModes;
}

}  // namespace

const std::vector<SpeculationModeInfo>& AllSpeculationModes() {
  return Table();
}

const SpeculationModeInfo& ModeInfo(SpeculationMode mode) {
  for (const SpeculationModeInfo& info : Table()) {
    if (info.mode == mode) return info;
  }
  // Only a value outside the enum gets here (a cast from a bad integer).
  std::abort();
}

std::string SpeculationModeName(SpeculationMode mode) {
  return ModeInfo(mode).name;
}

absl::StatusOr<SpeculationMode> ParseSpeculationMode(const std::string& name) {
  std::vector<std::string> names;
  for (const SpeculationModeInfo& info : Table()) {
    if (name == info.name) return info.mode;
    names.push_back(info.name);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("spec: unknown speculation mode '", name,
                   "' (supported: ", absl::StrJoin(names, ", "), ")"));
}

bool Drafts(SpeculationMode mode) { return ModeInfo(mode).drafts; }
bool IsPlanned(SpeculationMode mode) { return ModeInfo(mode).planned; }
bool DraftsWithFixedMask(SpeculationMode mode) {
  const SpeculationModeInfo& info = ModeInfo(mode);
  return info.drafts && !info.planned && !info.routed && !info.early_exit;
}
bool DraftsByEarlyExit(SpeculationMode mode) {
  return ModeInfo(mode).early_exit;
}
bool IsRouted(SpeculationMode mode) { return ModeInfo(mode).routed; }
PlanPolicy PlannedPolicy(SpeculationMode mode) { return ModeInfo(mode).policy; }
int DefaultMaxDraft(SpeculationMode mode) {
  return ModeInfo(mode).default_max_draft;
}

}  // namespace knapserve

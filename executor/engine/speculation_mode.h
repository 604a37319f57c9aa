// SpeculationMode: how a generation drafts, and the one table (kModes in
// speculation_mode.cc) that says what each mode is. Everything that depends on
// the mode (generator.cc, the wire codec, the command-line flags, the
// benchmarks) asks these functions instead of testing for particular modes.
//
// Adding a mode: its enumerator below, its row in kModes, and a value named
// SPECULATION_MODE_<NAME> (the row's name, upper-cased) in
// proto/knapserve/v1/generation.proto; the wire codec maps by that name, and
// its test fails when a mode has no wire value. What the mode does when it
// decodes follows from its row (drafts, planned, policy); a mode that needs
// new behaviour also needs that behaviour, of course.
//
// Thread safety: the table is constant; every function from any thread.
#ifndef KNAPSERVE_EXECUTOR_ENGINE_SPECULATION_MODE_H_
#define KNAPSERVE_EXECUTOR_ENGINE_SPECULATION_MODE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/plan/planner_client.h"

namespace knapserve {

enum class SpeculationMode {
  kOff,
  kStatic,
  kKnapSpec,
  kClasp,
  kKnn,
  kSpecBound
};

struct SpeculationModeInfo {
  SpeculationMode mode;
  // Flag, JSON and log spelling; the wire enum is SPECULATION_MODE_ + upper
  // case.
  const char* name;
  // Drafts at all: false means plain autoregressive decoding (no mask, gamma
  // 0).
  bool drafts;
  // Mask and gamma come from a planner (needs a PlannerClient); the request's
  // `skip` mask only serves until the first plan. Unplanned drafting modes
  // draft with `skip` and max_draft throughout.
  bool planned;
  // Mask and gamma come from the process's domain anchors (KNN-SSD,
  // executor/planning/domain_router.h): the request is routed once, after its
  // prefill, and keeps its domain's draft to the end. Needs
  // PlanningShared::router.
  bool routed;
  // Drafts by early exit (SpecBound, executor/engine/specbound.h): no layer
  // mask; each draft token runs layers upward until an exit head is confident.
  bool early_exit;
  // The planner policy of the same meaning. For planned modes it is the one
  // that solves their plans (and keys the plan cache).
  PlanPolicy policy;
  // max_draft when neither the request nor a flag sets it: the draft length
  // of an unplanned mode, the planner's largest gamma for a planned one.
  int default_max_draft;
};

// Every mode, in listing order (off first; `bench spec` runs them in it).
const std::vector<SpeculationModeInfo>& AllSpeculationModes();
const SpeculationModeInfo& ModeInfo(SpeculationMode mode);

// "off" / "static" / "clasp" / "knapspec" / "knn" / "specbound".
std::string SpeculationModeName(SpeculationMode mode);
// The mode named `name`; InvalidArgument listing the names otherwise.
absl::StatusOr<SpeculationMode> ParseSpeculationMode(const std::string& name);

bool Drafts(SpeculationMode mode);
bool IsPlanned(SpeculationMode mode);
// Drafts with the request's fixed `skip` mask for the whole generation.
bool DraftsWithFixedMask(SpeculationMode mode);
// Drafts with the mask and gamma of the domain its prompt routes to.
bool IsRouted(SpeculationMode mode);
// Drafts by early exit (see SpeculationModeInfo::early_exit).
bool DraftsByEarlyExit(SpeculationMode mode);
// See SpeculationModeInfo::policy.
PlanPolicy PlannedPolicy(SpeculationMode mode);
int DefaultMaxDraft(SpeculationMode mode);

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_ENGINE_SPECULATION_MODE_H_

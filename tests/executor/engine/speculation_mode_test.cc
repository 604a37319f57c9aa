// Tests of the speculation mode table (executor/engine/speculation_mode.h):
// every mode is listed once, off first, with the properties the generator, the
// flags and the benchmarks route on; names round-trip.
#include "executor/engine/speculation_mode.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace knapserve {
namespace {

TEST(SpeculationModeTest, TheTableListsEveryModeOnceOffFirst) {
  const std::vector<SpeculationModeInfo>& modes = AllSpeculationModes();
  EXPECT_EQ(modes[0].mode, SpeculationMode::kOff);
  std::set<SpeculationMode> seen;
  std::set<std::string> names;
  for (const SpeculationModeInfo& info : modes) {
    EXPECT_TRUE(seen.insert(info.mode).second) << info.name;
    EXPECT_TRUE(names.insert(info.name).second) << info.name;
    EXPECT_EQ(&ModeInfo(info.mode), &info);
    EXPECT_GE(info.default_max_draft, 1) << info.name;
    EXPECT_TRUE(!info.planned || info.drafts)
        << info.name << ": planned modes draft";
    EXPECT_TRUE(!info.routed || (info.drafts && !info.planned))
        << info.name << ": routed modes draft, unplanned";
  }
  for (SpeculationMode mode :
       {SpeculationMode::kOff, SpeculationMode::kStatic,
        SpeculationMode::kKnapSpec, SpeculationMode::kClasp,
        SpeculationMode::kKnn, SpeculationMode::kSpecBound}) {
    EXPECT_TRUE(seen.count(mode)) << SpeculationModeName(mode);
  }
}

TEST(SpeculationModeTest, PropertiesOfEachMode) {
  EXPECT_FALSE(Drafts(SpeculationMode::kOff));
  EXPECT_FALSE(IsPlanned(SpeculationMode::kOff));
  EXPECT_TRUE(DraftsWithFixedMask(SpeculationMode::kStatic));
  EXPECT_FALSE(IsPlanned(SpeculationMode::kStatic));
  for (SpeculationMode planned :
       {SpeculationMode::kKnapSpec, SpeculationMode::kClasp}) {
    EXPECT_TRUE(Drafts(planned));
    EXPECT_TRUE(IsPlanned(planned));
    EXPECT_FALSE(DraftsWithFixedMask(planned));
    EXPECT_EQ(DefaultMaxDraft(planned), 10);
  }
  EXPECT_EQ(DefaultMaxDraft(SpeculationMode::kStatic), 5);
  // knn drafts with its routed domain's mask, not the request's.
  EXPECT_TRUE(Drafts(SpeculationMode::kKnn));
  EXPECT_TRUE(IsRouted(SpeculationMode::kKnn));
  EXPECT_FALSE(IsPlanned(SpeculationMode::kKnn));
  EXPECT_FALSE(DraftsWithFixedMask(SpeculationMode::kKnn));
  EXPECT_FALSE(IsRouted(SpeculationMode::kStatic));
  EXPECT_EQ(DefaultMaxDraft(SpeculationMode::kKnn), 10);
  EXPECT_EQ(PlannedPolicy(SpeculationMode::kKnapSpec), PlanPolicy::kKnapSpec);
  EXPECT_EQ(PlannedPolicy(SpeculationMode::kClasp), PlanPolicy::kClasp);
  // SpecBound drafts by early exit: no mask, no planner.
  EXPECT_TRUE(Drafts(SpeculationMode::kSpecBound));
  EXPECT_TRUE(DraftsByEarlyExit(SpeculationMode::kSpecBound));
  EXPECT_FALSE(IsPlanned(SpeculationMode::kSpecBound));
  EXPECT_FALSE(DraftsWithFixedMask(SpeculationMode::kSpecBound));
  for (SpeculationMode other :
       {SpeculationMode::kOff, SpeculationMode::kStatic,
        SpeculationMode::kKnapSpec, SpeculationMode::kClasp}) {
    EXPECT_FALSE(DraftsByEarlyExit(other));
  }
}

TEST(SpeculationModeTest, NamesRoundTripAndUnknownNamesAreRefused) {
  for (const SpeculationModeInfo& info : AllSpeculationModes()) {
    absl::StatusOr<SpeculationMode> parsed = ParseSpeculationMode(info.name);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, info.mode);
    EXPECT_EQ(SpeculationModeName(info.mode), info.name);
  }
  absl::StatusOr<SpeculationMode> bad = ParseSpeculationMode("eagle");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'eagle'"), std::string::npos)
      << bad.status();
  EXPECT_NE(bad.status().message().find(
                "off, static, clasp, knapspec, knn, specbound"),
            std::string::npos)
      << bad.status();
}

}  // namespace
}  // namespace knapserve

// knapserve-planner: the Planner service as its own process.
//   knapserve-planner --model DIR --listen 0.0.0.0:50052 [--profile FILE]
// Without --profile the latency profile comes from the profile cache
// (planner/profile_cache.h); on a miss the planner serves at once, answers
// "profile pending" while it measures the profile in the background, and
// stores it.
#include "absl/flags/usage.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "knapserve-planner --model DIR --listen ADDR [--profile FILE | "
      "--profile-cache DIR] "
      "[--dtype] [--threads] [--planner-threads]");
  knapserve::ParseFlagsWithDashes(argc, argv);
  return knapserve::RunPlannerServer();
}

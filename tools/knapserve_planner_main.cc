// knapserve-planner: the Planner service as its own process.
//   knapserve-planner --model DIR --listen 0.0.0.0:50052 --profile FILE
#include "absl/flags/usage.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "knapserve-planner --model DIR --listen ADDR --profile FILE [--dtype] [--threads] "
      "[--planner-threads]");
  knapserve::ParseFlagsWithDashes(argc, argv);
  return knapserve::RunPlannerServer();
}

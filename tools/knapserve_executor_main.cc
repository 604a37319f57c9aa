// knapserve-executor: the Generation service as its own process.
//   knapserve-executor --model DIR --listen 0.0.0.0:50051 --planner
//   ADDR|inproc|none
#include "absl/flags/usage.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "knapserve-executor --model DIR --listen ADDR --planner ADDR|inproc|none "
      "[--profile FILE] "
      "[--max-running N] [--max-queue N] [--kv-cache-memory BYTES|FRACTION] "
      "[--kv-block-size N] [--max-batch-tokens N] [--plain-batch-size N] "
      "[--drain-seconds S] [--dtype] "
      "[--threads]");
  knapserve::ParseFlagsWithDashes(argc, argv);
  return knapserve::RunExecutorServer();
}

// `knapserve-executor` / `knapserve executor` / `knapserve serve`: the
// Generation gRPC service for one model until SIGTERM or SIGINT, then a drain.
//   knapserve-executor --model DIR --listen ADDR --planner ADDR|inproc|none
//   knapserve serve --model DIR --listen ADDR          (in-process planner)
// The set-up itself is tools/executor_from_flags.h.
#include <iostream>

#include "absl/flags/flag.h"
#include "common/base/status.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/executor_from_flags.h"

ABSL_FLAG(
    double, drain_seconds, 30,
    "executor: on SIGTERM, how long running requests may take to finish.");

namespace knapserve {
namespace {

absl::Status ServeExecutor(bool one_process) {
  const std::string command = one_process ? "serve" : "executor";
  ASSIGN_OR_RETURN(const std::string listen,
                   ListenAddressAndBlockStopSignals());
  ASSIGN_OR_RETURN(Engine engine, LoadEngineFromFlags());
  const std::string where =
      one_process ? "inproc" : absl::GetFlag(FLAGS_planner);
  ASSIGN_OR_RETURN(
      std::unique_ptr<RunningExecutor> running,
      StartExecutorFromFlags(engine, where, listen, command,
                             one_process ? "knapserve" : "knapserve-executor"));
  std::cerr << "knapserve-executor: serving " << engine.model_dir
            << " (planner " << where << ") on port " << running->server->port()
            << std::endl;
  const int received = WaitForStopSignal();
  std::cerr << "knapserve-executor: signal " << received << ", draining"
            << std::endl;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(
      1000 * std::max(0.0, absl::GetFlag(FLAGS_drain_seconds))));
  if (!running->server->Drain(timeout)) {
    std::cerr
        << "knapserve-executor: drain timed out; cancelling what still runs"
        << std::endl;
  }
  return absl::OkStatus();
}

}  // namespace

int RunExecutorServer() { return ExitCode(ServeExecutor(false), "executor"); }
int RunServe() { return ExitCode(ServeExecutor(true), "serve"); }

}  // namespace knapserve

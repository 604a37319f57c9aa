// `knapserve-planner` (and `knapserve planner`): the Planner gRPC service for
// one model, until SIGTERM or SIGINT.
#include <csignal>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "planner/planner_server.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"

namespace knapserve {
namespace {

absl::Status ServePlanner() {
  const std::string listen = absl::GetFlag(FLAGS_listen);
  if (listen.empty()) return absl::InvalidArgumentError("--listen ADDR is required");
  // Block the stop signals before any thread starts, so sigwait below gets them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  ASSIGN_OR_RETURN(Engine engine, LoadEngineFromFlags());
  ASSIGN_OR_RETURN(std::unique_ptr<InProcessPlanner> planner,
                   PlannerFromFlags(engine, SpeculationMode::kKnapSpec));
  ASSIGN_OR_RETURN(std::unique_ptr<PlannerServer> server,
                   PlannerServer::Start(planner.get(), engine.model->num_layers(), listen));
  std::cerr << "knapserve-planner: serving " << engine.model_dir << " ("
            << engine.model->config().Fingerprint() << ") on port " << server->port()
            << std::endl;
  int received = 0;
  sigwait(&signals, &received);
  std::cerr << "knapserve-planner: signal " << received << ", shutting down" << std::endl;
  server->Shutdown();
  return absl::OkStatus();
}

}  // namespace

int RunPlannerServer() { return ExitCode(ServePlanner(), "planner"); }

}  // namespace knapserve

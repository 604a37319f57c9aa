// `knapserve-planner` (and `knapserve planner`): the Planner gRPC service for
// one model, until SIGTERM or SIGINT.
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/trace/otlp_http_exporter.h"
#include "planner/planner_server.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/executor_from_flags.h"
#include "tools/tls_from_flags.h"

namespace knapserve {
namespace {

absl::Status ServePlanner() {
  ASSIGN_OR_RETURN(const std::string listen,
                   ListenAddressAndBlockStopSignals());

  ASSIGN_OR_RETURN(Engine engine, LoadEngineFromFlags());
  // The profile: --profile or a cache hit; on a miss the planner serves at
  // once, answering "profile pending" until the background measurement
  // (started below, once the server is up) lands.
  ASSIGN_OR_RETURN(PlannerHandle handle,
                   ServerPlannerFromFlags(engine, "planner"));
  std::unique_ptr<InProcessPlanner> planner = std::move(handle.local);
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   PlannerServerCredentialsFromFlags());
  // Its own /metrics (--metrics-port): solves, queue, failures, bytes.
  MetricsRegistry metrics;
  std::unique_ptr<MetricsHttpServer> metrics_server;
  if (const int port = absl::GetFlag(FLAGS_metrics_port); port > 0) {
    metrics_server = MetricsHttpServer::Start(&metrics, "0.0.0.0", port);
    if (metrics_server == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("--metrics-port: cannot listen on ", port));
    }
  }
  // Traces (OTEL_EXPORTER_OTLP_ENDPOINT): flushed after the server stops,
  // before the registry goes.
  ASSIGN_OR_RETURN(trace::Tracer * tracer,
                   trace::InstallTracerFromEnv("knapserve-planner", &metrics));
  const trace::TracerShutdown flush_traces(tracer);
  ASSIGN_OR_RETURN(std::unique_ptr<PlannerServer> server,
                   PlannerServer::Start(
                       planner.get(), engine.model->num_layers(), listen,
                       absl::GetFlag(FLAGS_max_plan_request_bytes), credentials,
                       absl::GetFlag(FLAGS_health_listen), &metrics));
  if (server->health_port() != 0) {
    std::cerr << "knapserve-planner: grpc.health.v1 (plaintext) at port "
              << server->health_port() << std::endl;
  }
  std::cerr << "knapserve-planner: serving " << engine.model_dir << " ("
            << engine.model->config().Fingerprint() << ") on port "
            << server->port() << std::endl;
  std::unique_ptr<BackgroundProfile> background;
  if (planner->ProfilePending()) {
    ASSIGN_OR_RETURN(background,
                     MeasureProfileInBackground(engine, planner.get(), nullptr,
                                                "planner", nullptr));
  }
  const int received = WaitForStopSignal();
  std::cerr << "knapserve-planner: signal " << received << ", shutting down"
            << std::endl;
  background.reset();  // stops a measurement still running
  server->Shutdown();
  return absl::OkStatus();
}

}  // namespace

int RunPlannerServer() { return ExitCode(ServePlanner(), "planner"); }

}  // namespace knapserve

#include "planner/planner_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <climits>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace knapserve {

absl::StatusOr<std::unique_ptr<PlannerServer>> PlannerServer::Start(
    InProcessPlanner* planner, int num_layers, const std::string& listen,
    int64_t max_request_bytes,
    std::shared_ptr<grpc::ServerCredentials> credentials,
    const std::string& health_listen, MetricsRegistry* metrics) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  std::unique_ptr<PlannerServer> server(new PlannerServer());
  server->service_ = std::make_unique<PlannerService>(
      planner, num_layers, /*default_max_draft=*/10, metrics);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(
      listen,
      credentials != nullptr ? credentials : grpc::InsecureServerCredentials(),
      &server->port_);
  builder.RegisterService(server->service_.get());
  builder.SetMaxReceiveMessageSize(
      static_cast<int>(std::clamp<int64_t>(max_request_bytes, 1, INT32_MAX)));
  builder.SetMaxSendMessageSize(512 << 20);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("planner: cannot listen on ", listen));
  }
  if (!health_listen.empty()) {
    ASSIGN_OR_RETURN(server->health_, HealthPort::Start(health_listen));
    server->health_->SetServingStatus(v1::Planner::service_full_name(), true);
  }
  server->server_->GetHealthCheckService()->SetServingStatus(
      v1::Planner::service_full_name(), true);
  return server;
}

void PlannerServer::Shutdown(std::chrono::milliseconds grace) {
  if (shut_down_) return;
  shut_down_ = true;
  server_->GetHealthCheckService()->SetServingStatus(
      v1::Planner::service_full_name(), false);
  if (health_ != nullptr) health_->Shutdown();
  server_->Shutdown(std::chrono::system_clock::now() + grace);
}

PlannerServer::~PlannerServer() { Shutdown(std::chrono::milliseconds(0)); }

}  // namespace knapserve

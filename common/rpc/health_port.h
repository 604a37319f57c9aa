// HealthPort: a plaintext gRPC server on its own port that serves only
// grpc.health.v1, for servers whose main port speaks TLS. Kubernetes' gRPC
// probes (and most load balancers' health checks) cannot speak TLS; this
// port lets them check liveness ("") and readiness (a service name) while
// every request still goes over TLS. It carries no other service.
//
// The owner mirrors its main server's statuses with SetServingStatus; the
// overall status "" is SERVING from Start until Shutdown.
//
// Ownership: owns its grpc::Server. Thread safety: call SetServingStatus
// and Shutdown from the owner's thread (gRPC serves checks on its own
// threads); nothing after Shutdown.
#ifndef KNAPSERVE_COMMON_RPC_HEALTH_PORT_H_
#define KNAPSERVE_COMMON_RPC_HEALTH_PORT_H_

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace knapserve {

class HealthPort {
 public:
  // Listens on `listen` ("0.0.0.0:8081"; port 0 picks one: port()).
  // Unavailable if the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<HealthPort>> Start(
      const std::string& listen) {
    grpc::EnableDefaultHealthCheckService(true);
    std::unique_ptr<HealthPort> health(new HealthPort());
    grpc::ServerBuilder builder;
    builder.AddListeningPort(listen, grpc::InsecureServerCredentials(),
                             &health->port_);
    health->server_ = builder.BuildAndStart();
    if (health->server_ == nullptr || health->port_ == 0 ||
        health->server_->GetHealthCheckService() == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("--health-listen: cannot listen on ", listen));
    }
    return health;
  }
  ~HealthPort() { Shutdown(); }
  HealthPort(const HealthPort&) = delete;
  HealthPort& operator=(const HealthPort&) = delete;

  int port() const { return port_; }
  void SetServingStatus(const std::string& service, bool serving) {
    server_->GetHealthCheckService()->SetServingStatus(service, serving);
  }
  void Shutdown() {
    if (server_ == nullptr) return;
    server_->GetHealthCheckService()->SetServingStatus(false);
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(200));
    server_.reset();
  }

 private:
  HealthPort() = default;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_RPC_HEALTH_PORT_H_

// PlannerServer: a running gRPC server for the Planner service, with
// grpc.health.v1 (liveness on "", readiness on "knapserve.v1.Planner") and
// server reflection. Used by the knapserve-planner binary and by tests
// (listen on "127.0.0.1:0" and ask port()).
//
// Ownership: borrows the InProcessPlanner (must outlive the server); owns
// the service and the grpc::Server. Shutdown (or the destructor) stops
// accepting, cancels open streams after `grace` and waits for them.
#ifndef KNAPSERVE_PLANNER_PLANNER_SERVER_H_
#define KNAPSERVE_PLANNER_PLANNER_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/rpc/health_port.h"
#include "planner/planner_service.h"

namespace knapserve {

// The default cap on one plan request message: a snapshot's hidden states
// plus its K/V window (tens of MB for a 1B model at a few thousand tokens).
inline constexpr int64_t kDefaultMaxPlanRequestBytes = int64_t{512} << 20;

class PlannerServer {
 public:
  // Unavailable if the address cannot be bound. `credentials`: TLS, with
  // client certificates required for mutual TLS (tools/tls_from_flags.h),
  // or nullptr for plaintext. `health_listen` (optional): a plaintext port
  // with grpc.health.v1 only (common/rpc/health_port.h). A plan request message
  // larger than `max_request_bytes` (--max-plan-request-bytes) ends its
  // stream with RESOURCE_EXHAUSTED before it is decoded; other executors'
  // streams go on.
  static absl::StatusOr<std::unique_ptr<PlannerServer>> Start(
      InProcessPlanner* planner, int num_layers, const std::string& listen,
      int64_t max_request_bytes = kDefaultMaxPlanRequestBytes,
      std::shared_ptr<grpc::ServerCredentials> credentials = nullptr,
      const std::string& health_listen = "",
      MetricsRegistry* metrics = nullptr);
  ~PlannerServer();

  int port() const { return port_; }
  int health_port() const { return health_ != nullptr ? health_->port() : 0; }
  const PlannerService& service() const { return *service_; }
  // Readiness goes NOT_SERVING, then the server stops.
  void Shutdown(
      std::chrono::milliseconds grace = std::chrono::milliseconds(2000));
  // Blocks until Shutdown (from another thread).
  void Wait() { server_->Wait(); }

 private:
  PlannerServer() = default;

  std::unique_ptr<PlannerService> service_;
  std::unique_ptr<HealthPort> health_;  // with health_listen
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace knapserve

#endif  // KNAPSERVE_PLANNER_PLANNER_SERVER_H_

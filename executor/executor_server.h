// ExecutorServer: a running gRPC server for the Generation service, with
// grpc.health.v1 (liveness on "", readiness on "knapserve.v1.Generation":
// SERVING only after Start's warm-up) and server reflection. Used by
// knapserve-executor, `knapserve serve` and tests (listen on "127.0.0.1:0",
// ask port()).
//
// Drain (SIGTERM): readiness goes NOT_SERVING, new requests get UNAVAILABLE,
// running ones finish (up to `timeout`), then the server shuts down.
//
// Ownership: borrows the model, tokenizer and planner client through the
// service options (they must outlive the server); owns the service.
#ifndef KNAPSERVE_EXECUTOR_EXECUTOR_SERVER_H_
#define KNAPSERVE_EXECUTOR_EXECUTOR_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/rpc/health_port.h"
#include "executor/generation_service.h"

namespace knapserve {

class ExecutorServer {
 public:
  // Builds the service, warms the model up with a short generation, starts
  // serving. Unavailable if the address cannot be bound. `credentials`:
  // TLS (tools/tls_from_flags.h) or nullptr for plaintext. `health_listen`
  // (optional): a plaintext port with grpc.health.v1 only, mirroring this
  // server's statuses (common/rpc/health_port.h).
  static absl::StatusOr<std::unique_ptr<ExecutorServer>> Start(
      const LlamaModel& model, const Tokenizer& tokenizer,
      GenerationServiceOptions options, const std::string& listen,
      std::shared_ptr<grpc::ServerCredentials> credentials = nullptr,
      const std::string& health_listen = "");
  ~ExecutorServer();

  int port() const { return port_; }
  int health_port() const { return health_ != nullptr ? health_->port() : 0; }
  GenerationService& service() { return *service_; }
  // Returns true when every running request finished within `timeout`.
  bool Drain(std::chrono::milliseconds timeout);

 private:
  ExecutorServer() = default;

  std::unique_ptr<GenerationService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<HealthPort> health_;  // with health_listen
  int port_ = 0;
  bool stopped_ = false;
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_EXECUTOR_SERVER_H_

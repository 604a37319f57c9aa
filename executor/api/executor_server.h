// ExecutorServer: a running gRPC server for the Generation service, with
// grpc.health.v1 (liveness on "", readiness on "knapserve.v1.Generation":
// SERVING only after Start's warm-up) and server reflection. Used by
// knapserve-executor, `knapserve serve` and tests (listen on "127.0.0.1:0",
// ask port()).
//
// StartHttp adds the OpenAI-compatible HTTP front door
// (executor/api/http_front_door.h) on the same service.
//
// Drain (SIGTERM): readiness goes NOT_SERVING (and HTTP /health 503), new
// requests get UNAVAILABLE (HTTP 503), running ones finish (up to
// `timeout`), then both servers shut down.
//
// Ownership: borrows the model, tokenizer and planner client through the
// service options (they must outlive the server); owns the service and the
// front door. Thread safety: Start, StartHttp, Drain and the destructor from
// one thread (the main one).
#ifndef KNAPSERVE_EXECUTOR_API_EXECUTOR_SERVER_H_
#define KNAPSERVE_EXECUTOR_API_EXECUTOR_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/rpc/health_port.h"
#include "executor/api/generation_service.h"
#include "executor/api/http_front_door.h"

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

  // Serves HTTP on `listen` ("HOST:PORT", port 0 picks one: http_port()).
  absl::Status StartHttp(const std::string& listen,
                         HttpFrontDoorOptions options);
  int port() const { return port_; }
  int http_port() const { return http_ != nullptr ? http_->port() : 0; }
  int health_port() const { return health_ != nullptr ? health_->port() : 0; }
  GenerationService& service() { return *service_; }
  // Returns true when every running request finished within `timeout`.
  bool Drain(std::chrono::milliseconds timeout);

 private:
  ExecutorServer() = default;

  std::unique_ptr<GenerationService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<HealthPort> health_;   // with health_listen
  std::unique_ptr<HttpFrontDoor> http_;  // after StartHttp; borrows service_
  int port_ = 0;
  bool stopped_ = false;
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_API_EXECUTOR_SERVER_H_

#include "executor/api/executor_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <climits>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace knapserve {

absl::StatusOr<std::unique_ptr<ExecutorServer>> ExecutorServer::Start(
    const LlamaModel& model, const Tokenizer& tokenizer,
    GenerationServiceOptions options, const std::string& listen,
    std::shared_ptr<grpc::ServerCredentials> credentials,
    const std::string& health_listen) {
  // Warm-up before anyone can call: kernel selection, page faults.
  GenerationRequest warmup;
  warmup.prompt_ids = {model.config().bos_token_id.value_or(0)};
  warmup.max_new_tokens = 4;
  warmup.ignore_eos = true;
  RETURN_IF_ERROR(Annotate(
      knapserve::Generate(model, tokenizer, warmup).status(), "warm-up"));

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  std::unique_ptr<ExecutorServer> server(new ExecutorServer());
  const int64_t max_request_bytes = options.limits.max_request_bytes;
  server->service_ =
      std::make_unique<GenerationService>(model, tokenizer, std::move(options));
  grpc::ServerBuilder builder;
  builder.AddListeningPort(
      listen,
      credentials != nullptr ? credentials : grpc::InsecureServerCredentials(),
      &server->port_);
  builder.RegisterService(server->service_.get());
  // A larger request is refused by gRPC (RESOURCE_EXHAUSTED) before it is
  // decoded; other streams are unaffected.
  if (max_request_bytes > 0) {
    builder.SetMaxReceiveMessageSize(
        static_cast<int>(std::min<int64_t>(max_request_bytes, INT32_MAX)));
  }
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("executor: cannot listen on ", listen));
  }
  if (!health_listen.empty()) {
    ASSIGN_OR_RETURN(server->health_, HealthPort::Start(health_listen));
  }
  server->server_->GetHealthCheckService()->SetServingStatus(
      v1::Generation::service_full_name(), true);
  if (server->health_ != nullptr) {
    server->health_->SetServingStatus(v1::Generation::service_full_name(),
                                      true);
  }
  return server;
}

bool ExecutorServer::Drain(std::chrono::milliseconds timeout) {
  if (stopped_) return true;
  stopped_ = true;
  server_->GetHealthCheckService()->SetServingStatus(
      v1::Generation::service_full_name(), false);
  if (health_ != nullptr) {
    health_->SetServingStatus(v1::Generation::service_full_name(), false);
  }
  if (http_ != nullptr) http_->StartDraining();
  const bool finished = service_->Drain(timeout);
  server_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(500));
  if (http_ != nullptr) http_->Shutdown();
  if (health_ != nullptr) health_->Shutdown();
  return finished;
}

absl::Status ExecutorServer::StartHttp(const std::string& listen,
                                       HttpFrontDoorOptions options) {
  if (http_ != nullptr) {
    return absl::FailedPreconditionError("the HTTP front door already runs");
  }
  ASSIGN_OR_RETURN(http_,
                   HttpFrontDoor::Start(*service_, listen, std::move(options)));
  return absl::OkStatus();
}

ExecutorServer::~ExecutorServer() { Drain(std::chrono::milliseconds(0)); }

}  // namespace knapserve

// TLS for the gRPC links, from the command line:
//   --tls-cert FILE, --tls-key FILE  this process's certificate chain and
//                                    private key (PEM);
//   --tls-ca FILE                    the CA this process trusts (PEM).
//
// Who uses what:
//   - the Generation service (knapserve-executor, serve) serves TLS with
//     --tls-cert/--tls-key; clients are not asked for certificates;
//   - the Planner service (knapserve-planner) serves TLS with
//     --tls-cert/--tls-key, and with --tls-ca it requires every executor to
//     present a client certificate signed by that CA (mutual TLS);
//   - an executor's link to the planner: with --tls-ca it verifies the
//     planner against that CA and presents --tls-cert/--tls-key as its
//     client certificate;
//   - clients (`generate --server`, `bench serve --server`): with --tls-ca
//     they verify the server against that CA.
// Without the flags every link is plaintext, as before. A file that cannot
// be read, or a certificate without its key, is InvalidArgument naming the
// flag.
//
// Thread safety: the functions read the process-global flags; call them
// from the main thread.
#ifndef KNAPSERVE_TOOLS_TLS_FROM_FLAGS_H_
#define KNAPSERVE_TOOLS_TLS_FROM_FLAGS_H_

#include <grpcpp/grpcpp.h>

#include <memory>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"

ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_ca);
// A plaintext port with grpc.health.v1 only, beside a TLS port (probes).
ABSL_DECLARE_FLAG(std::string, health_listen);

namespace knapserve {

// The Generation service's credentials: TLS with --tls-cert/--tls-key, or
// nullptr (plaintext) without them.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>>
GenerationServerCredentialsFromFlags();

// The Planner service's credentials: TLS with --tls-cert/--tls-key, client
// certificates required and verified against --tls-ca when it is given;
// nullptr (plaintext) without a certificate. --tls-ca without a
// certificate is InvalidArgument (mutual TLS needs the server's own).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>>
PlannerServerCredentialsFromFlags();

// A client's credentials for a knapserve server (the planner, or the
// Generation service): with --tls-ca, TLS verifying the server against it,
// presenting --tls-cert/--tls-key when given; nullptr (plaintext) without.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>>
ClientCredentialsFromFlags();

// `credentials`, or insecure ones when it is nullptr.
std::shared_ptr<grpc::ChannelCredentials> OrInsecure(
    std::shared_ptr<grpc::ChannelCredentials> credentials);

}  // namespace knapserve

#endif  // KNAPSERVE_TOOLS_TLS_FROM_FLAGS_H_

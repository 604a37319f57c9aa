// TLS for the gRPC links, from the command line (see the header).
#include "tools/tls_from_flags.h"

#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"

ABSL_FLAG(std::string, tls_cert, "",
          "TLS: this process's certificate chain (PEM). With --tls-key, the "
          "executor's Generation service and the planner serve TLS, and an "
          "executor presents it to a planner that wants client certificates.");
ABSL_FLAG(std::string, tls_key, "",
          "TLS: the private key of --tls-cert (PEM).");
ABSL_FLAG(std::string, health_listen, "",
          "executor, serve, planner: also serve grpc.health.v1 alone, in "
          "plaintext, on this address (for probes that cannot speak TLS); "
          "empty = no such port.");
ABSL_FLAG(std::string, tls_ca, "",
          "TLS: the CA this process trusts (PEM). Clients verify servers "
          "with it; the planner requires executors' client certificates "
          "signed by it (mutual TLS).");

namespace knapserve {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot read '", path, "'"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", path, "' is not a PEM file"));
  }
  return text.str();
}

// --tls-cert and --tls-key as a key/certificate pair; nullopt when neither
// is given.
absl::StatusOr<std::optional<grpc::SslServerCredentialsOptions::PemKeyCertPair>>
KeyCertFromFlags() {
  const std::string cert = absl::GetFlag(FLAGS_tls_cert);
  const std::string key = absl::GetFlag(FLAGS_tls_key);
  if (cert.empty() && key.empty()) return std::nullopt;
  if (cert.empty() || key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.cert_chain, ReadPem(cert, "--tls-cert"));
  ASSIGN_OR_RETURN(pair.private_key, ReadPem(key, "--tls-key"));
  return pair;
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>>
GenerationServerCredentialsFromFlags() {
  ASSIGN_OR_RETURN(auto pair, KeyCertFromFlags());
  if (!pair.has_value()) return nullptr;
  grpc::SslServerCredentialsOptions options;
  options.pem_key_cert_pairs.push_back(*pair);
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>>
PlannerServerCredentialsFromFlags() {
  ASSIGN_OR_RETURN(auto pair, KeyCertFromFlags());
  const std::string ca = absl::GetFlag(FLAGS_tls_ca);
  if (!pair.has_value()) {
    if (!ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls-ca on the planner needs --tls-cert and --tls-key (mutual "
          "TLS)");
    }
    return nullptr;
  }
  grpc::SslServerCredentialsOptions options(
      ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                 : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_key_cert_pairs.push_back(*pair);
  if (!ca.empty()) {
    ASSIGN_OR_RETURN(options.pem_root_certs, ReadPem(ca, "--tls-ca"));
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>>
ClientCredentialsFromFlags() {
  const std::string ca = absl::GetFlag(FLAGS_tls_ca);
  if (ca.empty()) return nullptr;
  grpc::SslCredentialsOptions options;
  ASSIGN_OR_RETURN(options.pem_root_certs, ReadPem(ca, "--tls-ca"));
  ASSIGN_OR_RETURN(auto pair, KeyCertFromFlags());
  if (pair.has_value()) {
    options.pem_cert_chain = pair->cert_chain;
    options.pem_private_key = pair->private_key;
  }
  return grpc::SslCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> OrInsecure(
    std::shared_ptr<grpc::ChannelCredentials> credentials) {
  return credentials != nullptr ? credentials
                                : grpc::InsecureChannelCredentials();
}

}  // namespace knapserve

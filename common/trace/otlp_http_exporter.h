// OTLP/HTTP JSON export, and tracing configured the OpenTelemetry way from
// the environment.
//
//   OTEL_EXPORTER_OTLP_ENDPOINT         base URL; spans go to <base>/v1/traces
//   OTEL_EXPORTER_OTLP_TRACES_ENDPOINT  the full URL (wins over the base)
//   OTEL_SERVICE_NAME                   resource service.name (else the
//                                       binary's default)
//   OTEL_RESOURCE_ATTRIBUTES            more resource attributes, k=v,k2=v2
//   OTEL_TRACES_SAMPLER[_ARG]           common/trace/sampler.h
//   OTEL_EXPORTER_OTLP_PROTOCOL         only http/json is spoken; another
//                                       value is warned about and ignored
//   OTEL_SDK_DISABLED=true              tracing off
//
// Without either endpoint tracing is off (TracingConfigFromEnv says so with
// nullopt) and the binaries install no tracer.
//
// Ownership: OtlpHttpExporter owns its HTTP client. Thread safety: Export
// runs on the tracer's exporter thread only; the functions are thread-safe.
#ifndef KNAPSERVE_COMMON_TRACE_OTLP_HTTP_EXPORTER_H_
#define KNAPSERVE_COMMON_TRACE_OTLP_HTTP_EXPORTER_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics/metrics.h"
#include "common/trace/tracer.h"

namespace knapserve::trace {

// A URL split for cpp-httplib: "http://host:port" and "/path".
struct HttpUrl {
  std::string scheme_host_port;
  std::string path;
};
// InvalidArgument unless `url` is http:// or https://, a host, an optional
// port and an optional path ("/" when absent).
absl::StatusOr<HttpUrl> ParseHttpUrl(const std::string& url);

// POSTs each batch to the OTLP/HTTP traces URL with Content-Type
// application/json; any 2xx answer is success.
class OtlpHttpExporter final : public SpanExporter {
 public:
  static absl::StatusOr<std::unique_ptr<OtlpHttpExporter>> Create(
      const std::string& traces_url);
  ~OtlpHttpExporter() override;
  absl::Status Export(const std::string& body, absl::Time deadline) override;

 private:
  struct Impl;  // the cpp-httplib client (its types stay in the .cc)
  explicit OtlpHttpExporter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

struct TracingConfig {
  std::string traces_url;  // where the spans go
  TracerOptions tracer;    // service name, resource, sampler
};

// The configuration the environment asks for, read through `getenv` (the
// real one by default); nullopt when tracing is off (no endpoint, or
// OTEL_SDK_DISABLED=true). `default_service` is service.name without
// OTEL_SERVICE_NAME. InvalidArgument for a bad sampler, ratio or URL.
using GetEnv = std::function<const char*(const char*)>;
absl::StatusOr<std::optional<TracingConfig>> TracingConfigFromEnv(
    const std::string& default_service, const GetEnv& getenv = nullptr);

// What a binary calls at start-up: reads the environment, and when tracing
// is on, creates a Tracer exporting over OTLP/HTTP with `metrics`' counters
// and installs it as the global tracer (SetGlobalTracer). Returns it, or
// nullptr when tracing is off. The tracer is never destroyed (spans may end
// on any thread until the process exits); the binary calls Shutdown (see
// TracerShutdown in common/trace/tracer.h) once its servers stopped and
// before `metrics` goes away. Errors as TracingConfigFromEnv.
absl::StatusOr<Tracer*> InstallTracerFromEnv(const std::string& default_service,
                                             MetricsRegistry* metrics);

}  // namespace knapserve::trace

#endif  // KNAPSERVE_COMMON_TRACE_OTLP_HTTP_EXPORTER_H_

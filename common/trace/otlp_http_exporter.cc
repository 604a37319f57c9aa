#include "common/trace/otlp_http_exporter.h"

#include <httplib.h>

#include <cstdlib>
#include <iostream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace knapserve::trace {

absl::StatusOr<HttpUrl> ParseHttpUrl(const std::string& url) {
  absl::string_view rest = url;
  std::string scheme;
  if (absl::ConsumePrefix(&rest, "http://")) {
    scheme = "http://";
  } else if (absl::ConsumePrefix(&rest, "https://")) {
    scheme = "https://";
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("'", url, "' is not an http:// or https:// URL"));
  }
  const size_t slash = rest.find('/');
  const absl::string_view authority = rest.substr(0, slash);
  HttpUrl out;
  out.path =
      slash == absl::string_view::npos ? "/" : std::string(rest.substr(slash));
  if (authority.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", url, "' has no host"));
  }
  // host, host:port, [v6], [v6]:port.
  const size_t colon = authority.rfind(':');
  const size_t bracket = authority.rfind(']');
  if (colon != absl::string_view::npos &&
      (bracket == absl::string_view::npos || colon > bracket)) {
    int port = 0;
    if (!absl::SimpleAtoi(authority.substr(colon + 1), &port) || port < 1 ||
        port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", url, "' has a bad port"));
    }
  }
  out.scheme_host_port = scheme + std::string(authority);
  return out;
}

// ---------------------------------------------------------------------------
// OtlpHttpExporter

struct OtlpHttpExporter::Impl {
  explicit Impl(const HttpUrl& url)
      : client(url.scheme_host_port), path(url.path) {
    client.set_keep_alive(true);
  }
  httplib::Client client;
  std::string path;
};

OtlpHttpExporter::OtlpHttpExporter(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
OtlpHttpExporter::~OtlpHttpExporter() = default;

absl::StatusOr<std::unique_ptr<OtlpHttpExporter>> OtlpHttpExporter::Create(
    const std::string& traces_url) {
  absl::StatusOr<HttpUrl> url = ParseHttpUrl(traces_url);
  if (!url.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("OTLP traces endpoint: ", url.status().message()));
  }
  return std::unique_ptr<OtlpHttpExporter>(
      new OtlpHttpExporter(std::make_unique<Impl>(*url)));
}

absl::Status OtlpHttpExporter::Export(const std::string& body,
                                      absl::Time deadline) {
  const absl::Duration left =
      std::max(absl::Milliseconds(1), deadline - absl::Now());
  const int64_t micros = absl::ToInt64Microseconds(left);
  const time_t seconds = static_cast<time_t>(micros / 1000000);
  const time_t usec = static_cast<time_t>(micros % 1000000);
  impl_->client.set_connection_timeout(seconds, usec);
  impl_->client.set_read_timeout(seconds, usec);
  impl_->client.set_write_timeout(seconds, usec);
  const httplib::Result result =
      impl_->client.Post(impl_->path, body, "application/json");
  if (!result) {
    return absl::UnavailableError(absl::StrCat(
        "POST ", impl_->path, ": ", httplib::to_string(result.error())));
  }
  if (result->status < 200 || result->status >= 300) {
    return absl::UnavailableError(absl::StrCat("POST ", impl_->path, ": HTTP ",
                                               result->status, " ",
                                               result->body.substr(0, 200)));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Configuration from the environment

namespace {

std::string Env(const GetEnv& getenv, const char* name) {
  const char* value = getenv(name);
  return value == nullptr ? std::string()
                          : std::string(absl::StripAsciiWhitespace(value));
}

}  // namespace

absl::StatusOr<std::optional<TracingConfig>> TracingConfigFromEnv(
    const std::string& default_service, const GetEnv& getenv_fn) {
  const GetEnv getenv = getenv_fn ? getenv_fn : [](const char* name) {
    return std::getenv(name);
  };
  if (absl::AsciiStrToLower(Env(getenv, "OTEL_SDK_DISABLED")) == "true") {
    return std::nullopt;
  }
  TracingConfig config;
  config.traces_url = Env(getenv, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
  if (config.traces_url.empty()) {
    std::string base = Env(getenv, "OTEL_EXPORTER_OTLP_ENDPOINT");
    if (base.empty()) return std::nullopt;
    if (!absl::EndsWith(base, "/")) base += "/";
    config.traces_url = base + "v1/traces";
  }
  if (absl::Status url = ParseHttpUrl(config.traces_url).status(); !url.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("OTLP traces endpoint: ", url.message()));
  }
  config.tracer.service_name = Env(getenv, "OTEL_SERVICE_NAME");
  if (config.tracer.service_name.empty()) {
    config.tracer.service_name = default_service;
  }
  for (absl::string_view pair : absl::StrSplit(
           Env(getenv, "OTEL_RESOURCE_ATTRIBUTES"), ',', absl::SkipEmpty())) {
    const size_t eq = pair.find('=');
    if (eq == absl::string_view::npos) continue;  // malformed: ignored
    const std::string key(absl::StripAsciiWhitespace(pair.substr(0, eq)));
    const std::string value(absl::StripAsciiWhitespace(pair.substr(eq + 1)));
    if (key.empty()) continue;
    if (key == "service.name") {
      // OTEL_SERVICE_NAME wins over it.
      if (Env(getenv, "OTEL_SERVICE_NAME").empty()) {
        config.tracer.service_name = value;
      }
    } else {
      config.tracer.resource.emplace_back(key, value);
    }
  }
  absl::StatusOr<Sampler> sampler =
      Sampler::Parse(Env(getenv, "OTEL_TRACES_SAMPLER"),
                     Env(getenv, "OTEL_TRACES_SAMPLER_ARG"));
  if (!sampler.ok()) return sampler.status();
  config.tracer.sampler = *sampler;
  return config;
}

absl::StatusOr<Tracer*> InstallTracerFromEnv(const std::string& default_service,
                                             MetricsRegistry* metrics) {
  absl::StatusOr<std::optional<TracingConfig>> config =
      TracingConfigFromEnv(default_service);
  if (!config.ok()) return config.status();
  if (!config->has_value()) return nullptr;
  const std::string protocol = Env([](const char* n) { return std::getenv(n); },
                                   "OTEL_EXPORTER_OTLP_PROTOCOL");
  if (!protocol.empty() && protocol != "http/json") {
    std::cerr << "knapserve: OTEL_EXPORTER_OTLP_PROTOCOL=" << protocol
              << " is not supported; exporting traces as http/json"
              << std::endl;
  }
  absl::StatusOr<std::unique_ptr<OtlpHttpExporter>> exporter =
      OtlpHttpExporter::Create((*config)->traces_url);
  if (!exporter.ok()) return exporter.status();
  TracerOptions options = std::move((*config)->tracer);
  options.metrics = metrics;
  // Never destroyed: spans may end on any thread until the process exits.
  auto* tracer = new Tracer(std::move(options), std::move(*exporter));
  SetGlobalTracer(tracer);
  std::cerr << "knapserve: exporting traces to " << (*config)->traces_url
            << " as service '" << tracer->options().service_name
            << "', sampler " << tracer->options().sampler.Describe()
            << std::endl;
  return tracer;
}

}  // namespace knapserve::trace

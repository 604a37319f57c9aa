#include "common/metrics/metrics.h"

#include <httplib.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <algorithm>

namespace knapserve {

void Counter::Add(double v) { counter_.Increment(v); }
double Counter::value() const { return counter_.Value(); }

void Histogram::Observe(double v) { histogram_.Observe(v); }

MetricsRegistry::MetricsRegistry()
    : registry_(std::make_shared<prometheus::Registry>()) {}

MetricsRegistry::~MetricsRegistry() = default;

Counter& MetricsRegistry::AddCounter(const std::string& name,
                                     const std::string& help,
                                     const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<Counter>& slot = counters_[{name, labels}];
  if (slot == nullptr) {
    // prometheus-cpp merges a family registered again under its name.
    auto& family =
        prometheus::BuildCounter().Name(name).Help(help).Register(*registry_);
    slot = std::make_unique<Counter>(family.Add(labels));
  }
  return *slot;
}

Histogram& MetricsRegistry::AddHistogram(const std::string& name,
                                         const std::string& help,
                                         std::vector<double> bounds) {
  absl::MutexLock lock(&mu_);
  std::unique_ptr<Histogram>& slot = histograms_[name];
  if (slot == nullptr) {
    std::sort(bounds.begin(), bounds.end());
    auto& family =
        prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_);
    slot = std::make_unique<Histogram>(family.Add(
        {},
        prometheus::Histogram::BucketBoundaries(bounds.begin(), bounds.end())));
  }
  return *slot;
}

void MetricsRegistry::AddGauge(const std::string& name, const std::string& help,
                               std::function<double()> read) {
  absl::MutexLock lock(&mu_);
  auto& family =
      prometheus::BuildGauge().Name(name).Help(help).Register(*registry_);
  gauges_.push_back(GaugeFn{&family.Add({}), std::move(read)});
}

std::string MetricsRegistry::Render() const {
  absl::MutexLock lock(&mu_);
  for (const GaugeFn& g : gauges_) g.gauge->Set(g.read ? g.read() : 0.0);
  return prometheus::TextSerializer().Serialize(registry_->Collect());
}

struct MetricsHttpServer::Impl {
  httplib::Server server;
};

std::unique_ptr<MetricsHttpServer> MetricsHttpServer::Start(
    const MetricsRegistry* registry, const std::string& host, int port) {
  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer());
  s->impl_ = std::make_unique<Impl>();
  s->impl_->server.Get(
      "/metrics", [registry](const httplib::Request&, httplib::Response& res) {
        res.set_content(registry->Render(), "text/plain; version=0.0.4");
      });
  s->port_ = port == 0
                 ? s->impl_->server.bind_to_any_port(host)
                 : (s->impl_->server.bind_to_port(host, port) ? port : -1);
  if (s->port_ <= 0) return nullptr;
  Impl* impl = s->impl_.get();
  s->thread_ = std::thread([impl] { impl->server.listen_after_bind(); });
  return s;
}

MetricsHttpServer::~MetricsHttpServer() {
  impl_->server.stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace knapserve

#include "common/metrics/metrics.h"

#include <httplib.h>

#include <algorithm>
#include <cmath>
#include <sstream>

namespace knapserve {
namespace {

std::string Number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  std::ostringstream out;
  out.precision(17);
  out << v;
  return out.str();
}

std::string WithLabels(const std::string& name, const std::string& labels) {
  return labels.empty() ? name : name + "{" + labels + "}";
}

}  // namespace

void Histogram::Observe(double v) {
  const size_t bucket =
      std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  absl::MutexLock lock(&mu_);
  ++counts_[bucket];
  sum_ += v;
  ++count_;
}

void Histogram::Snapshot(std::vector<uint64_t>* cumulative, double* sum,
                         uint64_t* count) const {
  absl::MutexLock lock(&mu_);
  cumulative->clear();
  uint64_t running = 0;
  for (uint64_t c : counts_) cumulative->push_back(running += c);
  *sum = sum_;
  *count = count_;
}

MetricsRegistry::Family& MetricsRegistry::FamilyFor(const std::string& name,
                                                    const std::string& help,
                                                    const std::string& type) {
  for (auto& f : families_) {
    if (f->name == name) return *f;
  }
  families_.push_back(std::make_unique<Family>());
  Family& f = *families_.back();
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

Counter& MetricsRegistry::AddCounter(const std::string& name,
                                     const std::string& help,
                                     const std::string& labels) {
  absl::MutexLock lock(&mu_);
  Family& f = FamilyFor(name, help, "counter");
  for (auto& [l, c] : f.counters) {
    if (l == labels) return *c;
  }
  f.counters.emplace_back(labels, std::make_unique<Counter>());
  return *f.counters.back().second;
}

Histogram& MetricsRegistry::AddHistogram(const std::string& name,
                                         const std::string& help,
                                         std::vector<double> bounds) {
  absl::MutexLock lock(&mu_);
  Family& f = FamilyFor(name, help, "histogram");
  std::sort(bounds.begin(), bounds.end());
  if (f.histogram == nullptr)
    f.histogram = std::make_unique<Histogram>(std::move(bounds));
  return *f.histogram;
}

void MetricsRegistry::AddGauge(const std::string& name, const std::string& help,
                               std::function<double()> read) {
  absl::MutexLock lock(&mu_);
  FamilyFor(name, help, "gauge").gauge = std::move(read);
}

std::string MetricsRegistry::Render() const {
  absl::MutexLock lock(&mu_);
  std::string out;
  for (const auto& f : families_) {
    out += "# HELP " + f->name + " " + f->help + "\n# TYPE " + f->name + " " +
           f->type + "\n";
    if (f->type == "counter") {
      for (const auto& [labels, c] : f->counters) {
        out += WithLabels(f->name, labels) + " " + Number(c->value()) + "\n";
      }
    } else if (f->type == "gauge") {
      out += f->name + " " + Number(f->gauge ? f->gauge() : 0.0) + "\n";
    } else {
      std::vector<uint64_t> cumulative;
      double sum = 0;
      uint64_t count = 0;
      f->histogram->Snapshot(&cumulative, &sum, &count);
      const std::vector<double>& bounds = f->histogram->bounds();
      for (size_t i = 0; i < cumulative.size(); ++i) {
        const double le = i < bounds.size() ? bounds[i] : INFINITY;
        out += f->name + "_bucket{le=\"" + Number(le) + "\"} " +
               std::to_string(cumulative[i]) + "\n";
      }
      out += f->name + "_sum " + Number(sum) + "\n";
      out += f->name + "_count " + std::to_string(count) + "\n";
    }
  }
  return out;
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

// Metrics in the Prometheus text exposition format, on prometheus-cpp
// (Debian's prometheus-cpp-dev): counters (`_total`), gauges and histograms
// (seconds), all named with the prefix knapserve_. A MetricsRegistry owns a
// prometheus::Registry and the small handles it gives out; Render() writes
// the text a /metrics endpoint serves (see MetricsHttpServer).
//
//   MetricsRegistry registry;
//   Counter& drafts =
//       registry.AddCounter("knapserve_spec_decode_num_drafts_total", "...");
//   drafts.Add(3);
//   Histogram& ttft = registry.AddHistogram(
//       "knapserve_time_to_first_token_seconds", "...", {0.01, 0.1, 1});
//   ttft.Observe(0.05);
//   registry.AddGauge("knapserve_running_requests", "...", [&] { return n; });
//
// Labels: a family may have several series, each with its own labels (e.g.
// {{"code", "OK"}}), added with the same name. Gauges are functions read at
// each Render, so they always show the current state.
//
// Ownership: the registry owns every metric and returns stable references.
// Thread safety: Add/Observe and Render from any thread (prometheus-cpp's
// metrics are atomic or locked; the registry's mutex guards its maps of
// handles and the gauge functions). Render calls the gauge functions with
// that mutex held, so a gauge function must not add metrics to the same
// registry. Metric and label names are checked by prometheus-cpp; they are
// constants of this program, and an invalid one aborts at start-up.
#ifndef KNAPSERVE_COMMON_METRICS_METRICS_H_
#define KNAPSERVE_COMMON_METRICS_METRICS_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace knapserve {

using MetricLabels = std::map<std::string, std::string>;

class Counter {
 public:
  explicit Counter(prometheus::Counter& counter) : counter_(counter) {}
  void Add(double v = 1);  // v >= 0
  double value() const;

 private:
  prometheus::Counter& counter_;  // owned by the registry
};

class Histogram {
 public:
  explicit Histogram(prometheus::Histogram& histogram)
      : histogram_(histogram) {}
  void Observe(double v);

 private:
  prometheus::Histogram& histogram_;  // owned by the registry
};

class MetricsRegistry {
 public:
  MetricsRegistry();
  ~MetricsRegistry();

  // Same name + labels twice returns the same counter.
  Counter& AddCounter(const std::string& name, const std::string& help,
                      const MetricLabels& labels = {}) ABSL_LOCKS_EXCLUDED(mu_);
  // Upper bounds in seconds (or whatever the name says); +Inf is implied.
  // The same name twice returns the first histogram.
  Histogram& AddHistogram(const std::string& name, const std::string& help,
                          std::vector<double> bounds) ABSL_LOCKS_EXCLUDED(mu_);
  // A gauge read at render time (with the registry's mutex held).
  void AddGauge(const std::string& name, const std::string& help,
                std::function<double()> read) ABSL_LOCKS_EXCLUDED(mu_);

  // The Prometheus text format (version 0.0.4), families sorted by name.
  std::string Render() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct GaugeFn {
    prometheus::Gauge* gauge;
    std::function<double()> read;
  };
  std::shared_ptr<prometheus::Registry> registry_;  // thread-safe itself
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, MetricLabels>, std::unique_ptr<Counter>>
      counters_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<Histogram>> histograms_
      ABSL_GUARDED_BY(mu_);
  std::vector<GaugeFn> gauges_ ABSL_GUARDED_BY(mu_);
};

// Serves GET /metrics (registry.Render()) over HTTP on its own thread.
class MetricsHttpServer {
 public:
  // port 0 picks a free port; bound_port() says which. Empty pointer if it
  // cannot listen.
  static std::unique_ptr<MetricsHttpServer> Start(
      const MetricsRegistry* registry, const std::string& host, int port);
  ~MetricsHttpServer();
  int bound_port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_METRICS_METRICS_H_

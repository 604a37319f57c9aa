// Metrics in the Prometheus text exposition format:
// counters (`_total`), gauges and histograms (seconds), all named with the
// prefix knapserve_. A MetricsRegistry owns its metrics; Render() writes the
// text a /metrics endpoint serves (see MetricsHttpServer).
//
//   MetricsRegistry registry;
//   Counter& drafts =
//   registry.AddCounter("knapserve_spec_decode_num_drafts_total", "...");
//   drafts.Add(3);
//   Histogram& ttft =
//   registry.AddHistogram("knapserve_time_to_first_token_seconds", "...",
//                                           {0.01, 0.1, 1});
//   ttft.Observe(0.05);
//
// Labels: a metric family may have several series, each with a fixed label
// string (e.g. `code="OK"`), added with the same name.
//
// Ownership: the registry owns every metric and returns stable references.
// Thread safety: Add/Set/Observe and Render from any thread. A Counter is one
// atomic; a Histogram guards its buckets with its own absl::Mutex; the
// registry's mutex guards the family list (not the metrics' values). Render
// calls gauge functions with the registry's mutex held, so a gauge function
// must not add metrics to the same registry.
#ifndef KNAPSERVE_COMMON_METRICS_METRICS_H_
#define KNAPSERVE_COMMON_METRICS_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace knapserve {

class Counter {
 public:
  void Add(double v = 1) {
    double cur = value_.load();
    while (!value_.compare_exchange_weak(cur, cur + v)) {
    }
  }
  double value() const { return value_.load(); }

 private:
  std::atomic<double> value_{0};
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds)
      : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void Observe(double v) ABSL_LOCKS_EXCLUDED(mu_);
  // Cumulative counts per upper bound (last = +Inf), sum and count.
  void Snapshot(std::vector<uint64_t>* cumulative, double* sum,
                uint64_t* count) const ABSL_LOCKS_EXCLUDED(mu_);
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  const std::vector<double> bounds_;  // immutable: read without the lock
  mutable absl::Mutex mu_;
  std::vector<uint64_t> counts_
      ABSL_GUARDED_BY(mu_);  // per bucket, not cumulative
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

class MetricsRegistry {
 public:
  // `labels` like `code="OK"` (empty: none). Same name + labels twice returns
  // the same metric.
  Counter& AddCounter(const std::string& name, const std::string& help,
                      const std::string& labels = "") ABSL_LOCKS_EXCLUDED(mu_);
  Histogram& AddHistogram(const std::string& name, const std::string& help,
                          std::vector<double> bounds) ABSL_LOCKS_EXCLUDED(mu_);
  // A gauge read at render time (with the registry's mutex held).
  void AddGauge(const std::string& name, const std::string& help,
                std::function<double()> read) ABSL_LOCKS_EXCLUDED(mu_);

  // The Prometheus text format, families in the order they were added.
  std::string Render() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Family {
    std::string name, help, type;
    std::vector<std::pair<std::string, std::unique_ptr<Counter>>>
        counters;  // by labels
    std::unique_ptr<Histogram> histogram;
    std::function<double()> gauge;
  };
  // The family `name`, added (with `help` and `type`) when there is none.
  Family& FamilyFor(const std::string& name, const std::string& help,
                    const std::string& type) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  // The families and their fields (counters, histogram, gauge: which metric
  // objects exist) are guarded; the metric objects guard their own values.
  std::vector<std::unique_ptr<Family>> families_ ABSL_GUARDED_BY(mu_);
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

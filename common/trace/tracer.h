// The tracing core: spans, the tracer that batches and exports them, and
// the process-wide tracer the instrumentation uses.
//
//   trace::Span span = trace::StartSpan("plan.solve", parent);
//   span.SetAttribute("knapserve.plan.gamma", int64_t{4});
//   ...
//   span.End();  // or let it go out of scope
//
// Tracing is off unless a binary installs a tracer (SetGlobalTracer; tools/
// does so when OTEL_EXPORTER_OTLP_ENDPOINT is set, see
// common/trace/otlp_http_exporter.h). Off, StartSpan is one atomic load and
// returns an empty Span whose methods do nothing; on, a span costs its
// attributes and one queue push when it ends. Spans a sampler drops carry
// their context (for propagation, with the sampled flag off) but record
// nothing.
//
// Export: ended spans go into a bounded queue (max_queue_spans); a full queue
// drops the span and counts it, so ending a span never waits. One exporter
// thread takes batches of up to max_batch_spans every batch_interval (or as
// soon as a batch is full), encodes them (common/trace/span_data.h) and hands
// them to the SpanExporter; spans of a failed export are counted, not
// retried. Shutdown flushes what is queued within a deadline.
//
// Counters (with a MetricsRegistry): knapserve_trace_spans_dropped_total
// (queue full, or ended after Shutdown), knapserve_trace_spans_exported_total
// and knapserve_trace_spans_failed_total (their export failed).
//
// Ownership: a Tracer owns its queue, exporter and thread, and borrows the
// registry until Shutdown (after which the registry may go: later drops are
// only counted in dropped()). A Span refers to the tracer that started it,
// which must outlive it (the global tracer of a binary is never destroyed,
// only shut down).
// Thread safety: Tracer is thread-safe. A Span is used by one thread at a
// time but may move between threads (a plan's send span is started by the
// writer thread and ended by the reader).
#ifndef KNAPSERVE_COMMON_TRACE_TRACER_H_
#define KNAPSERVE_COMMON_TRACE_TRACER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics/metrics.h"
#include "common/trace/sampler.h"
#include "common/trace/span_context.h"
#include "common/trace/span_data.h"

namespace knapserve::trace {

// Nanoseconds since the Unix epoch (the system clock), as OTLP wants them.
int64_t NowUnixNanos();

// Where batches of encoded spans go (OtlpHttpExporter; tests use fakes).
// Called on the exporter thread only, one call at a time.
class SpanExporter {
 public:
  virtual ~SpanExporter() = default;
  // POSTs one ExportTraceServiceRequest (JSON) and returns once it was
  // accepted or failed; must give up by `deadline`.
  virtual absl::Status Export(const std::string& body, absl::Time deadline) = 0;
};

struct TracerOptions {
  std::string service_name = "knapserve";
  // More resource attributes (service.name, telemetry.sdk.* are added).
  std::vector<Attribute> resource;
  Sampler sampler;
  size_t max_queue_spans = 2048;
  size_t max_batch_spans = 512;
  absl::Duration batch_interval = absl::Milliseconds(200);
  // One export may take this long (those Shutdown starts: at most until its
  // deadline).
  absl::Duration export_timeout = absl::Seconds(3);
  // Where the counters go (nullptr: none).
  MetricsRegistry* metrics = nullptr;
};

class Tracer;

// One span. Empty (default-constructed, or started while tracing is off)
// or not sampled: every method is a no-op and recording() is false.
// Ends at destruction if End was not called. Move-only.
class Span {
 public:
  Span() = default;
  Span(Span&& other) noexcept { *this = std::move(other); }
  Span& operator=(Span&& other) noexcept;
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  ~Span() { End(); }

  // Whether this span will be exported.
  bool recording() const { return data_ != nullptr; }
  // Its context (invalid when tracing is off); children use it as parent.
  const SpanContext& context() const { return context_; }
  // context() as a W3C traceparent ("" when invalid).
  std::string traceparent() const { return FormatTraceparent(context_); }

  // Sets (or replaces) an attribute. Other integer types must be cast.
  void SetAttribute(std::string_view key, std::string_view value);
  void SetAttribute(std::string_view key, const char* value) {
    SetAttribute(key, std::string_view(value));
  }
  void SetAttribute(std::string_view key, int64_t value);
  void SetAttribute(std::string_view key, int value) {
    SetAttribute(key, static_cast<int64_t>(value));
  }
  void SetAttribute(std::string_view key, double value);
  void SetAttribute(std::string_view key, bool value);
  void SetAttribute(std::string_view key, std::vector<std::string> value);
  // Marks the span failed with `message` (OTLP status ERROR).
  void SetError(std::string_view message);
  // Marks it OK (OTLP status OK).
  void SetOk();
  // Moves its start (a span reconstructed from measured times).
  void SetStartTime(int64_t unix_nanos);
  // Ends it now, or at `end_unix_nanos`, and queues it for export. Later
  // calls do nothing.
  void End();
  void End(int64_t end_unix_nanos);

 private:
  friend class Tracer;
  void Set(std::string_view key, AttributeValue value);

  Tracer* tracer_ = nullptr;
  std::unique_ptr<SpanData> data_;  // null unless recording
  SpanContext context_;
};

class Tracer {
 public:
  // Starts the exporter thread.
  Tracer(TracerOptions options, std::unique_ptr<SpanExporter> exporter);
  // Shutdown(5 s) if it did not run yet.
  ~Tracer();
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  // A span named `name`, child of `parent` (invalid: a new trace), started
  // now (or at start_unix_nanos when > 0). The sampler decides whether it
  // records.
  Span StartSpan(std::string_view name, const SpanContext& parent = {},
                 SpanKind kind = SpanKind::kInternal,
                 int64_t start_unix_nanos = 0);

  // Exports what is queued (and what Span::End queues meanwhile) until the
  // queue is empty or `timeout` passed, then stops the thread and lets go of
  // the metrics registry; later spans are dropped. An export already in
  // flight keeps its own deadline (export_timeout), so this may take up to
  // export_timeout + timeout. Idempotent; any thread.
  void Shutdown(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

  // Spans dropped (queue full, after Shutdown, unexported at the deadline),
  // exported, and lost in failed exports.
  int64_t dropped() const { return dropped_.load(); }
  int64_t exported() const { return exported_.load(); }
  int64_t failed() const { return failed_.load(); }
  const TracerOptions& options() const { return options_; }

 private:
  friend class Span;
  // Queues a finished span, or drops it. Never waits for space.
  void Enqueue(std::unique_ptr<SpanData> span) ABSL_LOCKS_EXCLUDED(mu_);
  // Counts in the atomics and, until Shutdown, the registry.
  void CountDropped(int64_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CountExport(int64_t n, bool ok) ABSL_LOCKS_EXCLUDED(mu_);
  // The exporter thread.
  void Run() ABSL_LOCKS_EXCLUDED(mu_);
  // Encodes and exports one batch (exporter thread).
  void ExportBatch(const std::vector<SpanData>& batch, absl::Time deadline);

  const TracerOptions options_;
  const std::unique_ptr<SpanExporter> exporter_;
  std::vector<Attribute> resource_;  // service.name and the rest
  std::atomic<int64_t> dropped_{0};
  std::atomic<int64_t> exported_{0};
  std::atomic<int64_t> failed_{0};
  bool failing_ = false;  // the last export failed (exporter thread only)

  absl::Mutex mu_;
  std::deque<SpanData> queue_ ABSL_GUARDED_BY(mu_);
  // The registry's counters (null without one, and after Shutdown).
  Counter* dropped_counter_ ABSL_GUARDED_BY(mu_) = nullptr;
  Counter* exported_counter_ ABSL_GUARDED_BY(mu_) = nullptr;
  Counter* failed_counter_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // Shutdown began
  absl::Time flush_deadline_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool joined_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started when everything above exists
};

// The process-wide tracer (nullptr, the default: tracing off). The binaries
// in tools/ set it once at start-up; it must stay alive while any span may
// still end (they never destroy it, only shut it down). Any thread.
Tracer* GlobalTracer();
void SetGlobalTracer(Tracer* tracer);

// GlobalTracer()->StartSpan(...), or an empty span when tracing is off.
Span StartSpan(std::string_view name, const SpanContext& parent = {},
               SpanKind kind = SpanKind::kInternal,
               int64_t start_unix_nanos = 0);
// The same with the parent as a W3C traceparent; a malformed or empty one
// starts a new trace.
Span StartSpan(std::string_view name, std::string_view parent_traceparent,
               SpanKind kind = SpanKind::kInternal,
               int64_t start_unix_nanos = 0);

// Shuts a tracer down (flushing within `timeout`) when it goes out of scope,
// e.g. as a member declared after the metrics registry the tracer counts
// into. The tracer itself lives on. nullptr: nothing.
class TracerShutdown {
 public:
  explicit TracerShutdown(Tracer* tracer = nullptr,
                          absl::Duration timeout = absl::Seconds(5))
      : tracer_(tracer), timeout_(timeout) {}
  ~TracerShutdown() {
    if (tracer_ != nullptr) tracer_->Shutdown(timeout_);
  }
  TracerShutdown(const TracerShutdown&) = delete;
  TracerShutdown& operator=(const TracerShutdown&) = delete;

 private:
  Tracer* const tracer_;
  const absl::Duration timeout_;
};

// The calling thread's current span context: what ScopedSpan parents its
// spans to (invalid outside any).
SpanContext CurrentContext();

// Makes `context` the calling thread's current context for its scope, so
// that code deeper in the stack (the planner's solve stages) can add child
// spans without passing it along. Restores the previous one at exit.
class ScopedContext {
 public:
  explicit ScopedContext(const SpanContext& context);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

 private:
  SpanContext previous_;
};

// A child of the current context until End or the end of the scope (itself
// current meanwhile). Nothing at all when tracing is off or there is no
// current context: stages of a computation never start traces of their own.
// Scoped spans of one thread must end in reverse order of their start.
//
//   trace::ScopedSpan stage("plan.solve.knapsack_dp");
//   ASSIGN_OR_RETURN(auto candidates, SolveKnapsack(...));  // ends on return
//   stage.span().SetAttribute("knapserve.plan.candidates", n);
//   stage.End();
class ScopedSpan {
 public:
  explicit ScopedSpan(std::string_view name);
  ~ScopedSpan() { End(); }
  ScopedSpan(const ScopedSpan&) = delete;
  ScopedSpan& operator=(const ScopedSpan&) = delete;
  Span& span() { return span_; }
  // Ends the span and restores the previous current context. Idempotent.
  void End();

 private:
  Span span_;
  SpanContext previous_;
  bool active_ = false;
};

}  // namespace knapserve::trace

#endif  // KNAPSERVE_COMMON_TRACE_TRACER_H_

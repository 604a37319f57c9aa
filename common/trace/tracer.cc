#include "common/trace/tracer.h"

#include <chrono>
#include <cstdio>
#include <utility>

namespace knapserve::trace {
namespace {

std::atomic<Tracer*> global_tracer{nullptr};
thread_local SpanContext current_context;

}  // namespace

int64_t NowUnixNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// ---------------------------------------------------------------------------
// Span

Span& Span::operator=(Span&& other) noexcept {
  if (this != &other) {
    End();
    tracer_ = std::exchange(other.tracer_, nullptr);
    data_ = std::move(other.data_);
    context_ = std::exchange(other.context_, SpanContext());
  }
  return *this;
}

void Span::Set(std::string_view key, AttributeValue value) {
  for (Attribute& attribute : data_->attributes) {
    if (attribute.first == key) {
      attribute.second = std::move(value);
      return;
    }
  }
  data_->attributes.emplace_back(std::string(key), std::move(value));
}

void Span::SetAttribute(std::string_view key, std::string_view value) {
  if (data_ != nullptr) Set(key, std::string(value));
}
void Span::SetAttribute(std::string_view key, int64_t value) {
  if (data_ != nullptr) Set(key, value);
}
void Span::SetAttribute(std::string_view key, double value) {
  if (data_ != nullptr) Set(key, value);
}
void Span::SetAttribute(std::string_view key, bool value) {
  if (data_ != nullptr) Set(key, value);
}
void Span::SetAttribute(std::string_view key, std::vector<std::string> value) {
  if (data_ != nullptr) Set(key, std::move(value));
}

void Span::SetError(std::string_view message) {
  if (data_ == nullptr) return;
  data_->status = StatusCode::kError;
  data_->status_message = std::string(message);
}

void Span::SetOk() {
  if (data_ == nullptr) return;
  data_->status = StatusCode::kOk;
  data_->status_message.clear();
}

void Span::SetStartTime(int64_t unix_nanos) {
  if (data_ != nullptr) data_->start_unix_nanos = unix_nanos;
}

void Span::End() {
  if (data_ != nullptr) End(NowUnixNanos());
}

void Span::End(int64_t end_unix_nanos) {
  if (data_ == nullptr) return;
  data_->end_unix_nanos = std::max(end_unix_nanos, data_->start_unix_nanos);
  tracer_->Enqueue(std::move(data_));
  data_ = nullptr;
}

// ---------------------------------------------------------------------------
// Tracer

Tracer::Tracer(TracerOptions options, std::unique_ptr<SpanExporter> exporter)
    : options_(std::move(options)), exporter_(std::move(exporter)) {
  resource_.emplace_back("service.name", options_.service_name);
  resource_.emplace_back("telemetry.sdk.name", std::string("knapserve"));
  resource_.emplace_back("telemetry.sdk.language", std::string("cpp"));
  for (const Attribute& attribute : options_.resource) {
    if (attribute.first != "service.name") resource_.push_back(attribute);
  }
  if (options_.metrics != nullptr) {
    absl::MutexLock lock(&mu_);
    dropped_counter_ = &options_.metrics->AddCounter(
        "knapserve_trace_spans_dropped_total",
        "Spans dropped before export: the queue was full, or they ended "
        "after shutdown.");
    exported_counter_ =
        &options_.metrics->AddCounter("knapserve_trace_spans_exported_total",
                                      "Spans the OTLP receiver accepted.");
    failed_counter_ = &options_.metrics->AddCounter(
        "knapserve_trace_spans_failed_total",
        "Spans lost in exports that failed (not retried).");
  }
  thread_ = std::thread([this] { Run(); });
}

Tracer::~Tracer() {
  Shutdown(absl::Seconds(5));
  if (GlobalTracer() == this) SetGlobalTracer(nullptr);
}

Span Tracer::StartSpan(std::string_view name, const SpanContext& parent,
                       SpanKind kind, int64_t start_unix_nanos) {
  Span span;
  span.tracer_ = this;
  span.context_.trace_id = parent.valid() ? parent.trace_id : RandomTraceId();
  span.context_.span_id = RandomSpanId();
  span.context_.sampled =
      options_.sampler.ShouldSample(parent, span.context_.trace_id);
  if (!span.context_.sampled) return span;
  span.data_ = std::make_unique<SpanData>();
  SpanData& data = *span.data_;
  data.context = span.context_;
  if (parent.valid()) data.parent_span_id = parent.span_id;
  data.name = std::string(name);
  data.kind = kind;
  data.start_unix_nanos =
      start_unix_nanos > 0 ? start_unix_nanos : NowUnixNanos();
  return span;
}

void Tracer::CountDropped(int64_t n) {
  if (n <= 0) return;
  dropped_.fetch_add(n);
  if (dropped_counter_ != nullptr)
    dropped_counter_->Add(static_cast<double>(n));
}

void Tracer::CountExport(int64_t n, bool ok) {
  (ok ? exported_ : failed_).fetch_add(n);
  absl::MutexLock lock(&mu_);
  Counter* counter = ok ? exported_counter_ : failed_counter_;
  if (counter != nullptr) counter->Add(static_cast<double>(n));
}

void Tracer::Enqueue(std::unique_ptr<SpanData> span) {
  absl::MutexLock lock(&mu_);
  if (!stopping_ && queue_.size() < options_.max_queue_spans) {
    queue_.push_back(std::move(*span));
    return;
  }
  CountDropped(1);
}

void Tracer::Shutdown(absl::Duration timeout) {
  {
    absl::MutexLock lock(&mu_);
    if (joined_) return;
    joined_ = true;
    stopping_ = true;
    flush_deadline_ = absl::Now() + timeout;
  }
  thread_.join();
  // The registry may go now.
  absl::MutexLock lock(&mu_);
  dropped_counter_ = nullptr;
  exported_counter_ = nullptr;
  failed_counter_ = nullptr;
}

void Tracer::ExportBatch(const std::vector<SpanData>& batch,
                         absl::Time deadline) {
  const int64_t n = static_cast<int64_t>(batch.size());
  absl::Status status;
  try {
    status = exporter_->Export(EncodeOtlpJson(resource_, "knapserve", batch),
                               deadline);
  } catch (const std::exception& e) {
    status = absl::InternalError(e.what());
  }
  CountExport(n, status.ok());
  if (status.ok()) {
    if (failing_) {
      std::fprintf(stderr, "knapserve: trace export works again\n");
      failing_ = false;
    }
    return;
  }
  if (!failing_) {
    // Once per run of failures: a receiver that is down must not flood the
    // log.
    std::fprintf(stderr,
                 "knapserve: trace export failed (%lld spans lost; reported "
                 "again once it works): %s\n",
                 static_cast<long long>(n), status.ToString().c_str());
    failing_ = true;
  }
}

void Tracer::Run() {
  while (true) {
    std::vector<SpanData> batch;
    absl::Time deadline;
    bool stopping = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || queue_.size() >= options_.max_batch_spans;
      };
      mu_.AwaitWithTimeout(absl::Condition(&ready), options_.batch_interval);
      stopping = stopping_;
      if (stopping && absl::Now() >= flush_deadline_) {
        // Out of time: what is left is lost.
        CountDropped(static_cast<int64_t>(queue_.size()));
        queue_.clear();
        return;
      }
      const size_t take = std::min(queue_.size(), options_.max_batch_spans);
      batch.reserve(take);
      for (size_t i = 0; i < take; ++i) {
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      if (stopping && batch.empty()) return;
      deadline = absl::Now() + options_.export_timeout;
      if (stopping) deadline = std::min(deadline, flush_deadline_);
    }
    if (!batch.empty()) ExportBatch(batch, deadline);
  }
}

// ---------------------------------------------------------------------------
// The global tracer and the current context

Tracer* GlobalTracer() { return global_tracer.load(std::memory_order_acquire); }

void SetGlobalTracer(Tracer* tracer) {
  global_tracer.store(tracer, std::memory_order_release);
}

Span StartSpan(std::string_view name, const SpanContext& parent, SpanKind kind,
               int64_t start_unix_nanos) {
  Tracer* tracer = GlobalTracer();
  if (tracer == nullptr) return Span();
  return tracer->StartSpan(name, parent, kind, start_unix_nanos);
}

Span StartSpan(std::string_view name, std::string_view parent_traceparent,
               SpanKind kind, int64_t start_unix_nanos) {
  Tracer* tracer = GlobalTracer();
  if (tracer == nullptr) return Span();
  const std::optional<SpanContext> parent =
      ParseTraceparent(parent_traceparent);
  return tracer->StartSpan(name, parent.value_or(SpanContext()), kind,
                           start_unix_nanos);
}

SpanContext CurrentContext() { return current_context; }

ScopedContext::ScopedContext(const SpanContext& context)
    : previous_(current_context) {
  current_context = context;
}

ScopedContext::~ScopedContext() { current_context = previous_; }

ScopedSpan::ScopedSpan(std::string_view name) {
  if (GlobalTracer() == nullptr || !current_context.valid()) return;
  span_ = StartSpan(name, current_context);
  previous_ = current_context;
  current_context = span_.context();
  active_ = true;
}

void ScopedSpan::End() {
  if (!active_) return;
  active_ = false;
  span_.End();
  current_context = previous_;
}

}  // namespace knapserve::trace

// The tracing core: W3C traceparent, the sampler, the OTLP JSON encoding,
// the tracer's bounded queue and exporter thread, scoped spans, and the
// configuration from OTEL_* variables.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/metrics/metrics.h"
#include "common/trace/otlp_http_exporter.h"
#include "common/trace/sampler.h"
#include "common/trace/span_context.h"
#include "common/trace/span_data.h"
#include "common/trace/tracer.h"

namespace knapserve::trace {
namespace {

using ::testing::HasSubstr;

constexpr char kExample[] =
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

TEST(TraceparentTest, ParsesAndFormatsTheW3cExample) {
  const std::optional<SpanContext> context = ParseTraceparent(kExample);
  ASSERT_TRUE(context.has_value());
  EXPECT_EQ(ToHex(context->trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
  EXPECT_EQ(ToHex(context->span_id), "00f067aa0ba902b7");
  EXPECT_TRUE(context->sampled);
  EXPECT_TRUE(context->valid());
  EXPECT_EQ(FormatTraceparent(*context), kExample);

  const std::optional<SpanContext> unsampled = ParseTraceparent(
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00");
  ASSERT_TRUE(unsampled.has_value());
  EXPECT_FALSE(unsampled->sampled);
  EXPECT_EQ(FormatTraceparent(*unsampled),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00");
  // Only bit 0 of the flags means sampled; other bits are kept out.
  const std::optional<SpanContext> other_flags = ParseTraceparent(
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03");
  ASSERT_TRUE(other_flags.has_value());
  EXPECT_TRUE(other_flags->sampled);
  // Surrounding spaces and tabs (HTTP's optional whitespace) are fine.
  EXPECT_EQ(ParseTraceparent(std::string(" \t") + kExample + " "), context);
}

TEST(TraceparentTest, RandomContextsRoundTrip) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    SpanContext context{RandomTraceId(), RandomSpanId(), i % 2 == 0};
    ASSERT_TRUE(context.valid());
    const std::string header = FormatTraceparent(context);
    EXPECT_EQ(header.size(), 55u);
    EXPECT_EQ(ParseTraceparent(header), context) << header;
    seen.insert(header);
  }
  EXPECT_EQ(seen.size(), 100u);
  EXPECT_EQ(FormatTraceparent(SpanContext()), "");
}

TEST(TraceparentTest, MalformedHeadersAreIgnored) {
  const std::string trace = "4bf92f3577b34da6a3ce929d0e0e4736";
  const std::string span = "00f067aa0ba902b7";
  const std::vector<std::string> bad = {
      "",
      "garbage",
      "00",
      // Upper-case hex is not allowed.
      "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
      "00-" + trace + "-00F067AA0BA902B7-01",
      // Version ff is forbidden; version 00 has exactly four fields.
      "ff-" + trace + "-" + span + "-01",
      "00-" + trace + "-" + span + "-01-extra",
      "00-" + trace + "-" + span + "-010",
      // All-zero ids.
      "00-00000000000000000000000000000000-" + span + "-01",
      "00-" + trace + "-0000000000000000-01",
      // Lengths and separators.
      "00-" + trace.substr(1) + "-" + span + "-01",
      "00-" + trace + "-" + span.substr(1) + "-01",
      "00_" + trace + "-" + span + "-01",
      "00-" + trace + "_" + span + "-01",
      "00-" + trace + "-" + span + "_01",
      "0-" + trace + "-" + span + "-01",
      // Non-hex digits.
      "00-" + trace.substr(0, 31) + "g-" + span + "-01",
      "00-" + trace + "-" + span + "-0x",
      "zz-" + trace + "-" + span + "-01",
      // A later version's extra fields must follow a '-'.
      "01-" + trace + "-" + span + "-01x",
  };
  for (const std::string& header : bad) {
    EXPECT_FALSE(ParseTraceparent(header).has_value()) << header;
  }
  // A later version with more fields: its first four are read.
  const std::optional<SpanContext> future =
      ParseTraceparent("cc-" + trace + "-" + span + "-01-what-comes-next");
  ASSERT_TRUE(future.has_value());
  EXPECT_EQ(ToHex(future->trace_id), trace);
}

TEST(TraceSamplerTest, ParsesTheOtelNames) {
  const SpanContext sampled_parent{RandomTraceId(), RandomSpanId(), true};
  const SpanContext unsampled_parent{RandomTraceId(), RandomSpanId(), false};
  const SpanContext root;
  const TraceId id = RandomTraceId();
  struct Case {
    std::string name;
    bool root, sampled_parent, unsampled_parent;
  };
  for (const Case& c : std::vector<Case>{
           {"", true, true, false},
           {"parentbased_always_on", true, true, false},
           {"always_on", true, true, true},
           {"always_off", false, false, false},
           {"parentbased_always_off", false, true, false},
           {" ALWAYS_ON ", true, true, true},
       }) {
    absl::StatusOr<Sampler> sampler = Sampler::Parse(c.name, "");
    ASSERT_TRUE(sampler.ok()) << c.name << ": " << sampler.status();
    EXPECT_EQ(sampler->ShouldSample(root, id), c.root) << c.name;
    EXPECT_EQ(sampler->ShouldSample(sampled_parent, id), c.sampled_parent)
        << c.name;
    EXPECT_EQ(sampler->ShouldSample(unsampled_parent, id), c.unsampled_parent)
        << c.name;
  }
  EXPECT_EQ(Sampler().Describe(), "parentbased_always_on");
  EXPECT_FALSE(Sampler::Parse("sometimes", "").ok());
  EXPECT_THAT(std::string(Sampler::Parse("sometimes", "").status().message()),
              HasSubstr("OTEL_TRACES_SAMPLER"));
  for (const char* arg : {"x", "-0.1", "1.5", "nan"}) {
    EXPECT_FALSE(Sampler::Parse("traceidratio", arg).ok()) << arg;
  }
}

TEST(TraceSamplerTest, TraceIdRatioSamplesAShareDecidedByTheTraceId) {
  absl::StatusOr<Sampler> quarter = Sampler::Parse("traceidratio", "0.25");
  ASSERT_TRUE(quarter.ok());
  int sampled = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const TraceId id = RandomTraceId();
    const bool decision = quarter->ShouldSample(SpanContext(), id);
    // The same trace id always gets the same answer (every process agrees).
    EXPECT_EQ(quarter->ShouldSample(SpanContext(), id), decision);
    sampled += decision ? 1 : 0;
  }
  // 0.25 of 20000, within 5 standard deviations (sqrt(n p (1-p)) = 61).
  EXPECT_NEAR(sampled, n / 4, 310);
  // The decision is the last 8 bytes against ratio * 2^64.
  TraceId low{}, high{};
  low[15] = 1;
  high.fill(0xff);
  EXPECT_TRUE(quarter->ShouldSample(SpanContext(), low));
  EXPECT_FALSE(quarter->ShouldSample(SpanContext(), high));
  // Parent-based: the parent's flag wins over the ratio.
  absl::StatusOr<Sampler> none =
      Sampler::Parse("parentbased_traceidratio", "0");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->ShouldSample(SpanContext(), low));
  EXPECT_TRUE(
      none->ShouldSample(SpanContext{high, RandomSpanId(), true}, high));
  // No argument: ratio 1.
  absl::StatusOr<Sampler> all = Sampler::Parse("traceidratio", "");
  ASSERT_TRUE(all.ok());
  EXPECT_TRUE(all->ShouldSample(SpanContext(), high));
  // Not parent-based: an unsampled parent does not matter.
  EXPECT_TRUE(
      all->ShouldSample(SpanContext{high, RandomSpanId(), false}, high));
  EXPECT_EQ(all->Describe(), "traceidratio 1");
}

TEST(OtlpJsonTest, EncodesTheProtobufJsonMapping) {
  SpanData root;
  root.context = *ParseTraceparent(kExample);
  root.name = "generate";
  root.kind = SpanKind::kServer;
  root.start_unix_nanos = 1700000000123456789;
  root.end_unix_nanos = 1700000001123456789;
  root.attributes = {
      {"gen_ai.system", std::string("knapserve")},
      {"gen_ai.usage.output_tokens", int64_t{64}},
      {"gen_ai.request.temperature", 0.5},
      {"knapserve.flag", true},
      {"gen_ai.response.finish_reasons", std::vector<std::string>{"length"}},
      {"knapserve.nan", std::nan("")},
  };
  SpanData child;
  child.context = {root.context.trace_id, RandomSpanId(), true};
  child.parent_span_id = root.context.span_id;
  child.name = "decode";
  child.start_unix_nanos = 5;
  child.end_unix_nanos = 6;
  child.status = StatusCode::kError;
  child.status_message = "boom";

  const std::string body =
      EncodeOtlpJson({{"service.name", std::string("knapserve-executor")}},
                     "knapserve", {root, child});
  const nlohmann::json j = nlohmann::json::parse(body);
  ASSERT_EQ(j["resourceSpans"].size(), 1u);
  const nlohmann::json& rs = j["resourceSpans"][0];
  EXPECT_EQ(rs["resource"]["attributes"][0]["key"], "service.name");
  EXPECT_EQ(rs["resource"]["attributes"][0]["value"]["stringValue"],
            "knapserve-executor");
  ASSERT_EQ(rs["scopeSpans"].size(), 1u);
  EXPECT_EQ(rs["scopeSpans"][0]["scope"]["name"], "knapserve");
  const nlohmann::json& spans = rs["scopeSpans"][0]["spans"];
  ASSERT_EQ(spans.size(), 2u);
  const nlohmann::json& r = spans[0];
  EXPECT_EQ(r["traceId"], "4bf92f3577b34da6a3ce929d0e0e4736");
  EXPECT_EQ(r["spanId"], "00f067aa0ba902b7");
  EXPECT_FALSE(r.contains("parentSpanId"));
  EXPECT_FALSE(r.contains("status"));
  EXPECT_EQ(r["name"], "generate");
  EXPECT_EQ(r["kind"], 2);
  EXPECT_EQ(r["startTimeUnixNano"], "1700000000123456789");
  EXPECT_EQ(r["endTimeUnixNano"], "1700000001123456789");
  std::map<std::string, nlohmann::json> attributes;
  for (const nlohmann::json& a : r["attributes"])
    attributes[a["key"]] = a["value"];
  EXPECT_EQ(attributes["gen_ai.system"],
            (nlohmann::json{{"stringValue", "knapserve"}}));
  EXPECT_EQ(attributes["gen_ai.usage.output_tokens"],
            (nlohmann::json{{"intValue", "64"}}));
  EXPECT_EQ(attributes["gen_ai.request.temperature"],
            (nlohmann::json{{"doubleValue", 0.5}}));
  EXPECT_EQ(attributes["knapserve.flag"],
            (nlohmann::json{{"boolValue", true}}));
  EXPECT_EQ(attributes["gen_ai.response.finish_reasons"]["arrayValue"]["values"]
                      [0]["stringValue"],
            "length");
  EXPECT_EQ(attributes["knapserve.nan"],
            (nlohmann::json{{"doubleValue", "NaN"}}));
  const nlohmann::json& c = spans[1];
  EXPECT_EQ(c["parentSpanId"], "00f067aa0ba902b7");
  EXPECT_EQ(c["traceId"], r["traceId"]);
  EXPECT_EQ(c["kind"], 1);
  EXPECT_EQ(c["status"]["code"], 2);
  EXPECT_EQ(c["status"]["message"], "boom");
  EXPECT_EQ(c["attributes"], nlohmann::json::array());
}

// An exporter that records every batch; while `hold` is set, each Export
// waits until it is cleared (or its deadline passes and it fails).
class FakeExporter : public SpanExporter {
 public:
  struct State {
    absl::Mutex mu;
    std::vector<std::string> bodies ABSL_GUARDED_BY(mu);
    int calls ABSL_GUARDED_BY(mu) = 0;
    bool hold ABSL_GUARDED_BY(mu) = false;
    bool fail ABSL_GUARDED_BY(mu) = false;
  };
  explicit FakeExporter(State* state) : state_(state) {}
  absl::Status Export(const std::string& body, absl::Time deadline) override {
    absl::MutexLock lock(&state_->mu);
    ++state_->calls;
    auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
      return !state_->hold;
    };
    if (!state_->mu.AwaitWithDeadline(absl::Condition(&released), deadline)) {
      return absl::DeadlineExceededError("held past the deadline");
    }
    if (state_->fail) return absl::UnavailableError("receiver down");
    state_->bodies.push_back(body);
    return absl::OkStatus();
  }

 private:
  State* state_;
};

// Span names in the recorded bodies.
std::vector<std::string> ExportedNames(FakeExporter::State& state) {
  absl::MutexLock lock(&state.mu);
  std::vector<std::string> names;
  for (const std::string& body : state.bodies) {
    const nlohmann::json j = nlohmann::json::parse(body);
    for (const nlohmann::json& s :
         j["resourceSpans"][0]["scopeSpans"][0]["spans"]) {
      names.push_back(s["name"]);
    }
  }
  return names;
}

TEST(TracerTest, ExportsSpansInBatchesWithTheResource) {
  FakeExporter::State state;
  TracerOptions options;
  options.service_name = "svc";
  options.resource = {{"deployment.environment", std::string("test")}};
  options.max_batch_spans = 3;
  options.batch_interval = absl::Milliseconds(20);
  Tracer tracer(options, std::make_unique<FakeExporter>(&state));
  {
    Span root = tracer.StartSpan("root", {}, SpanKind::kServer);
    ASSERT_TRUE(root.recording());
    EXPECT_TRUE(root.context().sampled);
    EXPECT_EQ(ParseTraceparent(root.traceparent()), root.context());
    root.SetAttribute("k", "v");
    root.SetAttribute("k", int64_t{7});  // replaces
    for (int i = 0; i < 7; ++i) {
      Span child = tracer.StartSpan("child", root.context());
      EXPECT_EQ(child.context().trace_id, root.context().trace_id);
      EXPECT_NE(child.context().span_id, root.context().span_id);
    }  // ended by their destructors
    Span moved = tracer.StartSpan("moved", root.context());
    Span target = std::move(moved);
    EXPECT_FALSE(moved.recording());  // NOLINT: checking the moved-from span
    target.End();
    target.End();  // twice: once exported
  }
  tracer.Shutdown(absl::Seconds(5));
  const std::vector<std::string> names = ExportedNames(state);
  EXPECT_EQ(names.size(), 9u);
  EXPECT_EQ(std::count(names.begin(), names.end(), "child"), 7);
  EXPECT_EQ(tracer.exported(), 9);
  EXPECT_EQ(tracer.dropped(), 0);
  {
    absl::MutexLock lock(&state.mu);
    EXPECT_GE(state.calls, 3);  // batches of at most 3
    for (const std::string& body : state.bodies) {
      const nlohmann::json j = nlohmann::json::parse(body);
      EXPECT_LE(j["resourceSpans"][0]["scopeSpans"][0]["spans"].size(), 3u);
      const nlohmann::json& resource =
          j["resourceSpans"][0]["resource"]["attributes"];
      EXPECT_EQ(resource[0]["key"], "service.name");
      EXPECT_EQ(resource[0]["value"]["stringValue"], "svc");
      EXPECT_THAT(resource.dump(), HasSubstr("deployment.environment"));
    }
    // The root's attribute k was replaced, not repeated.
    for (const std::string& body : state.bodies) {
      if (body.find("\"root\"") == std::string::npos) continue;
      EXPECT_EQ(body.find("\"stringValue\":\"v\""), std::string::npos);
      EXPECT_NE(body.find("\"intValue\":\"7\""), std::string::npos);
    }
  }
  // After Shutdown a span is dropped and counted, never queued.
  tracer.StartSpan("late").End();
  EXPECT_EQ(tracer.dropped(), 1);
}

TEST(TracerTest, AFullQueueDropsAndCountsWithoutBlocking) {
  FakeExporter::State state;
  {
    absl::MutexLock lock(&state.mu);
    state.hold = true;
  }
  MetricsRegistry metrics;
  TracerOptions options;
  options.max_queue_spans = 4;
  options.max_batch_spans = 2;
  options.batch_interval = absl::Seconds(60);  // batches only when full
  options.metrics = &metrics;
  Tracer tracer(options, std::make_unique<FakeExporter>(&state));
  // Two spans fill a batch: the exporter thread takes them and blocks.
  tracer.StartSpan("a").End();
  tracer.StartSpan("a").End();
  {
    absl::MutexLock lock(&state.mu);
    auto called = [&state]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
      return state.calls == 1;
    };
    ASSERT_TRUE(
        state.mu.AwaitWithTimeout(absl::Condition(&called), absl::Seconds(10)));
  }
  // Four fit the queue; three more are dropped, and ending them returns at
  // once although the exporter is stuck.
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 7; ++i) tracer.StartSpan("b").End();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  EXPECT_EQ(tracer.dropped(), 3);
  EXPECT_THAT(metrics.Render(),
              HasSubstr("knapserve_trace_spans_dropped_total 3"));
  {
    absl::MutexLock lock(&state.mu);
    state.hold = false;
  }
  tracer.Shutdown(absl::Seconds(10));
  EXPECT_EQ(tracer.exported(), 6);
  EXPECT_EQ(tracer.failed(), 0);
  EXPECT_EQ(ExportedNames(state).size(), 6u);
  const std::string rendered = metrics.Render();
  EXPECT_THAT(rendered, HasSubstr("knapserve_trace_spans_exported_total 6"));
  EXPECT_THAT(rendered, HasSubstr("knapserve_trace_spans_failed_total 0"));
}

TEST(TracerTest, FailedExportsAreCountedAndShutdownKeepsItsDeadline) {
  FakeExporter::State state;
  {
    absl::MutexLock lock(&state.mu);
    state.fail = true;
  }
  TracerOptions options;
  options.batch_interval = absl::Milliseconds(10);
  // An export in flight ends by its own deadline: Shutdown waits for it.
  options.export_timeout = absl::Milliseconds(200);
  Tracer tracer(options, std::make_unique<FakeExporter>(&state));
  tracer.StartSpan("x").End();
  tracer.StartSpan("y").End();
  for (int i = 0; i < 500 && tracer.failed() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(tracer.failed(), 2);
  EXPECT_EQ(tracer.exported(), 0);
  // A receiver that never answers: Shutdown gives up at its deadline.
  {
    absl::MutexLock lock(&state.mu);
    state.fail = false;
    state.hold = true;
  }
  for (int i = 0; i < 5; ++i) tracer.StartSpan("z").End();
  const auto start = std::chrono::steady_clock::now();
  tracer.Shutdown(absl::Milliseconds(300));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  // The five were in a held export (failed) or still queued (dropped).
  EXPECT_EQ(tracer.failed() + tracer.dropped(), 2 + 5);
  EXPECT_EQ(tracer.exported(), 0);
}

TEST(TracerTest, UnsampledSpansPropagateButRecordNothing) {
  FakeExporter::State state;
  TracerOptions options;
  options.sampler = *Sampler::Parse("parentbased_always_off", "");
  Tracer tracer(options, std::make_unique<FakeExporter>(&state));
  Span root = tracer.StartSpan("root");
  EXPECT_FALSE(root.recording());
  EXPECT_TRUE(root.context().valid());
  EXPECT_FALSE(root.context().sampled);
  EXPECT_THAT(root.traceparent(), ::testing::EndsWith("-00"));
  root.SetAttribute("ignored", true);
  root.End();
  // A sampled remote parent wins (parent-based).
  Span child = tracer.StartSpan("child", *ParseTraceparent(kExample));
  EXPECT_TRUE(child.recording());
  child.End();
  tracer.Shutdown(absl::Seconds(5));
  EXPECT_EQ(ExportedNames(state), std::vector<std::string>{"child"});
}

TEST(TracerTest, ScopedSpansNeedAGlobalTracerAndACurrentContext) {
  // Off: nothing, not even a context.
  ASSERT_EQ(GlobalTracer(), nullptr);
  EXPECT_FALSE(StartSpan("off").context().valid());
  EXPECT_FALSE(StartSpan("off", std::string_view(kExample)).recording());
  {
    ScopedSpan stage("stage");
    EXPECT_FALSE(stage.span().context().valid());
  }
  FakeExporter::State state;
  {
    Tracer tracer(TracerOptions(), std::make_unique<FakeExporter>(&state));
    SetGlobalTracer(&tracer);
    {
      ScopedSpan orphan("orphan");  // no current context: no span
      EXPECT_FALSE(orphan.span().recording());
    }
    Span solve = StartSpan("solve", std::string_view(kExample));
    EXPECT_EQ(ToHex(solve.context().trace_id),
              "4bf92f3577b34da6a3ce929d0e0e4736");
    // A malformed parent starts a new trace.
    Span fresh = StartSpan("fresh", std::string_view("00-bad"));
    EXPECT_TRUE(fresh.recording());
    EXPECT_NE(fresh.context().trace_id, solve.context().trace_id);
    fresh.End();
    {
      ScopedContext in_solve(solve.context());
      ScopedSpan stage("stage");
      EXPECT_TRUE(stage.span().recording());
      EXPECT_EQ(CurrentContext(), stage.span().context());
      ScopedSpan inner("inner");
      EXPECT_TRUE(inner.span().recording());
    }
    EXPECT_FALSE(CurrentContext().valid());
    solve.End();
    tracer.Shutdown(absl::Seconds(5));
    SetGlobalTracer(nullptr);
  }
  std::map<std::string, nlohmann::json> by_name;
  {
    absl::MutexLock lock(&state.mu);
    for (const std::string& body : state.bodies) {
      const nlohmann::json j = nlohmann::json::parse(body);
      for (const nlohmann::json& s :
           j["resourceSpans"][0]["scopeSpans"][0]["spans"]) {
        by_name[s["name"]] = s;
      }
    }
  }
  ASSERT_EQ(by_name.size(), 4u);
  EXPECT_EQ(by_name["solve"]["parentSpanId"], "00f067aa0ba902b7");
  EXPECT_EQ(by_name["stage"]["parentSpanId"], by_name["solve"]["spanId"]);
  EXPECT_EQ(by_name["inner"]["parentSpanId"], by_name["stage"]["spanId"]);
  EXPECT_FALSE(by_name["fresh"].contains("parentSpanId"));
}

// Off, a span is an empty object: starting and ending a million of them,
// with attributes, takes well under a second (6 ms for the million here).
TEST(TracerTest, SpansCostAlmostNothingWhenTracingIsOff) {
  ASSERT_EQ(GlobalTracer(), nullptr);
  const auto start = std::chrono::steady_clock::now();
  int64_t valid = 0;
  for (int i = 0; i < 1000000; ++i) {
    Span span = StartSpan("plan.apply", SpanContext());
    span.SetAttribute("knapserve.plan.gamma", int64_t{i});
    valid += span.context().valid() ? 1 : 0;
    ScopedSpan stage("plan.solve.knapsack_dp");
  }
  EXPECT_EQ(valid, 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
}

TEST(TracingConfigTest, ReadsTheOtelVariables) {
  std::map<std::string, std::string> env;
  const GetEnv getenv = [&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  // No endpoint: off.
  absl::StatusOr<std::optional<TracingConfig>> config =
      TracingConfigFromEnv("knapserve-executor", getenv);
  ASSERT_TRUE(config.ok());
  EXPECT_FALSE(config->has_value());

  env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://collector:4318";
  config = TracingConfigFromEnv("knapserve-executor", getenv);
  ASSERT_TRUE(config.ok() && config->has_value());
  EXPECT_EQ((*config)->traces_url, "http://collector:4318/v1/traces");
  EXPECT_EQ((*config)->tracer.service_name, "knapserve-executor");
  EXPECT_EQ((*config)->tracer.sampler.Describe(), "parentbased_always_on");

  env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://collector:4318/base/";
  env["OTEL_SERVICE_NAME"] = "planner-a";
  env["OTEL_RESOURCE_ATTRIBUTES"] =
      "deployment.environment=prod, k8s.pod.name = p-1,broken,service.name=x";
  env["OTEL_TRACES_SAMPLER"] = "parentbased_traceidratio";
  env["OTEL_TRACES_SAMPLER_ARG"] = "0.1";
  config = TracingConfigFromEnv("knapserve-planner", getenv);
  ASSERT_TRUE(config.ok() && config->has_value());
  EXPECT_EQ((*config)->traces_url, "http://collector:4318/base/v1/traces");
  EXPECT_EQ((*config)->tracer.service_name, "planner-a");
  EXPECT_EQ((*config)->tracer.sampler.Describe(),
            "parentbased_traceidratio 0.1");
  ASSERT_EQ((*config)->tracer.resource.size(), 2u);
  EXPECT_EQ((*config)->tracer.resource[1].first, "k8s.pod.name");
  EXPECT_EQ(std::get<std::string>((*config)->tracer.resource[1].second), "p-1");

  // The traces endpoint is used as it is.
  env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "https://tempo:4318/otlp/traces";
  config = TracingConfigFromEnv("knapserve-planner", getenv);
  ASSERT_TRUE(config.ok() && config->has_value());
  EXPECT_EQ((*config)->traces_url, "https://tempo:4318/otlp/traces");

  env["OTEL_SDK_DISABLED"] = "true";
  config = TracingConfigFromEnv("knapserve-planner", getenv);
  ASSERT_TRUE(config.ok());
  EXPECT_FALSE(config->has_value());
  env.erase("OTEL_SDK_DISABLED");

  env["OTEL_TRACES_SAMPLER"] = "sometimes";
  EXPECT_FALSE(TracingConfigFromEnv("x", getenv).ok());
  env["OTEL_TRACES_SAMPLER"] = "always_on";
  env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "grpc://collector:4317";
  EXPECT_FALSE(TracingConfigFromEnv("x", getenv).ok());
}

TEST(TracingConfigTest, ParsesHttpUrls) {
  absl::StatusOr<HttpUrl> url = ParseHttpUrl("http://127.0.0.1:4318/v1/traces");
  ASSERT_TRUE(url.ok());
  EXPECT_EQ(url->scheme_host_port, "http://127.0.0.1:4318");
  EXPECT_EQ(url->path, "/v1/traces");
  url = ParseHttpUrl("https://tempo.example");
  ASSERT_TRUE(url.ok());
  EXPECT_EQ(url->scheme_host_port, "https://tempo.example");
  EXPECT_EQ(url->path, "/");
  url = ParseHttpUrl("http://[::1]:4318/v1/traces");
  ASSERT_TRUE(url.ok());
  EXPECT_EQ(url->scheme_host_port, "http://[::1]:4318");
  for (const char* bad : {"collector:4318", "http://", "http://host:0/",
                          "http://host:99999/", "http://host:x/"}) {
    EXPECT_FALSE(ParseHttpUrl(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace knapserve::trace

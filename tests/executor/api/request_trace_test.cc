// RequestTrace: the generate span and its queue / prefill / decode children
// for a request that ran, one refused before it ran, and one that failed
// while running; nothing at all while tracing is off.
#include "executor/api/request_trace.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/trace/tracer.h"

namespace knapserve {
namespace {

// Keeps every exported batch.
class MemoryExporter : public trace::SpanExporter {
 public:
  struct Bodies {
    absl::Mutex mu;
    std::vector<std::string> list ABSL_GUARDED_BY(mu);
  };
  explicit MemoryExporter(Bodies* bodies) : bodies_(bodies) {}
  absl::Status Export(const std::string& body, absl::Time) override {
    absl::MutexLock lock(&bodies_->mu);
    bodies_->list.push_back(body);
    return absl::OkStatus();
  }

 private:
  Bodies* bodies_;
};

// A tracer installed as the global one for the test's scope; spans() ends
// it and returns what it exported, by name.
class ScopedTracing {
 public:
  ScopedTracing()
      : tracer_(trace::TracerOptions(),
                std::make_unique<MemoryExporter>(&bodies_)) {
    trace::SetGlobalTracer(&tracer_);
  }
  ~ScopedTracing() { trace::SetGlobalTracer(nullptr); }
  std::multimap<std::string, nlohmann::json> spans() {
    tracer_.Shutdown(absl::Seconds(10));
    std::multimap<std::string, nlohmann::json> out;
    absl::MutexLock lock(&bodies_.mu);
    for (const std::string& body : bodies_.list) {
      const nlohmann::json j = nlohmann::json::parse(body);
      for (const nlohmann::json& s :
           j["resourceSpans"][0]["scopeSpans"][0]["spans"]) {
        out.emplace(s["name"].get<std::string>(), s);
      }
    }
    return out;
  }

 private:
  MemoryExporter::Bodies bodies_;
  trace::Tracer tracer_;
};

std::map<std::string, nlohmann::json> Attributes(const nlohmann::json& span) {
  std::map<std::string, nlohmann::json> out;
  for (const nlohmann::json& a : span["attributes"]) out[a["key"]] = a["value"];
  return out;
}

int64_t Nanos(const nlohmann::json& span, const char* field) {
  return std::stoll(span[field].get<std::string>());
}

constexpr char kCaller[] =
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

TEST(RequestTraceTest, DoesNothingWhileTracingIsOff) {
  ASSERT_EQ(trace::GlobalTracer(), nullptr);
  RequestTrace t;
  t.Start(kCaller, "req-1", "grpc", "text_completion", "m");
  GenerationRequest request;
  t.Begin(request);
  EXPECT_FALSE(request.trace_parent.valid());
  EXPECT_FALSE(t.context().valid());
  t.Finish(absl::OkStatus(), nullptr);
}

TEST(RequestTraceTest, ARequestThatRanHasQueuePrefillAndDecode) {
  ScopedTracing tracing;
  RequestTrace t;
  t.Start(kCaller, "req-1", "http", "chat", "stories");
  GenerationRequest request;
  request.max_new_tokens = 7;
  request.sampling.temperature = 0.5;
  request.speculation.mode = SpeculationMode::kKnapSpec;
  t.Begin(request);
  ASSERT_TRUE(request.trace_parent.valid());
  EXPECT_EQ(request.trace_parent.trace_id, t.context().trace_id);
  GenerationResult result;
  result.finish_reason = FinishReason::kLength;
  result.stats.prompt_tokens = 3;
  result.stats.completion_tokens = 7;
  const int64_t now = trace::NowUnixNanos();
  result.stats.first_pass_unix_nanos = now + 1000;
  result.stats.first_token_unix_nanos = now + 2000;
  result.stats.end_unix_nanos = now + 3000;
  result.speculation.drafts = 2;
  result.speculation.draft_tokens = 4;
  result.speculation.accepted_tokens = 3;
  // Finish runs after the sequence's end.
  while (trace::NowUnixNanos() <= now + 3000) {
  }
  t.Finish(absl::OkStatus(), &result);
  t.Finish(absl::InternalError("twice"), nullptr);  // ignored

  const auto spans = tracing.spans();
  ASSERT_EQ(spans.size(), 4u);
  const nlohmann::json& generate = spans.find("generate")->second;
  EXPECT_EQ(generate["parentSpanId"], "b7ad6b7169203331");
  EXPECT_EQ(generate["traceId"], "0af7651916cd43dd8448eb211c80319c");
  EXPECT_EQ(generate["status"]["code"], 1);
  auto a = Attributes(generate);
  EXPECT_EQ(a["gen_ai.operation.name"]["stringValue"], "chat");
  EXPECT_EQ(a["gen_ai.request.model"]["stringValue"], "stories");
  EXPECT_EQ(a["gen_ai.request.max_tokens"]["intValue"], "7");
  EXPECT_EQ(a["gen_ai.request.temperature"]["doubleValue"], 0.5);
  EXPECT_EQ(a["gen_ai.usage.input_tokens"]["intValue"], "3");
  EXPECT_EQ(a["gen_ai.usage.output_tokens"]["intValue"], "7");
  EXPECT_EQ(a["knapserve.front_door"]["stringValue"], "http");
  EXPECT_EQ(a["knapserve.spec.mode"]["stringValue"], "knapspec");
  EXPECT_EQ(a["knapserve.spec.acceptance_rate"]["doubleValue"], 0.75);
  EXPECT_EQ(a["knapserve.spec.mean_accepted_length"]["doubleValue"], 2.5);
  EXPECT_EQ(a["gen_ai.response.finish_reasons"]["arrayValue"]["values"][0]
             ["stringValue"],
            "length");
  const nlohmann::json& queue = spans.find("queue")->second;
  const nlohmann::json& prefill = spans.find("prefill")->second;
  const nlohmann::json& decode = spans.find("decode")->second;
  for (const nlohmann::json* s : {&queue, &prefill, &decode}) {
    EXPECT_EQ((*s)["parentSpanId"], generate["spanId"]);
  }
  EXPECT_EQ(trace::ToHex(request.trace_parent.span_id), decode["spanId"]);
  EXPECT_EQ(Nanos(queue, "startTimeUnixNano"),
            Nanos(generate, "startTimeUnixNano"));
  EXPECT_EQ(Nanos(queue, "endTimeUnixNano"), now + 1000);
  EXPECT_EQ(Nanos(prefill, "startTimeUnixNano"), now + 1000);
  EXPECT_EQ(Nanos(prefill, "endTimeUnixNano"), now + 2000);
  EXPECT_EQ(Nanos(decode, "startTimeUnixNano"), now + 2000);
  EXPECT_EQ(Nanos(decode, "endTimeUnixNano"), now + 3000);
  EXPECT_GE(Nanos(generate, "endTimeUnixNano"), now + 3000);
}

TEST(RequestTraceTest, RefusedAndFailedRequestsEndWithAnError) {
  ScopedTracing tracing;
  {
    RequestTrace refused;
    refused.Start("not a traceparent", "req-2", "grpc", "text_completion", "m");
    refused.Finish(absl::InvalidArgumentError("temperature: must be >= 0"),
                   nullptr);
  }
  RequestTrace failed;
  failed.Start("", "req-3", "grpc", "text_completion", "m");
  GenerationRequest request;
  failed.Begin(request);
  failed.Finish(absl::InternalError("a LibTorch check failed"), nullptr);

  const auto spans = tracing.spans();
  std::map<std::string, const nlohmann::json*> roots;
  for (const auto& [name, span] : spans) {
    if (name == "generate")
      roots[Attributes(span)["knapserve.request_id"]["stringValue"]] = &span;
  }
  ASSERT_EQ(roots.size(), 2u);
  const nlohmann::json& r2 = *roots["req-2"];
  EXPECT_FALSE(r2.contains("parentSpanId"));  // the bad header is ignored
  EXPECT_EQ(r2["status"]["code"], 2);
  EXPECT_THAT(r2["status"]["message"].get<std::string>(),
              ::testing::HasSubstr("temperature"));
  EXPECT_EQ(Attributes(r2)["knapserve.status_code"]["stringValue"],
            "INVALID_ARGUMENT");
  const nlohmann::json& r3 = *roots["req-3"];
  EXPECT_EQ(r3["status"]["code"], 2);
  // req-2 has no children; req-3 has queue and a failed decode.
  EXPECT_EQ(spans.count("prefill"), 0u);
  ASSERT_EQ(spans.count("queue"), 1u);
  ASSERT_EQ(spans.count("decode"), 1u);
  EXPECT_EQ(spans.find("queue")->second["parentSpanId"], r3["spanId"]);
  const nlohmann::json& decode = spans.find("decode")->second;
  EXPECT_EQ(decode["parentSpanId"], r3["spanId"]);
  EXPECT_EQ(decode["status"]["code"], 2);
}

}  // namespace
}  // namespace knapserve

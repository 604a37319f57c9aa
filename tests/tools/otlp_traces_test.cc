// End-to-end tracing: a split deployment (knapserve-planner and
// knapserve-executor, each exporting OTLP/HTTP JSON to a receiver in this
// test, each with its own OTEL_SERVICE_NAME) serves a `knapserve generate
// --server --spec knapspec --traceparent ...` request and two HTTP
// completions. The receiver then holds one trace per request: the gRPC one
// continues the caller's traceparent, its span tree is generate -> queue /
// prefill / decode and plan.snapshot -> plan.encode -> plan.send ->
// (planner) plan.queue, plan.solve -> plan.solve.* and plan.send ->
// plan.receive -> plan.apply, with the planner's spans under the executor's
// plan.send and the planner's service.name; the attributes are there with
// sane values. The HTTP completion with a traceparent header continues its
// trace and applies the cached plan (plan.apply naming the first trace as
// its origin); one with a malformed header starts a trace of its own.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "testing/build_paths.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_models.h"
#include "tests/testing/test_util.h"

namespace knapserve {
namespace {

using ::testing::HasSubstr;
using testing::ReadFile;

// A loopback OTLP/HTTP receiver: collects the JSON POSTed to /v1/traces.
class OtlpReceiver {
 public:
  OtlpReceiver() {
    server_.Post("/v1/traces",
                 [this](const httplib::Request& req, httplib::Response& res) {
                   absl::MutexLock lock(&mu_);
                   bodies_.push_back(req.body);
                   res.set_content("{}", "application/json");
                 });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    for (int i = 0; i < 5000 && !server_.is_running(); ++i) usleep(1000);
  }
  ~OtlpReceiver() {
    server_.stop();
    thread_.join();
  }
  std::string endpoint() const {
    return absl::StrCat("http://127.0.0.1:", port_);
  }
  std::vector<std::string> bodies() {
    absl::MutexLock lock(&mu_);
    return bodies_;
  }

 private:
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  absl::Mutex mu_;
  std::vector<std::string> bodies_ ABSL_GUARDED_BY(mu_);
};

using testing::FreeLoopbackPort;
using testing::ServerProcess;

// One exported span, flattened.
struct ExportedSpan {
  std::string service;
  std::string trace_id, span_id, parent_id, name;
  int kind = 0;
  int64_t start = 0, end = 0;
  int status = 0;
  std::map<std::string, nlohmann::json> attributes;  // key -> OTLP value

  bool has(const std::string& key) const { return attributes.count(key) > 0; }
  std::string str(const std::string& key) const {
    auto it = attributes.find(key);
    return it == attributes.end() ? "" : it->second.value("stringValue", "");
  }
  int64_t integer(const std::string& key) const {
    auto it = attributes.find(key);
    if (it == attributes.end() || !it->second.contains("intValue")) return -1;
    return std::stoll(it->second["intValue"].get<std::string>());
  }
  double real(const std::string& key) const {
    auto it = attributes.find(key);
    if (it == attributes.end() || !it->second.contains("doubleValue") ||
        !it->second["doubleValue"].is_number()) {
      return -1;
    }
    return it->second["doubleValue"].get<double>();
  }
};

std::vector<ExportedSpan> Flatten(const std::vector<std::string>& bodies) {
  std::vector<ExportedSpan> spans;
  for (const std::string& body : bodies) {
    const nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << body;
    if (j.is_discarded()) continue;
    for (const nlohmann::json& rs : j["resourceSpans"]) {
      std::string service;
      for (const nlohmann::json& a : rs["resource"]["attributes"]) {
        if (a["key"] == "service.name") service = a["value"]["stringValue"];
      }
      for (const nlohmann::json& ss : rs["scopeSpans"]) {
        for (const nlohmann::json& s : ss["spans"]) {
          ExportedSpan span;
          span.service = service;
          span.trace_id = s["traceId"];
          span.span_id = s["spanId"];
          span.parent_id = s.value("parentSpanId", "");
          span.name = s["name"];
          span.kind = s["kind"];
          span.start = std::stoll(s["startTimeUnixNano"].get<std::string>());
          span.end = std::stoll(s["endTimeUnixNano"].get<std::string>());
          if (s.contains("status")) span.status = s["status"].value("code", 0);
          for (const nlohmann::json& a : s["attributes"])
            span.attributes[a["key"]] = a["value"];
          spans.push_back(std::move(span));
        }
      }
    }
  }
  return spans;
}

// The spans of one trace, by id and by name.
struct Trace {
  std::map<std::string, const ExportedSpan*> by_id;
  std::multimap<std::string, const ExportedSpan*> by_name;
  const ExportedSpan* one(const std::string& name) const {
    EXPECT_EQ(by_name.count(name), 1u) << name;
    auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : it->second;
  }
  const ExportedSpan* parent(const ExportedSpan* span) const {
    auto it = by_id.find(span->parent_id);
    return it == by_id.end() ? nullptr : it->second;
  }
};

// A knapserve profile of stories260k (as knapserve_cli_test's).
std::string StoriesProfile(const std::string& dir) {
  const std::string file = dir + "/p.json";
  const testing::ProcessOutcome outcome = testing::RunProcess(
      {testing::kKnapserveBinary, "profile", "--out", file, "--profile-repeats",
       "3", "--profile-contexts", "32,128,256", "--model",
       testing::Stories260kDir(), "--threads", "1"});
  EXPECT_EQ(outcome.exit_code, 0) << outcome.err;
  return file;
}

constexpr char kTraceId[] = "0af7651916cd43dd8448eb211c80319c";
constexpr char kCallerSpan[] = "b7ad6b7169203331";
constexpr char kHttpTraceId[] = "4bf92f3577b34da6a3ce929d0e0e4736";
constexpr char kHttpCallerSpan[] = "00f067aa0ba902b7";

TEST(OtlpTracesTest, SplitDeploymentExportsOneTraceAcrossBothProcesses) {
  OtlpReceiver receiver;
  const testing::ScopedTempDir dir("otlp_traces");
  const std::string profile = StoriesProfile(dir.path());
  const std::vector<std::string> model = {"--model", testing::Stories260kDir(),
                                          "--threads", "1"};
  auto with_model = [&](std::vector<std::string> args) {
    args.insert(args.end(), model.begin(), model.end());
    return args;
  };
  // Each process: the receiver as its endpoint, its own service name, the
  // default sampler (whatever the environment of the test says).
  auto otel_env = [&](const std::string& service) {
    return std::vector<std::string>{
        "OTEL_EXPORTER_OTLP_ENDPOINT=" + receiver.endpoint(),
        "OTEL_SERVICE_NAME=" + service,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
        "OTEL_SDK_DISABLED",
        "OTEL_RESOURCE_ATTRIBUTES"};
  };
  ServerProcess planner(
      with_model({testing::kKnapservePlannerBinary, "--listen", "127.0.0.1:0",
                  "--profile", profile}),
      "", otel_env("test-planner"));
  ASSERT_FALSE(planner.address().empty()) << planner.log();
  const int http_port = FreeLoopbackPort();
  const int metrics_port = FreeLoopbackPort();
  ASSERT_TRUE(http_port > 0 && metrics_port > 0);
  ServerProcess executor(
      with_model({testing::kKnapserveExecutorBinary, "--listen", "127.0.0.1:0",
                  "--planner", planner.address(), "--http-listen",
                  absl::StrCat("127.0.0.1:", http_port), "--metrics-port",
                  std::to_string(metrics_port), "--plan-interval", "8",
                  "--reference-steps", "2"}),
      "", otel_env("test-executor"));
  ASSERT_FALSE(executor.address().empty()) << executor.log();
  EXPECT_THAT(executor.log(), HasSubstr("exporting traces to " +
                                        receiver.endpoint() + "/v1/traces"));

  // 1. gRPC, with the caller's traceparent as metadata.
  const std::string traceparent =
      absl::StrCat("00-", kTraceId, "-", kCallerSpan, "-01");
  // Long enough for the plan to come back and be applied (stories260k
  // decodes thousands of tokens per second; the solve takes milliseconds).
  const int new_tokens = 400;
  const testing::ProcessOutcome generated =
      testing::RunProcess({testing::kKnapserveBinary,
                           "generate",
                           "--server",
                           executor.address(),
                           "--prompt",
                           "Once upon a time",
                           "--max-new-tokens",
                           std::to_string(new_tokens),
                           "--temperature",
                           "0",
                           "--ignore-eos",
                           "--spec",
                           "knapspec",
                           "--plan-interval",
                           "8",
                           "--reference-steps",
                           "2",
                           "--traceparent",
                           traceparent,
                           "--json"});
  ASSERT_EQ(generated.exit_code, 0) << generated.err << executor.log();
  const nlohmann::json out = nlohmann::json::parse(generated.out);
  ASSERT_GT(out["speculation"]["plans_applied"].get<int64_t>(), 0)
      << generated.out;

  // A malformed traceparent is refused by the client...
  const testing::ProcessOutcome bad = testing::RunProcess(
      {testing::kKnapserveBinary, "generate", "--server", executor.address(),
       "--prompt", "Hi", "--traceparent", "00-nope"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err, HasSubstr("--traceparent"));

  // 2. HTTP with a traceparent header: the cached plan is applied at once.
  httplib::Client http("127.0.0.1", http_port);
  http.set_read_timeout(60, 0);
  const nlohmann::json completion = {{"model", "stories260k"},
                                     {"prompt", "Once upon a time"},
                                     {"max_tokens", 16},
                                     {"temperature", 0},
                                     {"knapserve", {{"spec", "knapspec"}}}};
  httplib::Result r = http.Post(
      "/v1/completions",
      {{"traceparent",
        absl::StrCat("00-", kHttpTraceId, "-", kHttpCallerSpan, "-01")}},
      completion.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  // ... and ignored by the server: a new trace.
  nlohmann::json plain = completion;
  plain["knapserve"]["spec"] = "off";
  plain["max_tokens"] = 4;
  r = http.Post("/v1/completions", {{"traceparent", "00-garbage-01"}},
                plain.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;

  // The exporter's counters: spans went out (every 200 ms), none dropped.
  httplib::Client metrics("127.0.0.1", metrics_port);
  std::string rendered;
  for (int i = 0; i < 100; ++i) {
    const httplib::Result m = metrics.Get("/metrics");
    rendered = m ? m->body : "";
    if (rendered.find("knapserve_trace_spans_exported_total 0\n") ==
            std::string::npos &&
        rendered.find("knapserve_trace_spans_exported_total") !=
            std::string::npos) {
      break;
    }
    usleep(100 * 1000);
  }
  EXPECT_THAT(rendered, HasSubstr("knapserve_trace_spans_dropped_total 0\n"));
  EXPECT_THAT(rendered, HasSubstr("knapserve_trace_spans_failed_total 0\n"));

  // SIGTERM flushes what is left.
  EXPECT_EQ(executor.Stop(), 0) << executor.log();
  EXPECT_EQ(planner.Stop(), 0) << planner.log();

  const std::vector<ExportedSpan> spans = Flatten(receiver.bodies());
  ASSERT_FALSE(spans.empty());
  std::map<std::string, Trace> traces;
  for (const ExportedSpan& span : spans) {
    Trace& t = traces[span.trace_id];
    EXPECT_TRUE(t.by_id.emplace(span.span_id, &span).second)
        << "span id twice: " << span.span_id;
    t.by_name.emplace(span.name, &span);
    EXPECT_LE(span.start, span.end) << span.name;
    EXPECT_GT(span.start, 1600000000000000000) << span.name;  // unix nanos
  }
  // One trace per request.
  ASSERT_EQ(traces.size(), 3u);
  ASSERT_TRUE(traces.count(kTraceId));
  ASSERT_TRUE(traces.count(kHttpTraceId));

  // ---- The gRPC request's trace.
  const Trace& t = traces[kTraceId];
  const ExportedSpan* generate = t.one("generate");
  ASSERT_NE(generate, nullptr);
  EXPECT_EQ(generate->parent_id, kCallerSpan);
  EXPECT_EQ(generate->service, "test-executor");
  EXPECT_EQ(generate->kind, 2);    // server
  EXPECT_EQ(generate->status, 1);  // OK
  EXPECT_EQ(generate->str("gen_ai.system"), "knapserve");
  EXPECT_EQ(generate->str("gen_ai.operation.name"), "text_completion");
  EXPECT_EQ(generate->str("gen_ai.request.model"), "stories260k");
  EXPECT_EQ(generate->str("knapserve.front_door"), "grpc");
  EXPECT_EQ(generate->integer("gen_ai.request.max_tokens"), new_tokens);
  EXPECT_EQ(generate->real("gen_ai.request.temperature"), 0);
  EXPECT_EQ(generate->integer("gen_ai.usage.input_tokens"),
            out["prompt_tokens"].get<int64_t>());
  EXPECT_EQ(generate->integer("gen_ai.usage.output_tokens"), new_tokens);
  EXPECT_EQ(generate->attributes.at(
                "gen_ai.response.finish_reasons")["arrayValue"]["values"][0]
                                                 ["stringValue"],
            "length");
  EXPECT_EQ(generate->str("gen_ai.response.id"), out["request_id"]);
  EXPECT_EQ(generate->str("knapserve.spec.mode"), "knapspec");
  EXPECT_EQ(generate->integer("knapserve.spec.drafts"),
            out["speculation"]["drafts"].get<int64_t>());
  EXPECT_EQ(generate->integer("knapserve.plans_applied"),
            out["speculation"]["plans_applied"].get<int64_t>());
  const double acceptance = generate->real("knapserve.spec.acceptance_rate");
  EXPECT_GE(acceptance, 0);
  EXPECT_LE(acceptance, 1);
  EXPECT_GE(generate->real("knapserve.spec.mean_accepted_length"), 1);
  EXPECT_NEAR(generate->real("knapserve.spec.mean_accepted_length"),
              out["speculation"]["mean_acceptance_length"].get<double>(), 1e-9);

  // generate -> queue, prefill, decode, in that order, inside generate.
  const ExportedSpan* queue = t.one("queue");
  const ExportedSpan* prefill = t.one("prefill");
  const ExportedSpan* decode = t.one("decode");
  ASSERT_TRUE(queue && prefill && decode);
  for (const ExportedSpan* child : {queue, prefill, decode}) {
    EXPECT_EQ(t.parent(child), generate) << child->name;
    EXPECT_GE(child->start, generate->start) << child->name;
    EXPECT_LE(child->end, generate->end) << child->name;
  }
  EXPECT_LE(queue->end, prefill->start);
  EXPECT_LE(prefill->end, decode->start);
  EXPECT_EQ(decode->integer("gen_ai.usage.output_tokens"), new_tokens);
  EXPECT_EQ(decode->integer("knapserve.guard.plain_steps"),
            out["planning"]["guard"]["plain_steps"].get<int64_t>());
  EXPECT_EQ(decode->integer("knapserve.guard.inherited_steps"),
            out["planning"]["guard"]["inherited_steps"].get<int64_t>());
  EXPECT_EQ(decode->integer("knapserve.guard.carried_steps"),
            out["planning"]["guard"]["carried_steps"].get<int64_t>());
  EXPECT_EQ(decode->integer("knapserve.guard.settle_steps"),
            out["planning"]["guard"]["settle_steps"].get<int64_t>());
  EXPECT_EQ(decode->integer("knapserve.guard.confirmations"),
            out["planning"]["guard"]["confirmations"].get<int64_t>());
  EXPECT_EQ(decode->integer("knapserve.guard.cleared_losses"),
            out["planning"]["guard"]["cleared_losses"].get<int64_t>());

  // The plan chain: snapshot -> encode -> send -> [planner] queue, solve;
  // send -> receive -> apply. The first snapshot is the no_plan trigger's
  // (acceptance drifting from the plan may make more chains).
  const ExportedSpan* snapshot = nullptr;
  for (auto [it, end] = t.by_name.equal_range("plan.snapshot"); it != end;
       ++it) {
    if (snapshot == nullptr || it->second->start < snapshot->start)
      snapshot = it->second;
  }
  ASSERT_NE(snapshot, nullptr);
  // The one child of `parent` named `name`.
  auto child = [&t](const ExportedSpan* parent,
                    const std::string& name) -> const ExportedSpan* {
    const ExportedSpan* found = nullptr;
    for (auto [it, end] = t.by_name.equal_range(name); it != end; ++it) {
      if (it->second->parent_id != parent->span_id) continue;
      EXPECT_EQ(found, nullptr) << "two " << name << " under " << parent->name;
      found = it->second;
    }
    EXPECT_NE(found, nullptr) << "no " << name << " under " << parent->name;
    return found;
  };
  EXPECT_EQ(t.parent(snapshot), decode);
  const ExportedSpan* encode = child(snapshot, "plan.encode");
  ASSERT_NE(encode, nullptr);
  const ExportedSpan* send = child(encode, "plan.send");
  ASSERT_NE(send, nullptr);
  const ExportedSpan* plan_queue = child(send, "plan.queue");
  const ExportedSpan* solve = child(send, "plan.solve");
  const ExportedSpan* receive = child(send, "plan.receive");
  ASSERT_TRUE(plan_queue && solve && receive);
  for (const ExportedSpan* s : {snapshot, encode, send, receive}) {
    EXPECT_EQ(s->service, "test-executor") << s->name;
  }
  for (const ExportedSpan* s : {plan_queue, solve}) {
    EXPECT_EQ(s->service, "test-planner") << s->name;
  }
  EXPECT_EQ(send->kind, 3);  // client
  EXPECT_EQ(snapshot->str("knapserve.plan.trigger"), "no_plan");
  EXPECT_EQ(snapshot->str("knapserve.plan.policy"), "knapspec");
  EXPECT_GT(snapshot->integer("knapserve.plan.context_length"), 0);
  EXPECT_GT(snapshot->integer("knapserve.plan.reference_tokens"), 0);
  EXPECT_GT(send->integer("knapserve.plan.request_bytes"), 1000);
  EXPECT_EQ(send->str("rpc.system"), "grpc");
  EXPECT_GE(plan_queue->real("knapserve.plan.queue_seconds"), 0);
  EXPECT_EQ(solve->integer("knapserve.plan.context_length"),
            snapshot->integer("knapserve.plan.context_length"));
  EXPECT_EQ(solve->str("knapserve.plan.policy"), "knapspec");
  EXPECT_GT(solve->real("knapserve.plan.solve_seconds"), 0);
  EXPECT_GT(solve->real("knapserve.plan.predicted_tokens_per_second"), 0);
  // The DP's stages, children of plan.solve, in the planner process.
  for (const char* stage :
       {"plan.solve.check_inputs", "plan.solve.profile_prices",
        "plan.solve.knapsack_dp", "plan.solve.tpt_grid"}) {
    const ExportedSpan* s = child(solve, stage);
    ASSERT_NE(s, nullptr) << stage;
    EXPECT_EQ(s->service, "test-planner") << stage;
    EXPECT_GE(s->start, solve->start) << stage;
    EXPECT_LE(s->end, solve->end) << stage;
  }
  EXPECT_GT(child(solve, "plan.solve.knapsack_dp")
                ->integer("knapserve.plan.candidates"),
            0);

  // Applied: this request's own solve.
  const ExportedSpan* apply = child(receive, "plan.apply");
  ASSERT_NE(apply, nullptr);
  EXPECT_EQ(apply->service, "test-executor");
  EXPECT_EQ(apply->str("knapserve.plan.source"), "solve");
  EXPECT_GE(apply->integer("knapserve.plan.age_steps"), 0);
  const int64_t gamma = apply->integer("knapserve.plan.gamma");
  EXPECT_GE(gamma, 0);
  EXPECT_LE(gamma, 10);
  EXPECT_EQ(gamma, solve->integer("knapserve.plan.gamma"));
  EXPECT_EQ(apply->str("knapserve.plan.mask"),
            solve->str("knapserve.plan.mask"));
  const std::string mask = apply->str("knapserve.plan.mask");
  const int64_t skipped = apply->integer("knapserve.plan.skipped_attention") +
                          apply->integer("knapserve.plan.skipped_mlp");
  const std::vector<std::string> mask_items =
      absl::StrSplit(mask, ',', absl::SkipEmpty());
  EXPECT_EQ(skipped, static_cast<int64_t>(mask_items.size())) << mask;
  const double alpha = apply->real("knapserve.plan.alpha_hat");
  EXPECT_GE(alpha, 0);
  EXPECT_LE(alpha, 1);
  EXPECT_GT(apply->real("knapserve.plan.predicted_tokens_per_second"), 0);
  EXPECT_GT(apply->real("knapserve.plan.realized_tokens_per_second"), 0);
  EXPECT_GT(apply->integer("knapserve.plan.steps_in_force"), 0);
  EXPECT_GE(apply->integer("knapserve.plan.tokens_in_force"),
            apply->integer("knapserve.plan.steps_in_force"));
  EXPECT_FALSE(apply->str("knapserve.plan.end_reason").empty());
  EXPECT_GE(apply->start, receive->start);
  // Nothing in this trace failed.
  for (const auto& [id, s] : t.by_id) EXPECT_NE(s->status, 2) << s->name;

  // ---- The HTTP request with a traceparent: the cached plan.
  const Trace& h = traces[kHttpTraceId];
  const ExportedSpan* http_generate = h.one("generate");
  ASSERT_NE(http_generate, nullptr);
  EXPECT_EQ(http_generate->parent_id, kHttpCallerSpan);
  EXPECT_EQ(http_generate->str("knapserve.front_door"), "http");
  EXPECT_EQ(http_generate->integer("gen_ai.usage.output_tokens"), 16);
  const ExportedSpan* http_apply = h.one("plan.apply");
  ASSERT_NE(http_apply, nullptr);
  EXPECT_EQ(h.parent(http_apply), h.one("decode"));
  EXPECT_EQ(http_apply->str("knapserve.plan.source"), "cache");
  EXPECT_THAT(http_apply->str("knapserve.plan.origin_traceparent"),
              HasSubstr(kTraceId));
  EXPECT_EQ(h.by_name.count("plan.snapshot"), 0u);  // no solve needed

  // ---- The HTTP request with a malformed traceparent: a root of its own.
  for (const auto& [id, other] : traces) {
    if (id == kTraceId || id == kHttpTraceId) continue;
    const ExportedSpan* root = other.one("generate");
    ASSERT_NE(root, nullptr);
    EXPECT_EQ(root->parent_id, "");
    EXPECT_EQ(root->str("knapserve.spec.mode"), "off");
    EXPECT_EQ(other.by_name.count("plan.snapshot"), 0u);
  }
}

// `knapserve serve` plans on a thread of its own: the same chain, in one
// process, without the wire's encode and send: plan.snapshot -> plan.queue,
// plan.solve (-> its stages), plan.receive -> plan.apply.
TEST(OtlpTracesTest, InProcessPlanningGivesTheSameChainInOneProcess) {
  OtlpReceiver receiver;
  const testing::ScopedTempDir dir("otlp_traces_inproc");
  const std::string profile = StoriesProfile(dir.path());
  ServerProcess serve(
      {testing::kKnapserveBinary, "serve", "--listen", "127.0.0.1:0",
       "--profile", profile, "--model", testing::Stories260kDir(), "--threads",
       "1"},
      "",
      {"OTEL_EXPORTER_OTLP_ENDPOINT=" + receiver.endpoint(),
       "OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
       "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_SDK_DISABLED",
       "OTEL_RESOURCE_ATTRIBUTES"});
  ASSERT_FALSE(serve.address().empty()) << serve.log();
  const std::string traceparent =
      absl::StrCat("00-", kTraceId, "-", kCallerSpan, "-01");
  const testing::ProcessOutcome generated =
      testing::RunProcess({testing::kKnapserveBinary,
                           "generate",
                           "--server",
                           serve.address(),
                           "--prompt",
                           "Once upon a time",
                           "--max-new-tokens",
                           "400",
                           "--temperature",
                           "0",
                           "--ignore-eos",
                           "--spec",
                           "knapspec",
                           "--plan-interval",
                           "8",
                           "--reference-steps",
                           "2",
                           "--traceparent",
                           traceparent,
                           "--json"});
  ASSERT_EQ(generated.exit_code, 0) << generated.err << serve.log();
  EXPECT_EQ(serve.Stop(), 0) << serve.log();

  const std::vector<ExportedSpan> spans = Flatten(receiver.bodies());
  std::map<std::string, const ExportedSpan*> by_id;
  for (const ExportedSpan& span : spans) {
    EXPECT_EQ(span.trace_id, kTraceId) << span.name;
    EXPECT_EQ(span.service, "knapserve") << span.name;  // serve's default
    by_id[span.span_id] = &span;
  }
  auto parent_name = [&](const ExportedSpan& span) -> std::string {
    auto it = by_id.find(span.parent_id);
    return it == by_id.end() ? "" : it->second->name;
  };
  std::multiset<std::string> edges;  // "parent > child"
  for (const ExportedSpan& span : spans) {
    edges.insert(parent_name(span) + " > " + span.name);
  }
  for (const char* edge :
       {"generate > queue", "generate > prefill", "generate > decode",
        "decode > plan.snapshot", "plan.snapshot > plan.queue",
        "plan.snapshot > plan.solve", "plan.solve > plan.solve.knapsack_dp",
        "plan.solve > plan.solve.tpt_grid", "plan.snapshot > plan.receive",
        "plan.receive > plan.apply"}) {
    EXPECT_GE(edges.count(edge), 1u) << edge;
  }
  EXPECT_EQ(edges.count("plan.snapshot > plan.encode"), 0u);
  EXPECT_EQ(edges.count("plan.encode > plan.send"), 0u);
}

}  // namespace
}  // namespace knapserve

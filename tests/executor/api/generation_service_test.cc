// Tests of the Generation gRPC service (executor/api/generation_service.h,
// executor_server.h) over real loopback gRPC: streamed output equals local
// generation, invalid requests name their field, concurrency, admission,
// cancellation, deadlines, Abort (scoped to the caller's connection), drain,
// and a LibTorch exception in one stream's forward pass failing that stream
// only.
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "executor/api/executor_server.h"
#include "executor/engine/sampler.h"
#include "planner/inprocess_planner.h"
#include "tests/testing/test_models.h"
#include "tools/domain_anchors.h"

namespace knapserve {
namespace {

using testing::CachedModel;
using testing::StoriesTokenizer;

// A Generation stub on loopback to `server`.
std::unique_ptr<v1::Generation::Stub> StubFor(const ExecutorServer& server) {
  return v1::Generation::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", server.port()),
                          grpc::InsecureChannelCredentials()));
}

struct Server {
  const LlamaModel* model = nullptr;
  std::unique_ptr<ExecutorServer> server;
  std::unique_ptr<v1::Generation::Stub> stub;
};

Server StartServer(int max_running = 4, int max_queue = 16,
                   MetricsRegistry* metrics = nullptr,
                   std::shared_ptr<const DomainRouter> router = nullptr) {
  Server s;
  s.model = CachedModel("stories260k");
  if (s.model == nullptr) return s;
  GenerationServiceOptions options;
  options.scheduler.max_running = max_running;
  options.scheduler.max_queue = max_queue;
  options.model_path = testing::Stories260kDir();
  options.metrics = metrics;
  options.planning = PlanningShared::Create();
  options.planning.router = std::move(router);
  auto server = ExecutorServer::Start(*s.model, *StoriesTokenizer(), options,
                                      "127.0.0.1:0");
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return s;
  s.server = std::move(*server);
  s.stub = StubFor(*s.server);
  return s;
}

struct Streamed {
  grpc::Status status;
  std::vector<int32_t> ids;
  std::string text;
  int chunks = 0;
  std::optional<v1::FinalResult> final;
};

// Runs one Generate call to the end. `on_first_chunk` runs once, when the
// first chunk arrives (for tests that act mid-stream).
Streamed Call(v1::Generation::Stub& stub, const v1::GenerateRequest& request,
              grpc::ClientContext* context = nullptr,
              const std::function<void()>& on_first_chunk = nullptr) {
  grpc::ClientContext local;
  if (context == nullptr) context = &local;
  Streamed out;
  auto reader = stub.Generate(context, request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    if (response.has_chunk()) {
      if (out.chunks++ == 0 && on_first_chunk) on_first_chunk();
      out.ids.insert(out.ids.end(), response.chunk().token_ids().begin(),
                     response.chunk().token_ids().end());
      out.text += response.chunk().text();
    } else if (response.has_final()) {
      out.final = response.final();
    }
  }
  out.status = reader->Finish();
  return out;
}

v1::GenerateRequest TextRequest(const std::string& text, int max_new_tokens) {
  v1::GenerateRequest request;
  request.set_text(text);
  request.set_max_new_tokens(max_new_tokens);
  request.set_temperature(0);
  return request;
}

TEST(GenerationServiceTest, StreamsWhatLocalGenerationProduces) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Server s = StartServer();
  ASSERT_NE(s.server, nullptr);
  for (const std::string prompt :
       {"Once upon a time", "Zoo", "The little dog"}) {
    v1::GenerateRequest request = TextRequest(prompt, 60);
    request.mutable_speculation()->set_mode(v1::SPECULATION_MODE_STATIC);
    request.mutable_speculation()->set_static_mask("a1,m3");
    Streamed got = Call(*s.stub, request);
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    GenerationRequest local;
    local.prompt_ids = *StoriesTokenizer()->Encode(prompt, true);
    local.max_new_tokens = 60;
    auto want = Generate(*s.model, *StoriesTokenizer(), local);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(got.ids, want->output_ids) << prompt;
    EXPECT_EQ(got.text, want->text) << prompt;
    ASSERT_TRUE(got.final.has_value());
    EXPECT_EQ(got.final->usage().completion_tokens(),
              static_cast<int>(got.ids.size()));
    EXPECT_EQ(got.final->usage().prompt_tokens(),
              static_cast<int>(local.prompt_ids.size()));
    EXPECT_NE(got.final->finish_reason(), v1::FINISH_REASON_UNSPECIFIED);
    EXPECT_GT(got.final->timings().time_to_first_token_seconds(), 0);
    EXPECT_EQ(got.final->speculation_stats().mode(),
              v1::SPECULATION_MODE_STATIC);
    // It drafted, or the guard's verdict on this static mask (measured by
    // an earlier prompt on this toy model) kept it plain.
    EXPECT_TRUE(got.final->speculation_stats().drafts() > 0 ||
                got.final->planning().guard_inherited_steps() > 0)
        << prompt;
    EXPECT_FALSE(got.final->request_id().empty());
  }
  grpc::ClientContext context;
  v1::GetModelInfoResponse info;
  ASSERT_TRUE(
      s.stub->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.model_info().num_layers(), 5);
  EXPECT_EQ(info.model_info().max_context(), s.model->max_context());
  EXPECT_EQ(info.model_info().model_fingerprint(),
            s.model->config().Fingerprint());
}

// n choices over gRPC: each choice's chunks carry its index and each ends
// with a FinalResult of its own; choice i is the request alone with choice
// i's seed (executor/engine/sampler.h's ChoiceSeed). best_of returns the
// candidates with the highest cumulative log-probability, best first, as
// one chunk each once all ended.
TEST(GenerationServiceTest,
     ChoicesStreamWithTheirIndexAndBestOfPicksTheLikeliest) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  MetricsRegistry metrics;
  Server s = StartServer(4, 16, &metrics);
  ASSERT_NE(s.server, nullptr);
  v1::GenerateRequest request = TextRequest("Once upon a time", 16);
  request.set_temperature(1.0);
  request.set_seed(11);
  request.set_n(3);
  request.set_logprobs(true);
  request.set_ignore_eos(true);
  request.mutable_speculation()->set_mode(v1::SPECULATION_MODE_STATIC);
  request.mutable_speculation()->set_static_mask("a1,m3");
  grpc::ClientContext context;
  auto reader = s.stub->Generate(&context, request);
  std::map<int, std::vector<int32_t>> ids;
  std::map<int, v1::FinalResult> finals;
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    if (response.has_chunk()) {
      const v1::Chunk& chunk = response.chunk();
      EXPECT_EQ(finals.count(chunk.index()), 0u) << "a chunk after its final";
      ids[chunk.index()].insert(ids[chunk.index()].end(),
                                chunk.token_ids().begin(),
                                chunk.token_ids().end());
    } else {
      finals[response.final().index()] = response.final();
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  ASSERT_EQ(ids.size(), 3u);
  ASSERT_EQ(finals.size(), 3u);
  // One request; every choice's tokens; the prompt once.
  const std::string text = metrics.Render();
  EXPECT_NE(text.find("knapserve_requests_total{code=\"OK\"} 1\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("knapserve_generation_tokens_total 48\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find(absl::StrCat("knapserve_prompt_tokens_total ",
                                   finals[0].usage().prompt_tokens(), "\n")),
            std::string::npos)
      << text;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(ids[i].size(), 16u);
    EXPECT_EQ(finals[i].usage().completion_tokens(), 16);
    EXPECT_EQ(finals[i].seed(), ChoiceSeed(11, i));
    v1::GenerateRequest alone = request;
    alone.set_n(1);
    alone.set_seed(ChoiceSeed(11, i));
    Streamed single = Call(*s.stub, alone);
    ASSERT_TRUE(single.status.ok()) << single.status.error_message();
    EXPECT_EQ(single.ids, ids[i]) << "choice " << i;
    EXPECT_NEAR(single.final->cumulative_logprob(),
                finals[i].cumulative_logprob(), 1e-9);
  }
  EXPECT_NE(ids[0], ids[1]);

  // best_of 3, n 2: the same three candidates, the two likeliest first.
  std::vector<int> order = {0, 1, 2};
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return finals[a].cumulative_logprob() > finals[b].cumulative_logprob();
  });
  v1::GenerateRequest best = request;
  best.set_n(2);
  best.set_best_of(3);
  best.set_logprobs(false);
  grpc::ClientContext best_context;
  auto best_reader = s.stub->Generate(&best_context, best);
  std::vector<v1::Chunk> chunks;
  std::vector<v1::FinalResult> best_finals;
  while (best_reader->Read(&response)) {
    if (response.has_chunk()) {
      EXPECT_TRUE(best_finals.empty());
      chunks.push_back(response.chunk());
    } else {
      best_finals.push_back(response.final());
    }
  }
  ASSERT_TRUE(best_reader->Finish().ok());
  ASSERT_EQ(chunks.size(), 2u) << "one chunk per returned choice";
  ASSERT_EQ(best_finals.size(), 2u);
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(chunks[k].index(), k);
    EXPECT_EQ(std::vector<int32_t>(chunks[k].token_ids().begin(),
                                   chunks[k].token_ids().end()),
              ids[order[k]]);
    EXPECT_TRUE(chunks[k].logprobs().empty()) << "not asked for";
    EXPECT_EQ(best_finals[k].index(), k);
    EXPECT_NEAR(best_finals[k].cumulative_logprob(),
                finals[order[k]].cumulative_logprob(), 1e-9);
  }

  // Out of range: n above 16 or the server's max_running, best_of below n.
  for (auto [n, best_of] :
       {std::pair{17, 0}, std::pair{5, 0}, std::pair{3, 2}}) {
    v1::GenerateRequest bad = request;
    bad.set_n(n);
    bad.set_best_of(best_of);
    Streamed refused = Call(*s.stub, bad);
    EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << n << " " << best_of;
    EXPECT_NE(refused.status.error_message().find(n > 4 ? "n:" : "best_of:"),
              std::string::npos)
        << refused.status.error_message();
  }
}

// KNN-SSD over gRPC: a knn request is routed to the domain whose anchor is
// its own prompt, reports it in its final stats and in the metrics (every
// domain's series exposed from the start), and streams plain decoding's
// ids; a server without anchors refuses knn with FAILED_PRECONDITION.
TEST(GenerationServiceTest, KnnRequestsReportTheirRoutedDomain) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  const std::vector<std::string> prompts = {"Once upon a time",
                                            "The old man and his dog"};
  std::vector<torch::Tensor> anchors;
  for (const std::string& prompt : prompts) {
    auto v =
        PromptRoutingVector(*model, *StoriesTokenizer()->Encode(prompt, true));
    ASSERT_TRUE(v.ok()) << v.status();
    anchors.push_back(*v);
  }
  std::vector<RoutedDomain> domains(2);
  domains[0].name = "once";
  domains[0].mask = *LayerMask::Parse("a1,m3", model->num_layers());
  domains[0].gamma = 3;
  domains[1].name = "old";
  domains[1].mask = *LayerMask::Parse("m2", model->num_layers());
  domains[1].gamma = 2;
  auto router = DomainRouter::Create(
      model->config().Fingerprint(), model->weights_fingerprint(),
      model->num_layers(), domains, torch::stack(anchors), {0, 1});
  ASSERT_TRUE(router.ok()) << router.status();
  MetricsRegistry metrics;
  Server s = StartServer(4, 16, &metrics, *router);
  ASSERT_NE(s.server, nullptr);
  EXPECT_NE(metrics.Render().find(
                "knapserve_routed_requests_total{domain=\"old\"} 0\n"),
            std::string::npos);
  v1::GenerateRequest request = TextRequest(prompts[0], 40);
  request.set_ignore_eos(true);
  request.mutable_speculation()->set_mode(v1::SPECULATION_MODE_KNN);
  const Streamed got = Call(*s.stub, request);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  ASSERT_TRUE(got.final.has_value());
  EXPECT_EQ(got.final->speculation_stats().mode(), v1::SPECULATION_MODE_KNN);
  EXPECT_EQ(got.final->speculation_stats().routed_domain(), "once");
  EXPECT_GT(got.final->speculation_stats().routing_similarity(), 0.999);
  EXPECT_GT(got.final->timings().routing_seconds(), 0);
  EXPECT_GT(got.final->speculation_stats().drafts(), 0);
  GenerationRequest local;
  local.prompt_ids = *StoriesTokenizer()->Encode(prompts[0], true);
  local.max_new_tokens = 40;
  local.ignore_eos = true;
  auto want = Generate(*s.model, *StoriesTokenizer(), local);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(got.ids, want->output_ids);
  const std::string text = metrics.Render();
  EXPECT_NE(text.find("knapserve_routed_requests_total{domain=\"once\"} 1\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("knapserve_routed_requests_total{domain=\"old\"} 0\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("knapserve_routing_seconds_count 1\n"), std::string::npos)
      << text;

  Server plain = StartServer();
  ASSERT_NE(plain.server, nullptr);
  const Streamed refused = Call(*plain.stub, request);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.status.error_message().find("--anchors"), std::string::npos)
      << refused.status.error_message();
}

TEST(GenerationServiceTest, CountsRequestsTokensAndSpeculationInMetrics) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  MetricsRegistry metrics;
  Server s = StartServer(4, 16, &metrics);
  ASSERT_NE(s.server, nullptr);
  v1::GenerateRequest request = TextRequest("Once upon a time", 40);
  request.set_ignore_eos(true);
  request.mutable_speculation()->set_mode(v1::SPECULATION_MODE_STATIC);
  request.mutable_speculation()->set_static_mask("a1,m3");
  const Streamed first = Call(*s.stub, request);
  const Streamed second = Call(*s.stub, request);
  ASSERT_TRUE(first.status.ok() && second.status.ok());
  v1::GenerateRequest bad = TextRequest("Hi", 4);
  bad.set_temperature(-1);
  Call(*s.stub, bad);
  const std::string text = metrics.Render();
  EXPECT_NE(text.find("knapserve_requests_total{code=\"OK\"} 2\n"),
            std::string::npos)
      << text;
  EXPECT_NE(
      text.find("knapserve_requests_total{code=\"INVALID_ARGUMENT\"} 1\n"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("knapserve_generation_tokens_total 80\n"),
            std::string::npos)
      << text;
  // The two requests need not draft alike (the guard probes the plain rate
  // in the first one, before it drafts).
  const int drafts = first.final->speculation_stats().drafts() +
                     second.final->speculation_stats().drafts();
  EXPECT_NE(text.find("knapserve_spec_decode_num_drafts_total " +
                      std::to_string(drafts) + "\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("knapserve_spec_decode_num_accepted_tokens_per_pos_total{"
                      "position=\"0\"}"),
            std::string::npos);
  EXPECT_NE(text.find("knapserve_time_to_first_token_seconds_count 2\n"),
            std::string::npos);
  // The worker leaves the running count just after the stream ends: give it
  // a moment.
  std::string gauges = text;
  for (int i = 0; i < 200 && gauges.find("knapserve_running_requests 0\n") ==
                                 std::string::npos;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    gauges = metrics.Render();
  }
  EXPECT_NE(gauges.find("knapserve_running_requests 0\n"), std::string::npos)
      << gauges;
}

// The service shares one plan cache among its requests: the first knapspec
// request triggers a solve, the second starts from the cached plan, and the
// planning metrics say so.
TEST(GenerationServiceTest, RequestsShareThePlanCacheAndReportPlanningMetrics) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  auto planner = InProcessPlanner::Create(
      *model, testing::HandLatencyProfile(*model), InProcessPlannerOptions());
  ASSERT_TRUE(planner.ok()) << planner.status();
  MetricsRegistry metrics;
  GenerationServiceOptions options;
  options.model_path = testing::Stories260kDir();
  options.metrics = &metrics;
  options.planner = planner->get();
  options.planning = PlanningShared::Create();
  options.default_speculation.plan_bucket_tokens = 256;
  options.default_speculation.planner_budget = 0;
  options.default_speculation.reference_steps = 2;
  const PlanningShared planning = options.planning;
  auto server = ExecutorServer::Start(*model, *StoriesTokenizer(), options,
                                      "127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = StubFor(**server);
  v1::GenerateRequest request = TextRequest("Once upon a time", 40);
  request.set_ignore_eos(true);
  request.mutable_speculation()->set_mode(v1::SPECULATION_MODE_KNAPSPEC);
  // The solve runs on the planner thread; wait for its plan to be cached. A
  // request that ends before the planner thread starts its solve drops it
  // (Forget), which happens on a loaded machine: then the next request
  // triggers it again, and each such attempt counts one miss.
  Streamed first;
  int attempts = 0;
  while (planning.cache->size() == 0 && attempts < 5) {
    ++attempts;
    first = Call(*stub, request);
    ASSERT_TRUE(first.status.ok()) << first.status.error_message();
    for (int i = 0; i < 1000 && planning.cache->size() == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  ASSERT_EQ(planning.cache->size(), 1);
  const Streamed second = Call(*stub, request);
  ASSERT_TRUE(second.status.ok());
  EXPECT_EQ(second.ids, first.ids);
  EXPECT_EQ(planning.cache->hits(), 1);
  EXPECT_EQ(planning.cache->misses(), attempts);
  const std::string text = metrics.Render();
  EXPECT_NE(text.find("knapserve_plan_cache_hits_total 1\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find(absl::StrCat("knapserve_plan_cache_misses_total ",
                                   attempts, "\n")),
            std::string::npos)
      << text;
  EXPECT_NE(
      text.find(absl::StrCat("knapserve_plan_triggers_total{kind=\"no_plan\"} ",
                             attempts, "\n")),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("knapserve_plan_cache_entries 1\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("knapserve_planner_cpu_share "), std::string::npos)
      << text;
  EXPECT_NE(text.find("knapserve_guard_fallbacks_total "), std::string::npos)
      << text;
  EXPECT_NE(text.find("knapserve_planner_budget_deferrals_total 0\n"),
            std::string::npos)
      << text;
}

TEST(GenerationServiceTest, InvalidRequestsNameTheField) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Server s = StartServer();
  ASSERT_NE(s.server, nullptr);
  struct Case {
    std::string expected;
    grpc::StatusCode code;
    std::function<void(v1::GenerateRequest&)> edit;
  };
  const std::vector<Case> cases = {
      {"prompt", grpc::StatusCode::INVALID_ARGUMENT,
       [](v1::GenerateRequest& r) { r.clear_prompt(); }},
      {"prompt.text: empty", grpc::StatusCode::INVALID_ARGUMENT,
       [](v1::GenerateRequest& r) { r.set_text(""); }},
      {"temperature", grpc::StatusCode::INVALID_ARGUMENT,
       [](v1::GenerateRequest& r) { r.set_temperature(-1); }},
      {"speculation.mode", grpc::StatusCode::INVALID_ARGUMENT,
       [](v1::GenerateRequest& r) {
         r.mutable_speculation()->set_mode(
             static_cast<v1::SpeculationMode>(42));
       }},
      {"prompt: 600 tokens", grpc::StatusCode::INVALID_ARGUMENT,
       [](v1::GenerateRequest& r) {
         for (int i = 0; i < 600; ++i) r.mutable_token_ids()->add_ids(300);
       }},
      {"max_new_tokens", grpc::StatusCode::INVALID_ARGUMENT,
       [](v1::GenerateRequest& r) { r.set_max_new_tokens(0); }},
      {"needs a planner", grpc::StatusCode::FAILED_PRECONDITION,
       [](v1::GenerateRequest& r) {
         r.mutable_speculation()->set_mode(v1::SPECULATION_MODE_KNAPSPEC);
       }},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest request = TextRequest("Hello", 8);
    c.edit(request);
    Streamed got = Call(*s.stub, request);
    EXPECT_EQ(got.status.error_code(), c.code)
        << c.expected << ": " << got.status.error_message();
    EXPECT_NE(got.status.error_message().find(c.expected), std::string::npos)
        << c.expected << ": " << got.status.error_message();
    EXPECT_EQ(got.chunks, 0);
  }
}

// What a hand-encoded Generate call gets: its status and how many response
// messages arrived. Sent with grpc::GenericStub, so the request bytes go out
// exactly as given (no client-side protobuf library checks them).
struct RawOutcome {
  grpc::Status status;
  int responses = 0;
};

RawOutcome RawGenerate(const std::shared_ptr<grpc::Channel>& channel,
                       const std::string& bytes) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(60));
  grpc::CompletionQueue cq;
  // One operation at a time: start it, then wait for its tag.
  auto wait = [&cq]() {
    void* tag = nullptr;
    bool ok = false;
    EXPECT_TRUE(cq.Next(&tag, &ok));
    return ok;
  };
  RawOutcome outcome;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      stub.PrepareCall(&context, "/knapserve.v1.Generation/Generate", &cq);
  call->StartCall(nullptr);
  if (wait()) {
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1);
    call->WriteLast(request, grpc::WriteOptions(), nullptr);
    wait();
    grpc::ByteBuffer response;
    for (;;) {
      call->Read(&response, nullptr);
      if (!wait()) break;
      ++outcome.responses;
    }
  }
  call->Finish(&outcome.status, nullptr);
  wait();
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  return outcome;
}

// GenerateRequest.text is a proto3 string. Client libraries do not send
// invalid UTF-8 in it (Python and Go refuse to serialize it; C++ logs an
// error), but a hand-encoded request can. The server's protobuf parser
// refuses such a request before the service sees it, and gRPC C++ (1.51)
// then fails the call with UNIMPLEMENTED and an empty message; nothing is
// generated, and the server goes on serving.
TEST(GenerationServiceTest, NonUtf8TextFailsTheCallAndTheServerServesOn) {
  Server s = StartServer();
  ASSERT_NE(s.server, nullptr);
  auto channel =
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", s.server->port()),
                          grpc::InsecureChannelCredentials());
  // GenerateRequest{text = 2: "Zoo", max_new_tokens = 8: 4}, encoded by hand:
  // the control, which must work.
  const RawOutcome good =
      RawGenerate(channel, std::string("\x12\x03Zoo\x40\x04", 7));
  ASSERT_TRUE(good.status.ok())
      << good.status.error_code() << " " << good.status.error_message();
  EXPECT_GE(good.responses, 2);  // chunks, then the final message

  // The same with text = "caf" + a lone UTF-8 lead byte.
  const RawOutcome bad = RawGenerate(channel, std::string("\x12\x04"
                                                          "caf\xC3"
                                                          "\x40\x04",
                                                          8));
  EXPECT_FALSE(bad.status.ok());
  EXPECT_EQ(bad.status.error_code(), grpc::StatusCode::UNIMPLEMENTED)
      << bad.status.error_message();
  EXPECT_EQ(bad.status.error_message(), "");
  EXPECT_EQ(bad.responses, 0);

  // The server is still up and serves the next request.
  const Streamed next = Call(*s.stub, TextRequest("Zoo", 4));
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(next.ids.size(), 4u);
  ASSERT_TRUE(next.final.has_value());
}

TEST(GenerationServiceTest, SixteenConcurrentStreamsAllComplete) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Server s = StartServer(/*max_running=*/4, /*max_queue=*/16);
  ASSERT_NE(s.server, nullptr);
  const v1::GenerateRequest request = TextRequest("Once upon a time", 80);
  const Streamed reference = Call(*s.stub, request);
  ASSERT_TRUE(reference.status.ok());
  std::vector<Streamed> results(16);
  std::vector<std::thread> threads;
  for (int i = 0; i < 16; ++i) {
    threads.emplace_back([&, i] { results[i] = Call(*s.stub, request); });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < 16; ++i) {
    EXPECT_TRUE(results[i].status.ok())
        << i << ": " << results[i].status.error_message();
    EXPECT_EQ(results[i].ids, reference.ids) << i;
  }
}

// A request id is free again as soon as its call has ended for the client:
// the soak (tools/soak.sh) reused an id right after its stream finished and
// was refused as "already running", because the id was released only when
// gRPC later ran the reactor's OnDone. Two calls with one id at the same time
// are still refused.
TEST(GenerationServiceTest, ARequestIdIsFreeOnceItsCallHasEnded) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Server s = StartServer();
  ASSERT_NE(s.server, nullptr);
  v1::GenerateRequest request = TextRequest("Once upon a time", 2);
  request.set_request_id("reused");
  for (int i = 0; i < 30; ++i) {
    const Streamed again = Call(*s.stub, request);
    ASSERT_TRUE(again.status.ok()) << i << ": " << again.status.error_message();
  }
  v1::GenerateRequest longer = TextRequest("Once upon a time", 200);
  longer.set_request_id("reused");
  longer.set_ignore_eos(true);
  Streamed second;
  const Streamed first =
      Call(*s.stub, longer, nullptr, [&] { second = Call(*s.stub, longer); });
  EXPECT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(second.status.error_message(),
              ::testing::HasSubstr("already running"));
}

// One slot, no queue: a second request while one runs is RESOURCE_EXHAUSTED;
// cancelling the first frees the slot for a third.
TEST(GenerationServiceTest, FullQueueRefusesAndCancellationFreesTheSlot) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Server s = StartServer(/*max_running=*/1, /*max_queue=*/0);
  ASSERT_NE(s.server, nullptr);
  v1::GenerateRequest longer = TextRequest("Once", 480);
  longer.set_ignore_eos(true);
  grpc::ClientContext first_context;
  Streamed refused;
  Streamed first = Call(*s.stub, longer, &first_context, [&] {
    refused = Call(*s.stub, TextRequest("Zoo", 4));
    first_context.TryCancel();
  });
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.status.error_message();
  EXPECT_EQ(first.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(first.ids.size(), 480u);
  // The slot frees within a step; retry briefly.
  Streamed third;
  for (int attempt = 0; attempt < 100; ++attempt) {
    third = Call(*s.stub, TextRequest("Zoo", 4));
    if (third.status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(third.status.ok()) << third.status.error_message();
}

TEST(GenerationServiceTest, DeadlinesAndAbortStopTheSequence) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Server s = StartServer(/*max_running=*/1, /*max_queue=*/4);
  ASSERT_NE(s.server, nullptr);
  v1::GenerateRequest longer = TextRequest("Once", 480);
  longer.set_ignore_eos(true);
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(30));
    Streamed late = Call(*s.stub, longer, &context);
    EXPECT_EQ(late.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  longer.set_request_id("abort-me");
  bool found = false;
  Streamed aborted = Call(*s.stub, longer, nullptr, [&] {
    grpc::ClientContext context;
    v1::AbortRequest abort;
    abort.set_request_id("abort-me");
    v1::AbortResponse response;
    ASSERT_TRUE(s.stub->Abort(&context, abort, &response).ok());
    found = response.found();
  });
  EXPECT_TRUE(found);
  EXPECT_TRUE(aborted.status.ok()) << aborted.status.error_message();
  ASSERT_TRUE(aborted.final.has_value());
  EXPECT_EQ(aborted.final->finish_reason(), v1::FINISH_REASON_ABORTED);
  EXPECT_LT(aborted.ids.size(), 480u);
  // The slot is free again.
  EXPECT_TRUE(Call(*s.stub, TextRequest("Zoo", 4)).status.ok());
}

// Issue 28, item 7: a request id belongs to the connection that sent it.
// A second client on its own connection cannot abort the first client's
// "job-1" (found = false, as for an unknown id) and may use "job-1" itself
// meanwhile; the first client cannot start a second "job-1" while its own
// runs, and its Abort finds it. Ids the server chooses are 32 random hex
// digits, never repeated.
TEST(GenerationServiceTest, ARequestIdBelongsToItsCaller) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Server s = StartServer(/*max_running=*/4, /*max_queue=*/4);
  ASSERT_NE(s.server, nullptr);
  // Its own subchannel pool gives the second client its own connection.
  grpc::ChannelArguments own_connection;
  own_connection.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::unique_ptr<v1::Generation::Stub> other =
      v1::Generation::NewStub(grpc::CreateCustomChannel(
          absl::StrCat("127.0.0.1:", s.server->port()),
          grpc::InsecureChannelCredentials(), own_connection));
  auto abort = [](v1::Generation::Stub& stub, const std::string& id) {
    grpc::ClientContext context;
    v1::AbortRequest request;
    request.set_request_id(id);
    v1::AbortResponse response;
    EXPECT_TRUE(stub.Abort(&context, request, &response).ok());
    return response.found();
  };
  v1::GenerateRequest longer = TextRequest("Once", 480);
  longer.set_ignore_eos(true);
  longer.set_request_id("job-1");
  bool other_found = true;
  bool own_found = false;
  Streamed others_job, duplicate;
  Streamed mine = Call(*s.stub, longer, nullptr, [&] {
    other_found = abort(*other, "job-1");
    v1::GenerateRequest same_id = TextRequest("Zoo", 4);
    same_id.set_request_id("job-1");
    others_job = Call(*other, same_id);
    duplicate = Call(*s.stub, same_id);
    own_found = abort(*s.stub, "job-1");
  });
  EXPECT_FALSE(other_found) << "another connection aborted job-1";
  EXPECT_TRUE(others_job.status.ok()) << others_job.status.error_message();
  ASSERT_TRUE(others_job.final.has_value());
  EXPECT_EQ(others_job.final->request_id(), "job-1");
  EXPECT_EQ(others_job.ids.size(), 4u);
  EXPECT_EQ(duplicate.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(duplicate.status.error_message(),
              ::testing::HasSubstr("already running"));
  EXPECT_TRUE(own_found);
  ASSERT_TRUE(mine.final.has_value());
  EXPECT_EQ(mine.final->finish_reason(), v1::FINISH_REASON_ABORTED);
  EXPECT_LT(mine.ids.size(), 480u);

  std::set<std::string> ids;
  const std::regex unguessable("req-[0-9a-f]{32}");
  for (int i = 0; i < 3; ++i) {
    const Streamed call = Call(*other, TextRequest("Zoo", 2));
    ASSERT_TRUE(call.final.has_value());
    EXPECT_TRUE(std::regex_match(call.final->request_id(), unguessable))
        << call.final->request_id();
    ids.insert(call.final->request_id());
  }
  EXPECT_EQ(ids.size(), 3u);
}

TEST(GenerationServiceTest, DrainFinishesRunningRequestsAndRefusesNewOnes) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Server s = StartServer(/*max_running=*/2, /*max_queue=*/2);
  ASSERT_NE(s.server, nullptr);
  v1::GenerateRequest longer = TextRequest("Once", 400);
  longer.set_ignore_eos(true);
  std::thread drainer;
  Streamed refused;
  Streamed running = Call(*s.stub, longer, nullptr, [&] {
    drainer = std::thread(
        [&] { EXPECT_TRUE(s.server->Drain(std::chrono::seconds(30))); });
    while (!s.server->service().scheduler().draining())
      std::this_thread::yield();
    refused = Call(*s.stub, TextRequest("Zoo", 4));
  });
  drainer.join();
  EXPECT_TRUE(running.status.ok()) << running.status.error_message();
  EXPECT_EQ(running.ids.size(), 400u);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

// A c10::Error thrown mid-stream (the fault hook runs where the step's
// forward passes run, holding the step turn) ends that stream with INTERNAL
// after the chunks it streamed; a concurrent stream finishes with exactly the
// greedy output it gives alone, the server serves the next request, and the
// internal-error metric counts 1.
TEST(GenerationServiceTest, AnExceptionInOneStreamsForwardFailsThatStreamOnly) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  constexpr int64_t kFaultStep = 12;
  // (request id, step) of every decode step, in the order they ran.
  absl::Mutex mu;
  std::vector<std::pair<std::string, int64_t>> steps;
  MetricsRegistry metrics;
  GenerationServiceOptions options;
  options.model_path = testing::Stories260kDir();
  options.metrics = &metrics;
  options.before_step_for_tests = [&](std::string_view id, int64_t step) {
    {
      absl::MutexLock lock(&mu);
      steps.emplace_back(std::string(id), step);
    }
    TORCH_CHECK(!(id == "faulty" && step == kFaultStep),
                "injected fault at step ", step);
  };
  auto server = ExecutorServer::Start(*model, *StoriesTokenizer(), options,
                                      "127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = StubFor(**server);

  v1::GenerateRequest healthy = TextRequest("Once upon a time", 160);
  healthy.set_ignore_eos(true);
  healthy.set_request_id("healthy");
  const Streamed alone = Call(*stub, healthy);
  ASSERT_TRUE(alone.status.ok()) << alone.status.error_message();
  ASSERT_EQ(alone.ids.size(), 160u);
  GenerationRequest local;
  local.prompt_ids = *StoriesTokenizer()->Encode("Once upon a time", true);
  local.max_new_tokens = 160;
  local.ignore_eos = true;
  auto want = Generate(*model, *StoriesTokenizer(), local);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(alone.ids, want->output_ids);
  {
    absl::MutexLock lock(&mu);
    steps.clear();
  }

  v1::GenerateRequest faulty = TextRequest("The little dog", 160);
  faulty.set_ignore_eos(true);
  faulty.set_request_id("faulty");
  Streamed failed;
  std::thread faulty_client;
  // The faulty stream starts once the healthy one is streaming.
  const Streamed together = Call(*stub, healthy, nullptr, [&] {
    faulty_client = std::thread([&] { failed = Call(*stub, faulty); });
  });
  faulty_client.join();

  EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::INTERNAL)
      << failed.status.error_message();
  EXPECT_NE(failed.status.error_message().find("injected fault at step 12"),
            std::string::npos)
      << failed.status.error_message();
  EXPECT_NE(failed.status.error_message().find("decode step 12"),
            std::string::npos)
      << failed.status.error_message();
  // It streamed its first token and one per step before the fault.
  EXPECT_EQ(failed.ids.size(), static_cast<size_t>(kFaultStep + 1));
  EXPECT_FALSE(failed.final.has_value());

  ASSERT_TRUE(together.status.ok()) << together.status.error_message();
  EXPECT_EQ(together.ids, alone.ids);
  EXPECT_EQ(together.text, alone.text);
  ASSERT_TRUE(together.final.has_value());
  EXPECT_EQ(together.final->finish_reason(), v1::FINISH_REASON_LENGTH);
  {
    // The two really ran side by side: the healthy stream stepped before and
    // after the fault.
    absl::MutexLock lock(&mu);
    auto fault =
        std::find(steps.begin(), steps.end(),
                  std::pair<std::string, int64_t>("faulty", kFaultStep));
    ASSERT_NE(fault, steps.end());
    EXPECT_NE(std::find_if(steps.begin(), fault,
                           [](const auto& s) { return s.first == "healthy"; }),
              fault);
    EXPECT_NE(std::find_if(fault, steps.end(),
                           [](const auto& s) { return s.first == "healthy"; }),
              steps.end());
  }

  // The step turn was released and the server still serves.
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(60));
  v1::GenerateRequest zoo = TextRequest("Zoo", 20);
  zoo.set_ignore_eos(true);
  const Streamed third = Call(*stub, zoo, &context);
  EXPECT_TRUE(third.status.ok()) << third.status.error_message();
  EXPECT_EQ(third.ids.size(), 20u);

  const std::string text = metrics.Render();
  EXPECT_NE(text.find("knapserve_request_internal_errors_total 1\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("knapserve_requests_total{code=\"INTERNAL\"} 1\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("knapserve_requests_total{code=\"OK\"} 3\n"),
            std::string::npos)
      << text;
}

}  // namespace
}  // namespace knapserve

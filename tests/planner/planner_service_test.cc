// Tests of the Planner gRPC service (planner/planner_service.h,
// planner_server.h) with the executor's RemotePlannerClient
// (executor/api/remote_planner_client.h), over real loopback gRPC in one
// process: answers, errors, planned generation through the wire, and a planner
// that dies mid-generation and comes back.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/metrics/metrics.h"
#include "common/wire/plan_codec.h"
#include "executor/api/remote_planner_client.h"
#include "executor/engine/generator.h"
#include "planner/planner_server.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::CachedModel;
using testing::ForwardPlanRequest;
using testing::HandLatencyProfile;
using testing::StoriesTokenizer;

struct Fixture {
  const LlamaModel* model = nullptr;
  std::unique_ptr<InProcessPlanner> planner;
  std::unique_ptr<PlannerServer> server;
  std::string address;
};

Fixture StartPlanner(const std::string& listen = "127.0.0.1:0",
                     int64_t max_request_bytes = kDefaultMaxPlanRequestBytes) {
  Fixture f;
  f.model = CachedModel("stories260k");
  if (f.model == nullptr) return f;
  auto planner =
      InProcessPlanner::Create(*f.model, HandLatencyProfile(*f.model), {});
  EXPECT_TRUE(planner.ok()) << planner.status();
  f.planner = std::move(*planner);
  auto server = PlannerServer::Start(f.planner.get(), f.model->num_layers(),
                                     listen, max_request_bytes);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return f;
  f.server = std::move(*server);
  f.address = absl::StrCat("127.0.0.1:", f.server->port());
  return f;
}

RemotePlannerOptions ClientOptions(const Fixture& f) {
  RemotePlannerOptions options;
  options.address = f.address;
  options.num_layers = f.model->num_layers();
  options.initial_backoff = std::chrono::milliseconds(50);
  options.max_backoff = std::chrono::milliseconds(200);
  return options;
}

absl::StatusOr<DraftPlan> SubmitAndWait(PlannerClient& client,
                                        PlanRequest request) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<DraftPlan>>>();
  auto future = promise->get_future();
  client.Submit(std::move(request), [promise](absl::StatusOr<DraftPlan> plan) {
    promise->set_value(std::move(plan));
  });
  if (future.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    return absl::DeadlineExceededError("no answer within 60 s");
  }
  return future.get();
}

TEST(PlannerServiceTest, AnswersOverTheWireLikeTheInProcessPlanner) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Fixture f = StartPlanner();
  ASSERT_NE(f.server, nullptr);
  RemotePlannerClient client(ClientOptions(f));
  const PlanRequest request = ForwardPlanRequest(*f.model, 7, 60, 8);
  auto direct = f.planner->Solve(request);
  ASSERT_TRUE(direct.ok()) << direct.status();
  auto remote = SubmitAndWait(client, request);
  ASSERT_TRUE(remote.ok()) << remote.status();
  // The default window (4 + 1024 positions) covers this prefix: same plan.
  EXPECT_EQ(remote->mask, direct->mask);
  EXPECT_EQ(remote->gamma, direct->gamma);
  EXPECT_DOUBLE_EQ(remote->alpha_hat, direct->alpha_hat);
  EXPECT_EQ(remote->step, request.step);
  EXPECT_GT(remote->solve_seconds, 0);
  EXPECT_GT(client.bytes_sent(), 0);
  EXPECT_EQ(client.requests_sent(), 1);
  EXPECT_EQ(f.server->service().requests(), 1);

  PlanRequest other = ForwardPlanRequest(*f.model, 8, 20, 4);
  other.model_fingerprint = "llama-another-model";
  auto refused = SubmitAndWait(client, other);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
      << refused.status();
  PlanRequest bad = ForwardPlanRequest(*f.model, 9, 20, 4);
  bad.states = bad.states.narrow(0, 0, 3);  // not 2L+1 boundaries
  auto invalid = SubmitAndWait(client, bad);
  EXPECT_EQ(invalid.status().code(), absl::StatusCode::kInvalidArgument)
      << invalid.status();
}

// A solve that throws behind the service answers that request
// PLAN_ERROR_CODE_INTERNAL (Internal to the executor's callback); the stream,
// the service and the planner keep answering.
TEST(PlannerServiceTest, ASolveThatThrowsIsInternalAndTheServiceKeepsServing) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  InProcessPlannerOptions options;
  options.before_solve_for_tests = [](const PlanRequest& request) {
    TORCH_CHECK(request.step != 666, "injected solve fault");
  };
  auto planner =
      InProcessPlanner::Create(*model, HandLatencyProfile(*model), options);
  ASSERT_TRUE(planner.ok()) << planner.status();
  auto server =
      PlannerServer::Start(planner->get(), model->num_layers(), "127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  Fixture f;
  f.model = model;
  f.address = absl::StrCat("127.0.0.1:", (*server)->port());
  RemotePlannerClient client(ClientOptions(f));
  PlanRequest faulty = ForwardPlanRequest(*model, 5, 30, 4);
  faulty.step = 666;
  auto failed = SubmitAndWait(client, faulty);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal)
      << failed.status();
  EXPECT_NE(failed.status().message().find("injected solve fault"),
            std::string::npos)
      << failed.status();
  for (uint64_t sequence : {5, 6}) {
    auto plan =
        SubmitAndWait(client, ForwardPlanRequest(*model, sequence, 30, 4));
    ASSERT_TRUE(plan.ok()) << sequence << ": " << plan.status();
  }
  EXPECT_EQ((*planner)->internal_errors(), 1);
  EXPECT_EQ((*server)->service().requests(), 3);
  EXPECT_EQ((*server)->service().internal_errors(), 0);  // decoding never threw
}

GenerationRequest Planned(int64_t tokens) {
  GenerationRequest request;
  request.prompt_ids = {1, 410, 469, 347};
  request.max_new_tokens = tokens;
  request.ignore_eos = true;
  request.speculation.mode = SpeculationMode::kKnapSpec;
  request.speculation.max_draft = 6;
  request.speculation.plan_interval = 8;
  request.speculation.reference_steps = 2;
  return request;
}

TEST(PlannerServiceTest, PlannedGenerationThroughARemotePlannerIsLossless) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Fixture f = StartPlanner();
  ASSERT_NE(f.server, nullptr);
  RemotePlannerClient client(ClientOptions(f));
  GenerationRequest off = Planned(300);
  off.speculation.mode = SpeculationMode::kOff;
  auto ar = Generate(*f.model, *StoriesTokenizer(), off);
  ASSERT_TRUE(ar.ok()) << ar.status();
  auto spec = Generate(*f.model, *StoriesTokenizer(), Planned(300), nullptr,
                       nullptr, &client);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->output_ids, ar->output_ids);
  EXPECT_GT(spec->stats.plan_requests, 0);
  std::printf("[ remote ] %lld plan requests, %zu applied, %lld bytes sent\n",
              static_cast<long long>(spec->stats.plan_requests),
              spec->plans.size(), static_cast<long long>(client.bytes_sent()));
}

// A planner that serves before its latency profile exists answers
// PLAN_ERROR_CODE_PROFILE_PENDING. The executor counts no failure: it decodes
// without a plan (same output), stops sending snapshots for a while, and
// plans once the profile has landed.
TEST(PlannerServiceTest, APlannerWithoutItsProfileYetIsPendingNotFailing) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  auto planner = InProcessPlanner::CreateWithoutProfile(*model, {});
  ASSERT_TRUE(planner.ok()) << planner.status();
  MetricsRegistry metrics;
  auto server =
      PlannerServer::Start(planner->get(), model->num_layers(), "127.0.0.1:0",
                           kDefaultMaxPlanRequestBytes, nullptr, "", &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  RemotePlannerOptions options;
  options.address = absl::StrCat("127.0.0.1:", (*server)->port());
  options.num_layers = model->num_layers();
  options.profile_pending_retry = std::chrono::milliseconds(200);
  RemotePlannerClient client(options);
  EXPECT_FALSE(client.ProfilePending());
  auto pending = SubmitAndWait(client, ForwardPlanRequest(*model, 1, 30, 4));
  EXPECT_TRUE(IsProfilePending(pending.status())) << pending.status();
  EXPECT_EQ(client.profile_pending_answers(), 1);
  EXPECT_NE(
      metrics.Render().find("knapserve_planner_server_profile_pending_total 1"),
      std::string::npos);

  // A generation whose first snapshot is answered "pending" mid-way (the
  // stream holds step 30 until the answer is in), once the client's retry
  // window after the first answer has passed.
  GenerationRequest off = Planned(120);
  off.speculation.mode = SpeculationMode::kOff;
  auto ar = Generate(*model, *StoriesTokenizer(), off);
  ASSERT_TRUE(ar.ok()) << ar.status();
  auto wait_until_not_pending = [&] {
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (client.ProfilePending() &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return !client.ProfilePending();
  };
  ASSERT_TRUE(wait_until_not_pending());
  int steps = 0;
  bool answered = true;
  auto spec = Generate(
      *model, *StoriesTokenizer(), Planned(120),
      [&](absl::Span<const int32_t>, std::string_view, const StepLogprobs&) {
        if (++steps == 30) {
          const auto deadline =
              std::chrono::steady_clock::now() + std::chrono::seconds(60);
          while (client.profile_pending_answers() < 2 &&
                 std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
          answered = client.profile_pending_answers() >= 2;
        }
        return true;
      },
      nullptr, &client);
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_TRUE(answered) << "the planner never answered the snapshot";
  EXPECT_EQ(spec->output_ids, ar->output_ids);
  EXPECT_GE(spec->stats.plan_requests, 1);
  EXPECT_EQ(spec->stats.plan_failures, 0);
  EXPECT_EQ(spec->last_plan_error, "");
  EXPECT_TRUE(spec->planning.profile_pending);
  EXPECT_GT(spec->planning.profile_pending_steps, 0);
  EXPECT_TRUE(spec->plans.empty());

  // The profile lands; after the retry window the client plans again.
  ASSERT_TRUE((*planner)->SetProfile(HandLatencyProfile(*model)).ok());
  ASSERT_TRUE(wait_until_not_pending());
  auto planned = Generate(*model, *StoriesTokenizer(), Planned(120), nullptr,
                          nullptr, &client);
  ASSERT_TRUE(planned.ok()) << planned.status();
  EXPECT_EQ(planned->output_ids, ar->output_ids);
  EXPECT_FALSE(planned->planning.profile_pending);
  EXPECT_GE(planned->stats.plan_requests, 1);
  EXPECT_EQ(planned->stats.plan_failures, 0);
  // The planner answers with plans now.
  const int64_t answers = client.profile_pending_answers();
  auto plan = SubmitAndWait(client, ForwardPlanRequest(*model, 3, 30, 4));
  EXPECT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(client.profile_pending_answers(), answers);
  EXPECT_FALSE(client.ProfilePending());
}

// The planner goes away mid-generation: decoding goes on (same output), and
// the client reconnects when a planner listens on the address again.
TEST(PlannerServiceTest, SurvivesAPlannerRestart) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Fixture f = StartPlanner();
  ASSERT_NE(f.server, nullptr);
  const int port = f.server->port();
  RemotePlannerClient client(ClientOptions(f));
  ASSERT_TRUE(
      SubmitAndWait(client, ForwardPlanRequest(*f.model, 1, 30, 4)).ok());
  EXPECT_EQ(client.connections(), 1);

  GenerationRequest off = Planned(400);
  off.speculation.mode = SpeculationMode::kOff;
  auto ar = Generate(*f.model, *StoriesTokenizer(), off);
  ASSERT_TRUE(ar.ok());
  std::atomic<int> steps{0};
  std::thread killer([&] {
    while (steps.load() < 40)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    f.server.reset();  // the planner dies
  });
  auto spec = Generate(
      *f.model, *StoriesTokenizer(), Planned(400),
      [&](absl::Span<const int32_t>, std::string_view, const StepLogprobs&) {
        ++steps;
        if (steps.load() > 40)
          std::this_thread::sleep_for(std::chrono::microseconds(300));
        return true;
      },
      nullptr, &client);
  killer.join();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->output_ids, ar->output_ids);

  // A new planner on the same port: the client finds it again.
  auto restarted = PlannerServer::Start(f.planner.get(), f.model->num_layers(),
                                        absl::StrCat("127.0.0.1:", port));
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  absl::StatusOr<DraftPlan> again = absl::UnavailableError("not tried");
  for (int attempt = 0; attempt < 50 && !again.ok(); ++attempt) {
    again = SubmitAndWait(client, ForwardPlanRequest(*f.model, 2, 30, 4));
    if (!again.ok())
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_GE(client.connections(), 2);
  EXPECT_TRUE(client.connected());
}

// --max-plan-request-bytes on both sides. The planner ends a stream whose
// request is over its cap (that request fails; another executor's stream
// goes on, and the first reconnects); a client with the cap fails such a
// request alone, naming the flag, and never sends it.
TEST(PlannerServiceTest, OversizePlanRequestsAreRefusedAndOtherStreamsGoOn) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  auto bytes_of = [](const PlanRequest& request) {
    v1::PlanRequest wire;
    EXPECT_TRUE(EncodePlanRequest(request, KvWindowOptions(), &wire).ok());
    return static_cast<int64_t>(wire.ByteSizeLong());
  };
  const int64_t small = bytes_of(ForwardPlanRequest(*model, 1, 8, 2));
  const int64_t big = bytes_of(ForwardPlanRequest(*model, 2, 300, 8));
  ASSERT_LT(small * 2, big);
  const int64_t cap = (small + big) / 2;
  Fixture f = StartPlanner("127.0.0.1:0", cap);
  ASSERT_NE(f.server, nullptr);

  RemotePlannerClient a(ClientOptions(f));  // sends whatever it is given
  RemotePlannerClient b(ClientOptions(f));
  ASSERT_TRUE(SubmitAndWait(b, ForwardPlanRequest(*model, 3, 8, 2)).ok());
  const absl::StatusOr<DraftPlan> refused =
      SubmitAndWait(a, ForwardPlanRequest(*model, 4, 300, 8));
  EXPECT_FALSE(refused.ok());
  // The other stream carries on; the refused client reconnects and works.
  const absl::StatusOr<DraftPlan> other =
      SubmitAndWait(b, ForwardPlanRequest(*model, 5, 8, 2));
  EXPECT_TRUE(other.ok()) << other.status();
  absl::StatusOr<DraftPlan> again = absl::UnavailableError("not tried");
  for (int attempt = 0; attempt < 50 && !again.ok(); ++attempt) {
    again = SubmitAndWait(a, ForwardPlanRequest(*model, 6 + attempt, 8, 2));
    if (!again.ok())
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(again.ok()) << again.status();

  RemotePlannerOptions capped = ClientOptions(f);
  capped.max_message_bytes = static_cast<int>(cap);
  RemotePlannerClient c(capped);
  const absl::StatusOr<DraftPlan> local_refusal =
      SubmitAndWait(c, ForwardPlanRequest(*model, 100, 300, 8));
  EXPECT_EQ(local_refusal.status().code(), absl::StatusCode::kResourceExhausted)
      << local_refusal.status();
  EXPECT_NE(local_refusal.status().message().find("--max-plan-request-bytes"),
            std::string::npos)
      << local_refusal.status();
  const absl::StatusOr<DraftPlan> fits =
      SubmitAndWait(c, ForwardPlanRequest(*model, 101, 8, 2));
  EXPECT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(c.connections(), 1);  // the refusal did not touch its stream
}

}  // namespace
}  // namespace knapserve

// Tests of the in-process planner (planner/inprocess_planner.h) and of
// planned generation end to end: executor/engine/generator.h driving a real
// InProcessPlanner through the PlannerClient interface
// (common/plan/planner_client.h).
#include "planner/inprocess_planner.h"

#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <future>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/model/parallel_for.h"
#include "common/text/tokenizer.h"
#include "common/wire/plan_codec.h"
#include "executor/engine/generator.h"
#include "tests/testing/synchronous_planner.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::HandLatencyProfile;
using testing::RandomModelDir;
using testing::Stories260kDir;
using testing::SynchronousPlanner;

// Models by name ("stories260k", "tiny-llama", "stories260k/bf16"), loaded
// once per process.
const LlamaModel* GetModel(const std::string& name) {
  return testing::CachedModel(name);
}

const Tokenizer* GetTokenizer() { return testing::StoriesTokenizer(); }

PlanRequest MakeRequest(const LlamaModel& model, uint64_t sequence_id,
                        int64_t prefix, int64_t r) {
  return testing::ForwardPlanRequest(model, sequence_id, prefix, r);
}

// The tiny 2-layer shapes have no middle layer: they may skip the first and
// last, and keep every DP cell (random weights give low cosines).
std::unique_ptr<InProcessPlanner> MakePlanner(
    const LlamaModel& model, const AlphaPrior& alpha_prior = AlphaPrior()) {
  InProcessPlannerOptions options;
  options.knapspec.alpha_prior = alpha_prior;
  if (model.num_layers() <= 2) {
    options.knapspec.keep_first_and_last = false;
    options.knapspec.tau = -1;
  }
  auto planner =
      InProcessPlanner::Create(model, HandLatencyProfile(model), options);
  EXPECT_TRUE(planner.ok()) << planner.status();
  return planner.ok() ? std::move(*planner) : nullptr;
}

// Waits for a callback's result (bounded, so a lost callback fails the test
// instead of hanging it).
absl::StatusOr<DraftPlan> Await(
    std::future<absl::StatusOr<DraftPlan>>& future) {
  if (future.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    return absl::DeadlineExceededError("no callback within 60 s");
  }
  return future.get();
}

TEST(InProcessPlannerTest, SolvesOnItsOwnThreadAndCallsBack) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = GetModel("stories260k");
  ASSERT_NE(model, nullptr);
  auto planner = MakePlanner(*model);
  ASSERT_NE(planner, nullptr);
  std::promise<absl::StatusOr<DraftPlan>> promise;
  auto future = promise.get_future();
  std::thread::id callback_thread;
  planner->Submit(MakeRequest(*model, 1, 40, 8),
                  [&](absl::StatusOr<DraftPlan> plan) {
                    callback_thread = std::this_thread::get_id();
                    promise.set_value(std::move(plan));
                  });
  auto plan = Await(future);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_NE(callback_thread, std::this_thread::get_id());
  EXPECT_EQ(plan->step, 64);
  EXPECT_EQ(plan->mask.num_layers(), model->num_layers());
  EXPECT_GE(plan->gamma, 0);
  EXPECT_LE(plan->gamma, 10);
  EXPECT_GT(plan->solve_seconds, 0);
  EXPECT_GE(plan->queue_seconds, 0);
  // The same request solved on this thread gives the same plan.
  auto direct = planner->Solve(MakeRequest(*model, 1, 40, 8));
  ASSERT_TRUE(direct.ok()) << direct.status();
  EXPECT_EQ(direct->mask, plan->mask);
  EXPECT_EQ(direct->gamma, plan->gamma);
  EXPECT_EQ(planner->solved(), 1);
}

TEST(InProcessPlannerTest, EveryPolicyAnswers) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = GetModel("stories260k");
  ASSERT_NE(model, nullptr);
  auto planner = MakePlanner(*model);
  ASSERT_NE(planner, nullptr);
  PlanRequest clasp = MakeRequest(*model, 2, 30, 6);
  clasp.policy = PlanPolicy::kClasp;
  clasp.clasp_layers = 2;
  auto plan = planner->Solve(clasp);
  ASSERT_TRUE(plan.ok()) << plan.status();
  if (plan->gamma > 0) {
    int skipped_layers = 0;
    for (int i = 0; i < model->num_layers(); ++i) {
      EXPECT_EQ(plan->mask.skip_attention(i), plan->mask.skip_mlp(i))
          << "whole layers only";
      skipped_layers += plan->mask.skip_attention(i) ? 1 : 0;
    }
    EXPECT_EQ(skipped_layers, 2);
  }
  PlanRequest fixed = MakeRequest(*model, 3, 30, 6);
  fixed.policy = PlanPolicy::kStatic;
  fixed.static_mask = "a2,m3";
  plan = planner->Solve(fixed);
  ASSERT_TRUE(plan.ok()) << plan.status();
  if (plan->gamma > 0) {
    EXPECT_EQ(plan->mask.ToString(), "a2,m3");
  }
  fixed.static_mask = "a9";
  EXPECT_EQ(planner->Solve(fixed).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// PlanRequest::plan_lifetime_tokens reaches every policy: the plan is priced
// at context_length + lifetime / 2 (0 keeps the snapshot's context).
TEST(InProcessPlannerTest, PricesEveryPolicyAtTheMeanContextOfThePlansLife) {
  const LlamaModel* model = GetModel("tiny-llama");
  ASSERT_NE(model, nullptr);
  LatencyProfile profile = HandLatencyProfile(*model);
  for (double& v : profile.verify_seconds.back())
    v *= 4;  // dearer with context
  InProcessPlannerOptions options;
  options.knapspec.keep_first_and_last = false;
  options.knapspec.tau = -1;
  auto planner = InProcessPlanner::Create(*model, profile, options);
  ASSERT_TRUE(planner.ok()) << planner.status();
  for (PlanPolicy policy :
       {PlanPolicy::kKnapSpec, PlanPolicy::kClasp, PlanPolicy::kStatic}) {
    SCOPED_TRACE(PlanPolicyName(policy));
    PlanRequest request = MakeRequest(*model, 4, 24, 6);  // context 30
    request.policy = policy;
    request.clasp_layers = 1;
    request.static_mask = "m0";
    auto now = (*planner)->Solve(request);
    ASSERT_TRUE(now.ok()) << now.status();
    EXPECT_DOUBLE_EQ(now->baseline_tpt, 1.0 / profile.VerifySeconds(30, 1));
    request.plan_lifetime_tokens = 64;
    auto lived = (*planner)->Solve(request);
    ASSERT_TRUE(lived.ok()) << lived.status();
    EXPECT_DOUBLE_EQ(lived->baseline_tpt, 1.0 / profile.VerifySeconds(62, 1));
    EXPECT_LT(lived->baseline_tpt, now->baseline_tpt);
  }
}

TEST(InProcessPlannerTest, RefusesRequestsAndProfilesOfAnotherModel) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = GetModel("stories260k");
  ASSERT_NE(model, nullptr);
  auto planner = MakePlanner(*model);
  ASSERT_NE(planner, nullptr);
  PlanRequest request = MakeRequest(*model, 4, 20, 4);
  request.model_fingerprint = "llama-some-other-model";
  std::promise<absl::StatusOr<DraftPlan>> promise;
  auto future = promise.get_future();
  planner->Submit(std::move(request), [&](absl::StatusOr<DraftPlan> plan) {
    promise.set_value(std::move(plan));
  });
  auto plan = Await(future);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition)
      << plan.status();
  EXPECT_NE(plan.status().message().find("llama-some-other-model"),
            std::string::npos);

  LatencyProfile other = HandLatencyProfile(*model);
  other.dtype = "bf16";
  auto refused = InProcessPlanner::Create(*model, other, {});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
      << refused.status();
  InProcessPlannerOptions no_threads;
  no_threads.threads = 0;
  EXPECT_EQ(
      InProcessPlanner::Create(*model, HandLatencyProfile(*model), no_threads)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
}

// A request that crossed the wire with a window covering the whole prefix
// plans exactly like the in-memory one, for every policy: the wire also
// carries the reference tokens' committed K/V, which CLaSp's DP on the last
// reference token attends to. A short window still plans.
TEST(InProcessPlannerTest, AnExactKvWindowGivesTheInMemoryPlan) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = GetModel("stories260k");
  ASSERT_NE(model, nullptr);
  auto planner = MakePlanner(*model);
  ASSERT_NE(planner, nullptr);
  PlanRequest request = MakeRequest(*model, 5, 60, 8);
  // As the executor sends it: the cache holds the reference tokens too.
  request.kv_length = 60 + 8;
  for (const PlanPolicy policy :
       {PlanPolicy::kKnapSpec, PlanPolicy::kClasp, PlanPolicy::kStatic}) {
    request.policy = policy;
    request.clasp_layers = 2;
    request.static_mask = "a2,m3";
    const std::string name = PlanPolicyName(policy);
    auto direct = planner->Solve(request);
    ASSERT_TRUE(direct.ok()) << name << ": " << direct.status();
    for (const KvWindowOptions& window :
         {KvWindowOptions{4, 1024}, KvWindowOptions{2, 16}}) {
      v1::PlanRequest wire;
      ASSERT_TRUE(EncodePlanRequest(request, window, &wire).ok());
      EXPECT_EQ(wire.kv_context().window().reference_positions_with_kv(), 7);
      auto decoded = DecodePlanRequest(wire, model->num_layers(), 10);
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      decoded->target_argmax.clear();  // let the planner recompute them
      auto remote = planner->Solve(*decoded);
      ASSERT_TRUE(remote.ok()) << name << ": " << remote.status();
      if (window.window >= 60) {
        // Every committed position before the last reference token, in
        // order and bit for bit: what CLaSp's DP on that token attends to.
        EXPECT_EQ(decoded->kv_length, 67) << name;
        ASSERT_EQ(decoded->kv_positions.size(), 67u);
        EXPECT_EQ(decoded->kv_positions.back(), 66);
        for (int l = 0; l < model->num_layers(); ++l) {
          EXPECT_TRUE(torch::equal(decoded->kv[l].k,
                                   request.kv[l].k.narrow(1, 0, 67).cpu()));
        }
        EXPECT_EQ(remote->mask, direct->mask) << name;
        EXPECT_EQ(remote->gamma, direct->gamma) << name;
        EXPECT_DOUBLE_EQ(remote->alpha_hat, direct->alpha_hat) << name;
        EXPECT_DOUBLE_EQ(remote->mean_cosine, direct->mean_cosine) << name;
      }
      std::printf(
          "[ %s window %lld+%lld ] mask '%s' gamma %d alpha_hat %.3f cosine "
          "%.4f (in memory: '%s' %d %.3f %.4f)\n",
          name.c_str(), static_cast<long long>(window.leading),
          static_cast<long long>(window.window),
          remote->mask.ToString().c_str(), remote->gamma, remote->alpha_hat,
          remote->mean_cosine, direct->mask.ToString().c_str(), direct->gamma,
          direct->alpha_hat, direct->mean_cosine);
    }
  }
  request.policy = PlanPolicy::kKnapSpec;
  PlanRequest off = request;
  off.policy = PlanPolicy::kOff;
  auto none = planner->Solve(off);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->gamma, 0);
}

// While the worker is held inside a callback, a second request of the same
// sequence replaces the queued one (Cancelled) and Forget drops another.
TEST(InProcessPlannerTest, NewerRequestReplacesTheQueuedOneAndForgetDrops) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = GetModel("stories260k");
  ASSERT_NE(model, nullptr);
  auto planner = MakePlanner(*model);
  ASSERT_NE(planner, nullptr);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<void> holding;
  planner->Submit(MakeRequest(*model, 10, 20, 4),
                  [&](absl::StatusOr<DraftPlan>) {
                    holding.set_value();
                    released.wait();
                  });
  holding.get_future().wait();  // the worker is now busy in the callback

  std::promise<absl::StatusOr<DraftPlan>> first, second, other;
  auto first_f = first.get_future(), second_f = second.get_future(),
       other_f = other.get_future();
  PlanRequest older = MakeRequest(*model, 11, 20, 4);
  older.step = 1;
  PlanRequest newer = MakeRequest(*model, 11, 24, 4);
  newer.step = 2;
  planner->Submit(std::move(older),
                  [&](absl::StatusOr<DraftPlan> p) { first.set_value(p); });
  planner->Submit(std::move(newer),
                  [&](absl::StatusOr<DraftPlan> p) { second.set_value(p); });
  planner->Submit(MakeRequest(*model, 12, 20, 4),
                  [&](absl::StatusOr<DraftPlan> p) { other.set_value(p); });
  auto replaced = Await(first_f);
  EXPECT_EQ(replaced.status().code(), absl::StatusCode::kCancelled)
      << replaced.status();
  planner->Forget(12);
  auto forgotten = Await(other_f);
  EXPECT_EQ(forgotten.status().code(), absl::StatusCode::kCancelled)
      << forgotten.status();
  release.set_value();
  auto solved = Await(second_f);
  ASSERT_TRUE(solved.ok()) << solved.status();
  EXPECT_EQ(solved->step, 2);
  EXPECT_EQ(planner->replaced(), 1);
}

// A solve that throws (a c10::Error from a LibTorch check, injected through
// the documented test hook) answers that request Internal, is counted, and
// the planner goes on solving the next request on the same thread.
TEST(InProcessPlannerTest, ASolveThatThrowsIsInternalForThatRequestOnly) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = GetModel("stories260k");
  ASSERT_NE(model, nullptr);
  InProcessPlannerOptions options;
  options.before_solve_for_tests = [](const PlanRequest& request) {
    TORCH_CHECK(request.sequence_id != 21, "injected solve fault for sequence ",
                request.sequence_id);
  };
  auto planner =
      InProcessPlanner::Create(*model, HandLatencyProfile(*model), options);
  ASSERT_TRUE(planner.ok()) << planner.status();
  std::promise<absl::StatusOr<DraftPlan>> failed, solved;
  auto failed_f = failed.get_future(), solved_f = solved.get_future();
  (*planner)->Submit(MakeRequest(*model, 21, 20, 4),
                     [&](absl::StatusOr<DraftPlan> p) { failed.set_value(p); });
  (*planner)->Submit(MakeRequest(*model, 22, 20, 4),
                     [&](absl::StatusOr<DraftPlan> p) { solved.set_value(p); });
  auto error = Await(failed_f);
  EXPECT_EQ(error.status().code(), absl::StatusCode::kInternal)
      << error.status();
  EXPECT_NE(
      error.status().message().find("injected solve fault for sequence 21"),
      std::string::npos)
      << error.status();
  // The message is LibTorch's, without the C++ backtrace it appends to what().
  EXPECT_EQ(error.status().message().find("most recent call first"),
            std::string::npos)
      << error.status();
  auto plan = Await(solved_f);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ((*planner)->internal_errors(), 1);
  EXPECT_EQ((*planner)->solved(), 2);
}

// With reserve_cores, every pass of the kernels leaves the solve its cores
// while it runs (ScopedSolveCores), and only then.
TEST(InProcessPlannerTest, ASolveHasItsReservedCoresWhileItRuns) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = GetModel("stories260k");
  ASSERT_NE(model, nullptr);
  const int cores = UsableCores();
  if (cores < 2) GTEST_SKIP() << "one core: nothing to leave";
  SetPassThreads(cores, cores);  // the decode wants every core
  std::atomic<int> during{-1};
  InProcessPlannerOptions options;
  options.reserve_cores = 1;
  options.before_solve_for_tests = [&](const PlanRequest&) {
    during = PassThreads(1);
  };
  auto planner =
      InProcessPlanner::Create(*model, HandLatencyProfile(*model), options);
  ASSERT_TRUE(planner.ok()) << planner.status();
  std::promise<absl::StatusOr<DraftPlan>> solved;
  auto solved_f = solved.get_future();
  (*planner)->Submit(MakeRequest(*model, 31, 20, 4),
                     [&](absl::StatusOr<DraftPlan> p) { solved.set_value(p); });
  auto plan = Await(solved_f);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(during.load(), cores - 1);
  EXPECT_EQ(PassThreads(1), cores);
  EXPECT_EQ(PassThreads(1000), cores);
  SetPassThreads(0, 0);
  InProcessPlannerOptions bad;
  bad.reserve_cores = -1;
  EXPECT_EQ(InProcessPlanner::CreateWithoutProfile(*model, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

GenerationRequest PlannedRequest(SpeculationMode mode, int64_t max_new_tokens) {
  GenerationRequest request;
  request.prompt_ids = {1, 210, 169, 247, 270};
  request.max_new_tokens = max_new_tokens;
  request.ignore_eos = true;
  request.speculation.mode = mode;
  request.speculation.max_draft = 6;
  request.speculation.exit_threshold = 0.0;
  request.speculation.plan_interval = 8;
  request.speculation.reference_steps = 3;
  request.speculation.clasp_layers = 1;
  // Replanning happens on triggers (executor/planning/plan_controller.h):
  // 32-token context buckets give a new-bucket trigger every ~32 tokens, and no
  // planner budget lets every trigger solve (the budget has its own tests).
  request.speculation.plan_bucket_tokens = 32;
  request.speculation.planner_budget = 0;
  return request;
}

class PlannedGenerationTest : public ::testing::TestWithParam<std::string> {};

// Greedy output under knapspec and clasp plans equals --spec off, with
// several plans applied (some of which draft).
TEST_P(PlannedGenerationTest, GreedyOutputEqualsAutoregressive) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = GetModel(GetParam());
  ASSERT_NE(model, nullptr);
  // Raw alpha_hat: with 3 reference tokens the default Beta(1, 1) prior caps
  // the acceptance at 4/5, and a one-layer CLaSp draft of stories260k (80% of
  // a step) then never pays; this test needs plans that draft.
  auto core = MakePlanner(*model, AlphaPrior{0, 0});
  ASSERT_NE(core, nullptr);
  const int64_t tokens = std::min<int64_t>(160, model->max_context() - 5);
  auto ar = Generate(*model, *GetTokenizer(),
                     PlannedRequest(SpeculationMode::kOff, tokens));
  ASSERT_TRUE(ar.ok()) << ar.status();
  for (SpeculationMode mode :
       {SpeculationMode::kKnapSpec, SpeculationMode::kClasp}) {
    SCOPED_TRACE(SpeculationModeName(mode));
    SynchronousPlanner planner(core.get());
    auto spec = Generate(*model, *GetTokenizer(), PlannedRequest(mode, tokens),
                         nullptr, nullptr, &planner);
    ASSERT_TRUE(spec.ok()) << spec.status();
    EXPECT_EQ(spec->output_ids, ar->output_ids);
    EXPECT_EQ(spec->text, ar->text);
    EXPECT_GE(spec->plans.size(), 3u);
    EXPECT_EQ(spec->stats.plan_requests, planner.submitted());
    EXPECT_EQ(spec->stats.plan_failures, 0);
    bool drafted = false;
    for (const AppliedPlan& p : spec->plans) {
      EXPECT_GE(p.age_steps, 0);
      // A solve's plan was in flight from its snapshot to its first step;
      // the sequence's own re-choices of it were not.
      if (p.source == "solve") {
        EXPECT_EQ(p.applied_step - p.plan_step, p.age_steps);
      } else {
        EXPECT_EQ(p.age_steps, 0) << p.source;
      }
      EXPECT_GT(p.context_length, 0);
      drafted = drafted || p.gamma > 0;
    }
    EXPECT_TRUE(drafted)
        << "no plan drafted; the hand profile makes drafts cheap";
    EXPECT_GT(spec->speculation.drafts, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Models, PlannedGenerationTest,
                         ::testing::Values("stories260k", "stories260k/bf16",
                                           "tiny-llama", "tiny-qwen3"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c)))
                               c = '_';
                           }
                           return name;
                         });

TEST(PlannedGenerationFaultTest,
     PlannerFailuresKeepTheLastPlanAndOutputIsUnchanged) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = GetModel("stories260k");
  ASSERT_NE(model, nullptr);
  auto core = MakePlanner(*model);
  ASSERT_NE(core, nullptr);
  auto ar = Generate(*model, *GetTokenizer(),
                     PlannedRequest(SpeculationMode::kOff, 150));
  ASSERT_TRUE(ar.ok()) << ar.status();
  SynchronousPlanner flaky(core.get(), /*fail_every=*/2);
  auto spec = Generate(*model, *GetTokenizer(),
                       PlannedRequest(SpeculationMode::kKnapSpec, 150), nullptr,
                       nullptr, &flaky);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->output_ids, ar->output_ids);
  EXPECT_GT(spec->stats.plan_failures, 0);
  EXPECT_NE(spec->last_plan_error.find("injected planner failure"),
            std::string::npos)
      << spec->last_plan_error;
  // Every answered request applied one plan (source "solve"); refinements
  // of a cached plan and the sequence's own re-choices of it (no request)
  // add their own.
  const int64_t solved =
      std::count_if(spec->plans.begin(), spec->plans.end(),
                    [](const AppliedPlan& p) { return p.source == "solve"; });
  EXPECT_EQ(solved, spec->stats.plan_requests - spec->stats.plan_failures);
}

// The real asynchronous planner: decoding never waits, output is identical,
// and every request is answered or dropped by the end.
TEST(PlannedGenerationFaultTest, AsynchronousPlannerGivesIdenticalOutput) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = GetModel("stories260k");
  ASSERT_NE(model, nullptr);
  auto planner = MakePlanner(*model);
  ASSERT_NE(planner, nullptr);
  auto ar = Generate(*model, *GetTokenizer(),
                     PlannedRequest(SpeculationMode::kOff, 200));
  ASSERT_TRUE(ar.ok()) << ar.status();
  for (SpeculationMode mode :
       {SpeculationMode::kKnapSpec, SpeculationMode::kClasp}) {
    auto spec = Generate(*model, *GetTokenizer(), PlannedRequest(mode, 200),
                         nullptr, nullptr, planner.get());
    ASSERT_TRUE(spec.ok()) << spec.status();
    EXPECT_EQ(spec->output_ids, ar->output_ids) << SpeculationModeName(mode);
    EXPECT_GT(spec->stats.plan_requests, 0);
    EXPECT_EQ(spec->stats.plan_failures, 0);
  }
}

TEST(PlannedGenerationFaultTest, BadPlannedRequestsAreClearErrors) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = GetModel("stories260k");
  ASSERT_NE(model, nullptr);
  auto no_planner = Generate(*model, *GetTokenizer(),
                             PlannedRequest(SpeculationMode::kKnapSpec, 10));
  EXPECT_EQ(no_planner.status().code(), absl::StatusCode::kFailedPrecondition);
  auto planner = MakePlanner(*model);
  GenerationRequest request = PlannedRequest(SpeculationMode::kClasp, 10);
  request.speculation.clasp_layers = model->num_layers();
  auto bad = Generate(*model, *GetTokenizer(), request, nullptr, nullptr,
                      planner.get());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("clasp_layers"), std::string::npos)
      << bad.status();
  request = PlannedRequest(SpeculationMode::kKnapSpec, 10);
  request.speculation.plain_recheck_steps = -1;
  bad = Generate(*model, *GetTokenizer(), request, nullptr, nullptr,
                 planner.get());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("plain_recheck_steps"),
            std::string::npos)
      << bad.status();
  for (const double share : {-0.1, 1.0, std::nan("")}) {
    request = PlannedRequest(SpeculationMode::kKnapSpec, 10);
    request.speculation.guard_explore_share = share;
    bad = Generate(*model, *GetTokenizer(), request, nullptr, nullptr,
                   planner.get());
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << share;
    EXPECT_NE(bad.status().message().find("guard_explore_share"),
              std::string::npos)
        << bad.status();
  }
  for (const double confidence : {-1.0, std::nan(""), HUGE_VAL}) {
    request = PlannedRequest(SpeculationMode::kKnapSpec, 10);
    request.speculation.guard_confirm_confidence = confidence;
    bad = Generate(*model, *GetTokenizer(), request, nullptr, nullptr,
                   planner.get());
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument)
        << confidence;
    EXPECT_NE(bad.status().message().find("guard_confirm_confidence"),
              std::string::npos)
        << bad.status();
  }
  EXPECT_EQ(ParseSpeculationMode("knapsack").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace knapserve

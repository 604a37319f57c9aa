// Tests of the planner policies (planner/planner.h) on real small models with
// hand-made latency profiles: KnapSpec end to end, the CLaSp and static
// baselines, "no speculation" and input errors. A disabled test times
// SolveKnapSpec on the smollm2-135m shape.
#include "planner/planner.h"

#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/model/llama.h"
#include "planner/knapsack.h"
#include "planner/tpt.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::RandomModelDir;
using testing::Stories260kDir;

std::unique_ptr<LlamaModel> LoadOrDie(const std::string& dir,
                                      torch::ScalarType dtype = torch::kFloat32) {
  ModelOptions options;
  options.dtype = dtype;
  auto model = LlamaModel::Load(dir, options);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(*model) : nullptr;
}

LatencyProfile ProfileFor(const LlamaModel& model, double attention = 1e-4, double mlp = 2e-4,
                          double fixed = 1e-4, int max_draft = 10) {
  return testing::HandLatencyProfile(model, attention, mlp, fixed, max_draft);
}

struct Snapshot {
  std::vector<LayerKv> kv;
  PlanInputs inputs;
};

// Full forward over prefix + r random tokens (no gradient, one pass) with
// boundary states captured: the planner inputs for the last r tokens.
std::unique_ptr<Snapshot> MakeSnapshot(const LlamaModel& model, int64_t prefix, int64_t r,
                                       uint64_t seed) {
  c10::InferenceMode guard;
  torch::manual_seed(seed);
  auto snap = std::make_unique<Snapshot>();
  torch::Tensor ids = torch::randint(3, model.config().vocab_size, {prefix + r}, torch::kInt64);
  snap->kv = model.AllocateKv(prefix + r);
  torch::Tensor boundaries;
  ForwardOptions options;
  options.boundary_states = &boundaries;
  torch::Tensor logits = model.Forward(ids, 0, snap->kv, options);
  PlanInputs& in = snap->inputs;
  in.states = boundaries.narrow(1, prefix, r).contiguous();
  in.first_position = prefix;
  torch::Tensor top = logits.narrow(0, prefix, r).argmax(-1);
  for (int64_t i = 0; i < r; ++i) in.target_argmax.push_back(top[i].item<int64_t>());
  in.prefix_kv = &snap->kv;
  in.prefix_len = prefix;
  in.context_length = prefix + r;
  in.step = 64;
  return snap;
}

TEST(SolveKnapSpecTest, PlansOnStories260k) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "stories260k not found under " << Stories260kDir();
  auto model = LoadOrDie(Stories260kDir());
  ASSERT_NE(model, nullptr);
  auto snap = MakeSnapshot(*model, /*prefix=*/48, /*r=*/16, /*seed=*/3);
  const LatencyProfile profile = ProfileFor(*model);
  KnapSpecOptions options;
  auto plan = SolveKnapSpec(*model, profile, snap->inputs, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->step, 64);
  EXPECT_GT(plan->solve_seconds, 0);
  EXPECT_GE(plan->num_candidates, 1);
  EXPECT_GE(plan->predicted_tpt, plan->baseline_tpt);
  EXPECT_GE(plan->alpha_hat, 0);
  EXPECT_LE(plan->alpha_hat, 1);
  EXPECT_EQ(plan->mask.num_layers(), model->num_layers());
  // Layer 0 and the last layer are never skipped.
  EXPECT_FALSE(plan->mask.skip_attention(0) || plan->mask.skip_mlp(0));
  EXPECT_FALSE(plan->mask.skip_attention(4) || plan->mask.skip_mlp(4));
  std::printf(
      "[ stories260k ] plan: mask '%s' gamma %d alpha_hat %.3f cosine %.4f tpt %.1f "
      "(AR %.1f) from %d candidates in %.2f ms\n",
      plan->mask.ToString().c_str(), plan->gamma, plan->alpha_hat, plan->mean_cosine,
      plan->predicted_tpt, plan->baseline_tpt, plan->num_candidates, 1e3 * plan->solve_seconds);

  // The same pieces by hand give the same plan.
  auto runner = ModelSublayerRunner::Create(*model, &snap->kv, 48, 48);
  ASSERT_TRUE(runner.ok());
  const SublayerWeights w = ComputeSublayerWeights(1e-4, 2e-4, 5);
  EXPECT_EQ(w.attention, 1);
  EXPECT_EQ(w.mlp, 2);
  auto candidates =
      SolveKnapsack(*runner, snap->inputs.states, snap->inputs.target_argmax, w, KnapsackOptions());
  ASSERT_TRUE(candidates.ok());
  EXPECT_EQ(static_cast<int>(candidates->size()), plan->num_candidates);
  std::vector<TptCandidate> tc;
  for (const SkipCandidate& c : *candidates) {
    tc.push_back({c.alpha_hat, profile.DraftSeconds(c.mask, 64)});
  }
  std::vector<double> verify;
  for (int t = 1; t <= 11; ++t) verify.push_back(profile.VerifySeconds(64, t));
  auto choice = MaximizeTpt(tc, verify, 10);
  ASSERT_TRUE(choice.ok());
  EXPECT_EQ(plan->gamma, choice->gamma);
  EXPECT_DOUBLE_EQ(plan->predicted_tpt, choice->tpt);
  if (choice->candidate >= 0) {
    EXPECT_EQ(plan->mask, (*candidates)[choice->candidate].mask);
  }
}

TEST(SolveKnapSpecTest, SpeculatesWhenDraftsAreCheapAndAcceptedAndNotOtherwise) {
  auto model = LoadOrDie(RandomModelDir("tiny-llama"));
  ASSERT_NE(model, nullptr);
  auto snap = MakeSnapshot(*model, /*prefix=*/20, /*r=*/12, /*seed=*/1);
  KnapSpecOptions options;
  options.keep_first_and_last = false;
  options.tau = -1;  // keep every candidate: random weights give low cosines

  // The full-model draft (j = 0) has alpha_hat 1; with drafting nearly free
  // and verification flat in the token count, drafting D tokens with it wins.
  LatencyProfile cheap = ProfileFor(*model, 1e-4, 2e-4, 1e-4);
  cheap.step_fixed_seconds = 0;
  cheap.attention = {1e-9, 0, 1};
  cheap.mlp_seconds = 1e-9;
  for (auto& row : cheap.verify_seconds) std::fill(row.begin(), row.end(), 1e-3);
  auto plan = SolveKnapSpec(*model, cheap, snap->inputs, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->gamma, 10);
  EXPECT_DOUBLE_EQ(plan->alpha_hat, 1.0);
  EXPECT_GT(plan->predicted_tpt, 10 * plan->baseline_tpt);

  // Drafting as dear as verifying: nothing beats autoregressive decoding.
  LatencyProfile dear = ProfileFor(*model, 1e-3, 1e-3, 1e-3);
  for (auto& row : dear.verify_seconds) std::fill(row.begin(), row.end(), 1e-4);
  plan = SolveKnapSpec(*model, dear, snap->inputs, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->gamma, 0);
  EXPECT_TRUE(plan->mask.empty());
  EXPECT_DOUBLE_EQ(plan->predicted_tpt, plan->baseline_tpt);
  EXPECT_DOUBLE_EQ(plan->predicted_tpt, 1e4);
}

TEST(SolveKnapSpecTest, RejectsBadInputsAndForeignProfiles) {
  auto model = LoadOrDie(RandomModelDir("tiny-llama"));
  ASSERT_NE(model, nullptr);
  auto snap = MakeSnapshot(*model, /*prefix=*/20, /*r=*/6, /*seed=*/2);
  const LatencyProfile profile = ProfileFor(*model);
  KnapSpecOptions free;
  free.keep_first_and_last = false;
  ASSERT_TRUE(SolveKnapSpec(*model, profile, snap->inputs, free).ok());

  // Two layers with first and last kept: nothing to skip.
  auto plan = SolveKnapSpec(*model, profile, snap->inputs, KnapSpecOptions());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("nothing to skip"), std::string::npos) << plan.status();

  // A profile for another model or dtype.
  LatencyProfile other = profile;
  other.model_fingerprint = "ffffffffffffffff";
  plan = SolveKnapSpec(*model, other, snap->inputs, free);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(plan.status().message().find("ffffffffffffffff"), std::string::npos);
  other = profile;
  other.dtype = "bf16";
  EXPECT_EQ(SolveKnapSpec(*model, other, snap->inputs, free).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A verify table shorter than max_draft.
  KnapSpecOptions far = free;
  far.max_draft = 12;
  plan = SolveKnapSpec(*model, profile, snap->inputs, far);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("max_draft"), std::string::npos);

  auto expect_invalid = [&](const PlanInputs& in, const std::string& needle) {
    auto p = SolveKnapSpec(*model, profile, in, free);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << needle;
    EXPECT_NE(p.status().message().find(needle), std::string::npos) << p.status();
  };
  PlanInputs in = snap->inputs;
  in.states = in.states.narrow(0, 0, 4);
  expect_invalid(in, "states must be");
  in = snap->inputs;
  in.target_argmax.pop_back();
  expect_invalid(in, "target_argmax");
  in = snap->inputs;
  in.target_argmax[0] = 100000;
  expect_invalid(in, "vocabulary");
  in = snap->inputs;
  in.prefix_kv = nullptr;
  expect_invalid(in, "prefix_kv");
  in = snap->inputs;
  in.first_position = model->max_context() - 2;
  expect_invalid(in, "first_position");
  in = snap->inputs;
  in.prefix_len = 1000;  // more than the K/V holds
  expect_invalid(in, "holds");
  KnapSpecOptions bad = free;
  bad.weight_cap = 0;
  EXPECT_EQ(SolveKnapSpec(*model, profile, snap->inputs, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  bad = free;
  bad.tau = 2;
  EXPECT_EQ(SolveKnapSpec(*model, profile, snap->inputs, bad).status().code(),
            absl::StatusCode::kInvalidArgument);

  // prefix_len past first_position is fine (the executor's cache also holds
  // the reference tokens' K/V): the DP uses the first first_position.
  in = snap->inputs;
  in.prefix_len = in.first_position + 6;
  auto longer = SolveKnapSpec(*model, profile, in, free);
  auto plain = SolveKnapSpec(*model, profile, snap->inputs, free);
  ASSERT_TRUE(longer.ok()) << longer.status();
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(longer->mask, plain->mask);
  EXPECT_EQ(longer->gamma, plain->gamma);
  EXPECT_DOUBLE_EQ(longer->alpha_hat, plain->alpha_hat);
}

TEST(SolveClaspTest, SkipsExactlyMWholeLayers) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "stories260k not found under " << Stories260kDir();
  auto model = LoadOrDie(Stories260kDir());
  ASSERT_NE(model, nullptr);
  auto snap = MakeSnapshot(*model, /*prefix=*/40, /*r=*/10, /*seed=*/4);
  const LatencyProfile profile = ProfileFor(*model);
  for (int m = 1; m <= 3; ++m) {
    ClaspOptions options;
    options.num_skipped_layers = m;
    auto plan = SolveClasp(*model, profile, snap->inputs, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    int skipped_layers = 0;
    for (int l = 0; l < model->num_layers(); ++l) {
      EXPECT_EQ(plan->mask.skip_attention(l), plan->mask.skip_mlp(l)) << "layer " << l;
      if (plan->mask.skip_attention(l)) ++skipped_layers;
    }
    EXPECT_EQ(skipped_layers, m);
    EXPECT_FALSE(plan->mask.skip_attention(0));
    EXPECT_FALSE(plan->mask.skip_attention(4));
    EXPECT_EQ(plan->num_candidates, 1);
    EXPECT_EQ(plan->step, 64);
    std::printf("[ CLaSp M=%d ] mask '%s' alpha_hat %.3f gamma %d\n", m,
                plan->mask.ToString().c_str(), plan->alpha_hat, plan->gamma);
    // alpha_hat is measured on all r tokens: it agrees with EvaluateMask.
    auto runner = ModelSublayerRunner::Create(*model, &snap->kv, 40, 40);
    ASSERT_TRUE(runner.ok());
    auto eval = EvaluateMask(*runner, snap->inputs.states, snap->inputs.target_argmax, plan->mask);
    ASSERT_TRUE(eval.ok());
    EXPECT_DOUBLE_EQ(plan->alpha_hat, eval->alpha_hat);
  }
  // A fixed gamma is kept.
  ClaspOptions fixed;
  fixed.num_skipped_layers = 2;
  fixed.gamma = 3;
  auto plan = SolveClasp(*model, profile, snap->inputs, fixed);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->gamma, 3);
  // Impossible budgets.
  for (int m : {0, 4, 7}) {
    ClaspOptions bad;
    bad.num_skipped_layers = m;
    auto p = SolveClasp(*model, profile, snap->inputs, bad);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << m;
  }
  ClaspOptions freed;
  freed.num_skipped_layers = 5;
  freed.keep_first_and_last = false;
  EXPECT_TRUE(SolveClasp(*model, profile, snap->inputs, freed).ok());
}

TEST(SolveStaticTest, MeasuresTheGivenMaskAndPicksGamma) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "stories260k not found under " << Stories260kDir();
  auto model = LoadOrDie(Stories260kDir());
  ASSERT_NE(model, nullptr);
  auto snap = MakeSnapshot(*model, /*prefix=*/40, /*r=*/10, /*seed=*/5);
  const LatencyProfile profile = ProfileFor(*model);
  auto mask = LayerMask::Parse("a2,m2,m3", 5);
  ASSERT_TRUE(mask.ok());
  auto plan = SolveStatic(*model, profile, snap->inputs, *mask, StaticOptions());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->mask, *mask);
  auto runner = ModelSublayerRunner::Create(*model, &snap->kv, 40, 40);
  ASSERT_TRUE(runner.ok());
  auto eval = EvaluateMask(*runner, snap->inputs.states, snap->inputs.target_argmax, *mask);
  ASSERT_TRUE(eval.ok());
  EXPECT_DOUBLE_EQ(plan->alpha_hat, eval->alpha_hat);
  std::vector<double> verify;
  for (int t = 1; t <= 11; ++t) verify.push_back(profile.VerifySeconds(50, t));
  const TptCandidate one{eval->alpha_hat, profile.DraftSeconds(*mask, 50)};
  auto choice = MaximizeTpt({&one, 1}, verify, 10);
  ASSERT_TRUE(choice.ok());
  EXPECT_EQ(plan->gamma, choice->gamma);

  // The empty mask is the full model: alpha_hat 1.
  plan = SolveStatic(*model, profile, snap->inputs, LayerMask(5), StaticOptions());
  ASSERT_TRUE(plan.ok());
  EXPECT_DOUBLE_EQ(plan->alpha_hat, 1.0);
  EXPECT_NEAR(plan->mean_cosine, 1.0, 1e-5);
  // A mask for another model.
  EXPECT_EQ(
      SolveStatic(*model, profile, snap->inputs, LayerMask(4), StaticOptions()).status().code(),
      absl::StatusCode::kInvalidArgument);
}

// Solve time on the smollm2-135m shape (bf16). Not a unit test: run with
//   KNAPSERVE_SMOLLM2_DIR=/tmp/smollm2 planner_tests
//     --gtest_also_run_disabled_tests --gtest_filter='*SolveTime*'
// (make the folder with `knapserve make-model --shape smollm2-135m --out
// /tmp/smollm2 --dtype bf16`). It measures a latency profile first (the
// weights come from it), prefills 4096 random ids, then plans for r
// reference tokens at contexts 512 and 4096.
TEST(SolveKnapSpecBenchmark, DISABLED_SolveTimeOnSmollm2Shape) {
  const char* dir = std::getenv("KNAPSERVE_SMOLLM2_DIR");
  if (dir == nullptr) GTEST_SKIP() << "set KNAPSERVE_SMOLLM2_DIR";
  auto model = LoadOrDie(dir, torch::kBFloat16);
  ASSERT_NE(model, nullptr);
  ProfileOptions po;
  po.contexts = {512, 1024, 2048, 4096};
  po.repeats = 7;
  po.warmup = 2;
  auto profile = ProfileModel(*model, po);
  ASSERT_TRUE(profile.ok()) << profile.status();
  std::printf(
      "[ profile ] t_attn(n) = %.3g + %.3g n s (r2 %.3f); t_mlp %.3g s; fixed %.3g s; "
      "t_verify(512, 1) %.3g s, (4096, 1) %.3g s, (4096, 11) %.3g s\n",
      profile->attention.a, profile->attention.b, profile->attention.r2, profile->mlp_seconds,
      profile->step_fixed_seconds, profile->VerifySeconds(512, 1), profile->VerifySeconds(4096, 1),
      profile->VerifySeconds(4096, 11));
  for (int64_t n : {512, 4096}) {
    std::printf(
        "[ profile ] n=%lld: sublayer model of the full step %.4f s vs measured "
        "t_verify(n, 1) %.4f s\n",
        static_cast<long long>(n), profile->FullStepSeconds(model->num_layers(), n),
        profile->VerifySeconds(n, 1));
  }

  c10::InferenceMode guard;
  const int64_t max_r = 30;
  torch::manual_seed(1);
  std::vector<LayerKv> kv = model->AllocateKv(4096 + max_r);
  torch::Tensor prompt = torch::randint(3, model->config().vocab_size, {4096}, torch::kInt64);
  auto start = std::chrono::steady_clock::now();
  model->Prefill(prompt, 0, kv);
  std::printf("[ prefill ] 4096 random ids in %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  for (int64_t context : {512, 4096}) {
    for (int64_t r : {10, 30}) {
      // The reference tokens: a full forward over r ids at positions
      // context.. (this overwrites the prefill's K/V past `context`, which the
      // DP does not read).
      torch::Tensor ids = torch::randint(3, model->config().vocab_size, {r}, torch::kInt64);
      torch::Tensor boundaries;
      ForwardOptions fo;
      fo.boundary_states = &boundaries;
      torch::Tensor logits = model->Forward(ids, context, kv, fo);
      PlanInputs in;
      in.states = boundaries;
      in.first_position = context;
      for (int64_t i = 0; i < r; ++i) {
        in.target_argmax.push_back(logits[i].argmax().item<int64_t>());
      }
      in.prefix_kv = &kv;
      in.prefix_len = context;
      in.context_length = context + r;
      const SublayerWeights w =
          ComputeSublayerWeights(profile->AttentionSeconds(context + r), profile->MlpSeconds(), 5);
      for (int cap : {5, 2}) {
        KnapSpecOptions options;
        options.weight_cap = cap;
        auto plan = SolveKnapSpec(*model, *profile, in, options);  // warm-up
        ASSERT_TRUE(plan.ok()) << plan.status();
        plan = SolveKnapSpec(*model, *profile, in, options);
        ASSERT_TRUE(plan.ok()) << plan.status();
        std::printf(
            "[ smollm2-135m bf16 ] n=%lld r=%lld weights attn/mlp %d/%d (cap %d): solve "
            "%.3f s, %d candidates, gamma %d, alpha_hat %.2f, mask '%s'\n",
            static_cast<long long>(context), static_cast<long long>(r), std::min(w.attention, cap),
            std::min(w.mlp, cap), cap, plan->solve_seconds, plan->num_candidates, plan->gamma,
            plan->alpha_hat, plan->mask.ToString().c_str());
      }
    }
  }
}

}  // namespace
}  // namespace knapserve

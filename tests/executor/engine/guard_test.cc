// The online guard in the drafting modes that are not planned (static,
// specbound; knn takes the same path once routed): a setting that loses to
// plain decoding gets a verdict in the process's GuardVerdicts
// (executor/planning/plan_cache.h), and the next request with the same
// setting decodes plainly from its first step, inheriting the verdict,
// instead of measuring the loser again. Output stays plain decoding's.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "executor/engine/generator.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::CachedModel;
using testing::StoriesTokenizer;

// A greedy request of `max_new` tokens after a fixed story prompt.
GenerationRequest StoryRequest(int64_t max_new) {
  GenerationRequest request;
  request.prompt_ids = {1, 410, 469, 347};
  request.max_new_tokens = max_new;
  request.ignore_eos = true;
  return request;
}

// stories260k, and plain decoding's output ids for StoryRequest(48).
class GuardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
    model = CachedModel("stories260k");
    ASSERT_NE(model, nullptr);
    auto plain = Generate(*model, *StoriesTokenizer(), StoryRequest(48));
    ASSERT_TRUE(plain.ok()) << plain.status();
    plain_ids = plain->output_ids;
  }
  const LlamaModel* model = nullptr;
  std::vector<int32_t> plain_ids;
};

TEST_F(GuardTest, UnplannedModesShareALosingVerdict) {
  const GenerationRequest base = StoryRequest(48);
  for (const SpeculationMode mode :
       {SpeculationMode::kStatic, SpeculationMode::kSpecBound}) {
    SCOPED_TRACE(SpeculationModeName(mode));
    PlanningShared shared = PlanningShared::Create();
    GenerationRequest request = base;
    SpeculationConfig& spec = request.speculation;
    spec.mode = mode;
    spec.max_draft = 3;
    spec.exit_threshold = 0.0;
    if (mode == SpeculationMode::kStatic) spec.skip = "a2,m2,a3";
    spec.specbound.lambda = 0.2;
    spec.specbound.check_every = 1;
    // Speculation would have to be 1000 times faster than plain decoding:
    // every judgement loses, whatever this machine's timings.
    spec.guard = true;
    spec.guard_margin = 1000;
    spec.guard_min_steps = 4;
    spec.guard_probe_steps = 3;
    spec.guard_reprobe_steps = 10000;
    // Whether the loss is a clear one (which would also hold the mode's
    // other settings) depends on this machine's timings, and so does
    // whether a narrow one is confirmed by a second probe (3 more probe
    // steps): both off, the verdict comes at the first probe's window.
    spec.guard_clear_losses = false;
    spec.guard_confirm_losses = false;
    auto first = Generate(*model, *StoriesTokenizer(), request, nullptr,
                          nullptr, nullptr, &shared);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(first->output_ids, plain_ids);
    EXPECT_GT(first->speculation.drafts, 0) << "it measured the setting";
    EXPECT_EQ(first->planning.guard_checks, 1);
    EXPECT_EQ(first->planning.guard_fallbacks, 1);
    EXPECT_EQ(first->planning.guard_probe_steps, 3)
        << "no plain timings before: a probe";
    EXPECT_GT(first->planning.guard_plain_steps, 20);
    EXPECT_EQ(first->planning.guard_inherited_steps, 0);
    EXPECT_EQ(shared.verdicts->losing(), 1);

    auto second = Generate(*model, *StoriesTokenizer(), request, nullptr,
                           nullptr, nullptr, &shared);
    ASSERT_TRUE(second.ok()) << second.status();
    EXPECT_EQ(second->output_ids, plain_ids);
    EXPECT_EQ(second->speculation.drafts, 0) << "the loser is not tried again";
    EXPECT_EQ(second->planning.guard_checks, 0);
    EXPECT_EQ(second->planning.guard_inherited_steps, second->stats.steps);
    EXPECT_EQ(second->planning.guard_plain_steps, second->stats.steps);
    EXPECT_DOUBLE_EQ(second->planning.guard_last_plain_tps,
                     first->planning.guard_last_plain_tps);

    // Another setting (another mask) is judged on its own.
    GenerationRequest other = request;
    other.speculation.skip = "m1";
    other.speculation.max_draft = 2;
    auto third = Generate(*model, *StoriesTokenizer(), other, nullptr, nullptr,
                          nullptr, &shared);
    ASSERT_TRUE(third.ok()) << third.status();
    EXPECT_GT(third->speculation.drafts, 0);
    EXPECT_EQ(third->planning.guard_inherited_steps, 0);
  }
}

// SpecBound whose draft tokens all exit at the model's last layer saves no
// layer: the guard condemns it after GuardOptions::futile_steps such steps
// (6), whatever the timings (here no timing judgement could come before
// 1000 steps), and a later request inherits the verdict. Exits below the last
// layer are no such evidence: only timings judge those.
TEST_F(GuardTest, SpecBoundThatSavesNoLayerIsHeldPlainAtOnce) {
  const GenerationRequest base = StoryRequest(48);
  for (const int check_every : {model->num_layers(), 1}) {
    const bool futile = check_every == model->num_layers();
    SCOPED_TRACE(futile ? "exits at the last layer" : "exits at layer 1");
    PlanningShared shared = PlanningShared::Create();
    GenerationRequest request = base;
    SpeculationConfig& spec = request.speculation;
    spec.mode = SpeculationMode::kSpecBound;
    spec.max_draft = 3;
    spec.specbound.lambda = 0.0;  // every check exits
    spec.specbound.check_every = check_every;
    spec.guard = true;
    spec.guard_min_steps = 1000;
    spec.guard_reprobe_steps = 10000;
    auto first = Generate(*model, *StoriesTokenizer(), request, nullptr,
                          nullptr, nullptr, &shared);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(first->output_ids, plain_ids);
    // The setting never won here: its first 8 steps (the settle steps)
    // decode plainly (GuardOptions::settle_plain).
    EXPECT_EQ(first->planning.guard_settle_steps, 8);
    if (!futile) {
      // Judged by its timings only: after the settle steps, in a probe.
      EXPECT_GT(first->speculation.drafts, 0);
      EXPECT_GT(first->planning.guard_probe_steps, 0);
      continue;
    }
    ASSERT_EQ(first->speculation.exit_depths.size(),
              static_cast<size_t>(model->num_layers()));
    EXPECT_EQ(first->speculation.exit_depths.back(),
              first->speculation.draft_tokens);
    EXPECT_EQ(first->speculation.drafts, 6) << "six steps, then plain";
    EXPECT_EQ(first->planning.guard_checks, 1);
    EXPECT_EQ(first->planning.guard_fallbacks, 1);
    // The bucket had no plain rate, so the six steps ran in a probe, each
    // but the last followed by a plain step; the sixth ended it.
    EXPECT_EQ(first->planning.guard_probe_steps, 5);
    EXPECT_EQ(shared.verdicts->losing(), 1);
    auto second = Generate(*model, *StoriesTokenizer(), request, nullptr,
                           nullptr, nullptr, &shared);
    ASSERT_TRUE(second.ok()) << second.status();
    EXPECT_EQ(second->output_ids, plain_ids);
    EXPECT_EQ(second->speculation.drafts, 0);
    EXPECT_EQ(second->planning.guard_inherited_steps, second->stats.steps);
  }
}

// With the guard off (--guard=false) nothing is judged or inherited.
TEST_F(GuardTest, AnUnguardedRequestAlwaysDrafts) {
  PlanningShared shared = PlanningShared::Create();
  GenerationRequest request = StoryRequest(40);
  request.speculation.mode = SpeculationMode::kStatic;
  request.speculation.skip = "a2,m2,a3";
  request.speculation.max_draft = 3;
  request.speculation.exit_threshold = 0.0;
  request.speculation.guard = false;
  request.speculation.guard_margin = 1000;
  for (int run = 0; run < 2; ++run) {
    auto result = Generate(*model, *StoriesTokenizer(), request, nullptr,
                           nullptr, nullptr, &shared);
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_GT(result->speculation.drafts, 5);
    EXPECT_EQ(result->planning.guard_checks, 0);
    EXPECT_EQ(result->planning.guard_plain_steps, 0);
  }
  EXPECT_EQ(shared.verdicts->losing(), 0);
}

}  // namespace
}  // namespace knapserve

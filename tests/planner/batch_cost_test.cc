// Tests of ProfileBatchCost (planner/batch_cost.h): pass prices past the
// verify table, the attention of separate caches, and the drafting-or-plain
// decision flipping from drafting at small batches to plain at large ones.
#include "planner/batch_cost.h"

#include <gtest/gtest.h>

#include <vector>

#include "common/model/layer_mask.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::CachedModel;

TEST(ProfileBatchCostTest, PassesGrowAlongTheLastMeasuredStepPastTheTable) {
  const LlamaModel* model = CachedModel("tiny-llama");
  ASSERT_NE(model, nullptr);
  // Verifying t tokens costs the full step plus 2% per extra token; 11 rows
  // measured (max_draft 10).
  LatencyProfile profile = testing::HandLatencyProfile(*model);
  const double full = profile.VerifySeconds(100, 1);
  ProfileBatchCost cost(profile, model->num_layers());
  EXPECT_DOUBLE_EQ(cost.PassSeconds(100, 1, 1), full);
  EXPECT_NEAR(cost.PassSeconds(100, 11, 1), full * 1.2, 1e-12);
  EXPECT_NEAR(cost.PassSeconds(100, 41, 1), full * (1.2 + 30 * 0.02), 1e-12);
  // A flat attention fit (b = 0): separate caches cost nothing extra.
  EXPECT_NEAR(cost.PassSeconds(100, 8, 8), cost.PassSeconds(100, 8, 1), 1e-15);
  // With a per-position attention slope, every extra sequence reads its own
  // positions in every layer.
  profile.attention.b = 1e-7;
  ProfileBatchCost sloped(profile, model->num_layers());
  EXPECT_NEAR(sloped.PassSeconds(100, 8, 8) - sloped.PassSeconds(100, 8, 1),
              7 * model->num_layers() * 1e-7 * 100, 1e-12);
}

TEST(ProfileBatchCostTest, DraftingPaysAloneAndStopsPayingInALargeBatch) {
  const LlamaModel* model = CachedModel("tiny-llama");
  ASSERT_NE(model, nullptr);
  ProfileBatchCost cost(testing::HandLatencyProfile(*model),
                        model->num_layers());
  // Half the layers' MLPs and attentions skipped: a cheap draft.
  LayerMask mask(model->num_layers());
  for (int i = 0; i < model->num_sublayers() / 2; ++i)
    mask.set_skipped(i, true);
  auto members = [&](int n, int gamma, double acceptance) {
    return std::vector<BatchMember>(n, BatchMember{gamma, acceptance, &mask});
  };
  EXPECT_TRUE(cost.DraftsPay(64, members(1, 4, 0.85)));
  EXPECT_TRUE(cost.DraftsPay(64, members(2, 4, 0.85)));
  EXPECT_FALSE(cost.DraftsPay(64, members(32, 4, 0.85)));
  // Poor acceptance never pays, even alone.
  EXPECT_FALSE(cost.DraftsPay(64, members(1, 4, 0.05)));
  // Members without drafts: drafting and plain are the same step.
  EXPECT_NEAR(cost.StepTokensPerSecond(64, members(4, 0, 0.9), true),
              cost.StepTokensPerSecond(64, members(4, 0, 0.9), false), 1e-9);
  // Where it flips, it stays flipped for larger batches.
  int flip = 0;
  for (int n = 1; n <= 64; ++n) {
    const bool pays = cost.DraftsPay(64, members(n, 4, 0.85));
    if (!pays && flip == 0) flip = n;
    if (flip != 0) {
      EXPECT_FALSE(pays) << n;
    }
  }
  EXPECT_GT(flip, 2);

  // The engine's work per draft row (the profile's o_draft) is part of the
  // price: at a full step's worth a draft never pays, even alone.
  LatencyProfile dear = testing::HandLatencyProfile(*model);
  dear.draft_overhead_seconds = dear.VerifySeconds(64, 1);
  ProfileBatchCost priced(dear, model->num_layers());
  EXPECT_FALSE(priced.DraftsPay(64, members(1, 4, 0.85)));
  // o_step is paid per member either way.
  dear.draft_overhead_seconds = 0;
  dear.step_overhead_seconds = 1e-3;
  ProfileBatchCost stepped(dear, model->num_layers());
  EXPECT_NEAR(stepped.StepTokensPerSecond(64, members(2, 0, 0.9), false),
              2 / (stepped.PassSeconds(64, 2, 2) + 2e-3), 1e-9);
}

// Before its profile lands every step's drafts pay (as with no cost model);
// then it answers as ProfileBatchCost does.
TEST(DeferredBatchCostTest, DraftsPayUntilTheProfileLandsThenItPrices) {
  const LlamaModel* model = CachedModel("tiny-llama");
  ASSERT_NE(model, nullptr);
  LayerMask mask(model->num_layers());
  for (int i = 0; i < model->num_sublayers() / 2; ++i)
    mask.set_skipped(i, true);
  const std::vector<BatchMember> large(32, BatchMember{4, 0.85, &mask});
  const std::vector<BatchMember> poor(1, BatchMember{4, 0.05, &mask});
  DeferredBatchCost deferred(model->num_layers());
  EXPECT_FALSE(deferred.has_profile());
  EXPECT_TRUE(deferred.DraftsPay(64, large));
  EXPECT_TRUE(deferred.DraftsPay(64, poor));
  deferred.SetProfile(testing::HandLatencyProfile(*model));
  EXPECT_TRUE(deferred.has_profile());
  const ProfileBatchCost direct(testing::HandLatencyProfile(*model),
                                model->num_layers());
  EXPECT_FALSE(direct.DraftsPay(64, large));
  EXPECT_EQ(deferred.DraftsPay(64, large), direct.DraftsPay(64, large));
  EXPECT_EQ(deferred.DraftsPay(64, poor), direct.DraftsPay(64, poor));
}

}  // namespace
}  // namespace knapserve

// Tests of executor/planning/plan_refinement.h (DraftEvidence, RefinePlan,
// RefinePlanForSequence) and of the PlanCache's use of them
// (PlanCache::RecordDraftStep).
#include "executor/planning/plan_refinement.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "common/plan/step_forecast.h"
#include "executor/planning/plan_cache.h"

namespace knapserve {
namespace {

// A drafting plan whose gamma rests on 16 reference tokens with a 0.5 share:
// with these prices gamma 1 is best (1.15 tokens/ms against 1.0 plain).
DraftPlan HalfAcceptedPlan(bool confidence_stop = false) {
  DraftPlan plan;
  plan.mask = *LayerMask::Parse("a1", 2);
  plan.gamma = 1;
  plan.alpha_hat = 0.5;
  plan.solve_seconds = 0.4;
  PlanBasis& basis = plan.basis;
  basis.verify_seconds = {1.0e-3, 1.1e-3, 1.2e-3, 1.3e-3, 1.4e-3};
  basis.draft_seconds = 0.2e-3;
  basis.reference_tokens = 16;
  basis.accept_share = 0.5;
  basis.confidence_stop = confidence_stop;
  basis.go_on_share = confidence_stop ? 0.75 : 1.0;
  basis.accept_and_go_on_share = confidence_stop ? 0.375 : 0.5;
  return plan;
}

// Gamma in 1..4 with the highest ForecastStep tokens/s above plain decoding
// at 1 ms a step (0 when none beats it), and that rate: the refinement's
// choice recomputed by hand.
std::pair<int, double> BestGamma(const TptCandidate& c,
                                 const std::vector<double>& verify) {
  int best_gamma = 0;
  double best = 1 / 1.0e-3;
  for (int g = 1; g <= 4; ++g) {
    const double tps = ForecastStep(c, g, verify).tokens_per_second();
    if (tps > best) {
      best = tps;
      best_gamma = g;
    }
  }
  return {best_gamma, best};
}

// The six counts of one group of draft positions, in DraftCounts' order.
std::vector<int64_t> Counts(const DraftCounts& c) {
  return {c.accept_trials, c.accepted,    c.go_on_trials,
          c.went_on,       c.both_trials, c.both};
}

TEST(DraftEvidenceTest, CountsWhatEachStepShowed) {
  using V = std::vector<int64_t>;
  DraftEvidence e;
  // Budget 4, all 4 drafted and accepted: 4 acceptances; confidence of
  // drafts 1..3 (the 4th ends the draft anyway), all confident. Draft 1
  // apart from drafts 2..4.
  e.AddStep(4, 4, 4);
  EXPECT_EQ(Counts(e.first), (V{1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(Counts(e.later), (V{3, 3, 2, 2, 2, 2}));
  EXPECT_EQ(e.accept_trials(), 4);
  // Budget 4, the draft stopped after 2 and the first was rejected: one
  // rejection (draft 1); draft 1 went on, draft 2 stopped; only draft 1's
  // acceptance and confidence were both seen (rejected).
  e = DraftEvidence();
  e.AddStep(4, 2, 0);
  EXPECT_EQ(Counts(e.first), (V{1, 0, 1, 1, 1, 0}));
  EXPECT_EQ(Counts(e.later), (V{0, 0, 1, 0, 0, 0}));
  // Budget 4, stopped after 3, all accepted: the 3rd was accepted but not
  // confident.
  e = DraftEvidence();
  e.AddStep(4, 3, 3);
  EXPECT_EQ(Counts(e.first), (V{1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(Counts(e.later), (V{2, 2, 2, 1, 2, 1}));
  // Budget 1: one acceptance trial at draft 1, no confidence seen.
  e = DraftEvidence();
  e.AddStep(1, 1, 1);
  EXPECT_EQ(Counts(e.first), (V{1, 1, 0, 0, 0, 0}));
  EXPECT_EQ(Counts(e.later), (V{0, 0, 0, 0, 0, 0}));
  // Nothing drafted, or counts out of range: no evidence.
  const DraftEvidence before = e;
  e.AddStep(4, 0, 0);
  e.AddStep(0, 1, 1);
  e.AddStep(2, 3, 1);
  e.AddStep(4, 2, 3);
  e.AddStep(4, 2, -1);
  EXPECT_EQ(Counts(e.first), Counts(before.first));
  EXPECT_EQ(Counts(e.later), Counts(before.later));
}

TEST(RefinePlanTest, WithoutEvidenceItIsTheSolvesOwnChoice) {
  for (bool stop : {false, true}) {
    const DraftPlan plan = HalfAcceptedPlan(stop);
    auto refined = RefinePlan(plan, DraftEvidence());
    ASSERT_TRUE(refined.has_value());
    // Recomputed from the basis alone: the smoothed share, ForecastStep.
    TptCandidate c;
    c.alpha = SmoothAlpha(0.5, 16, AlphaPrior());
    c.draft_seconds = 0.2e-3;
    if (stop) {
      c.stop = ConfidenceStop{SmoothAlpha(0.75, 16, AlphaPrior()),
                              SmoothAlpha(0.375, 16, AlphaPrior())};
    }
    const auto [best_gamma, best] = BestGamma(c, plan.basis.verify_seconds);
    EXPECT_EQ(refined->gamma, best_gamma) << stop;
    EXPECT_DOUBLE_EQ(refined->predicted_tpt, best);
    EXPECT_DOUBLE_EQ(refined->baseline_tpt, 1 / 1.0e-3);
    EXPECT_DOUBLE_EQ(refined->alpha_hat, 0.5);
    EXPECT_DOUBLE_EQ(refined->alpha_smoothed, c.alpha);
    EXPECT_EQ(refined->evidence_trials, 0);
    EXPECT_EQ(refined->mask, plan.mask);
    EXPECT_DOUBLE_EQ(refined->solve_seconds, 0.4);
  }
}

// The planner's pairs of consecutive reference tokens (PlanBasis::later_*)
// price drafts 2..gamma: without evidence they give the later drafts their
// own odds, and the later drafts' evidence pools with them (not with draft
// 1's odds).
TEST(RefinePlanTest, TheBasisLaterSharesPriceTheLaterDrafts) {
  DraftPlan plan = HalfAcceptedPlan();
  // Of 8 tokens right after an accepted one, 7 were accepted too.
  plan.basis.later_accept_trials = 8;
  plan.basis.later_accept_share = 7.0 / 8;
  plan.basis.later_accept_and_go_on_share = 7.0 / 8;
  plan.basis.later_go_on_trials = 8;
  plan.basis.later_go_on_share = 1;
  auto refined = RefinePlan(plan, DraftEvidence());
  ASSERT_TRUE(refined.has_value());
  TptCandidate c{SmoothAlpha(0.5, 16, AlphaPrior()), 0.2e-3};
  c.later =
      LaterDraftOdds{SmoothAlpha(7.0 / 8, 8, AlphaPrior()), ConfidenceStop()};
  const auto [best_gamma, best] = BestGamma(c, plan.basis.verify_seconds);
  // Draft 2 is accepted 0.8 of the time where draft 1 is 0.5: a second
  // draft pays, where with draft 1's odds throughout gamma 1 was best.
  EXPECT_GT(best_gamma, 1);
  EXPECT_EQ(refined->gamma, best_gamma);
  EXPECT_DOUBLE_EQ(refined->predicted_tpt, best);
  EXPECT_EQ(RefinePlan(HalfAcceptedPlan(), DraftEvidence())->gamma, 1);
  // Later evidence pools with the 8 pairs: 20 steps of 2 drafts with draft 2
  // always rejected after an accepted draft 1.
  DraftEvidence evidence;
  for (int i = 0; i < 20; ++i) evidence.AddStep(2, 2, 1);
  auto pooled = RefinePlan(plan, evidence);
  ASSERT_TRUE(pooled.has_value());
  TptCandidate p{SmoothAlpha((0.5 * 16 + 20) / 36, 36, AlphaPrior()), 0.2e-3};
  p.later =
      LaterDraftOdds{SmoothAlpha(7.0 / 28, 28, AlphaPrior()), ConfidenceStop()};
  EXPECT_NEAR(pooled->predicted_tokens_per_step,
              ForecastStep(p, pooled->gamma, plan.basis.verify_seconds).tokens,
              1e-12);
}

TEST(RefinePlanTest, EvidenceMovesGammaEitherWay) {
  const DraftPlan plan = HalfAcceptedPlan();
  // 100 steps of 4 drafts, all accepted: acceptance (8 + 400 + 1) / 418
  // over every draft. The step is forecast with draft 1's share 108 / 116
  // and the later drafts' (16 tokens of draft 1's share + 300) / 316, each
  // smoothed.
  DraftEvidence good;
  for (int i = 0; i < 100; ++i) good.AddStep(4, 4, 4);
  auto up = RefinePlan(plan, good);
  ASSERT_TRUE(up.has_value());
  EXPECT_EQ(up->gamma, 4);
  EXPECT_NEAR(up->alpha_hat, 408.0 / 416.0, 1e-12);
  EXPECT_NEAR(up->alpha_smoothed, 409.0 / 418.0, 1e-12);
  EXPECT_EQ(up->evidence_trials, 400);
  const double first_share = 108.0 / 116.0;
  TptCandidate both_groups{109.0 / 118.0, 0.2e-3};
  both_groups.later = LaterDraftOdds{
      SmoothAlpha((first_share * 16 + 300) / 316, 316, AlphaPrior()),
      ConfidenceStop()};
  const StepForecast f =
      ForecastStep(both_groups, 4, plan.basis.verify_seconds);
  EXPECT_NEAR(up->predicted_tokens_per_step, f.tokens, 1e-12);
  EXPECT_NEAR(up->predicted_drafts_per_step, 4, 1e-12);
  EXPECT_NEAR(up->predicted_tpt, f.tokens_per_second(), 1e-9);
  // 100 rejections at the first draft: plain decoding is predicted faster.
  DraftEvidence bad;
  for (int i = 0; i < 100; ++i) bad.AddStep(1, 1, 0);
  auto down = RefinePlan(plan, bad);
  ASSERT_TRUE(down.has_value());
  EXPECT_EQ(down->gamma, 0);
  EXPECT_DOUBLE_EQ(down->predicted_tpt, down->baseline_tpt);
  EXPECT_DOUBLE_EQ(down->predicted_tokens_per_step, 1);
  EXPECT_DOUBLE_EQ(down->alpha_smoothed, 0);
  // A request's own gamma stays; its predictions follow the evidence.
  DraftPlan fixed = plan;
  fixed.basis.gamma_fixed = true;
  auto kept = RefinePlan(fixed, good);
  ASSERT_TRUE(kept.has_value());
  EXPECT_EQ(kept->gamma, 1);
  EXPECT_GT(kept->predicted_tokens_per_step, 1.9);
}

TEST(RefinePlanTest, AConfidenceStopIsRefinedFromTheDraftsMade) {
  const DraftPlan plan = HalfAcceptedPlan(/*confidence_stop=*/true);
  // Drafts always run to the budget and are accepted: c and b go to 1.
  DraftEvidence e;
  for (int i = 0; i < 200; ++i) e.AddStep(4, 4, 4);
  auto refined = RefinePlan(plan, e);
  ASSERT_TRUE(refined.has_value());
  EXPECT_EQ(refined->gamma, 4);
  EXPECT_GT(refined->predicted_drafts_per_step, 3.8);
  // Drafts that stop after one token: E[m] near 1 whatever the budget.
  DraftEvidence stops;
  for (int i = 0; i < 200; ++i) stops.AddStep(4, 1, 1);
  auto short_drafts = RefinePlan(plan, stops);
  ASSERT_TRUE(short_drafts.has_value());
  EXPECT_LT(short_drafts->predicted_drafts_per_step, 1.1);
}

// Half the steps accept all 4 drafts and half reject the first: 3 tokens a
// step. One share over every draft (0.8) would promise 3.36; draft 1's odds
// (0.5) and the later drafts' (near 1) forecast the 3.
TEST(RefinePlanTest, StepsThatDifferAreForecastByDraftPosition) {
  DraftPlan plan = HalfAcceptedPlan();
  plan.basis.gamma_fixed = true;
  plan.gamma = 4;
  DraftEvidence halves;
  for (int i = 0; i < 200; ++i) {
    halves.AddStep(4, 4, 4);
    halves.AddStep(4, 4, 0);
  }
  auto refined = RefinePlan(plan, halves);
  ASSERT_TRUE(refined.has_value());
  EXPECT_EQ(refined->gamma, 4);
  EXPECT_NEAR(refined->alpha_hat, (8.0 + 800) / (16 + 1000), 1e-12);
  EXPECT_NEAR(refined->predicted_tokens_per_step, 3.0, 0.05);
  EXPECT_GT(ExpectedTokensPerStep(refined->alpha_smoothed, 4), 3.3);
  // Free to choose, the same odds still draft: a step of 4 drafts makes 3
  // tokens for 1.4 + 4 x 0.2 = 2.2 ms.
  plan.basis.gamma_fixed = false;
  auto chosen = RefinePlan(plan, halves);
  ASSERT_TRUE(chosen.has_value());
  EXPECT_GE(chosen->gamma, 1);
  EXPECT_GT(chosen->predicted_tpt, chosen->baseline_tpt);
}

// A plan of gamma 1 never sees drafts 2..gamma: they are taken to be as
// good as draft 1, so drafts that are all accepted raise gamma.
TEST(RefinePlanTest, UnseenLaterDraftsTakeDraftOnesOdds) {
  const DraftPlan plan = HalfAcceptedPlan();
  DraftEvidence ones;
  for (int i = 0; i < 100; ++i) ones.AddStep(1, 1, 1);
  auto refined = RefinePlan(plan, ones);
  ASSERT_TRUE(refined.has_value());
  EXPECT_EQ(refined->gamma, 4);
  const double share = (8.0 + 100) / 116;
  TptCandidate expected{SmoothAlpha(share, 116, AlphaPrior()), 0.2e-3};
  expected.later =
      LaterDraftOdds{SmoothAlpha(share, 16, AlphaPrior()), ConfidenceStop()};
  EXPECT_NEAR(refined->predicted_tokens_per_step,
              ForecastStep(expected, 4, plan.basis.verify_seconds).tokens,
              1e-12);
}

TEST(RefinePlanTest, APlanWithoutABasisOrGammaIsNotRefined) {
  DraftPlan none = HalfAcceptedPlan();
  none.basis = PlanBasis();
  EXPECT_FALSE(RefinePlan(none, DraftEvidence()).has_value());
  DraftPlan plain = HalfAcceptedPlan();
  plain.gamma = 0;
  EXPECT_FALSE(RefinePlan(plain, DraftEvidence()).has_value());
}

TEST(EvidenceWithoutTest, SubtractsAndClamps) {
  DraftEvidence all;
  for (int i = 0; i < 10; ++i) all.AddStep(4, 4, 4);
  DraftEvidence part;
  for (int i = 0; i < 3; ++i) part.AddStep(4, 4, 4);
  using V = std::vector<int64_t>;
  const DraftEvidence rest = EvidenceWithout(all, part);
  EXPECT_EQ(Counts(rest.first), (V{7, 7, 7, 7, 7, 7}));
  EXPECT_EQ(Counts(rest.later), (V{21, 21, 14, 14, 14, 14}));
  // A part larger than the whole, or successes beyond the trials left: 0
  // and at most the trials.
  DraftEvidence rejected;
  for (int i = 0; i < 20; ++i) rejected.AddStep(1, 1, 0);
  const DraftEvidence none = EvidenceWithout(part, all);
  EXPECT_EQ(none.accept_trials(), 0);
  EXPECT_EQ(none.first.accepted, 0);
  EXPECT_EQ(none.later.accepted, 0);
  const DraftEvidence odd = EvidenceWithout(all, rejected);
  EXPECT_EQ(odd.first.accept_trials, 0);
  EXPECT_EQ(odd.first.accepted, 0);
  EXPECT_EQ(odd.later.accept_trials, 30);
}

TEST(RefinePlanForSequenceTest, WithoutOwnEvidenceItIsThePoolsChoice) {
  const DraftPlan plan = HalfAcceptedPlan(/*confidence_stop=*/true);
  // 16 reference tokens and 40 trials of the others: all of it counts while
  // the prior may weigh 56 tokens or more.
  DraftEvidence pooled;
  for (int i = 0; i < 10; ++i) pooled.AddStep(4, 4, 4);
  auto expected = RefinePlan(plan, pooled);
  auto own = RefinePlanForSequence(plan, pooled, DraftEvidence(), 56);
  ASSERT_TRUE(expected.has_value());
  ASSERT_TRUE(own.has_value());
  EXPECT_EQ(own->gamma, expected->gamma);
  EXPECT_DOUBLE_EQ(own->alpha_hat, expected->alpha_hat);
  EXPECT_DOUBLE_EQ(own->alpha_smoothed, expected->alpha_smoothed);
  EXPECT_DOUBLE_EQ(own->predicted_tpt, expected->predicted_tpt);
  EXPECT_DOUBLE_EQ(own->predicted_drafts_per_step,
                   expected->predicted_drafts_per_step);
  EXPECT_EQ(own->evidence_trials, 40);
  // A smaller prior keeps the share (no own evidence moves it) but smooths
  // it over fewer tokens.
  auto capped = RefinePlanForSequence(plan, pooled, DraftEvidence(), 20);
  ASSERT_TRUE(capped.has_value());
  EXPECT_DOUBLE_EQ(capped->alpha_hat, expected->alpha_hat);
  EXPECT_NEAR(capped->alpha_smoothed,
              SmoothAlpha(expected->alpha_hat, 20, plan.basis.prior), 1e-12);
  EXPECT_NE(capped->alpha_smoothed, expected->alpha_smoothed);
}

// The others drafted 984 accepted tokens; this sequence accepted 10 of 40.
// Pooled, its 40 trials hardly count (gamma 4 for everyone); its own odds
// weigh the others as 32 tokens: (0.992 x 32 + 10) / 72.
TEST(RefinePlanForSequenceTest, OwnTextOutweighsTheOthersAfterAFewDozenTokens) {
  const DraftPlan plan = HalfAcceptedPlan();
  DraftEvidence others;
  for (int i = 0; i < 246; ++i) others.AddStep(4, 4, 4);
  DraftEvidence own;
  DraftEvidence pooled = others;
  for (DraftEvidence* e : {&own, &pooled}) {
    for (int i = 0; i < 10; ++i) e->AddStep(4, 4, 1);  // 1 accepted, 1 not
    for (int i = 0; i < 20; ++i) e->AddStep(1, 1, 0);
  }
  ASSERT_EQ(own.accept_trials(), 40);
  ASSERT_EQ(own.first.accepted + own.later.accepted, 10);
  auto everyone = RefinePlan(plan, pooled);
  ASSERT_TRUE(everyone.has_value());
  EXPECT_EQ(everyone->gamma, 4);
  auto mine = RefinePlanForSequence(plan, pooled, own, 32);
  ASSERT_TRUE(mine.has_value());
  const double others_share = (0.5 * 16 + 984) / 1000.0;
  EXPECT_NEAR(mine->alpha_hat, (others_share * 32 + 10) / 72.0, 1e-12);
  EXPECT_NEAR(mine->alpha_smoothed,
              SmoothAlpha(mine->alpha_hat, 72, plan.basis.prior), 1e-12);
  EXPECT_LT(mine->gamma, everyone->gamma);
  EXPECT_LT(mine->predicted_tokens_per_step,
            everyone->predicted_tokens_per_step);
  EXPECT_EQ(mine->evidence_trials, 1024);
  EXPECT_EQ(mine->mask, plan.mask);
  // The other way: an easy text under a pool that drafts badly.
  DraftEvidence bad_others;
  for (int i = 0; i < 200; ++i) bad_others.AddStep(1, 1, 0);
  DraftEvidence easy;
  DraftEvidence bad_pool = bad_others;
  for (DraftEvidence* e : {&easy, &bad_pool}) {
    for (int i = 0; i < 20; ++i) e->AddStep(4, 4, 4);
  }
  auto pool_says = RefinePlan(plan, bad_pool);
  auto easy_says = RefinePlanForSequence(plan, bad_pool, easy, 32);
  ASSERT_TRUE(pool_says.has_value());
  ASSERT_TRUE(easy_says.has_value());
  EXPECT_EQ(pool_says->gamma, 0);
  EXPECT_GE(easy_says->gamma, 1);
}

PlanCacheKey Key() {
  PlanCacheKey key;
  key.model_fingerprint = "llama:L=2";
  key.device = "cpu";
  key.dtype = "fp32";
  key.threads = 2;
  key.max_draft = 4;
  return key;
}

TEST(PlanCacheRefinementTest, ANewGammaIsANewVersionForEverySequence) {
  PlanCache cache(/*refine_every_trials=*/32);
  const DraftPlan plan = HalfAcceptedPlan();
  const int64_t v1 = cache.Insert(Key(), plan, 7, 100);
  DraftEvidence evidence;
  // 31 accepted single drafts: not yet.
  for (int i = 0; i < 31; ++i) {
    EXPECT_EQ(cache.RecordDraftStep(Key(), v1, 1, 1, 1).version, v1);
    evidence.AddStep(1, 1, 1);
  }
  EXPECT_EQ(cache.Peek(Key())->plan.evidence_trials, 0);
  // The 32nd refines: acceptance (8 + 32 + 1) / 50 takes gamma above 1.
  const PlanCache::PlanOdds odds = cache.RecordDraftStep(Key(), v1, 1, 1, 1);
  const int64_t v2 = odds.version;
  evidence.AddStep(1, 1, 1);
  EXPECT_GT(v2, v1);
  auto cached = cache.Peek(Key());
  ASSERT_TRUE(cached.has_value());
  EXPECT_EQ(cached->version, v2);
  EXPECT_EQ(cached->sequence_id, 7u);
  auto expected = RefinePlan(plan, evidence);
  ASSERT_TRUE(expected.has_value());
  EXPECT_GT(expected->gamma, 1);
  EXPECT_EQ(cached->plan.gamma, expected->gamma);
  EXPECT_DOUBLE_EQ(cached->plan.predicted_tpt, expected->predicted_tpt);
  EXPECT_EQ(cached->plan.evidence_trials, 32);
  // The call returns the refined plan's odds (the drift check's reference).
  EXPECT_EQ(odds.gamma, cached->plan.gamma);
  EXPECT_DOUBLE_EQ(odds.alpha_hat, cached->plan.alpha_hat);
  EXPECT_NE(odds.alpha_hat, plan.alpha_hat);
  EXPECT_DOUBLE_EQ(odds.predicted_drafts_per_step,
                   cached->plan.predicted_drafts_per_step);
  EXPECT_EQ(cache.gamma_refinements(), 1);
  // Steps under the first version still count (same solve, same mask):
  // 8 + 7 x 3 = 29 more trials, then 3 more make 64.
  for (int i = 0; i < 8; ++i) cache.RecordDraftStep(Key(), v1, 1, 1, 1);
  for (int i = 0; i < 7; ++i) cache.RecordDraftStep(Key(), v2, 3, 3, 3);
  EXPECT_EQ(cache.Peek(Key())->plan.evidence_trials, 32);
  cache.RecordDraftStep(Key(), v2, 3, 3, 3);
  EXPECT_EQ(cache.Peek(Key())->plan.evidence_trials, 64);
}

TEST(PlanCacheRefinementTest, NewPredictionsAloneKeepTheVersion) {
  PlanCache cache(/*refine_every_trials=*/32);
  DraftPlan plan = HalfAcceptedPlan();
  plan.basis.gamma_fixed = true;
  const int64_t v1 = cache.Insert(Key(), plan, 7, 100);
  for (int i = 0; i < 32; ++i) cache.RecordDraftStep(Key(), v1, 1, 1, 1);
  auto cached = cache.Peek(Key());
  ASSERT_TRUE(cached.has_value());
  EXPECT_EQ(cached->version, v1);
  EXPECT_EQ(cached->plan.gamma, 1);
  EXPECT_EQ(cached->plan.evidence_trials, 32);
  EXPECT_GT(cached->plan.predicted_tokens_per_step, 1.8);
  EXPECT_EQ(cache.prediction_refinements(), 1);
  EXPECT_EQ(cache.gamma_refinements(), 0);
}

TEST(PlanCacheRefinementTest, ANewSolveStartsItsOwnEvidence) {
  PlanCache cache(/*refine_every_trials=*/32);
  const int64_t v1 = cache.Insert(Key(), HalfAcceptedPlan(), 7, 100);
  for (int i = 0; i < 20; ++i) cache.RecordDraftStep(Key(), v1, 1, 1, 1);
  const int64_t v2 = cache.Insert(Key(), HalfAcceptedPlan(), 8, 100);
  // The old solve's steps are another mask's evidence: ignored.
  for (int i = 0; i < 40; ++i) {
    EXPECT_EQ(cache.RecordDraftStep(Key(), v1, 1, 1, 1).version, v2);
  }
  EXPECT_EQ(cache.Peek(Key())->plan.evidence_trials, 0);
  // The new one's 20 + 12: refined at 32, not at 12.
  for (int i = 0; i < 31; ++i) cache.RecordDraftStep(Key(), v2, 1, 1, 1);
  EXPECT_EQ(cache.Peek(Key())->plan.evidence_trials, 0);
  cache.RecordDraftStep(Key(), v2, 1, 1, 1);
  EXPECT_EQ(cache.Peek(Key())->plan.evidence_trials, 32);
  // No plan, or refinement off: nothing happens.
  PlanCacheKey other = Key();
  other.bucket = 3;
  EXPECT_EQ(cache.RecordDraftStep(other, v2, 1, 1, 1).version, 0);
  PlanCache off(/*refine_every_trials=*/0);
  const int64_t w = off.Insert(Key(), HalfAcceptedPlan(), 7, 100);
  for (int i = 0; i < 100; ++i) off.RecordDraftStep(Key(), w, 1, 1, 1);
  EXPECT_EQ(off.Peek(Key())->plan.evidence_trials, 0);
  EXPECT_EQ(off.Peek(Key())->version, w);
}

TEST(PlanCacheRefinementTest, ARefinementToPlainIsRecheckedLikeAPlainSolve) {
  PlanCache cache(/*refine_every_trials=*/32);
  const int64_t v1 = cache.Insert(Key(), HalfAcceptedPlan(), 7, 100);
  int64_t v2 = v1;
  for (int i = 0; i < 32; ++i)
    v2 = cache.RecordDraftStep(Key(), v1, 1, 1, 0).version;
  ASSERT_GT(v2, v1);
  EXPECT_EQ(cache.Peek(Key())->plan.gamma, 0);
  // The first plain answer: rechecked after base_steps plain steps.
  for (int i = 0; i < 9; ++i) {
    EXPECT_FALSE(cache.CountPlainStep(Key(), v2, 10));
  }
  EXPECT_TRUE(cache.CountPlainStep(Key(), v2, 10));
}

}  // namespace
}  // namespace knapserve

// Tests of the TPT objective and its grid search (planner/tpt.h).
#include "planner/tpt.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace knapserve {
namespace {

TEST(TptTest, ExpectedTokensMatchesTheGeometricSeries) {
  for (double a : {0.0, 0.3, 0.8, 0.99}) {
    for (int gamma = 0; gamma <= 10; ++gamma) {
      double sum = 0;
      for (int k = 0; k <= gamma; ++k) sum += std::pow(a, k);
      EXPECT_NEAR(ExpectedTokensPerStep(a, gamma), sum, 1e-12) << a << " " << gamma;
    }
  }
  // a == 1: the limit gamma + 1, and continuous next to it.
  EXPECT_DOUBLE_EQ(ExpectedTokensPerStep(1.0, 5), 6.0);
  EXPECT_NEAR(ExpectedTokensPerStep(1.0 - 1e-7, 5), 6.0, 1e-4);
  EXPECT_DOUBLE_EQ(TokensPerSecond(0.5, 0, 123.0, 0.01), 100.0);  // gamma 0: AR
}

TEST(TptTest, GridReturnsTheMaximizerOfHandBuiltTables) {
  // Verify cost grows with the token count; D = 4.
  const std::vector<double> verify = {0.010, 0.011, 0.012, 0.013, 0.014};
  const std::vector<TptCandidate> candidates = {
      {0.95, 0.009},  // nearly the full model: accepts a lot, barely cheaper
      {0.80, 0.004},  // the sweet spot
      {0.30, 0.001},  // cheap but mostly rejected
  };
  auto choice = MaximizeTpt(candidates, verify, 4);
  ASSERT_TRUE(choice.ok()) << choice.status();
  // Brute force over the same grid.
  int best_c = -1, best_g = 0;
  double best = 1.0 / verify[0];
  for (size_t c = 0; c < candidates.size(); ++c) {
    for (int g = 1; g <= 4; ++g) {
      const double tpt = ExpectedTokensPerStep(candidates[c].alpha, g) /
                         (g * candidates[c].draft_seconds + verify[g]);
      if (tpt > best) {
        best = tpt;
        best_c = static_cast<int>(c);
        best_g = g;
      }
    }
  }
  EXPECT_EQ(best_c, 1);
  EXPECT_EQ(choice->candidate, best_c);
  EXPECT_EQ(choice->gamma, best_g);
  EXPECT_DOUBLE_EQ(choice->tpt, best);
  EXPECT_DOUBLE_EQ(choice->baseline_tpt, 100.0);
}

TEST(TptTest, GridMatchesBruteForceOnRandomTables) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int d = 1 + trial % 10;
    std::vector<double> verify;
    double t = 0.005 + 0.01 * u(rng);
    for (int k = 0; k <= d; ++k) verify.push_back(t += 0.002 * u(rng));
    std::vector<TptCandidate> candidates;
    for (int c = 0; c < 1 + trial % 7; ++c) {
      candidates.push_back({u(rng), 0.0005 + 0.01 * u(rng)});
    }
    if (trial % 13 == 0) candidates.push_back({1.0, 0.003});
    auto choice = MaximizeTpt(candidates, verify, d);
    ASSERT_TRUE(choice.ok());
    double best = 1.0 / verify[0];
    for (const TptCandidate& c : candidates) {
      for (int g = 1; g <= d; ++g) {
        best = std::max(best, TokensPerSecond(c.alpha, g, c.draft_seconds, verify[g]));
      }
    }
    EXPECT_DOUBLE_EQ(choice->tpt, best);
    if (choice->candidate >= 0) {
      const TptCandidate& c = candidates[choice->candidate];
      EXPECT_DOUBLE_EQ(
          TokensPerSecond(c.alpha, choice->gamma, c.draft_seconds, verify[choice->gamma]), best);
      EXPECT_GT(choice->tpt, choice->baseline_tpt);
    }
  }
}

TEST(TptTest, SaysNoSpeculationWhenNothingBeatsAutoregressive) {
  const std::vector<double> verify = {0.010, 0.012, 0.014, 0.016};
  // Drafts as slow as the full model, or accepting almost nothing.
  const std::vector<TptCandidate> candidates = {{1.0, 0.010}, {0.05, 0.002}};
  auto choice = MaximizeTpt(candidates, verify, 3);
  ASSERT_TRUE(choice.ok());
  EXPECT_EQ(choice->candidate, -1);
  EXPECT_EQ(choice->gamma, 0);
  EXPECT_DOUBLE_EQ(choice->tpt, 100.0);
  EXPECT_DOUBLE_EQ(choice->baseline_tpt, 100.0);
  // No candidates at all: the same.
  choice = MaximizeTpt({}, verify, 3);
  ASSERT_TRUE(choice.ok());
  EXPECT_EQ(choice->gamma, 0);
}

TEST(TptTest, RejectsBadInputs) {
  const std::vector<double> verify = {0.01, 0.02, 0.03};
  const std::vector<TptCandidate> ok = {{0.5, 0.001}};
  EXPECT_EQ(MaximizeTpt(ok, verify, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MaximizeTpt(ok, verify, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MaximizeTpt(ok, std::vector<double>{0.01, 0.0, 0.03}, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MaximizeTpt(std::vector<TptCandidate>{{1.5, 0.001}}, verify, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MaximizeTpt(std::vector<TptCandidate>{{0.5, 0.0}}, verify, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MaximizeTpt(std::vector<TptCandidate>{{NAN, 0.01}}, verify, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace knapserve

// Tests of the TPT objective and its grid search (planner/tpt.h).
#include "planner/tpt.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

namespace knapserve {
namespace {

TEST(TptTest, ExpectedTokensMatchesTheGeometricSeries) {
  for (double a : {0.0, 0.3, 0.8, 0.99}) {
    for (int gamma = 0; gamma <= 10; ++gamma) {
      double sum = 0;
      for (int k = 0; k <= gamma; ++k) sum += std::pow(a, k);
      EXPECT_NEAR(ExpectedTokensPerStep(a, gamma), sum, 1e-12)
          << a << " " << gamma;
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
    // A draft must beat plain decoding by kMinSpeculationGain.
    const double baseline = 1.0 / verify[0];
    double best = baseline;
    for (const TptCandidate& c : candidates) {
      for (int g = 1; g <= d; ++g) {
        const double tps =
            TokensPerSecond(c.alpha, g, c.draft_seconds, verify[g]);
        if (tps > baseline * (1 + kMinSpeculationGain)) {
          best = std::max(best, tps);
        }
      }
    }
    EXPECT_DOUBLE_EQ(choice->tpt, best);
    if (choice->candidate >= 0) {
      const TptCandidate& c = candidates[choice->candidate];
      EXPECT_DOUBLE_EQ(TokensPerSecond(c.alpha, choice->gamma, c.draft_seconds,
                                       verify[choice->gamma]),
                       best);
      EXPECT_GT(choice->tpt, choice->baseline_tpt * (1 + kMinSpeculationGain));
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
  EXPECT_EQ(MaximizeTpt(ok, verify, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MaximizeTpt(ok, verify, 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      MaximizeTpt(ok, std::vector<double>{0.01, 0.0, 0.03}, 2).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MaximizeTpt(std::vector<TptCandidate>{{1.5, 0.001}}, verify, 2)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MaximizeTpt(std::vector<TptCandidate>{{0.5, 0.0}}, verify, 2)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MaximizeTpt(std::vector<TptCandidate>{{NAN, 0.01}}, verify, 2)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// The engine's rule, enumerated: every position independently is one of
// (accepted, confident), (accepted, unsure), (rejected, confident),
// (rejected, unsure) with probabilities b, a - b, c - b, 1 - a - c + b. A
// step drafts until an unsure token or gamma, keeps the leading accepted
// drafts and one more token, and costs m drafts plus a verification of m + 1
// tokens. ForecastStep must give the exact expectation. Draft 1 has odds
// (a, c, b) and drafts 2..gamma (a2, c2, b2).
StepForecast Enumerated(double a, double c, double b, double a2, double c2,
                        double b2, int gamma, double draft_seconds,
                        const std::vector<double>& verify) {
  const double first[4] = {b, a - b, c - b, 1 - a - c + b};
  const double later[4] = {b2, a2 - b2, c2 - b2, 1 - a2 - c2 + b2};
  StepForecast out;
  out.tokens = 0;
  int outcomes = 1;
  for (int k = 0; k < gamma; ++k) outcomes *= 4;
  for (int code = 0; code < outcomes; ++code) {
    double prob = 1;
    int m = 0, accepted = 0;
    bool drafting = true, matching = true;
    for (int k = 0, rest = code; k < gamma; ++k, rest /= 4) {
      const int o = rest % 4;
      prob *= k == 0 ? first[o] : later[o];
      if (!drafting) continue;
      ++m;
      const bool accept = o <= 1, confident = o == 0 || o == 2;
      matching = matching && accept;
      if (matching) ++accepted;
      drafting = confident;
    }
    out.tokens += prob * (accepted + 1);
    out.drafts += prob * m;
    out.seconds += prob * (m * draft_seconds + verify[m]);
  }
  return out;
}

StepForecast Enumerated(double a, double c, double b, int gamma,
                        double draft_seconds,
                        const std::vector<double>& verify) {
  return Enumerated(a, c, b, a, c, b, gamma, draft_seconds, verify);
}

TEST(TptTest, ForecastsDraftsThatStopOnLowConfidence) {
  const std::vector<double> verify = {0.010, 0.011, 0.013, 0.016, 0.020};
  for (double a : {0.0, 0.4, 0.9, 1.0}) {
    for (double c : {0.0, 0.3, 0.8, 1.0}) {
      for (double share : {0.0, 0.5, 1.0}) {
        const double b = share * std::min(a, c);
        // b >= a + c - 1: the four probabilities are a distribution.
        if (b < a + c - 1 - 1e-12) continue;
        for (int gamma = 1; gamma <= 4; ++gamma) {
          SCOPED_TRACE(::testing::Message() << "a " << a << " c " << c << " b "
                                            << b << " gamma " << gamma);
          const TptCandidate candidate{a, 0.002, ConfidenceStop{c, b}};
          const StepForecast f = ForecastStep(candidate, gamma, verify);
          const StepForecast e = Enumerated(a, c, b, gamma, 0.002, verify);
          EXPECT_NEAR(f.tokens, e.tokens, 1e-12);
          EXPECT_NEAR(f.drafts, e.drafts, 1e-12);
          EXPECT_NEAR(f.seconds, e.seconds, 1e-12);
          EXPECT_LE(f.drafts, gamma + 1e-12);
          EXPECT_GE(f.drafts, 1.0 - 1e-12);  // the first draft is always made
        }
      }
    }
  }
  // A stop that never fires is the plain formula, to the last bit of the
  // rate the grid compares.
  for (int gamma = 1; gamma <= 4; ++gamma) {
    const StepForecast never =
        ForecastStep({0.7, 0.002, ConfidenceStop{1.0, 0.7}}, gamma, verify);
    const StepForecast none = ForecastStep({0.7, 0.002}, gamma, verify);
    EXPECT_NEAR(never.tokens, ExpectedTokensPerStep(0.7, gamma), 1e-12);
    EXPECT_DOUBLE_EQ(none.tokens, ExpectedTokensPerStep(0.7, gamma));
    EXPECT_DOUBLE_EQ(none.drafts, gamma);
    EXPECT_DOUBLE_EQ(none.tokens_per_second(),
                     TokensPerSecond(0.7, gamma, 0.002, verify[gamma]));
    EXPECT_NEAR(never.seconds, none.seconds, 1e-15);
  }
  // gamma 0: one plain token.
  const StepForecast plain =
      ForecastStep({0.7, 0.002, ConfidenceStop{0.5, 0.3}}, 0, verify);
  EXPECT_EQ(plain.tokens, 1.0);
  EXPECT_EQ(plain.drafts, 0.0);
  EXPECT_EQ(plain.seconds, verify[0]);
}

// Drafts 2..gamma with odds of their own (TptCandidate::later), with and
// without a stop, against the enumeration.
TEST(TptTest, ForecastsLaterDraftsWithOddsOfTheirOwn) {
  const std::vector<double> verify = {0.010, 0.011, 0.013, 0.016, 0.020};
  struct Odds {
    double a, c, b;
  };
  const Odds cases[] = {{0.5, 1.0, 0.5}, {0.9, 0.8, 0.75}, {0.3, 0.6, 0.2}};
  for (const Odds& one : cases) {
    for (const Odds& two : cases) {
      for (int gamma = 1; gamma <= 4; ++gamma) {
        SCOPED_TRACE(::testing::Message()
                     << one.a << " " << two.a << " gamma " << gamma);
        TptCandidate candidate{one.a, 0.002, ConfidenceStop{one.c, one.b}};
        candidate.later = LaterDraftOdds{two.a, ConfidenceStop{two.c, two.b}};
        const StepForecast f = ForecastStep(candidate, gamma, verify);
        const StepForecast e = Enumerated(one.a, one.c, one.b, two.a, two.c,
                                          two.b, gamma, 0.002, verify);
        EXPECT_NEAR(f.tokens, e.tokens, 1e-12);
        EXPECT_NEAR(f.drafts, e.drafts, 1e-12);
        EXPECT_NEAR(f.seconds, e.seconds, 1e-12);
        // Without a stop the later odds' c and b are not used.
        candidate.stop.reset();
        const StepForecast g = ForecastStep(candidate, gamma, verify);
        const StepForecast plain =
            Enumerated(one.a, 1, one.a, two.a, 1, two.a, gamma, 0.002, verify);
        EXPECT_NEAR(g.tokens, plain.tokens, 1e-12);
        EXPECT_DOUBLE_EQ(g.drafts, gamma);
        EXPECT_NEAR(g.seconds, plain.seconds, 1e-12);
      }
    }
  }
  // Half the steps accept all 4 drafts, half reject the first: 3 tokens a
  // step, where one share over all drafts (4 / 5) would promise 3.36.
  TptCandidate halves{0.5, 0.002};
  halves.later = LaterDraftOdds{1.0, ConfidenceStop()};
  EXPECT_NEAR(ForecastStep(halves, 4, verify).tokens, 3.0, 1e-12);
  EXPECT_NEAR(ExpectedTokensPerStep(0.8, 4), 3.3616, 1e-12);
}

// A draft that is often unsure ends early: each extra token of budget costs
// less than a full draft, so the grid may pick a larger gamma than without
// the stop, and it predicts fewer tokens for the same gamma.
TEST(TptTest, TheGridPricesTheStop) {
  const std::vector<double> verify = {0.010, 0.0105, 0.011, 0.0115,
                                      0.012, 0.0125, 0.013};
  const TptCandidate always{0.6, 0.003};
  const TptCandidate stops{0.6, 0.003, ConfidenceStop{0.5, 0.45}};
  auto without = MaximizeTpt({&always, 1}, verify, 6);
  auto with = MaximizeTpt({&stops, 1}, verify, 6);
  ASSERT_TRUE(without.ok());
  ASSERT_TRUE(with.ok());
  EXPECT_GT(without->gamma, 0);
  EXPECT_GT(with->gamma, without->gamma);
  EXPECT_LT(ForecastStep(stops, with->gamma, verify).tokens,
            ForecastStep(always, with->gamma, verify).tokens);
  EXPECT_LT(ForecastStep(stops, with->gamma, verify).drafts, with->gamma);
  EXPECT_DOUBLE_EQ(
      with->tpt, ForecastStep(stops, with->gamma, verify).tokens_per_second());
}

TEST(TptTest, RejectsStopSharesThatCannotBe) {
  const std::vector<double> verify = {0.01, 0.011, 0.012};
  auto code = [&](TptCandidate c) {
    return MaximizeTpt({&c, 1}, verify, 2).status().code();
  };
  EXPECT_EQ(code({0.5, 0.001, ConfidenceStop{0.8, 0.4}}),
            absl::StatusCode::kOk);
  // Accepted-and-confident above either share.
  EXPECT_EQ(code({0.5, 0.001, ConfidenceStop{0.8, 0.6}}),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({0.5, 0.001, ConfidenceStop{0.3, 0.4}}),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({0.5, 0.001, ConfidenceStop{1.2, 0.4}}),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code({0.5, 0.001, ConfidenceStop{NAN, 0.4}}),
            absl::StatusCode::kInvalidArgument);
  // The lazy search: a stop it was not told about.
  auto lazy = MaximizeTptLazily(
      std::vector<double>{0.001}, 1.0, verify, 2, /*confidence_stop=*/false,
      [](int) -> absl::StatusOr<DraftOdds> {
        return DraftOdds{0.5, ConfidenceStop{0.8, 0.4}};
      });
  EXPECT_EQ(lazy.status().code(), absl::StatusCode::kInvalidArgument);
  // The later drafts' odds are checked like draft 1's.
  TptCandidate later{0.5, 0.001, ConfidenceStop{0.8, 0.4}};
  later.later = LaterDraftOdds{0.9, ConfidenceStop{0.9, 0.85}};
  EXPECT_EQ(code(later), absl::StatusCode::kOk);
  later.later = LaterDraftOdds{0.9, ConfidenceStop{0.7, 0.8}};
  EXPECT_EQ(code(later), absl::StatusCode::kInvalidArgument);
  later.later = LaterDraftOdds{1.5, ConfidenceStop()};
  EXPECT_EQ(code(later), absl::StatusCode::kInvalidArgument);
  // Without a stop the later stop is not used, so not checked.
  later.stop.reset();
  later.later = LaterDraftOdds{0.9, ConfidenceStop{0.7, 0.8}};
  EXPECT_EQ(code(later), absl::StatusCode::kOk);
  // The lazy search: later odds above alpha_upper break its bound.
  auto above = MaximizeTptLazily(
      std::vector<double>{0.001}, 0.9, verify, 2, /*confidence_stop=*/false,
      [](int) -> absl::StatusOr<DraftOdds> {
        return DraftOdds{0.5, std::nullopt,
                         LaterDraftOdds{0.95, ConfidenceStop()}};
      });
  EXPECT_EQ(above.status().code(), absl::StatusCode::kInvalidArgument);
}

// With stops, the lazy search's bound allows any stop; it still returns the
// eager grid's choice, and whatever it did not measure could not have won.
TEST(TptTest, LazySearchWithStopsMatchesTheFullGrid) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  int skipped_somewhere = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int d = 1 + trial % 8;
    std::vector<double> verify;
    for (int t = 0; t <= d; ++t)
      verify.push_back(0.01 * (1 + 0.02 * t + 0.3 * u(rng) * (t > 0)));
    const int count = 1 + trial % 13;
    const double upper = 0.95;
    std::vector<double> draft;
    std::vector<TptCandidate> all;
    for (int c = 0; c < count; ++c) {
      draft.push_back(0.0005 + 0.012 * u(rng));
      const double a = upper * u(rng);
      const double go_on = u(rng);
      const double b =
          std::max(0.0, a + go_on - 1) +
          u(rng) * (std::min(a, go_on) - std::max(0.0, a + go_on - 1));
      all.push_back({a, draft.back(), ConfidenceStop{go_on, b}});
      // Every other trial: later drafts with odds of their own (the bound
      // must hold for them too).
      if (trial % 2 == 1) {
        const double a2 = upper * u(rng);
        const double c2 = u(rng);
        all.back().later =
            LaterDraftOdds{a2, ConfidenceStop{c2, u(rng) * std::min(a2, c2)}};
      }
    }
    auto eager = MaximizeTpt(all, verify, d);
    ASSERT_TRUE(eager.ok()) << eager.status();
    std::set<int> asked;
    auto lazy = MaximizeTptLazily(
        draft, upper, verify, d, /*confidence_stop=*/true,
        [&](int i) -> absl::StatusOr<DraftOdds> {
          asked.insert(i);
          return DraftOdds{all[i].alpha, all[i].stop, all[i].later};
        });
    ASSERT_TRUE(lazy.ok()) << lazy.status();
    EXPECT_EQ(lazy->candidate, eager->candidate) << "trial " << trial;
    EXPECT_EQ(lazy->gamma, eager->gamma) << "trial " << trial;
    EXPECT_DOUBLE_EQ(lazy->tpt, eager->tpt);
    for (int c = 0; c < count; ++c) {
      if (asked.count(c) > 0) continue;
      for (int g = 1; g <= d; ++g) {
        EXPECT_LE(ForecastStep(all[c], g, verify).tokens_per_second(),
                  lazy->tpt);
      }
    }
    if (lazy->num_evaluated < count) ++skipped_somewhere;
  }
  EXPECT_GT(skipped_somewhere, 10);
}

TEST(TptTest, SmoothsAlphaWithABetaPrior) {
  // Laplace's rule of succession for the default Beta(1, 1).
  EXPECT_DOUBLE_EQ(SmoothAlpha(1.0, 5, AlphaPrior()), 6.0 / 7.0);
  EXPECT_DOUBLE_EQ(SmoothAlpha(0.0, 5, AlphaPrior()), 1.0 / 7.0);
  EXPECT_DOUBLE_EQ(SmoothAlpha(0.6, 5, AlphaPrior()), 4.0 / 7.0);
  EXPECT_DOUBLE_EQ(SmoothAlpha(1.0, 16, AlphaPrior()), 17.0 / 18.0);
  // Shrinks toward the prior mean, less with more tokens.
  EXPECT_LT(SmoothAlpha(1.0, 5, AlphaPrior()),
            SmoothAlpha(1.0, 50, AlphaPrior()));
  EXPECT_NEAR(SmoothAlpha(0.9, 100000, AlphaPrior()), 0.9, 1e-4);
  // {0, 0}: no smoothing; r = 0 with no prior: the share itself.
  EXPECT_DOUBLE_EQ(SmoothAlpha(1.0, 5, AlphaPrior{0, 0}), 1.0);
  EXPECT_DOUBLE_EQ(SmoothAlpha(0.4, 0, AlphaPrior{0, 0}), 0.4);
  EXPECT_DOUBLE_EQ(SmoothAlpha(0.4, 0, AlphaPrior{3, 1}), 0.75);
  // Validation names the field.
  EXPECT_TRUE(ValidateAlphaPrior(AlphaPrior()).ok());
  absl::Status bad = ValidateAlphaPrior(AlphaPrior{-1, 1});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("alpha_prior.hits"), std::string::npos) << bad;
  bad = ValidateAlphaPrior(AlphaPrior{1, NAN});
  EXPECT_NE(bad.message().find("alpha_prior.misses"), std::string::npos) << bad;
}

TEST(TptTest, APerfectShareFromFiveTokensNoLongerDrivesGammaToTheMaximum) {
  // Drafts at 40% of a verification, which grows 3% per extra token; D = 10.
  std::vector<double> verify;
  for (int t = 1; t <= 11; ++t) verify.push_back(0.010 * (1 + 0.03 * (t - 1)));
  const double draft = 0.004;
  auto raw = MaximizeTpt(std::vector<TptCandidate>{{1.0, draft}}, verify, 10);
  ASSERT_TRUE(raw.ok());
  EXPECT_EQ(raw->gamma, 10);  // what 5 of 5 did before smoothing
  auto smoothed = MaximizeTpt(
      std::vector<TptCandidate>{{SmoothAlpha(1.0, 5, AlphaPrior()), draft}},
      verify, 10);
  ASSERT_TRUE(smoothed.ok());
  EXPECT_GT(smoothed->gamma, 0);
  EXPECT_LT(smoothed->gamma, 10);
}

// Random grids: the lazy search returns exactly MaximizeTpt's choice, asks
// for each alpha at most once, and never asks for one it does not need.
TEST(TptTest, LazySearchMatchesTheFullGridAndSkipsHopelessCandidates) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  int skipped_somewhere = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int d = 1 + trial % 10;
    const int r = 1 + trial % 16;
    const AlphaPrior prior = trial % 5 == 0 ? AlphaPrior{0, 0} : AlphaPrior();
    std::vector<double> verify;
    double t = 0.005 + 0.01 * u(rng);
    for (int k = 0; k <= d; ++k) verify.push_back(t += 0.002 * u(rng));
    const int count = trial % 40;
    std::vector<double> draft;
    std::vector<double> alpha;
    for (int c = 0; c < count; ++c) {
      draft.push_back(0.0005 + 0.012 * u(rng));
      // Shares on the r-token grid, smoothed; some candidates share a draft
      // time and alpha (exact ties).
      const int hits = static_cast<int>(u(rng) * (r + 1)) % (r + 1);
      alpha.push_back(SmoothAlpha(static_cast<double>(hits) / r, r, prior));
      if (c > 0 && trial % 7 == 0 && c % 3 == 0) {
        draft.back() = draft[c - 1];
        alpha.back() = alpha[c - 1];
      }
    }
    std::vector<TptCandidate> all;
    for (int c = 0; c < count; ++c) all.push_back({alpha[c], draft[c]});
    auto eager = MaximizeTpt(all, verify, d);
    ASSERT_TRUE(eager.ok());
    std::multiset<int> asked;
    auto lazy = MaximizeTptLazily(draft, SmoothAlpha(1.0, r, prior), verify, d,
                                  [&](int i) -> absl::StatusOr<double> {
                                    asked.insert(i);
                                    return alpha[i];
                                  });
    ASSERT_TRUE(lazy.ok()) << lazy.status();
    EXPECT_EQ(lazy->candidate, eager->candidate) << "trial " << trial;
    EXPECT_EQ(lazy->gamma, eager->gamma) << "trial " << trial;
    EXPECT_DOUBLE_EQ(lazy->tpt, eager->tpt);
    EXPECT_DOUBLE_EQ(lazy->baseline_tpt, eager->baseline_tpt);
    EXPECT_EQ(eager->num_evaluated, count);
    EXPECT_EQ(lazy->num_evaluated, static_cast<int>(asked.size()));
    for (int i : asked)
      EXPECT_EQ(asked.count(i), 1u) << "candidate " << i << " asked twice";
    // A candidate it never asked about could not have won (beaten the
    // choice, or plain decoding by kMinSpeculationGain).
    const double to_beat =
        std::max(lazy->tpt, lazy->baseline_tpt * (1 + kMinSpeculationGain));
    for (int c = 0; c < count; ++c) {
      if (asked.count(c) > 0) continue;
      for (int g = 1; g <= d; ++g) {
        EXPECT_LE(TokensPerSecond(alpha[c], g, draft[c], verify[g]), to_beat);
      }
    }
    if (lazy->num_evaluated < count) ++skipped_somewhere;
  }
  EXPECT_GT(skipped_somewhere, 100);
}

TEST(TptTest, LazySearchStopsAtTheBaselineAndPassesErrorsThrough) {
  const std::vector<double> verify = {0.010, 0.020, 0.030};
  // Verifying two tokens costs two steps: no draft can beat plain decoding,
  // so no alpha is measured at all.
  int calls = 0;
  auto choice =
      MaximizeTptLazily(std::vector<double>{0.001, 0.002}, 1.0, verify, 2,
                        [&](int) -> absl::StatusOr<double> {
                          ++calls;
                          return 1.0;
                        });
  ASSERT_TRUE(choice.ok());
  EXPECT_EQ(choice->gamma, 0);
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(choice->num_evaluated, 0);
  // Errors of the alpha function abort the search.
  const std::vector<double> flat = {0.010, 0.010, 0.010};
  choice = MaximizeTptLazily(std::vector<double>{0.001}, 1.0, flat, 2,
                             [](int) -> absl::StatusOr<double> {
                               return absl::InternalError("LM head failed");
                             });
  EXPECT_EQ(choice.status().code(), absl::StatusCode::kInternal);
  // An alpha above the promised bound is refused, naming the candidate.
  choice = MaximizeTptLazily(std::vector<double>{0.001}, 0.5, flat, 2,
                             [](int) -> absl::StatusOr<double> { return 0.9; });
  EXPECT_EQ(choice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(choice.status().message().find("candidate 0"), std::string::npos);
  EXPECT_EQ(MaximizeTptLazily(std::vector<double>{0.0}, 1.0, flat, 2,
                              [](int) -> absl::StatusOr<double> { return 0.5; })
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MaximizeTptLazily({}, 1.5, flat, 2,
                              [](int) -> absl::StatusOr<double> { return 0.5; })
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace knapserve

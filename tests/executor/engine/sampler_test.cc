#include "executor/engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace knapserve {
namespace {

torch::Tensor Logits() {
  return torch::tensor({2.0f, 1.0f, 0.5f, 0.0f, -1.0f, 3.0f});
}

TEST(SamplerTest, GreedyIsArgmaxAndOneHot) {
  Sampler sampler(SamplingParams{});
  EXPECT_TRUE(sampler.greedy());
  EXPECT_EQ(sampler.Sample(Logits(), 0), 5);
  torch::Tensor d = sampler.Distribution(Logits());
  EXPECT_FLOAT_EQ(d[5].item<float>(), 1.0f);
  EXPECT_FLOAT_EQ(d.sum().item<float>(), 1.0f);
}

TEST(SamplerTest, ArgmaxTiesGoToLowestIndex) {
  EXPECT_EQ(Argmax(torch::tensor({1.0f, 3.0f, 3.0f})), 1);
}

TEST(SamplerTest, TemperatureScalesSoftmax) {
  SamplingParams p;
  p.temperature = 2.0;
  torch::Tensor d = Sampler(p).Distribution(Logits());
  EXPECT_TRUE(
      torch::allclose(d, torch::softmax(Logits() / 2.0, 0), 1e-6, 1e-6));
}

TEST(SamplerTest, TopKKeepsTheKLargest) {
  SamplingParams p;
  p.temperature = 1.0;
  p.top_k = 2;
  torch::Tensor d = Sampler(p).Distribution(Logits());
  EXPECT_GT(d[5].item<float>(), 0);
  EXPECT_GT(d[0].item<float>(), 0);
  EXPECT_EQ((d > 0).sum().item<int64_t>(), 2);
  EXPECT_NEAR(d.sum().item<float>(), 1.0f, 1e-6);
  EXPECT_NEAR(d[5].item<float>() / d[0].item<float>(), std::exp(1.0f), 1e-4);
}

TEST(SamplerTest, TopPKeepsTheSmallestNucleus) {
  SamplingParams p;
  p.temperature = 1.0;
  torch::Tensor full = Sampler(p).Distribution(Logits());
  // Sorted: 5 (0.58), 0 (0.21), 1 (0.08)...: top_p 0.7 keeps {5, 0}.
  p.top_p = 0.7;
  torch::Tensor d = Sampler(p).Distribution(Logits());
  EXPECT_EQ((d > 0).sum().item<int64_t>(), 2);
  EXPECT_GT(d[5].item<float>(), 0);
  EXPECT_GT(d[0].item<float>(), 0);
  EXPECT_NEAR(d[5].item<float>(),
              full[5].item<float>() / (full[5] + full[0]).item<float>(), 1e-5);
  // A tiny top_p still keeps the most likely token.
  p.top_p = 1e-6;
  d = Sampler(p).Distribution(Logits());
  EXPECT_EQ((d > 0).sum().item<int64_t>(), 1);
  EXPECT_FLOAT_EQ(d[5].item<float>(), 1.0f);
}

SamplingParams Seeded(uint64_t seed, DraftAcceptance acceptance) {
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = seed;
  p.acceptance = acceptance;
  return p;
}

TEST(SamplerTest, SameSeedSameDraws) {
  for (DraftAcceptance acceptance :
       {DraftAcceptance::kRejection, DraftAcceptance::kCoupled}) {
    SCOPED_TRACE(DraftAcceptanceName(acceptance));
    Sampler a(Seeded(1234, acceptance)), b(Seeded(1234, acceptance));
    std::vector<int32_t> xs, ys;
    for (int i = 0; i < 200; ++i) {
      xs.push_back(a.Sample(Logits(), i));
      ys.push_back(b.Sample(Logits(), i));
    }
    EXPECT_EQ(xs, ys);
    Sampler c(Seeded(99, acceptance));
    std::vector<int32_t> zs;
    for (int i = 0; i < 200; ++i) zs.push_back(c.Sample(Logits(), i));
    EXPECT_NE(xs, zs);
  }
}

TEST(SamplerTest, ASeedMeansCoupledDrawsUnlessRejectionIsAsked) {
  EXPECT_TRUE(CoupledDraws(Seeded(1, DraftAcceptance::kAuto)));
  EXPECT_FALSE(CoupledDraws(Seeded(1, DraftAcceptance::kRejection)));
  SamplingParams unseeded;
  unseeded.temperature = 1.0;
  EXPECT_FALSE(CoupledDraws(unseeded));
  unseeded.acceptance = DraftAcceptance::kCoupled;
  EXPECT_TRUE(CoupledDraws(unseeded));
  EXPECT_FALSE(CoupledDraws(SamplingParams{})) << "greedy draws nothing";
  EXPECT_TRUE(Sampler(Seeded(1, DraftAcceptance::kAuto)).coupled());
  for (DraftAcceptance a : {DraftAcceptance::kAuto, DraftAcceptance::kRejection,
                            DraftAcceptance::kCoupled}) {
    EXPECT_EQ(*ParseDraftAcceptance(DraftAcceptanceName(a)), a);
  }
  EXPECT_NE(ParseDraftAcceptance("gumbel").status().message().find("coupled"),
            std::string::npos);
}

// A coupled draw depends on (seed, position, distribution) only: not on the
// draws made before it or their order.
TEST(SamplerTest, CoupledDrawsAreAFunctionOfSeedAndPosition) {
  Sampler forward(Seeded(5, DraftAcceptance::kCoupled));
  Sampler backward(Seeded(5, DraftAcceptance::kCoupled));
  std::vector<int32_t> xs(300), ys(300);
  for (int i = 0; i < 300; ++i) xs[i] = forward.Sample(Logits(), i);
  for (int i = 299; i >= 0; --i) {
    ys[i] = backward.Sample(Logits(), i);
    EXPECT_EQ(backward.Sample(Logits(), i), ys[i]) << "drawn again";
  }
  EXPECT_EQ(xs, ys);
  // Different positions draw differently (not one token throughout).
  std::map<int32_t, int> seen;
  for (int32_t x : xs) ++seen[x];
  EXPECT_GE(seen.size(), 4u);
}

// Chi-square goodness of fit of `counts` (n draws) to `d`, 5 degrees of
// freedom: 20.5 is the 0.1% quantile.
double ChiSquareOf(const std::map<int32_t, int>& counts, const torch::Tensor& d,
                   int n) {
  double chi2 = 0;
  for (int64_t k = 0; k < d.size(0); ++k) {
    const double expected = n * d[k].item<double>();
    const auto it = counts.find(static_cast<int32_t>(k));
    const double diff = (it == counts.end() ? 0 : it->second) - expected;
    chi2 += diff * diff / expected;
  }
  return chi2;
}

TEST(SamplerTest, DrawsFollowTheDistribution) {
  Sampler sampler(Seeded(7, DraftAcceptance::kRejection));
  torch::Tensor d = sampler.Distribution(Logits());
  const int n = 20000;
  std::map<int32_t, int> counts;
  for (int i = 0; i < n; ++i) ++counts[sampler.SampleFrom(d)];
  EXPECT_LT(ChiSquareOf(counts, d, n), 20.5);
}

// The exponential race over Philox noise is an exact draw: across positions
// (and across seeds at one position) the tokens follow the distribution.
TEST(SamplerTest, CoupledDrawsFollowTheDistribution) {
  Sampler sampler(Seeded(7, DraftAcceptance::kCoupled));
  torch::Tensor d = sampler.Distribution(Logits());
  const int n = 20000;
  std::map<int32_t, int> by_position, by_seed;
  for (int i = 0; i < n; ++i) ++by_position[sampler.DrawAt(d, i)];
  EXPECT_LT(ChiSquareOf(by_position, d, n), 20.5);
  for (int s = 0; s < n; ++s) {
    ++by_seed[Sampler(Seeded(1000 + s, DraftAcceptance::kCoupled))
                  .DrawAt(d, /*position=*/3)];
  }
  EXPECT_LT(ChiSquareOf(by_seed, d, n), 20.5);
  // The same statistic rejects a wrong distribution (temperature 1.3).
  SamplingParams hot = Seeded(7, DraftAcceptance::kCoupled);
  hot.temperature = 1.3;
  EXPECT_GT(ChiSquareOf(by_position, Sampler(hot).Distribution(Logits()), n),
            20.5);
}

// Draft and target draw with the same noise, so close distributions agree
// often: Gumbel-max coupling agrees with probability at least
// (1 - TV) / (1 + TV), TV the total variation distance, where independent
// draws would agree with probability sum p_i q_i.
TEST(SamplerTest, CoupledDraftsAgreeWithTheTargetAsTheCouplingPromises) {
  Sampler sampler(Seeded(11, DraftAcceptance::kCoupled));
  torch::Tensor p = sampler.Distribution(Logits());
  torch::Tensor q = sampler.Distribution(
      Logits() + torch::tensor({0.3f, -0.2f, 0.1f, 0.0f, 0.4f, -0.3f}));
  const double tv = 0.5 * (p - q).abs().sum().item<double>();
  const double independent = (p * q).sum().item<double>();
  const int n = 20000;
  int agree = 0;
  for (int i = 0; i < n; ++i)
    agree += sampler.DrawAt(p, i) == sampler.DrawAt(q, i);
  const double rate = static_cast<double>(agree) / n;
  EXPECT_GE(rate, (1 - tv) / (1 + tv) - 0.01) << "tv " << tv;
  EXPECT_LE(rate, 1 - tv + 0.01) << "no coupling beats the maximal one";
  EXPECT_GT(rate, independent + 0.2);
}

TEST(SamplerTest, NeverDrawsAFilteredToken) {
  for (DraftAcceptance acceptance :
       {DraftAcceptance::kRejection, DraftAcceptance::kCoupled}) {
    SamplingParams p = Seeded(3, acceptance);
    p.temperature = 1.5;
    p.top_k = 3;
    p.top_p = 0.9;
    Sampler sampler(p);
    torch::Tensor d = sampler.Distribution(Logits());
    for (int i = 0; i < 2000; ++i) {
      EXPECT_GT(d[sampler.Sample(Logits(), i)].item<float>(), 0);
    }
  }
}

TEST(SamplerTest, ValidatesParams) {
  SamplingParams p;
  EXPECT_TRUE(ValidateSamplingParams(p, /*vocab_size=*/16).ok());
  p.temperature = -0.5;
  EXPECT_NE(ValidateSamplingParams(p, /*vocab_size=*/16)
                .message()
                .find("temperature"),
            std::string::npos);
  p = SamplingParams();
  p.top_k = -1;
  EXPECT_NE(
      ValidateSamplingParams(p, /*vocab_size=*/16).message().find("top_k"),
      std::string::npos);
  p = SamplingParams();
  p.top_p = 0;
  EXPECT_NE(
      ValidateSamplingParams(p, /*vocab_size=*/16).message().find("top_p"),
      std::string::npos);
  p.top_p = 1.5;
  EXPECT_FALSE(ValidateSamplingParams(p, /*vocab_size=*/16).ok());
  p = SamplingParams();
  p.temperature = NAN;
  EXPECT_FALSE(ValidateSamplingParams(p, /*vocab_size=*/16).ok());
}

}  // namespace
}  // namespace knapserve

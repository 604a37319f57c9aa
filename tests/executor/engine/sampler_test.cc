#include "executor/engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

namespace knapserve {
namespace {

torch::Tensor Logits() {
  return torch::tensor({2.0f, 1.0f, 0.5f, 0.0f, -1.0f, 3.0f});
}

TEST(SamplerTest, GreedyIsArgmaxAndOneHot) {
  Sampler sampler(SamplingParams{});
  EXPECT_TRUE(sampler.greedy());
  EXPECT_EQ(sampler.Sample(Logits()), 5);
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

TEST(SamplerTest, SameSeedSameDraws) {
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 1234;
  Sampler a(p), b(p);
  std::vector<int32_t> xs, ys;
  for (int i = 0; i < 200; ++i) {
    xs.push_back(a.Sample(Logits()));
    ys.push_back(b.Sample(Logits()));
  }
  EXPECT_EQ(xs, ys);
  p.seed = 99;
  Sampler c(p);
  std::vector<int32_t> zs;
  for (int i = 0; i < 200; ++i) zs.push_back(c.Sample(Logits()));
  EXPECT_NE(xs, zs);
}

TEST(SamplerTest, DrawsFollowTheDistribution) {
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 7;
  Sampler sampler(p);
  torch::Tensor d = sampler.Distribution(Logits());
  const int n = 20000;
  std::map<int32_t, int> counts;
  for (int i = 0; i < n; ++i) ++counts[sampler.SampleFrom(d)];
  // Chi-square goodness of fit, 5 degrees of freedom: 20.5 is the 0.1%
  // quantile.
  double chi2 = 0;
  for (int64_t k = 0; k < d.size(0); ++k) {
    const double expected = n * d[k].item<double>();
    const double diff = counts[static_cast<int32_t>(k)] - expected;
    chi2 += diff * diff / expected;
  }
  EXPECT_LT(chi2, 20.5);
}

TEST(SamplerTest, NeverDrawsAFilteredToken) {
  SamplingParams p;
  p.temperature = 1.5;
  p.top_k = 3;
  p.top_p = 0.9;
  p.seed = 3;
  Sampler sampler(p);
  torch::Tensor d = sampler.Distribution(Logits());
  for (int i = 0; i < 2000; ++i) {
    EXPECT_GT(d[sampler.Sample(Logits())].item<float>(), 0);
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

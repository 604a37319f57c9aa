// Tests of the latency model (planner/latency_profile.h): the line fit,
// interpolation of the verify table, JSON round trip and the refusal of
// corrupt or mismatched profiles, and a real (small) measurement.
#include "planner/latency_profile.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/model/llama.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::Stories260kDir;

LatencyProfile HandProfile() {
  LatencyProfile p;
  p.model_fingerprint = "0123456789abcdef";
  p.device = "cpu";
  p.dtype = "bf16";
  p.threads = 2;
  p.attention = {1e-4, 2e-8, 0.99};
  p.mlp_seconds = 3e-4;
  p.mlp_fit = {3e-4, 1e-12, 0.01};
  p.step_fixed_seconds = 5e-4;
  p.max_draft = 2;
  p.verify_contexts = {100, 1100};
  p.verify_seconds = {{1e-3, 1.5e-3, 2e-3}, {2e-3, 2.5e-3, 3e-3}};
  p.sublayer_contexts = {100, 1100};
  p.attention_medians = {1.02e-4, 1.22e-4};
  p.mlp_medians = {3e-4, 3e-4};
  return p;
}

std::string WriteFile(const std::string& dir, const std::string& name,
                      const std::string& text) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(FitLineTest, RecoversKnownCoefficientsFromNoisyTimings) {
  std::mt19937 rng(42);
  std::normal_distribution<double> noise(0.0, 2e-7);
  const double a = 3.5e-5, b = 1.25e-8;
  std::vector<double> x, y;
  for (int n = 64; n <= 8192; n += 128) {
    x.push_back(n);
    y.push_back(a + b * n + noise(rng));
  }
  auto fit = FitLine(x, y);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_NEAR(fit->a, a, 1e-7);
  EXPECT_NEAR(fit->b, b, 1e-10);
  EXPECT_GT(fit->r2, 0.99);
  EXPECT_LE(fit->r2, 1.0);

  // Exact line: r2 = 1; flat data: b = 0, r2 = 1 (the fit is exact).
  auto exact =
      FitLine(std::vector<double>{1, 2, 3}, std::vector<double>{2, 4, 6});
  ASSERT_TRUE(exact.ok());
  EXPECT_NEAR(exact->a, 0, 1e-12);
  EXPECT_NEAR(exact->b, 2, 1e-12);
  EXPECT_NEAR(exact->r2, 1, 1e-12);
  auto flat =
      FitLine(std::vector<double>{1, 2, 3}, std::vector<double>{5, 5, 5});
  ASSERT_TRUE(flat.ok());
  EXPECT_NEAR(flat->b, 0, 1e-12);
  // Pure noise around a constant: r2 near 0.
  std::vector<double> noisy;
  for (double v : x) noisy.push_back(1e-3 + noise(rng) + 0 * v);
  auto none = FitLine(x, noisy);
  ASSERT_TRUE(none.ok());
  EXPECT_LT(none->r2, 0.2);
}

TEST(FitLineTest, RejectsDegenerateInput) {
  EXPECT_EQ(
      FitLine(std::vector<double>{1}, std::vector<double>{1}).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FitLine(std::vector<double>{1, 2}, std::vector<double>{1})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FitLine(std::vector<double>{3, 3, 3}, std::vector<double>{1, 2, 3})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LatencyProfileTest, InterpolatesInsideAndClampsBelowTheVerifyTable) {
  const LatencyProfile p = HandProfile();
  ASSERT_TRUE(p.Validate().ok()) << p.Validate();
  EXPECT_DOUBLE_EQ(p.VerifySeconds(100, 1), 1e-3);
  EXPECT_DOUBLE_EQ(p.VerifySeconds(600, 1), 1.5e-3);   // halfway
  EXPECT_DOUBLE_EQ(p.VerifySeconds(350, 3), 2.25e-3);  // a quarter
  EXPECT_DOUBLE_EQ(p.VerifySeconds(0, 2), 1.5e-3);     // clamped below
  EXPECT_DOUBLE_EQ(p.VerifySeconds(1100, 2),
                   2.5e-3);  // the last measured context
  EXPECT_DOUBLE_EQ(p.VerifySeconds(100, 9),
                   2e-3);  // tokens clamped to max_draft+1
  EXPECT_DOUBLE_EQ(p.AttentionSeconds(1000), 1e-4 + 2e-5);

  // The raw sublayer model: fixed + kept attention * t_attn(n) + kept MLP *
  // t_mlp.
  LayerMask mask(4);
  EXPECT_DOUBLE_EQ(p.SublayerSeconds(mask, 1000), 5e-4 + 4 * 1.2e-4 + 4 * 3e-4);
  EXPECT_DOUBLE_EQ(p.FullStepSeconds(4, 1000), p.SublayerSeconds(mask, 1000));
  mask.set_skipped(2, true);  // a1
  mask.set_skipped(5, true);  // m2
  mask.set_skipped(7, true);  // m3
  EXPECT_DOUBLE_EQ(p.SublayerSeconds(mask, 1000), 5e-4 + 3 * 1.2e-4 + 2 * 3e-4);
}

// The verify cost keeps growing past the largest profiled context, along the
// least-squares line of each token count's row (it used to stay clamped).
TEST(LatencyProfileTest, ExtrapolatesVerifyCostPastTheLargestContext) {
  LatencyProfile p = HandProfile();
  // Rows exactly linear in n: t_verify(n, t) = (0.8 + 0.2 t) ms + t * 1e-6 * n.
  p.verify_contexts = {128, 512, 1024};
  p.verify_seconds.clear();
  for (int64_t n : p.verify_contexts) {
    std::vector<double> row;
    for (int t = 1; t <= 3; ++t)
      row.push_back((0.8 + 0.2 * t) * 1e-3 + t * 1e-6 * n);
    p.verify_seconds.push_back(row);
  }
  ASSERT_TRUE(p.Validate().ok()) << p.Validate();
  for (int t = 1; t <= 3; ++t) {
    EXPECT_NEAR(p.VerifySlope(t), t * 1e-6, 1e-15) << t;
    for (int64_t n : {1024, 1500, 4096, 16384}) {
      EXPECT_NEAR(p.VerifySeconds(n, t), (0.8 + 0.2 * t) * 1e-3 + t * 1e-6 * n,
                  1e-12)
          << "n " << n << " t " << t;
    }
  }
  EXPECT_GT(p.VerifySeconds(4096, 1), p.VerifySeconds(1024, 1) + 3e-3);
  // Anchored at the last measurement (continuous there) even when the rows
  // are not on a line: slope from the fit, offset from the last point.
  p.verify_seconds[2][0] += 2e-4;
  const double slope = p.VerifySlope(1);
  EXPECT_GT(slope, 0);
  EXPECT_DOUBLE_EQ(p.VerifySeconds(1024, 1), p.verify_seconds[2][0]);
  EXPECT_NEAR(p.VerifySeconds(2024, 1), p.verify_seconds[2][0] + 1000 * slope,
              1e-15);
  // A falling row (timing noise) extrapolates flat, never below the last point.
  p.verify_seconds[0][0] = 9e-3;
  EXPECT_DOUBLE_EQ(p.VerifySlope(1), 0);
  EXPECT_DOUBLE_EQ(p.VerifySeconds(8192, 1), p.verify_seconds[2][0]);
  // A single measured context: flat.
  LatencyProfile one = HandProfile();
  one.verify_contexts = {100};
  one.verify_seconds.resize(1);
  ASSERT_TRUE(one.Validate().ok()) << one.Validate();
  EXPECT_DOUBLE_EQ(one.VerifySlope(2), 0);
  EXPECT_DOUBLE_EQ(one.VerifySeconds(5000, 2), 1.5e-3);
}

// Verifying more tokens never counts as cheaper than verifying fewer.
TEST(LatencyProfileTest, VerifyCostIsNonDecreasingInTokens) {
  LatencyProfile p = HandProfile();
  p.verify_seconds = {{1e-3, 0.9e-3, 1.2e-3},
                      {2e-3, 1.8e-3, 1.9e-3}};  // noisy rows
  ASSERT_TRUE(p.Validate().ok());
  for (int64_t n : {0, 100, 600, 1100, 5000}) {
    for (int t = 2; t <= 3; ++t) {
      EXPECT_GE(p.VerifySeconds(n, t), p.VerifySeconds(n, t - 1))
          << "n " << n << " t " << t;
    }
  }
  EXPECT_DOUBLE_EQ(p.VerifySeconds(100, 2), 1e-3);
  EXPECT_DOUBLE_EQ(p.VerifySeconds(100, 3), 1.2e-3);
  EXPECT_DOUBLE_EQ(p.VerifySeconds(1100, 3), 2e-3);
}

// t_draft and t_verify on one basis: the empty mask costs exactly a
// one-token verification, at every context (inside, below and past the
// measured ones), and skipping saves the sublayers' scaled share.
TEST(LatencyProfileTest, DraftAndVerifyCostsShareOneBasis) {
  const LatencyProfile p = HandProfile();
  for (int num_layers : {1, 4, 30}) {
    const LayerMask none(num_layers);
    for (int64_t n : {0, 100, 350, 1100, 3000, 100000}) {
      EXPECT_NEAR(p.DraftSeconds(none, n), p.VerifySeconds(n, 1), 1e-15)
          << "L " << num_layers << " n " << n;
    }
  }
  // HandProfile's sublayer model says 5e-4 + 4 * (1.2e-4 + 3e-4) = 2.18e-3 for
  // a 4-layer step at n = 1000, but a measured pass takes 1.9e-3.
  const double scale = p.VerifySeconds(1000, 1) / p.FullStepSeconds(4, 1000);
  EXPECT_NEAR(scale, 1.9e-3 / 2.18e-3, 1e-12);
  LayerMask mask(4);
  mask.set_skipped(2, true);  // a1
  mask.set_skipped(5, true);  // m2
  mask.set_skipped(7, true);  // m3
  EXPECT_NEAR(p.DraftSeconds(mask, 1000),
              p.VerifySeconds(1000, 1) - scale * (1.2e-4 + 2 * 3e-4), 1e-15);
  EXPECT_NEAR(p.DraftSeconds(mask, 1000), scale * p.SublayerSeconds(mask, 1000),
              1e-15);
  EXPECT_LT(p.DraftSeconds(mask, 1000), p.DraftSeconds(LayerMask(4), 1000));
}

TEST(LatencyProfileTest, PricesTheWholeStepWithTheEnginesOverhead) {
  LatencyProfile p = HandProfile();
  LayerMask mask(4);
  mask.set_skipped(2, true);
  // Without a measured overhead the whole step is the pass.
  EXPECT_DOUBLE_EQ(p.StepSeconds(600, 2), p.VerifySeconds(600, 2));
  EXPECT_DOUBLE_EQ(p.DraftTokenSeconds(mask, 600), p.DraftSeconds(mask, 600));
  p.step_overhead_seconds = 4e-5;
  p.draft_overhead_seconds = 3e-5;
  ASSERT_TRUE(p.Validate().ok()) << p.Validate();
  for (int tokens : {1, 2, 3}) {
    EXPECT_DOUBLE_EQ(p.StepSeconds(600, tokens),
                     p.VerifySeconds(600, tokens) + 4e-5);
  }
  EXPECT_DOUBLE_EQ(p.DraftTokenSeconds(mask, 600),
                   p.DraftSeconds(mask, 600) + 3e-5);
  // The passes themselves are priced as before.
  EXPECT_DOUBLE_EQ(p.VerifySeconds(600, 1), 1.5e-3);
  // The overheads grow along their slopes with the context.
  p.step_overhead_slope = 1e-8;
  p.draft_overhead_slope = 2e-8;
  ASSERT_TRUE(p.Validate().ok()) << p.Validate();
  EXPECT_DOUBLE_EQ(p.StepOverheadSeconds(1000), 4e-5 + 1e-5);
  EXPECT_DOUBLE_EQ(p.DraftOverheadSeconds(1000), 3e-5 + 2e-5);
  EXPECT_DOUBLE_EQ(p.StepSeconds(1000, 2), p.VerifySeconds(1000, 2) + 5e-5);
  EXPECT_DOUBLE_EQ(p.DraftTokenSeconds(mask, 1000),
                   p.DraftSeconds(mask, 1000) + 5e-5);
  // A mean token count sits between the whole counts' prices.
  EXPECT_DOUBLE_EQ(p.MeanVerifySeconds(600, 2), p.VerifySeconds(600, 2));
  EXPECT_DOUBLE_EQ(
      p.MeanVerifySeconds(600, 2.25),
      0.75 * p.VerifySeconds(600, 2) + 0.25 * p.VerifySeconds(600, 3));
  p.step_overhead_slope = -1e-9;
  EXPECT_THAT(p.Validate().message(), HasSubstr("step_overhead_slope"));
  p.step_overhead_slope = 0;
  p.draft_overhead_slope = std::nan("");
  EXPECT_THAT(p.Validate().message(), HasSubstr("draft_overhead_slope"));
  p.draft_overhead_slope = 0;

  // A negative or non-finite overhead is refused, naming the field.
  p.step_overhead_seconds = -1e-6;
  EXPECT_THAT(p.Validate().message(), HasSubstr("step_overhead_seconds"));
  p.step_overhead_seconds = 0;
  p.draft_overhead_seconds = std::nan("");
  EXPECT_THAT(p.Validate().message(), HasSubstr("draft_overhead_seconds"));
}

TEST(LatencyProfileTest, RefusesAVersionOneProfileWithoutTheOverhead) {
  LatencyProfile p = HandProfile();
  nlohmann::json json = nlohmann::json::parse(p.ToJson());
  EXPECT_EQ(json["version"], LatencyProfile::kVersion);
  json["version"] = 1;
  json.erase("step_overhead_seconds");
  json.erase("draft_overhead_seconds");
  auto loaded = LatencyProfile::FromJson(json.dump(), "old.json");
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(loaded.status().message(),
              AllOf(HasSubstr("old.json"), HasSubstr("version 1"),
                    HasSubstr("knapserve profile")));
}

TEST(LatencyProfileTest, RoundTripsThroughJsonFiles) {
  const testing::ScopedTempDir temp("profile");
  const std::string& dir = temp.path();
  const std::string path = dir + "/profile.json";
  LatencyProfile p = HandProfile();
  p.step_overhead_seconds = 2.5e-5;
  p.step_overhead_slope = 3e-9;
  p.draft_overhead_seconds = 1.25e-5;
  p.draft_overhead_slope = 5e-9;
  ASSERT_TRUE(p.Save(path).ok());
  auto loaded = LatencyProfile::Load(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->source, path);
  EXPECT_EQ(loaded->model_fingerprint, p.model_fingerprint);
  EXPECT_EQ(loaded->device, p.device);
  EXPECT_EQ(loaded->dtype, p.dtype);
  EXPECT_EQ(loaded->threads, p.threads);
  EXPECT_DOUBLE_EQ(loaded->attention.a, p.attention.a);
  EXPECT_DOUBLE_EQ(loaded->attention.b, p.attention.b);
  EXPECT_DOUBLE_EQ(loaded->attention.r2, p.attention.r2);
  EXPECT_DOUBLE_EQ(loaded->mlp_seconds, p.mlp_seconds);
  EXPECT_DOUBLE_EQ(loaded->step_fixed_seconds, p.step_fixed_seconds);
  EXPECT_DOUBLE_EQ(loaded->step_overhead_seconds, p.step_overhead_seconds);
  EXPECT_DOUBLE_EQ(loaded->draft_overhead_seconds, p.draft_overhead_seconds);
  EXPECT_DOUBLE_EQ(loaded->step_overhead_slope, p.step_overhead_slope);
  EXPECT_DOUBLE_EQ(loaded->draft_overhead_slope, p.draft_overhead_slope);
  EXPECT_EQ(loaded->max_draft, p.max_draft);
  EXPECT_EQ(loaded->verify_contexts, p.verify_contexts);
  EXPECT_EQ(loaded->verify_seconds, p.verify_seconds);
  EXPECT_EQ(loaded->attention_medians, p.attention_medians);
  EXPECT_EQ(loaded->ToJson(), p.ToJson());
}

TEST(LatencyProfileTest, RefusesCorruptFilesNamingThem) {
  const testing::ScopedTempDir temp("profile");
  const std::string& dir = temp.path();
  const LatencyProfile good = HandProfile();

  // Not JSON.
  std::string path =
      WriteFile(dir, "corrupt.json", "{\"format\": \"knapserve-lat");
  auto loaded = LatencyProfile::Load(path);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(loaded.status().message().find(path), std::string::npos)
      << loaded.status();
  EXPECT_NE(loaded.status().message().find("not valid JSON"),
            std::string::npos);

  // A missing field.
  std::string text = good.ToJson();
  const size_t at = text.find("\"mlp_seconds\"");
  ASSERT_NE(at, std::string::npos);
  std::string missing = text;
  missing.replace(at, std::string("\"mlp_seconds\"").size(), "\"mlp_secs\"");
  path = WriteFile(dir, "missing.json", missing);
  loaded = LatencyProfile::Load(path);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(loaded.status().message().find(path), std::string::npos)
      << loaded.status();
  EXPECT_EQ(loaded.status().message(),
            path + ": field \"mlp_seconds\": required but missing");

  // Another version.
  std::string versioned = text;
  const std::string current =
      absl::StrCat("\"version\": ", LatencyProfile::kVersion);
  const size_t v = versioned.find(current);
  ASSERT_NE(v, std::string::npos);
  versioned.replace(v, current.size(), "\"version\": 99");
  path = WriteFile(dir, "version.json", versioned);
  loaded = LatencyProfile::Load(path);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(loaded.status().message().find("version 99"), std::string::npos)
      << loaded.status();
  EXPECT_NE(loaded.status().message().find(path), std::string::npos);

  // A verify table of the wrong shape.
  LatencyProfile bad = good;
  bad.verify_seconds[1].pop_back();
  path = WriteFile(dir, "table.json", bad.ToJson());
  loaded = LatencyProfile::Load(path);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(loaded.status().message().find("verify_seconds"), std::string::npos)
      << loaded.status();

  // A mistyped field.
  std::string typed = text;
  const size_t t = typed.find("\"threads\": 2");
  ASSERT_NE(t, std::string::npos);
  typed.replace(t, std::string("\"threads\": 2").size(),
                "\"threads\": \"two\"");
  loaded = LatencyProfile::FromJson(typed, "inline");
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      loaded.status().message(),
      "inline: field \"threads\": expected an integer, got string \"two\"");

  // A malformed element of a nested array is named by its indices.
  std::string nested = text;
  const size_t row = nested.find("\"verify_seconds\": [");
  ASSERT_NE(row, std::string::npos);
  const size_t first = nested.find_first_of("0123456789", row);
  nested.insert(first, "\"slow\", ");
  loaded = LatencyProfile::FromJson(nested, "nested.json");
  EXPECT_EQ(loaded.status().message(),
            "nested.json: field \"verify_seconds[0][0]\": expected a number, "
            "got string "
            "\"slow\"");

  // No file at all.
  loaded = LatencyProfile::Load(dir + "/nope.json");
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(loaded.status().message().find("nope.json"), std::string::npos);
}

TEST(LatencyProfileTest, RefusesAMismatchedEngineNamingBothKeys) {
  LatencyProfile p = HandProfile();
  p.source = "/profiles/smollm2.json";
  EXPECT_TRUE(p.CheckMatches("0123456789abcdef", "cpu", "bf16", 2).ok());
  absl::Status s = p.CheckMatches("fedcba9876543210", "cpu", "fp32", 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  const std::string msg(s.message());
  EXPECT_NE(msg.find("/profiles/smollm2.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("0123456789abcdef"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fedcba9876543210"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model, dtype differ"), std::string::npos) << msg;
  EXPECT_NE(msg.find("knapserve profile"), std::string::npos) << msg;
  s = p.CheckMatches("0123456789abcdef", "cpu", "bf16", 8);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("threads 8"), std::string::npos) << s;
}

TEST(ProfileModelTest, MeasuresAModel) {
  if (!std::filesystem::exists(Stories260kDir() + "/model.safetensors")) {
    GTEST_SKIP() << "stories260k not found under " << Stories260kDir();
  }
  auto model = LlamaModel::Load(Stories260kDir(), ModelOptions());
  ASSERT_TRUE(model.ok()) << model.status();
  ProfileOptions options;
  options.contexts = {16, 128, 256,
                      4096};  // 4096 does not fit (max 512): dropped
  options.repeats = 3;
  options.warmup = 1;
  options.max_draft = 4;
  auto profile = ProfileModel(**model, options);
  ASSERT_TRUE(profile.ok()) << profile.status();
  EXPECT_TRUE(profile->Validate().ok()) << profile->Validate();
  EXPECT_EQ(profile->model_fingerprint, (*model)->config().Fingerprint());
  EXPECT_EQ(profile->device, "cpu");
  EXPECT_EQ(profile->dtype, "fp32");
  EXPECT_GE(profile->threads, 1);
  EXPECT_EQ(profile->verify_contexts, (std::vector<int64_t>{16, 128, 256}));
  ASSERT_EQ(profile->verify_seconds.size(), 3u);
  for (const auto& row : profile->verify_seconds) EXPECT_EQ(row.size(), 5u);
  EXPECT_GT(profile->mlp_seconds, 0);
  EXPECT_GT(profile->AttentionSeconds(128), 0);
  EXPECT_GE(profile->step_fixed_seconds, 0);
  EXPECT_TRUE(profile
                  ->CheckMatches((*model)->config().Fingerprint(), "cpu",
                                 "fp32", profile->threads)
                  .ok());

  // Without an engine the overhead is left at 0.
  EXPECT_EQ(profile->step_overhead_seconds, 0);
  EXPECT_EQ(profile->draft_overhead_seconds, 0);

  // The caller's measurement of the engine's overhead goes into the profile,
  // after the passes and with the same before_run gate.
  int gate_calls = 0;
  options.before_run = [&]() -> absl::StatusOr<bool> {
    ++gate_calls;
    return false;
  };
  int overhead_calls = 0;
  options.measure_overhead =
      [&](const LatencyProfile& passes,
          const std::function<absl::StatusOr<bool>()>& before_run)
      -> absl::StatusOr<StepOverhead> {
    ++overhead_calls;
    // It sees the measured pass prices, and no overhead yet.
    EXPECT_EQ(passes.verify_contexts, (std::vector<int64_t>{16, 128, 256}));
    EXPECT_GT(passes.VerifySeconds(128, 2), 0);
    EXPECT_EQ(passes.step_overhead_seconds, 0);
    const int before = gate_calls;
    EXPECT_TRUE(before_run().ok());
    EXPECT_EQ(gate_calls, before + 1);
    return StepOverhead{3e-5, 1e-8, 2e-5, 4e-8};
  };
  profile = ProfileModel(**model, options);
  ASSERT_TRUE(profile.ok()) << profile.status();
  EXPECT_EQ(overhead_calls, 1);
  EXPECT_DOUBLE_EQ(profile->step_overhead_seconds, 3e-5);
  EXPECT_DOUBLE_EQ(profile->step_overhead_slope, 1e-8);
  EXPECT_DOUBLE_EQ(profile->draft_overhead_seconds, 2e-5);
  EXPECT_DOUBLE_EQ(profile->draft_overhead_slope, 4e-8);
  // A negative measurement is an error, as is the measurement's own.
  options.measure_overhead = [](const auto&,
                                const auto&) -> absl::StatusOr<StepOverhead> {
    return StepOverhead{-1e-6, 0, 0, 0};
  };
  EXPECT_THAT(ProfileModel(**model, options).status().message(),
              HasSubstr("non-negative"));
  options.measure_overhead = [](const auto&,
                                const auto&) -> absl::StatusOr<StepOverhead> {
    return StepOverhead{0, 0, 0, -1e-9};
  };
  EXPECT_THAT(ProfileModel(**model, options).status().message(),
              HasSubstr("non-negative"));
  options.measure_overhead = [](const auto&,
                                const auto&) -> absl::StatusOr<StepOverhead> {
    return absl::CancelledError("stopping");
  };
  EXPECT_EQ(ProfileModel(**model, options).status().code(),
            absl::StatusCode::kCancelled);
  options.measure_overhead = nullptr;
  options.before_run = nullptr;

  // A point budget that every run exceeds: each point (the sublayers, then
  // the verify row, at each context in each of two sweeps) runs one warm-up
  // and min_repeats timed runs. The gate counts them: asked before every run
  // and, in a verify run, between its max_draft + 1 passes.
  gate_calls = 0;
  options.before_run = [&]() -> absl::StatusOr<bool> {
    ++gate_calls;
    return false;
  };
  options.contexts = {16, 128};
  options.warmup = 3;
  options.repeats = 10;
  options.min_repeats = 2;
  options.point_budget_seconds = 1e-9;
  ASSERT_TRUE(ProfileModel(**model, options).ok());
  const int runs = 1 + options.min_repeats;
  EXPECT_EQ(gate_calls, 2 * 2 * (runs + runs * (options.max_draft + 1)));
  // Without the budget: every warm-up and timed run.
  gate_calls = 0;
  options.point_budget_seconds = 0;
  ASSERT_TRUE(ProfileModel(**model, options).ok());
  EXPECT_EQ(gate_calls, 2 * 2 * 13 * (1 + options.max_draft + 1));
  // A wait starts the point over, the budget's clock with it: here once,
  // before the first point's first timed run (the second call), so that
  // point makes its warm-up again: two calls more.
  gate_calls = 0;
  options.point_budget_seconds = 1e-9;
  options.before_run = [&]() -> absl::StatusOr<bool> {
    return ++gate_calls == 2;
  };
  ASSERT_TRUE(ProfileModel(**model, options).ok());
  EXPECT_EQ(gate_calls, 2 + 2 * 2 * (runs + runs * (options.max_draft + 1)));
  options.before_run = nullptr;
  options.min_repeats = 0;
  EXPECT_EQ(ProfileModel(**model, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.min_repeats = 3;
  options.point_budget_seconds = -1;
  EXPECT_EQ(ProfileModel(**model, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.point_budget_seconds = 0;

  // Bad options.
  options.contexts = {16};
  EXPECT_EQ(ProfileModel(**model, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.contexts = {16, 128};
  options.repeats = 0;
  EXPECT_EQ(ProfileModel(**model, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace knapserve

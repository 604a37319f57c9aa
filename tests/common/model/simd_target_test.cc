#include "common/model/simd_target.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/model/linear.h"

namespace knapserve {
namespace {

// Puts back the target the process started with.
class SimdTargetTest : public ::testing::Test {
 protected:
  void SetUp() override { start_ = simd::CurrentTarget(); }
  void TearDown() override { ASSERT_TRUE(simd::PinTarget(start_).ok()); }
  std::string start_;
};

TEST_F(SimdTargetTest, EveryCpuRunsTheScalarFallbackAndKnowsItsTargets) {
  const std::vector<std::string> supported = simd::SupportedTargets();
  ASSERT_FALSE(supported.empty());
  EXPECT_EQ(supported.back(), "scalar");
  const std::vector<std::string> known = simd::KnownTargets();
  for (const std::string& name : supported) {
    EXPECT_NE(std::find(known.begin(), known.end(), name), known.end());
  }
#if defined(__x86_64__)
  for (const char* name : {"avx512bf16", "avx512", "avx2", "scalar"}) {
    EXPECT_NE(std::find(known.begin(), known.end(), name), known.end()) << name;
  }
#endif
}

TEST_F(SimdTargetTest, PinsEachSupportedTargetAndRefusesOthersClearly) {
  for (const std::string& name : simd::SupportedTargets()) {
    ASSERT_TRUE(simd::PinTarget(name).ok()) << name;
    EXPECT_EQ(simd::CurrentTarget(), name);
    EXPECT_EQ(simd::Avx512Bf16Active(), name == "avx512bf16");
    EXPECT_NE(simd::Describe().find("simd " + name), std::string::npos);
  }
  ASSERT_TRUE(simd::PinTarget("auto").ok());
  EXPECT_EQ(simd::CurrentTarget(), simd::SupportedTargets().front());

  const std::string before = simd::CurrentTarget();
  const absl::Status unknown = simd::PinTarget("avx9000");
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.message().find("avx9000"), std::string::npos);
  EXPECT_NE(unknown.message().find("scalar"), std::string::npos);
  EXPECT_EQ(simd::CurrentTarget(), before);
  for (const std::string& name : simd::KnownTargets()) {
    const std::vector<std::string> supported = simd::SupportedTargets();
    if (std::find(supported.begin(), supported.end(), name) !=
        supported.end()) {
      continue;
    }
    EXPECT_EQ(simd::PinTarget(name).code(),
              absl::StatusCode::kFailedPrecondition)
        << name;
    EXPECT_EQ(simd::CurrentTarget(), before);
  }
}

// Every target packs the same layout and computes the same product up to
// rounding: the kernels differ in instructions, not in what they compute.
TEST_F(SimdTargetTest, EveryTargetComputesTheSameProjection) {
  torch::manual_seed(7);
  for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
    const torch::Tensor w = torch::randn({37, 70}).to(dtype);
    const torch::Tensor x = torch::randn({5, 70}).to(dtype);
    const LinearWeight packed(w);
    ASSERT_TRUE(packed.packed());
    const torch::Tensor reference =
        torch::mm(x.to(torch::kFloat32), w.to(torch::kFloat32).t());
    for (const std::string& name : simd::SupportedTargets()) {
      ASSERT_TRUE(simd::PinTarget(name).ok());
      const torch::Tensor y = LinearFloatOut(x, packed);
      EXPECT_TRUE(torch::allclose(y, reference, 1e-4, 1e-4))
          << name << " " << (dtype == torch::kFloat32 ? "fp32" : "bf16")
          << " max diff " << (y - reference).abs().max().item<float>();
    }
  }
}

}  // namespace
}  // namespace knapserve

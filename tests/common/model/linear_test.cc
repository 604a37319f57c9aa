// Tests of the packed projection kernel (common/model/linear.h): it matches a
// float64 reference on odd shapes, and a row's bits do not depend on how many
// rows are computed with it or on the thread count.
#include "common/model/linear.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "tests/testing/test_util.h"

namespace knapserve {
namespace {

using ThreadCount = testing::ScopedThreadCount;

struct Shape {
  int64_t n, k;
  torch::ScalarType dtype;
};

class LinearTest : public ::testing::TestWithParam<Shape> {};

TEST_P(LinearTest, MatchesReferenceAndEveryRowIsInvariant) {
  c10::InferenceMode guard;
  const Shape s = GetParam();
  if (!FastLinearSupported(s.dtype))
    GTEST_SKIP() << "no packed kernel for this dtype here";
  torch::manual_seed(5);
  const torch::Tensor w = torch::randn({s.n, s.k}).to(s.dtype);
  const torch::Tensor bias = torch::randn({s.n}).to(s.dtype);
  const LinearWeight packed(w);
  ASSERT_TRUE(packed.packed());
  EXPECT_TRUE(torch::equal(packed.ToDense(), w));
  const torch::Tensor x = torch::randn({17, s.k}).to(s.dtype);
  const torch::Tensor ref =
      torch::mm(x.to(torch::kFloat64), w.to(torch::kFloat64).t());
  // Products of bf16 values are exact in fp32; only the fp32 sums round.
  const double tol = 1e-4 * std::sqrt(static_cast<double>(s.k));
  const torch::Tensor all = LinearFloatOut(x, packed);
  EXPECT_TRUE(torch::allclose(all.to(torch::kFloat64), ref, tol, tol))
      << "max error "
      << (all.to(torch::kFloat64) - ref).abs().max().item<double>();
  const torch::Tensor with_bias = Linear(x, packed, bias);
  EXPECT_EQ(with_bias.scalar_type(), s.dtype);
  EXPECT_TRUE(torch::allclose(with_bias.to(torch::kFloat64),
                              ref + bias.to(torch::kFloat64), 2e-2, 2e-2));
  // Every prefix of rows M = 1..17, with 1 and 2 threads, gives the same bits
  // per row as the 17-row call.
  for (int threads : {1, 2}) {
    ThreadCount scoped(threads);
    for (int64_t m = 1; m <= 17; ++m) {
      const torch::Tensor part = LinearFloatOut(x.narrow(0, 0, m), packed);
      EXPECT_TRUE(torch::equal(part, all.narrow(0, 0, m)))
          << "M " << m << ", threads " << threads;
      // The same row alone, from the middle of the batch.
      const torch::Tensor alone = LinearFloatOut(x.narrow(0, m - 1, 1), packed);
      EXPECT_TRUE(torch::equal(alone[0], all[m - 1]))
          << "row " << m - 1 << " alone";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearTest,
                         ::testing::Values(Shape{1, 1, torch::kFloat32},
                                           Shape{33, 7, torch::kFloat32},
                                           Shape{100, 45, torch::kFloat32},
                                           Shape{320, 192, torch::kFloat32},
                                           Shape{17, 31, torch::kBFloat16},
                                           Shape{70, 33, torch::kBFloat16},
                                           Shape{512, 192, torch::kBFloat16},
                                           Shape{5, 1, torch::kBFloat16}));

TEST(LinearTest, LargeRowCountsSplitIntoChunksWithTheSameBits) {
  c10::InferenceMode guard;
  if (!FastLinearSupported(torch::kFloat32)) GTEST_SKIP();
  ThreadCount scoped(2);
  torch::manual_seed(6);
  const LinearWeight w(torch::randn({50, 40}));
  const torch::Tensor x = torch::randn({300, 40});  // several row chunks
  const torch::Tensor all = LinearFloatOut(x, w);
  for (int64_t m : {0, 95, 96, 97, 299}) {
    EXPECT_TRUE(torch::equal(LinearFloatOut(x.narrow(0, m, 1), w)[0], all[m]))
        << "row " << m;
  }
}

TEST(LinearTest, UnpackedWeightsUseTorch) {
  c10::InferenceMode guard;
  torch::manual_seed(7);
  const torch::Tensor w =
      torch::randn({6, 4}).to(torch::kFloat16);  // fp16: CUDA only, unpacked
  const LinearWeight weight(w);
  EXPECT_FALSE(weight.packed());
  EXPECT_EQ(weight.out_features(), 6);
  EXPECT_EQ(weight.in_features(), 4);
  EXPECT_EQ(weight.bytes(), 6 * 4 * 2);
  EXPECT_TRUE(torch::equal(weight.ToDense(), w));
}

}  // namespace
}  // namespace knapserve

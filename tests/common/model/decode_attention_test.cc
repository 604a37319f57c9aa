// Tests of the batch-invariant decode attention
// (common/model/decode_attention.h): it matches a plain LibTorch reference, and
// a row's output does not depend on how many rows are computed with it.
#include "common/model/decode_attention.h"

#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <cmath>

namespace knapserve {
namespace {

// softmax(q k^T * scale) v with a causal mask, in float64.
torch::Tensor Reference(const torch::Tensor& q, const torch::Tensor& k,
                        const torch::Tensor& v, int64_t start_pos,
                        double scale) {
  const int64_t t = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k.size(0);
  const int64_t n = start_pos + t;
  torch::Tensor qd = q.to(torch::kFloat64);
  torch::Tensor kd =
      k.narrow(1, 0, n).to(torch::kFloat64).repeat_interleave(nh / nkv, 0);
  torch::Tensor vd =
      v.narrow(1, 0, n).to(torch::kFloat64).repeat_interleave(nh / nkv, 0);
  torch::Tensor scores = torch::einsum("thd,hnd->htn", {qd, kd}) * scale;
  torch::Tensor qpos = torch::arange(start_pos, n).unsqueeze(1);
  torch::Tensor kpos = torch::arange(0, n).unsqueeze(0);
  scores = scores.masked_fill(kpos > qpos, -INFINITY);
  torch::Tensor out =
      torch::einsum("htn,hnd->thd", {torch::softmax(scores, -1), vd});
  return out.reshape({t, nh * hd});
}

struct Shape {
  int64_t heads, kv_heads, head_dim, start_pos;
  torch::ScalarType dtype;
};

class DecodeAttentionTest : public ::testing::TestWithParam<Shape> {};

TEST_P(DecodeAttentionTest, MatchesReferenceAndIsBatchInvariant) {
  c10::InferenceMode guard;
  const Shape s = GetParam();
  torch::manual_seed(3);
  const int64_t capacity = s.start_pos + 16;
  torch::Tensor k =
      torch::randn({s.kv_heads, capacity, s.head_dim}).to(s.dtype);
  torch::Tensor v =
      torch::randn({s.kv_heads, capacity, s.head_dim}).to(s.dtype);
  torch::Tensor q = torch::randn({11, s.heads, s.head_dim}).to(s.dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  torch::Tensor all = DecodeAttention(q, k, v, s.start_pos, scale);
  ASSERT_EQ(all.scalar_type(), s.dtype);
  const double tol = s.dtype == torch::kFloat32 ? 1e-5 : 2e-2;
  EXPECT_TRUE(torch::allclose(all.to(torch::kFloat64),
                              Reference(q, k, v, s.start_pos, scale), tol,
                              tol));
  // Row i alone (at its own position) gives the same bits as inside the pass.
  for (int64_t i = 0; i < 11; ++i) {
    torch::Tensor one =
        DecodeAttention(q.narrow(0, i, 1), k, v, s.start_pos + i, scale);
    EXPECT_TRUE(torch::equal(one[0], all[i])) << "row " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeAttentionTest,
    ::testing::Values(
        Shape{9, 3, 64, 700, torch::kBFloat16},  // smollm2-135m
        Shape{9, 3, 64, 37, torch::kFloat32},
        Shape{6, 2, 32, 1000, torch::kFloat32},   // stories-24l at 1k
        Shape{6, 2, 32, 1000, torch::kBFloat16},  // the same in bf16
        Shape{4, 1, 48, 100, torch::kFloat32},    // 3 vectors on AVX-512
        Shape{8, 2, 128, 300, torch::kBFloat16},  // Llama's head size
        Shape{2, 2, 32, 200, torch::kBFloat16},   // one query row per head
        Shape{8, 8, 8, 5, torch::kFloat32},  // stories260k-like: portable path
        Shape{4, 2, 16, 0, torch::kBFloat16},
        Shape{14, 2, 24, 50,
              torch::kFloat32}));  // head_dim not a multiple of 16

TEST(DecodeAttentionTest, AppliesOnlyToFewCpuRows) {
  c10::InferenceMode guard;
  EXPECT_TRUE(DecodeAttentionApplies(torch::zeros({1, 4, 16})));
  EXPECT_TRUE(
      DecodeAttentionApplies(torch::zeros({kMaxDecodeAttentionRows, 4, 16})));
  EXPECT_FALSE(DecodeAttentionApplies(
      torch::zeros({kMaxDecodeAttentionRows + 1, 4, 16})));
  EXPECT_FALSE(DecodeAttentionApplies(torch::zeros({2, 4, 16}, torch::kInt32)));
}

}  // namespace
}  // namespace knapserve

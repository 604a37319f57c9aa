// Tests of the batch-invariant decode attention
// (common/model/decode_attention.h): it matches a plain LibTorch reference, and
// a row's output does not depend on how many rows are computed with it; the
// same for the planner's shared-prefix attention (AttendSharedPrefix).
#include "common/model/decode_attention.h"

#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

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

// Branches over a shared prefix: every row's softmax over the positions its
// token sees, in float64, with its maximum and sum.
struct PrefixReference {
  torch::Tensor out, max, sum;  // [B, r, H, D], [B, r, H, 1] x 2
};
PrefixReference ReferencePrefix(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v,
                                const std::vector<int64_t>& lens,
                                double scale) {
  const int64_t b = q.size(0), r = q.size(1), nh = q.size(2), hd = q.size(3);
  const int64_t nkv = k.size(0);
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  PrefixReference ref{torch::zeros({b, r, nh, hd}, f64),
                      torch::full({b, r, nh, 1}, -INFINITY, f64),
                      torch::zeros({b, r, nh, 1}, f64)};
  for (int64_t t = 0; t < r; ++t) {
    if (lens[t] == 0) continue;
    for (int64_t h = 0; h < nh; ++h) {
      torch::Tensor kh =
          k[h / (nh / nkv)].narrow(0, 0, lens[t]).to(torch::kFloat64);
      torch::Tensor vh =
          v[h / (nh / nkv)].narrow(0, 0, lens[t]).to(torch::kFloat64);
      torch::Tensor qh = q.select(1, t).select(1, h).to(torch::kFloat64);
      torch::Tensor scores = torch::matmul(qh, kh.t()) * scale;  // [B, n]
      torch::Tensor max = scores.amax(-1, true);
      torch::Tensor e = (scores - max).exp();
      torch::Tensor sum = e.sum(-1, true);
      ref.out.select(1, t).select(1, h).copy_(torch::matmul(e / sum, vh));
      ref.max.select(1, t).select(1, h).copy_(max);
      ref.sum.select(1, t).select(1, h).copy_(sum);
    }
  }
  return ref;
}

class SharedPrefixAttentionTest : public ::testing::TestWithParam<Shape> {};

TEST_P(SharedPrefixAttentionTest, MatchesReferenceAndIsBatchInvariant) {
  c10::InferenceMode guard;
  const Shape s = GetParam();
  ASSERT_TRUE(SharedPrefixAttentionApplies(torch::kCPU, s.dtype, s.head_dim));
  torch::manual_seed(5);
  const int64_t capacity = s.start_pos + 8, b = 5, r = 6;
  torch::Tensor k =
      torch::randn({s.kv_heads, capacity, s.head_dim}).to(s.dtype);
  torch::Tensor v =
      torch::randn({s.kv_heads, capacity, s.head_dim}).to(s.dtype);
  torch::Tensor q = torch::randn({b, r, s.heads, s.head_dim});
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  const int64_t p = s.start_pos;
  // Every token the same prefix (the DP's branches); first-draft rows that
  // see one more entry each (the first one nothing); the whole capacity.
  const std::vector<std::vector<int64_t>> all_lens = {
      std::vector<int64_t>(r, p),
      {0, p / 3, p / 3, p / 2 + 1, p + 3, p + 4},
      std::vector<int64_t>(r, capacity)};
  for (const std::vector<int64_t>& lens : all_lens) {
    SharedPrefixAttention got =
        AttendSharedPrefix(q, k, v, lens, static_cast<float>(scale));
    PrefixReference want = ReferencePrefix(q, k, v, lens, scale);
    const double tol = 1e-5;
    EXPECT_TRUE(
        torch::allclose(got.out.to(torch::kFloat64), want.out, tol, tol));
    EXPECT_TRUE(torch::allclose(got.max.to(torch::kFloat64), want.max, tol, tol,
                                /*equal_nan=*/false));
    EXPECT_TRUE(
        torch::allclose(got.sum.to(torch::kFloat64), want.sum, tol, tol));
    // One branch alone, and the first tokens alone, give the same bits.
    for (int64_t branch = 0; branch < b; ++branch) {
      SharedPrefixAttention one =
          AttendSharedPrefix(q.narrow(0, branch, 1).contiguous(), k, v, lens,
                             static_cast<float>(scale));
      EXPECT_TRUE(torch::equal(one.out[0], got.out[branch]))
          << "branch " << branch;
      EXPECT_TRUE(torch::equal(one.sum[0], got.sum[branch]));
    }
    SharedPrefixAttention first =
        AttendSharedPrefix(q.narrow(1, 0, 3).contiguous(), k, v,
                           std::vector<int64_t>(lens.begin(), lens.begin() + 3),
                           static_cast<float>(scale));
    EXPECT_TRUE(torch::equal(first.out, got.out.narrow(1, 0, 3)));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SharedPrefixAttentionTest,
    ::testing::Values(Shape{6, 2, 32, 1000, torch::kFloat32},  // stories-24l
                      Shape{6, 2, 32, 1000, torch::kBFloat16},
                      Shape{9, 3, 64, 130, torch::kBFloat16},  // smollm2
                      Shape{4, 1, 48, 40, torch::kFloat32},
                      Shape{8, 2, 128, 20, torch::kBFloat16}));

TEST(SharedPrefixAttentionTest, RefusesWhatTheKernelCannotRun) {
  c10::InferenceMode guard;
  EXPECT_FALSE(SharedPrefixAttentionApplies(torch::kCPU, torch::kFloat16, 32));
  EXPECT_FALSE(SharedPrefixAttentionApplies(torch::kCPU, torch::kFloat32, 24));
  EXPECT_FALSE(SharedPrefixAttentionApplies(torch::kCUDA, torch::kFloat32, 32));
  torch::Tensor k = torch::randn({2, 20, 32});
  torch::Tensor q = torch::randn({1, 3, 4, 32});
  // Lengths must be non-decreasing, one per token, within the capacity.
  EXPECT_THROW(AttendSharedPrefix(q, k, k, {5, 4, 6}, 1.0f), c10::Error);
  EXPECT_THROW(AttendSharedPrefix(q, k, k, {5, 6}, 1.0f), c10::Error);
  EXPECT_THROW(AttendSharedPrefix(q, k, k, {5, 6, 21}, 1.0f), c10::Error);
  EXPECT_THROW(
      AttendSharedPrefix(q.to(torch::kBFloat16), k, k, {1, 2, 3}, 1.0f),
      c10::Error);
}

}  // namespace
}  // namespace knapserve

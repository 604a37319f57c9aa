// The decode-attention kernel of attention_kernels.h, one Highway source
// compiled for every SIMD target (hwy/foreach_target.h re-includes this file
// once per target; HWY_DYNAMIC_DISPATCH picks the chosen one at run time).
#include "common/model/attention_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/model/simd_target.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "common/model/attention_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// Must come after foreach_target.h.
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace knapserve::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Up to 16 fp32 lanes (head_dim is a multiple of 16).
using DF = hn::CappedTag<float, 16>;
using DU = hn::RebindToUnsigned<DF>;
using DU16 = hn::Rebind<uint16_t, DF>;

// One row of 16-bit bf16 values widened to fp32 (exact), or fp32 as is.
HWY_INLINE hn::Vec<DF> LoadRow(const uint16_t* p) {
  const DF d;
  const DU du;
  return hn::BitCast(
      d, hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(DU16(), p))));
}
HWY_INLINE hn::Vec<DF> LoadRow(const float* p) { return hn::LoadU(DF(), p); }

// Dot products of one query with `count` (1..4) keys, over hd in vectors of
// the target's width: each an FMA chain over the head dimension, then its
// lanes summed by a fixed tree (the same for every key slot). out[s] gets
// key s's dot product.
// QAt(c) gives the query's vector at element offset c (loaded, or kept in
// registers by the caller); the arithmetic is the same either way.
template <typename E, typename QAt>
HWY_INLINE void Dot4(const QAt& q_at, const E* const* keys, int64_t hd,
                     float* out) {
  const DF d;
  const int64_t lanes = hn::Lanes(d);
  const auto q0 = q_at(0);
  auto a0 = hn::Mul(q0, LoadRow(keys[0]));
  auto a1 = hn::Mul(q0, LoadRow(keys[1]));
  auto a2 = hn::Mul(q0, LoadRow(keys[2]));
  auto a3 = hn::Mul(q0, LoadRow(keys[3]));
  for (int64_t c = lanes; c < hd; c += lanes) {
    const auto qc = q_at(c);
    a0 = hn::MulAdd(qc, LoadRow(keys[0] + c), a0);
    a1 = hn::MulAdd(qc, LoadRow(keys[1] + c), a1);
    a2 = hn::MulAdd(qc, LoadRow(keys[2] + c), a2);
    a3 = hn::MulAdd(qc, LoadRow(keys[3] + c), a3);
  }
#if HWY_HAVE_SCALABLE || HWY_TARGET == HWY_SCALAR
  out[0] = hn::GetLane(hn::SumOfLanes(d, a0));
  out[1] = hn::GetLane(hn::SumOfLanes(d, a1));
  out[2] = hn::GetLane(hn::SumOfLanes(d, a2));
  out[3] = hn::GetLane(hn::SumOfLanes(d, a3));
#else
  // Within each 128-bit block: [a0+a2, a1+a3] pairs, then 64-bit halves, so
  // lane s of `s4` is key s's block sum; then the blocks are added by halving.
  const hn::Repartition<double, DF> dd;
  const auto t01 =
      hn::Add(hn::InterleaveLower(d, a0, a1), hn::InterleaveUpper(d, a0, a1));
  const auto t23 =
      hn::Add(hn::InterleaveLower(d, a2, a3), hn::InterleaveUpper(d, a2, a3));
  const auto s4 =
      hn::Add(hn::BitCast(d, hn::InterleaveLower(dd, hn::BitCast(dd, t01),
                                                 hn::BitCast(dd, t23))),
              hn::BitCast(d, hn::InterleaveUpper(dd, hn::BitCast(dd, t01),
                                                 hn::BitCast(dd, t23))));
  if constexpr (hn::MaxLanes(DF()) == 16) {
    const hn::Half<DF> d8;
    const hn::Half<decltype(d8)> d4;
    const auto s8 = hn::Add(hn::LowerHalf(d8, s4), hn::UpperHalf(d8, s4));
    hn::StoreU(hn::Add(hn::LowerHalf(d4, s8), hn::UpperHalf(d4, s8)), d4, out);
  } else if constexpr (hn::MaxLanes(DF()) == 8) {
    const hn::Half<DF> d4;
    hn::StoreU(hn::Add(hn::LowerHalf(d4, s4), hn::UpperHalf(d4, s4)), d4, out);
  } else {
    hn::StoreU(s4, d, out);
  }
#endif
}

// e^x for the softmax (x <= 0 here): Cody-Waite range reduction and a
// degree-6 polynomial, about 2 ulp; inputs below -87.3 give about 1e-38, not
// 0, which the normalization makes negligible.
HWY_INLINE hn::Vec<DF> SoftmaxExp(hn::Vec<DF> x) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  x = hn::Max(x, hn::Set(d, -87.3f));
  const auto n = hn::Round(hn::Mul(x, hn::Set(d, 1.44269504088896341f)));
  auto r = hn::NegMulAdd(n, hn::Set(d, 0.693359375f), x);
  r = hn::NegMulAdd(n, hn::Set(d, -2.12194440e-4f), r);
  auto p = hn::Set(d, 1.9875691500e-4f);
  p = hn::MulAdd(p, r, hn::Set(d, 1.3981999507e-3f));
  p = hn::MulAdd(p, r, hn::Set(d, 8.3334519073e-3f));
  p = hn::MulAdd(p, r, hn::Set(d, 4.1665795894e-2f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.6666665459e-1f));
  p = hn::MulAdd(p, r, hn::Set(d, 5.0000001201e-1f));
  p = hn::MulAdd(p, hn::Mul(r, r), hn::Add(r, hn::Set(d, 1.0f)));
  // 2^n by building the exponent bits (n is in [-126, 0] here).
  const auto two_n = hn::BitCast(
      d, hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127))));
  return hn::Mul(p, two_n);
}

// Query rows per weighted-sum tile.
#if HWY_HAVE_SCALABLE
constexpr int kPvRows = 1;  // scalable vectors cannot live in arrays
#else
constexpr int kPvRows = 6;
#endif

// The weighted sums of one tile of NR query rows for the lanes of chunk
// `c` (element offset): o[r] = sum over keys j < tile_len, in order, of
// srow[r][j] * values[j][c ..]; each value vector is loaded once per tile.
template <int NR, typename E>
HWY_INLINE void PvTile(const float* const* srow, const E* values,
                       const KvBlocks& kv, int64_t tile_len, int64_t hd,
                       int64_t c, float* const* out) {
  const DF d;
  hn::Vec<DF> o[NR];
  for (int r = 0; r < NR; ++r) o[r] = hn::Zero(d);
  for (int64_t b0 = 0; b0 < tile_len; b0 += kv.block_rows) {
    const E* block =
        values + kv.blocks[b0 / kv.block_rows] * kv.block_stride + c;
    const int64_t end =
        tile_len - b0 < kv.block_rows ? tile_len - b0 : kv.block_rows;
    for (int64_t jj = 0; jj < end; ++jj) {
      const auto v = LoadRow(block + jj * hd);
      const int64_t j = b0 + jj;
      for (int r = 0; r < NR; ++r)
        o[r] = hn::MulAdd(hn::Set(d, srow[r][j]), v, o[r]);
    }
  }
  for (int r = 0; r < NR; ++r) hn::StoreU(o[r], d, out[r] + c);
}

template <typename E>
void AttendKvHead(const float* q, int64_t q_row_stride, int64_t rows,
                  int64_t group, int64_t first_len, const E* keys,
                  const E* values, const KvBlocks& kv, int64_t hd, float scale,
                  float* scores, int64_t scores_stride, float* out,
                  int64_t out_row_stride) {
  const DF d;
  const int64_t lanes = hn::Lanes(d);
  const int64_t num_q = rows * group;
  const int64_t n_max = first_len + rows - 1;
  // Query row i is (token row i / group, head i % group); it sees keys [0,
  // len).
  auto q_at = [&](int64_t i) {
    return q + (i / group) * q_row_stride + (i % group) * hd;
  };
  auto len_of = [&](int64_t i) { return first_len + i / group; };

  // 1. Scores, 16 keys at a time (4 groups of 4 sharing a reduction tree):
  //    each block of keys, once loaded, is used by every query row that sees
  //    it, and a query's vectors stay in registers for the block. Past n_max
  //    the last key is re-read (its scores are never used).
  const E* last_key = keys + RowOffset(kv, n_max - 1, hd);
#if HWY_HAVE_SCALABLE
  for (int64_t j0 = 0; j0 < n_max; j0 += 4) {
    const E* first = keys + RowOffset(kv, j0, hd);
    const E* kr[4];
    for (int j = 0; j < 4; ++j)
      kr[j] = j0 + j < n_max ? first + j * hd : last_key;
    for (int64_t i = 0; i < num_q; ++i) {
      if (len_of(i) <= j0) continue;
      const float* qi = q_at(i);
      float dots[4];
      Dot4([&](int64_t c) { return hn::LoadU(d, qi + c); }, kr, hd, dots);
      float* s = scores + i * scores_stride + j0;
      for (int j = 0; j < 4; ++j) s[j] = dots[j] * scale;
    }
  }
#else
  constexpr int64_t kMaxChunks = 512 / static_cast<int64_t>(hn::MaxLanes(DF()));
  hn::Vec<DF> qv[kMaxChunks];
  const auto vscale = hn::Set(d, scale);
  for (int64_t j0 = 0; j0 < n_max; j0 += 16) {
    // Block rows are a multiple of 16: the 16 keys share one table entry.
    const E* first = keys + RowOffset(kv, j0, hd);
    const E* kr[16];
    for (int j = 0; j < 16; ++j)
      kr[j] = j0 + j < n_max ? first + j * hd : last_key;
    for (int64_t i = 0; i < num_q; ++i) {
      const int64_t len = len_of(i);
      if (len <= j0) continue;
      const float* qi = q_at(i);
      for (int64_t c = 0; c * lanes < hd; ++c)
        qv[c] = hn::LoadU(d, qi + c * lanes);
      alignas(64) float dots[16] = {};
      for (int g = 0; g < 4 && j0 + 4 * g < len; ++g) {
        Dot4([&](int64_t c) { return qv[c / lanes]; }, kr + 4 * g, hd,
             dots + 4 * g);
      }
      float* s = scores + i * scores_stride + j0;
      for (int64_t k = 0; k < 16; k += lanes) {
        hn::StoreU(hn::Mul(hn::LoadU(d, dots + k), vscale), d, s + k);
      }
    }
  }
#endif

  // 2. Softmax of each query row over its own keys [0, len); probabilities
  //    past len are set to 0 up to n_max, so step 3 needs no mask.
  for (int64_t i = 0; i < num_q; ++i) {
    float* s = scores + i * scores_stride;
    const int64_t n = len_of(i);
    // The maximum is exact in any order.
    const auto neg_inf = hn::Set(d, -HUGE_VALF);
    auto vmax = neg_inf;
    for (int64_t j = 0; j < n; j += lanes) {
      auto v = hn::LoadU(d, s + j);
      if (n - j < lanes) v = hn::IfThenElse(hn::FirstN(d, n - j), v, neg_inf);
      vmax = hn::Max(vmax, v);
    }
    vmax = hn::MaxOfLanes(d, vmax);
    auto vsum = hn::Zero(d);
    for (int64_t j = 0; j < n; j += lanes) {
      auto e = SoftmaxExp(hn::Sub(hn::LoadU(d, s + j), vmax));
      if (n - j < lanes) e = hn::IfThenElseZero(hn::FirstN(d, n - j), e);
      hn::StoreU(e, d, s + j);  // lanes past n become 0
      vsum = hn::Add(vsum, e);
    }
    const auto inv = hn::Set(d, 1.0f / hn::GetLane(hn::SumOfLanes(d, vsum)));
    for (int64_t j = 0; j < n; j += lanes) {
      hn::StoreU(hn::Mul(hn::LoadU(d, s + j), inv), d, s + j);
    }
    for (int64_t j = (n + lanes - 1) / lanes * lanes; j < n_max; ++j) s[j] = 0;
  }

  // 3. Weighted sums of values, keys in order, in registers: tiles of up to
  //    kPvRows query rows x one vector of dimensions; each value vector is
  //    loaded once per tile. A key a row does not see has p = 0 and adds
  //    exactly 0. Each row's chain is the same in any tile.
  for (int64_t i0 = 0; i0 < num_q; i0 += kPvRows) {
    const int64_t nr = num_q - i0 < kPvRows ? num_q - i0 : kPvRows;
    const float* srow[kPvRows];
    float* orow[kPvRows];
    int64_t tile_len = 0;
    for (int r = 0; r < kPvRows; ++r) {
      const int64_t i = i0 + (r < nr ? r : 0);
      srow[r] = scores + i * scores_stride;
      orow[r] = out + (i / group) * out_row_stride + (i % group) * hd;
      if (r < nr && len_of(i) > tile_len) tile_len = len_of(i);
    }
    for (int64_t c = 0; c < hd; c += lanes) {
#if HWY_HAVE_SCALABLE
      PvTile<1>(srow, values, kv, tile_len, hd, c, orow);
#else
      switch (nr) {
        case 1:
          PvTile<1>(srow, values, kv, tile_len, hd, c, orow);
          break;
        case 2:
          PvTile<2>(srow, values, kv, tile_len, hd, c, orow);
          break;
        case 3:
          PvTile<3>(srow, values, kv, tile_len, hd, c, orow);
          break;
        case 4:
          PvTile<4>(srow, values, kv, tile_len, hd, c, orow);
          break;
        case 5:
          PvTile<5>(srow, values, kv, tile_len, hd, c, orow);
          break;
        default:
          PvTile<kPvRows>(srow, values, kv, tile_len, hd, c, orow);
          break;
      }
#endif
    }
  }
}

void AttendKvHeadBf16Impl(const float* q, int64_t q_row_stride, int64_t rows,
                          int64_t group, int64_t first_len,
                          const uint16_t* keys, const uint16_t* values,
                          const KvBlocks& kv, int64_t hd, float scale,
                          float* scores, int64_t scores_stride, float* out,
                          int64_t out_row_stride) {
  AttendKvHead(q, q_row_stride, rows, group, first_len, keys, values, kv, hd,
               scale, scores, scores_stride, out, out_row_stride);
}

void AttendKvHeadF32Impl(const float* q, int64_t q_row_stride, int64_t rows,
                         int64_t group, int64_t first_len, const float* keys,
                         const float* values, const KvBlocks& kv, int64_t hd,
                         float scale, float* scores, int64_t scores_stride,
                         float* out, int64_t out_row_stride) {
  AttendKvHead(q, q_row_stride, rows, group, first_len, keys, values, kv, hd,
               scale, scores, scores_stride, out, out_row_stride);
}

}  // namespace HWY_NAMESPACE
}  // namespace knapserve::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace knapserve::kernels {

HWY_EXPORT(AttendKvHeadBf16Impl);
HWY_EXPORT(AttendKvHeadF32Impl);

void AttendKvHeadBf16(const float* q, int64_t q_row_stride, int64_t rows,
                      int64_t group, int64_t first_len, const uint16_t* keys,
                      const uint16_t* values, const KvBlocks& kv, int64_t hd,
                      float scale, float* scores, int64_t scores_stride,
                      float* out, int64_t out_row_stride) {
  simd::EnsureChosen().IgnoreError();
  HWY_DYNAMIC_DISPATCH(AttendKvHeadBf16Impl)
  (q, q_row_stride, rows, group, first_len, keys, values, kv, hd, scale, scores,
   scores_stride, out, out_row_stride);
}

void AttendKvHeadF32(const float* q, int64_t q_row_stride, int64_t rows,
                     int64_t group, int64_t first_len, const float* keys,
                     const float* values, const KvBlocks& kv, int64_t hd,
                     float scale, float* scores, int64_t scores_stride,
                     float* out, int64_t out_row_stride) {
  simd::EnsureChosen().IgnoreError();
  HWY_DYNAMIC_DISPATCH(AttendKvHeadF32Impl)
  (q, q_row_stride, rows, group, first_len, keys, values, kv, hd, scale, scores,
   scores_stride, out, out_row_stride);
}

}  // namespace knapserve::kernels
#endif  // HWY_ONCE

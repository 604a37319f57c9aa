// The decode-attention kernel of attention_kernels.h, one Highway source
// compiled for every SIMD target (hwy/foreach_target.h re-includes this file
// once per target; HWY_DYNAMIC_DISPATCH picks the chosen one at run time).
#include "common/model/attention_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

#if HWY_HAVE_SCALABLE
// Scalable vectors (SVE, RVV) cannot live in arrays: dot products of one
// query with 4 keys, each an FMA chain over the head dimension, its lanes
// summed by SumOfLanes. out[s] gets key s's dot product.
template <typename E>
HWY_INLINE void Dot4(const float* q, const E* const* keys, int64_t hd,
                     float* out) {
  const DF d;
  const int64_t lanes = hn::Lanes(d);
  const auto q0 = hn::LoadU(d, q);
  auto a0 = hn::Mul(q0, LoadRow(keys[0]));
  auto a1 = hn::Mul(q0, LoadRow(keys[1]));
  auto a2 = hn::Mul(q0, LoadRow(keys[2]));
  auto a3 = hn::Mul(q0, LoadRow(keys[3]));
  for (int64_t c = lanes; c < hd; c += lanes) {
    const auto qc = hn::LoadU(d, q + c);
    a0 = hn::MulAdd(qc, LoadRow(keys[0] + c), a0);
    a1 = hn::MulAdd(qc, LoadRow(keys[1] + c), a1);
    a2 = hn::MulAdd(qc, LoadRow(keys[2] + c), a2);
    a3 = hn::MulAdd(qc, LoadRow(keys[3] + c), a3);
  }
  out[0] = hn::GetLane(hn::SumOfLanes(d, a0));
  out[1] = hn::GetLane(hn::SumOfLanes(d, a1));
  out[2] = hn::GetLane(hn::SumOfLanes(d, a2));
  out[3] = hn::GetLane(hn::SumOfLanes(d, a3));
}
#endif

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

// Sums the lanes of each of the N = MaxLanes(DF) vectors acc[0..N) by a fixed
// tree: lane k of the result is acc[k]'s sum. Within each 128-bit block,
// lanes are added (0+2)+(1+3), then blocks ((0+1)+(2+3)) (or (0+1), or the
// one block); every key slot gets the same association. Not for scalable
// vectors (their width is unknown here); one lane needs no sum.
#if !HWY_HAVE_SCALABLE
template <int N>
HWY_INLINE hn::Vec<DF> SumEachOfLanes(const hn::Vec<DF>* acc) {
#if HWY_TARGET == HWY_SCALAR
  static_assert(N == 1, "the scalar target has one lane");
  return acc[0];
#else
  const DF d;
  const hn::Repartition<double, DF> dd;
  // Per block: pairs of keys, then quads (lane s of quad q = key 4q+s).
  hn::Vec<DF> quad[N / 4];
  for (int q = 0; q < N / 4; ++q) {
    const auto a0 = acc[4 * q], a1 = acc[4 * q + 1];
    const auto a2 = acc[4 * q + 2], a3 = acc[4 * q + 3];
    const auto t01 =
        hn::Add(hn::InterleaveLower(d, a0, a1), hn::InterleaveUpper(d, a0, a1));
    const auto t23 =
        hn::Add(hn::InterleaveLower(d, a2, a3), hn::InterleaveUpper(d, a2, a3));
    quad[q] =
        hn::Add(hn::BitCast(d, hn::InterleaveLower(dd, hn::BitCast(dd, t01),
                                                   hn::BitCast(dd, t23))),
                hn::BitCast(d, hn::InterleaveUpper(dd, hn::BitCast(dd, t01),
                                                   hn::BitCast(dd, t23))));
  }
  if constexpr (N == 4) {
    return quad[0];
  } else if constexpr (N == 8) {
    // Two blocks: block b of the result is quad b's two blocks added.
    return hn::Add(hn::ConcatLowerLower(d, quad[1], quad[0]),
                   hn::ConcatUpperUpper(d, quad[1], quad[0]));
  } else {
    static_assert(N == 16, "fp32 vectors of 1, 4, 8 or 16 lanes");
    // Four blocks: pairs of blocks within each quad, then the halves.
    const auto p01 =
        hn::Add(hn::OddEvenBlocks(hn::SwapAdjacentBlocks(quad[1]), quad[0]),
                hn::OddEvenBlocks(quad[1], hn::SwapAdjacentBlocks(quad[0])));
    const auto p23 =
        hn::Add(hn::OddEvenBlocks(hn::SwapAdjacentBlocks(quad[3]), quad[2]),
                hn::OddEvenBlocks(quad[3], hn::SwapAdjacentBlocks(quad[2])));
    return hn::Add(hn::ConcatLowerLower(d, p23, p01),
                   hn::ConcatUpperUpper(d, p23, p01));
  }
#endif
}

// Scores of one query row against 16 keys: out[k] = scale * (q . key(k)),
// each dot product an FMA chain over the head dimension in vectors of the
// target's width, then SumEachOfLanes. All 16 keys are in flight at once, so
// the FMA chains hide each other's latency. KeyAt(k) gives key k's row. C is
// hd / lanes when known at compile time (the loop then unrolls fully), or 0.
template <int C, typename KeyAt>
HWY_INLINE void Scores16(const float* q, const KeyAt& key, int64_t hd,
                         hn::Vec<DF> vscale, float* out) {
  const DF d;
  constexpr int N = static_cast<int>(hn::MaxLanes(DF()));
  const int64_t lanes = hn::Lanes(d);
  const int64_t chunks = C > 0 ? C : hd / lanes;
  hn::Vec<DF> acc[16];
  const auto q0 = hn::LoadU(d, q);
  for (int k = 0; k < 16; ++k) acc[k] = hn::Mul(q0, LoadRow(key(k)));
  for (int64_t c = 1; c < chunks; ++c) {
    const auto qc = hn::LoadU(d, q + c * lanes);
    for (int k = 0; k < 16; ++k)
      acc[k] = hn::MulAdd(qc, LoadRow(key(k) + c * lanes), acc[k]);
  }
  for (int g = 0; g < 16; g += N) {
    hn::StoreU(hn::Mul(SumEachOfLanes<N>(acc + g), vscale), d, out + g);
  }
}

// Scores16 for every query row that sees key j0, the group's first.
// token_len(t): the keys token row t sees, non-decreasing in t.
template <int C, typename KeyAt, typename TokenLen>
HWY_INLINE void ScoreGroup(const float* q, int64_t q_row_stride, int64_t rows,
                           int64_t group, const TokenLen& token_len, int64_t j0,
                           const KeyAt& key, int64_t hd, hn::Vec<DF> vscale,
                           float* scores, int64_t scores_stride) {
  // Token rows in order; the first that sees key j0, then every later one.
  int64_t first_row = 0;
  while (first_row < rows && token_len(first_row) <= j0) ++first_row;
  for (int64_t t = first_row; t < rows; ++t) {
    const float* qt = q + t * q_row_stride;
    float* st = scores + t * group * scores_stride + j0;
    for (int64_t g = 0; g < group; ++g) {
      Scores16<C>(qt + g * hd, key, hd, vscale, st + g * scores_stride);
    }
  }
}

// Head sizes up to which ScoreAllKeys widens bf16 key groups on the stack
// (8 KiB).
constexpr int64_t kMaxWidenedHeadDim = 128;

// Step 1 of AttendKvHead: the scores of every query row against every key
// it sees, 16 keys at a time; each group of keys, once loaded, is used by
// every query row that sees it. Past n_max the last key is re-read (its
// scores are never used). n_max = token_len(rows - 1) > 0.
template <int C, typename E, typename TokenLen>
void ScoreAllKeys(const float* q, int64_t q_row_stride, int64_t rows,
                  int64_t group, const TokenLen& token_len, int64_t n_max,
                  const E* keys, const KvBlocks& kv, int64_t hd, float scale,
                  float* scores, int64_t scores_stride) {
  const E* last_key = keys + RowOffset(kv, n_max - 1, hd);
  const auto vscale = hn::Set(DF(), scale);
  const int64_t lanes = hn::Lanes(DF());
  // bf16 keys of up to kMaxWidenedHeadDim elements, read by two or more
  // query rows, are widened once per group (below).
  const bool widen = std::is_same_v<E, uint16_t> && hd <= kMaxWidenedHeadDim &&
                     rows * group >= 2;
  for (int64_t j0 = 0; j0 < n_max; j0 += 16) {
    // Block rows are a multiple of 16: the 16 keys lie in one block, in
    // order.
    const E* first = keys + RowOffset(kv, j0, hd);
    if constexpr (std::is_same_v<E, uint16_t>) {
      // bf16: widen the group to fp32 once for all its query rows (exact,
      // so the scores are the same bits as widening per row), instead of
      // once per query row.
      if (widen) {
        HWY_ALIGN float wide[16 * kMaxWidenedHeadDim];
        for (int j = 0; j < 16; ++j) {
          const E* src = j0 + j < n_max ? first + j * hd : last_key;
          for (int64_t c = 0; c < hd; c += lanes)
            hn::Store(LoadRow(src + c), DF(), wide + j * hd + c);
        }
        ScoreGroup<C>(
            q, q_row_stride, rows, group, token_len, j0,
            [&](int k) { return wide + k * hd; }, hd, vscale, scores,
            scores_stride);
        continue;
      }
    }
    if (j0 + 16 <= n_max) {
      ScoreGroup<C>(
          q, q_row_stride, rows, group, token_len, j0,
          [&](int k) { return first + k * hd; }, hd, vscale, scores,
          scores_stride);
    } else {
      const E* kr[16];
      for (int j = 0; j < 16; ++j)
        kr[j] = j0 + j < n_max ? first + j * hd : last_key;
      ScoreGroup<C>(
          q, q_row_stride, rows, group, token_len, j0,
          [&](int k) { return kr[k]; }, hd, vscale, scores, scores_stride);
    }
  }
}
#endif

// Query rows per weighted-sum tile, and vectors of the head dimension per
// pass over the keys: a tile keeps kPvRows x kPvChunks sums in registers.
#if HWY_HAVE_SCALABLE
constexpr int kPvRows = 1;  // scalable vectors cannot live in arrays
constexpr int kPvChunks = 1;
#else
constexpr int kPvRows = 6;
constexpr int kPvChunks = 4;
#endif

// The weighted sums of one tile of NR query rows for NC vectors of
// dimensions from element offset c: o[r] = sum over keys j < tile_len, in
// order, of srow[r][j] * values[j][c ..]; each value vector is loaded once
// per tile. The NR x NC chains are independent, so their latencies overlap.
template <int NR, int NC, typename E>
HWY_INLINE void PvTile(const float* const* srow, const E* values,
                       const KvBlocks& kv, int64_t tile_len, int64_t hd,
                       int64_t c, float* const* out) {
  const DF d;
#if HWY_HAVE_SCALABLE
  static_assert(NR == 1 && NC == 1, "scalable vectors cannot live in arrays");
  auto o = hn::Zero(d);
#else
  const int64_t lanes = hn::Lanes(d);
  hn::Vec<DF> o[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NC; ++u) o[r][u] = hn::Zero(d);
#endif
  for (int64_t b0 = 0; b0 < tile_len; b0 += kv.block_rows) {
    const E* block =
        values + kv.blocks[b0 / kv.block_rows] * kv.block_stride + c;
    const int64_t end =
        tile_len - b0 < kv.block_rows ? tile_len - b0 : kv.block_rows;
    for (int64_t jj = 0; jj < end; ++jj) {
      const E* vrow = block + jj * hd;
      const int64_t j = b0 + jj;
#if HWY_HAVE_SCALABLE
      o = hn::MulAdd(hn::Set(d, srow[0][j]), LoadRow(vrow), o);
#else
      hn::Vec<DF> p[NR];
      for (int r = 0; r < NR; ++r) p[r] = hn::Set(d, srow[r][j]);
      for (int u = 0; u < NC; ++u) {
        const auto v = LoadRow(vrow + u * lanes);
        for (int r = 0; r < NR; ++r) o[r][u] = hn::MulAdd(p[r], v, o[r][u]);
      }
#endif
    }
  }
#if HWY_HAVE_SCALABLE
  hn::StoreU(o, d, out[0] + c);
#else
  for (int r = 0; r < NR; ++r)
    for (int u = 0; u < NC; ++u) hn::StoreU(o[r][u], d, out[r] + c + u * lanes);
#endif
}

// PvTile over the whole head dimension: kPvChunks vectors at a time, then
// the 1-3 vectors left.
template <int NR, typename E>
HWY_INLINE void PvTileAllChunks(const float* const* srow, const E* values,
                                const KvBlocks& kv, int64_t tile_len,
                                int64_t hd, float* const* out) {
  const int64_t lanes = hn::Lanes(DF());
  int64_t c = 0;
  for (; c + kPvChunks * lanes <= hd; c += kPvChunks * lanes) {
    PvTile<NR, kPvChunks>(srow, values, kv, tile_len, hd, c, out);
  }
#if !HWY_HAVE_SCALABLE
  static_assert(kPvChunks == 4, "the cases below cover 1..3 chunks left");
  switch ((hd - c) / lanes) {
    case 1:
      PvTile<NR, 1>(srow, values, kv, tile_len, hd, c, out);
      break;
    case 2:
      PvTile<NR, 2>(srow, values, kv, tile_len, hd, c, out);
      break;
    case 3:
      PvTile<NR, 3>(srow, values, kv, tile_len, hd, c, out);
      break;
    default:
      break;
  }
#endif
}

// token_len(t): the keys [0, token_len(t)) token row t sees, non-decreasing
// in t. row_max / row_sum: null, or where each query row's softmax maximum
// and sum go.
template <typename E, typename TokenLen>
void AttendKvHead(const float* q, int64_t q_row_stride, int64_t rows,
                  int64_t group, const TokenLen& token_len, const E* keys,
                  const E* values, const KvBlocks& kv, int64_t hd, float scale,
                  float* scores, int64_t scores_stride, float* out,
                  int64_t out_row_stride, float* row_max, float* row_sum) {
  const DF d;
  const int64_t lanes = hn::Lanes(d);
  const int64_t num_q = rows * group;
  if (rows <= 0) return;
  const int64_t n_max = token_len(rows - 1);
  // Query row i is (token row i / group, head i % group); it sees keys [0,
  // len).
  auto len_of = [&](int64_t i) { return token_len(i / group); };

  // 1. Scores (ScoreAllKeys; 4 keys at a time for scalable vectors).
#if HWY_HAVE_SCALABLE
  const E* last_key = keys + RowOffset(kv, n_max > 0 ? n_max - 1 : 0, hd);
  for (int64_t j0 = 0; j0 < n_max; j0 += 4) {
    const E* first = keys + RowOffset(kv, j0, hd);
    const E* kr[4];
    for (int j = 0; j < 4; ++j)
      kr[j] = j0 + j < n_max ? first + j * hd : last_key;
    for (int64_t i = 0; i < num_q; ++i) {
      if (len_of(i) <= j0) continue;
      float dots[4];
      Dot4(q + (i / group) * q_row_stride + (i % group) * hd, kr, hd, dots);
      float* s = scores + i * scores_stride + j0;
      for (int j = 0; j < 4; ++j) s[j] = dots[j] * scale;
    }
  }
#else
  // Head dimensions of 1, 2, 4 or 8 vectors unroll fully.
  if (n_max > 0) {
    switch (hd / lanes) {
      case 1:
        ScoreAllKeys<1>(q, q_row_stride, rows, group, token_len, n_max, keys,
                        kv, hd, scale, scores, scores_stride);
        break;
      case 2:
        ScoreAllKeys<2>(q, q_row_stride, rows, group, token_len, n_max, keys,
                        kv, hd, scale, scores, scores_stride);
        break;
      case 4:
        ScoreAllKeys<4>(q, q_row_stride, rows, group, token_len, n_max, keys,
                        kv, hd, scale, scores, scores_stride);
        break;
      case 8:
        ScoreAllKeys<8>(q, q_row_stride, rows, group, token_len, n_max, keys,
                        kv, hd, scale, scores, scores_stride);
        break;
      default:
        ScoreAllKeys<0>(q, q_row_stride, rows, group, token_len, n_max, keys,
                        kv, hd, scale, scores, scores_stride);
        break;
    }
  }
#endif

  // 2. Softmax of each query row over its own keys [0, len); probabilities
  //    past len are set to 0 up to n_max, so step 3 needs no mask.
  for (int64_t i = 0; i < num_q; ++i) {
    float* s = scores + i * scores_stride;
    const int64_t n = len_of(i);
    if (n == 0) {  // sees no key: probabilities 0, so its output is 0
      for (int64_t j = 0; j < n_max; ++j) s[j] = 0;
      if (row_max != nullptr) row_max[i] = -HUGE_VALF;
      if (row_sum != nullptr) row_sum[i] = 0;
      continue;
    }
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
    const float sum = hn::GetLane(hn::SumOfLanes(d, vsum));
    if (row_max != nullptr) row_max[i] = hn::GetLane(vmax);
    if (row_sum != nullptr) row_sum[i] = sum;
    const auto inv = hn::Set(d, 1.0f / sum);
    for (int64_t j = 0; j < n; j += lanes) {
      hn::StoreU(hn::Mul(hn::LoadU(d, s + j), inv), d, s + j);
    }
    for (int64_t j = (n + lanes - 1) / lanes * lanes; j < n_max; ++j) s[j] = 0;
  }

  // 3. Weighted sums of values, keys in order, in registers: tiles of up to
  //    kPvRows query rows x kPvChunks vectors of dimensions; each value
  //    vector is loaded once per tile. A key a row does not see has p = 0 and
  //    adds exactly 0. Each row's chain is the same in any tile.
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
#if HWY_HAVE_SCALABLE
    PvTileAllChunks<1>(srow, values, kv, tile_len, hd, orow);
#else
    switch (nr) {
      case 1:
        PvTileAllChunks<1>(srow, values, kv, tile_len, hd, orow);
        break;
      case 2:
        PvTileAllChunks<2>(srow, values, kv, tile_len, hd, orow);
        break;
      case 3:
        PvTileAllChunks<3>(srow, values, kv, tile_len, hd, orow);
        break;
      case 4:
        PvTileAllChunks<4>(srow, values, kv, tile_len, hd, orow);
        break;
      case 5:
        PvTileAllChunks<5>(srow, values, kv, tile_len, hd, orow);
        break;
      default:
        PvTileAllChunks<kPvRows>(srow, values, kv, tile_len, hd, orow);
        break;
    }
#endif
  }
}

void AttendKvHeadBf16Impl(const float* q, int64_t q_row_stride, int64_t rows,
                          int64_t group, int64_t first_len,
                          const uint16_t* keys, const uint16_t* values,
                          const KvBlocks& kv, int64_t hd, float scale,
                          float* scores, int64_t scores_stride, float* out,
                          int64_t out_row_stride) {
  AttendKvHead(
      q, q_row_stride, rows, group,
      [first_len](int64_t t) { return first_len + t; }, keys, values, kv, hd,
      scale, scores, scores_stride, out, out_row_stride, nullptr, nullptr);
}

void AttendKvHeadF32Impl(const float* q, int64_t q_row_stride, int64_t rows,
                         int64_t group, int64_t first_len, const float* keys,
                         const float* values, const KvBlocks& kv, int64_t hd,
                         float scale, float* scores, int64_t scores_stride,
                         float* out, int64_t out_row_stride) {
  AttendKvHead(
      q, q_row_stride, rows, group,
      [first_len](int64_t t) { return first_len + t; }, keys, values, kv, hd,
      scale, scores, scores_stride, out, out_row_stride, nullptr, nullptr);
}

void AttendPrefixBf16Impl(const float* q, int64_t q_row_stride, int64_t rows,
                          int64_t group, const int64_t* lens,
                          const uint16_t* keys, const uint16_t* values,
                          const KvBlocks& kv, int64_t hd, float scale,
                          float* scores, int64_t scores_stride, float* out,
                          int64_t out_row_stride, float* row_max,
                          float* row_sum) {
  AttendKvHead(
      q, q_row_stride, rows, group, [lens](int64_t t) { return lens[t]; }, keys,
      values, kv, hd, scale, scores, scores_stride, out, out_row_stride,
      row_max, row_sum);
}

void AttendPrefixF32Impl(const float* q, int64_t q_row_stride, int64_t rows,
                         int64_t group, const int64_t* lens, const float* keys,
                         const float* values, const KvBlocks& kv, int64_t hd,
                         float scale, float* scores, int64_t scores_stride,
                         float* out, int64_t out_row_stride, float* row_max,
                         float* row_sum) {
  AttendKvHead(
      q, q_row_stride, rows, group, [lens](int64_t t) { return lens[t]; }, keys,
      values, kv, hd, scale, scores, scores_stride, out, out_row_stride,
      row_max, row_sum);
}

}  // namespace HWY_NAMESPACE
}  // namespace knapserve::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace knapserve::kernels {

HWY_EXPORT(AttendKvHeadBf16Impl);
HWY_EXPORT(AttendKvHeadF32Impl);
HWY_EXPORT(AttendPrefixBf16Impl);
HWY_EXPORT(AttendPrefixF32Impl);

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

void AttendPrefixBf16(const float* q, int64_t q_row_stride, int64_t rows,
                      int64_t group, const int64_t* lens, const uint16_t* keys,
                      const uint16_t* values, const KvBlocks& kv, int64_t hd,
                      float scale, float* scores, int64_t scores_stride,
                      float* out, int64_t out_row_stride, float* row_max,
                      float* row_sum) {
  simd::EnsureChosen().IgnoreError();
  HWY_DYNAMIC_DISPATCH(AttendPrefixBf16Impl)
  (q, q_row_stride, rows, group, lens, keys, values, kv, hd, scale, scores,
   scores_stride, out, out_row_stride, row_max, row_sum);
}

void AttendPrefixF32(const float* q, int64_t q_row_stride, int64_t rows,
                     int64_t group, const int64_t* lens, const float* keys,
                     const float* values, const KvBlocks& kv, int64_t hd,
                     float scale, float* scores, int64_t scores_stride,
                     float* out, int64_t out_row_stride, float* row_max,
                     float* row_sum) {
  simd::EnsureChosen().IgnoreError();
  HWY_DYNAMIC_DISPATCH(AttendPrefixF32Impl)
  (q, q_row_stride, rows, group, lens, keys, values, kv, hd, scale, scores,
   scores_stride, out, out_row_stride, row_max, row_sum);
}

}  // namespace knapserve::kernels
#endif  // HWY_ONCE

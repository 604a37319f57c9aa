// AVX-512 kernel behind common/model/attention_kernels.h. Compiled alone with
// AVX-512 flags (common/CMakeLists.txt); no torch or STL header, so no
// AVX-512 code can leak into inline functions other files share.
#include <immintrin.h>

#include "common/model/attention_kernels.h"

namespace knapserve::kernels {
namespace {

inline __m512 LoadRow(const uint16_t* p) {
  // bf16 -> fp32 is a 16-bit shift into the high half.
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
      16));
}
inline __m512 LoadRow(const float* p) { return _mm512_loadu_ps(p); }

// e^x for the softmax (x <= 0 here): Cody-Waite range reduction and a
// degree-6 polynomial, about 2 ulp; exp(-inf) = 0.
inline __m512 Exp(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(
      _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Sums of the 16 lanes of each of a[0..15], returned as lane j = sum of a[j]
// (a transpose-and-add tree: about 45 shuffles and adds for 16 sums instead
// of a horizontal reduction each). Lane j depends on a[j] alone, in a fixed
// order.
inline __m512 SumLanes16(const __m512* a) {
  __m512 t[4];
  for (int g = 0; g < 4; ++g) {
    const __m512* x = a + 4 * g;
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]),
                                     _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]),
                                     _mm512_unpackhi_ps(x[2], x[3]));
    // Per 128-bit chunk c: [x0_c, x1_c, x2_c, x3_c], the chunk's 4 lanes
    // summed.
    t[g] = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Sum the four chunks of each t[g]; chunk g of the result holds keys
  // 4g..4g+3.
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88),
                                   _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x88),
                                   _mm512_shuffle_f32x4(t[2], t[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88),
                       _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

constexpr int kMaxHeadChunks = 32;  // head_dim <= 512
constexpr int kPvRows = 6;          // query rows per weighted-sum tile

// The weighted sums of one tile of NR query rows for the 16 dimensions of
// chunk c: o[r] = sum over keys j < tile_len, in order, of srow[r][j] *
// values[j][c*16 .. c*16+15]; each value vector is loaded once for the tile.
template <int NR, typename E>
inline void PvTile(const float* const* srow, const E* values,
                   const KvBlocks& kv, int64_t tile_len, int64_t hd, int64_t c,
                   __m512* o) {
  for (int r = 0; r < NR; ++r) o[r] = _mm512_setzero_ps();
  // Keys in order, one block of the table at a time.
  for (int64_t b0 = 0; b0 < tile_len; b0 += kv.block_rows) {
    const E* block =
        values + kv.blocks[b0 / kv.block_rows] * kv.block_stride + c * 16;
    const int64_t end =
        tile_len - b0 < kv.block_rows ? tile_len - b0 : kv.block_rows;
    for (int64_t jj = 0; jj < end; ++jj) {
      const __m512 v = LoadRow(block + jj * hd);
      const int64_t j = b0 + jj;
      for (int r = 0; r < NR; ++r)
        o[r] = _mm512_fmadd_ps(_mm512_set1_ps(srow[r][j]), v, o[r]);
    }
  }
}

// CH = head_dim / 16 when known at compile time (the common head sizes), or
// 0 to read it at run time. The arithmetic is the same either way.
template <int CH, typename E>
void AttendKvHead(const float* q, int64_t q_row_stride, int64_t rows,
                  int64_t group, int64_t first_len, const E* keys,
                  const E* values, const KvBlocks& kv, int64_t hd, float scale,
                  float* scores, int64_t scores_stride, float* out,
                  int64_t out_row_stride) {
  const int64_t chunks = CH > 0 ? CH : hd / 16;
  const int64_t num_q = rows * group;
  const int64_t n_max = first_len + rows - 1;
  // Query row i is (token row i / group, head i % group); it sees keys [0,
  // len).
  auto q_at = [&](int64_t i) {
    return q + (i / group) * q_row_stride + (i % group) * hd;
  };
  auto len_of = [&](int64_t i) { return first_len + i / group; };

  // 1. Scores, 16 keys at a time: each block of keys is loaded from memory
  //    once and used by every query row that sees it. In the last block,
  //    lanes past n_max re-read key n_max - 1 (their scores are never used).
  __m512 acc[16];
  __m512 qv[CH > 0 ? CH : kMaxHeadChunks];
  const E* last_key = keys + RowOffset(kv, n_max - 1, hd);
  for (int64_t j0 = 0; j0 < n_max; j0 += 16) {
    // The 16 keys of this block share one block of the table (block_rows
    // is a multiple of 16): one table lookup, no division per key.
    const E* kr[16];
    const E* first = keys + RowOffset(kv, j0, hd);
    for (int j = 0; j < 16; ++j)
      kr[j] = j0 + j < n_max ? first + j * hd : last_key;
    for (int64_t i = 0; i < num_q; ++i) {
      if (len_of(i) <= j0) continue;
      const float* qi = q_at(i);
      for (int64_t c = 0; c < chunks; ++c) qv[c] = _mm512_loadu_ps(qi + c * 16);
      for (int j = 0; j < 16; ++j) {
        __m512 a = _mm512_mul_ps(qv[0], LoadRow(kr[j]));
        for (int64_t c = 1; c < chunks; ++c)
          a = _mm512_fmadd_ps(qv[c], LoadRow(kr[j] + c * 16), a);
        acc[j] = a;
      }
      _mm512_storeu_ps(scores + i * scores_stride + j0,
                       _mm512_mul_ps(SumLanes16(acc), _mm512_set1_ps(scale)));
    }
  }

  // 2. Softmax of each query row over its own keys [0, len); probabilities
  //    past len are set to 0 up to n_max, so step 3 needs no mask.
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  for (int64_t i = 0; i < num_q; ++i) {
    float* s = scores + i * scores_stride;
    const int64_t n = len_of(i);
    const int64_t full = n / 16;
    const int64_t rem = n % 16;
    const __mmask16 tail = rem ? static_cast<__mmask16>((1u << rem) - 1) : 0;
    __m512 vmax = neg_inf;
    for (int64_t b = 0; b < full; ++b)
      vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + b * 16));
    if (rem)
      vmax = _mm512_max_ps(vmax,
                           _mm512_mask_loadu_ps(neg_inf, tail, s + full * 16));
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t b = 0; b < full; ++b) {
      const __m512 e = Exp(_mm512_sub_ps(_mm512_loadu_ps(s + b * 16), max));
      _mm512_storeu_ps(s + b * 16, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    if (rem) {
      const __m512 e = _mm512_maskz_mov_ps(
          tail,
          Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full * 16), max)));
      _mm512_storeu_ps(s + full * 16, e);  // lanes past n become 0
      vsum = _mm512_add_ps(vsum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
    for (int64_t b = 0; b * 16 < n; ++b) {
      _mm512_storeu_ps(s + b * 16,
                       _mm512_mul_ps(_mm512_loadu_ps(s + b * 16), inv));
    }
    for (int64_t j = (n + 15) / 16 * 16; j < n_max; ++j) s[j] = 0.0f;
  }

  // 3. Weighted sums of values, keys in order, in registers: tiles of 6 query
  //    rows x 1 chunk of 16 dimensions; each value vector is loaded once per
  //    tile. A key a row does not see has p = 0 and adds exactly 0. A tile
  //    of fewer rows computes only those (each row's chain is the same in
  //    any tile).
  for (int64_t i0 = 0; i0 < num_q; i0 += kPvRows) {
    const int64_t nr = num_q - i0 < kPvRows ? num_q - i0 : kPvRows;
    const float* srow[kPvRows];
    int64_t tile_len = 0;
    for (int r = 0; r < kPvRows; ++r) {
      srow[r] = scores + (i0 + (r < nr ? r : 0)) * scores_stride;
      if (r < nr && len_of(i0 + r) > tile_len) tile_len = len_of(i0 + r);
    }
    for (int64_t c = 0; c < chunks; ++c) {
      __m512 o[kPvRows];
      switch (nr) {
        case 1:
          PvTile<1>(srow, values, kv, tile_len, hd, c, o);
          break;
        case 2:
          PvTile<2>(srow, values, kv, tile_len, hd, c, o);
          break;
        case 3:
          PvTile<3>(srow, values, kv, tile_len, hd, c, o);
          break;
        case 4:
          PvTile<4>(srow, values, kv, tile_len, hd, c, o);
          break;
        case 5:
          PvTile<5>(srow, values, kv, tile_len, hd, c, o);
          break;
        default:
          PvTile<kPvRows>(srow, values, kv, tile_len, hd, c, o);
          break;
      }
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t i = i0 + r;
        _mm512_storeu_ps(
            out + (i / group) * out_row_stride + (i % group) * hd + c * 16,
            o[r]);
      }
    }
  }
}

template <typename E>
void AttendKvHeadAnyDim(const float* q, int64_t q_row_stride, int64_t rows,
                        int64_t group, int64_t first_len, const E* keys,
                        const E* values, const KvBlocks& kv, int64_t hd,
                        float scale, float* scores, int64_t scores_stride,
                        float* out, int64_t out_row_stride) {
  switch (hd / 16) {
    case 2:
      return AttendKvHead<2>(q, q_row_stride, rows, group, first_len, keys,
                             values, kv, hd, scale, scores, scores_stride, out,
                             out_row_stride);
    case 4:
      return AttendKvHead<4>(q, q_row_stride, rows, group, first_len, keys,
                             values, kv, hd, scale, scores, scores_stride, out,
                             out_row_stride);
    case 8:
      return AttendKvHead<8>(q, q_row_stride, rows, group, first_len, keys,
                             values, kv, hd, scale, scores, scores_stride, out,
                             out_row_stride);
    default:
      return AttendKvHead<0>(q, q_row_stride, rows, group, first_len, keys,
                             values, kv, hd, scale, scores, scores_stride, out,
                             out_row_stride);
  }
}

}  // namespace

void AttendKvHeadBf16(const float* q, int64_t q_row_stride, int64_t rows,
                      int64_t group, int64_t first_len, const uint16_t* keys,
                      const uint16_t* values, const KvBlocks& kv, int64_t hd,
                      float scale, float* scores, int64_t scores_stride,
                      float* out, int64_t out_row_stride) {
  AttendKvHeadAnyDim(q, q_row_stride, rows, group, first_len, keys, values, kv,
                     hd, scale, scores, scores_stride, out, out_row_stride);
}

void AttendKvHeadF32(const float* q, int64_t q_row_stride, int64_t rows,
                     int64_t group, int64_t first_len, const float* keys,
                     const float* values, const KvBlocks& kv, int64_t hd,
                     float scale, float* scores, int64_t scores_stride,
                     float* out, int64_t out_row_stride) {
  AttendKvHeadAnyDim(q, q_row_stride, rows, group, first_len, keys, values, kv,
                     hd, scale, scores, scores_stride, out, out_row_stride);
}

}  // namespace knapserve::kernels

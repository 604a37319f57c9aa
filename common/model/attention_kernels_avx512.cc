// AVX-512 kernel behind common/model/attention_kernels.h. Compiled alone with
// AVX-512 flags (common/CMakeLists.txt); no torch or STL header, so no
// AVX-512 code can leak into inline functions other files share.
#include <immintrin.h>

#include "common/model/attention_kernels.h"

namespace knapserve::kernels {
namespace {

inline __m512 LoadRow(const uint16_t* p) {
  // bf16 -> fp32 is a 16-bit shift into the high half.
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                            reinterpret_cast<const __m256i*>(p))),
                        16));
}
inline __m512 LoadRow(const float* p) { return _mm512_loadu_ps(p); }

// e^x for the softmax (x <= 0 here): Cody-Waite range reduction and a
// degree-6 polynomial, about 2 ulp; exp(-inf) = 0.
inline __m512 Exp(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
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

template <typename E>
void AttendGroup(const float* q, const E* keys, const E* values, int64_t n, int64_t hd,
                 int64_t group, float scale, float* scores, float* out) {
  const int64_t chunks = hd / 16;
  const int64_t padded = (n + 15) / 16 * 16;
  // Scores: one FMA chain per (query head, key) over the head dimension.
  for (int64_t j = 0; j < n; ++j) {
    const E* kr = keys + j * hd;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * hd;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c * 16), LoadRow(kr + c * 16), acc);
      }
      scores[g * padded + j] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  // Softmax per query head: lanes hold keys j = 16b + lane.
  const int64_t full = n / 16;
  const int64_t rem = n % 16;
  const __mmask16 tail = rem ? static_cast<__mmask16>((1u << rem) - 1) : 0;
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * padded;
    __m512 vmax = neg_inf;
    for (int64_t b = 0; b < full; ++b) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + b * 16));
    if (rem) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(neg_inf, tail, s + full * 16));
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t b = 0; b < full; ++b) {
      const __m512 e = Exp(_mm512_sub_ps(_mm512_loadu_ps(s + b * 16), max));
      _mm512_storeu_ps(s + b * 16, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    if (rem) {
      const __m512 e =
          _mm512_maskz_mov_ps(tail, Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full * 16),
                                                      max)));
      _mm512_mask_storeu_ps(s + full * 16, tail, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(vsum);
    for (int64_t b = 0; b < padded / 16; ++b) {
      _mm512_storeu_ps(s + b * 16, _mm512_mul_ps(_mm512_loadu_ps(s + b * 16), _mm512_set1_ps(inv)));
    }
  }
  // Weighted sum of values, keys in order.
  for (int64_t i = 0; i < group * hd; ++i) out[i] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const E* vr = values + j * hd;
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 v = LoadRow(vr + c * 16);
      for (int64_t g = 0; g < group; ++g) {
        float* o = out + g * hd + c * 16;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * padded + j]), v,
                                            _mm512_loadu_ps(o)));
      }
    }
  }
}

}  // namespace

void AttendGroupBf16(const float* q, const uint16_t* keys, const uint16_t* values, int64_t n,
                     int64_t hd, int64_t group, float scale, float* scores, float* out) {
  AttendGroup(q, keys, values, n, hd, group, scale, scores, out);
}

void AttendGroupF32(const float* q, const float* keys, const float* values, int64_t n, int64_t hd,
                    int64_t group, float scale, float* scores, float* out) {
  AttendGroup(q, keys, values, n, hd, group, scale, scores, out);
}

}  // namespace knapserve::kernels

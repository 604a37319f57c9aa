// AVX-512 kernels behind common/model/linear.h. This file alone is compiled
// with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 (see common/CMakeLists.txt)
// and includes no torch header, so no AVX-512 code leaks into code that runs
// on CPUs without it; linear.cc calls in only after checking the CPU.
#include <immintrin.h>

#include "common/model/linear_kernels.h"

namespace knapserve::kernels {

// y[m, n] for n in [n0, n1): dot(x[m, :], w[n, :]) with bf16 pairs
// multiplied exactly and summed in fp32, 32 elements per instruction. Each
// row keeps its own accumulator and chunk order, so the result does not
// depend on M or on how rows are split between threads.
void DotRowsBf16(const uint16_t* x, const uint16_t* w, float* y, int64_t m_rows, int64_t n_total,
                 int64_t k, int64_t n0, int64_t n1) {
  const int64_t chunks = k / 32;
  const int64_t rem = k % 32;
  const __mmask32 tail = rem ? static_cast<__mmask32>((uint64_t{1} << rem) - 1) : 0;
  // Eight rows at a time: eight independent accumulator chains keep the
  // dot-product unit busy while one contiguous stream of weights is read.
  constexpr int kRows = 8;
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) {
    const uint16_t* wb = w + n * k;
    for (int64_t m = 0; m < m_rows; ++m) {
      const uint16_t* xr = x + m * k;
      __m512 acc[kRows];
      for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + c * 32);
        for (int r = 0; r < kRows; ++r) {
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(wb + r * k + c * 32), xv);
        }
      }
      if (rem) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, xr + chunks * 32);
        for (int r = 0; r < kRows; ++r) {
          acc[r] = _mm512_dpbf16_ps(
              acc[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, wb + r * k + chunks * 32), xv);
        }
      }
      for (int r = 0; r < kRows; ++r) y[m * n_total + n + r] = _mm512_reduce_add_ps(acc[r]);
    }
  }
  for (; n < n1; ++n) {
    const uint16_t* wr = w + n * k;
    for (int64_t m = 0; m < m_rows; ++m) {
      const uint16_t* xr = x + m * k;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(wr + c * 32),
                               (__m512bh)_mm512_loadu_si512(xr + c * 32));
      }
      if (rem) {
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + chunks * 32),
                               (__m512bh)_mm512_maskz_loadu_epi16(tail, xr + chunks * 32));
      }
      y[m * n_total + n] = _mm512_reduce_add_ps(acc);
    }
  }
}

// The fp32 version: 16 elements per FMA, same structure and invariance.
void DotRowsF32(const float* x, const float* w, float* y,
                                                    int64_t m_rows, int64_t n_total, int64_t k,
                                                    int64_t n0, int64_t n1) {
  const int64_t chunks = k / 16;
  const int64_t rem = k % 16;
  const __mmask16 tail = rem ? static_cast<__mmask16>((1u << rem) - 1) : 0;
  auto dot = [&](__m512& acc, const float* wr, const float* xr, int64_t c) {
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(wr + c * 16), _mm512_loadu_ps(xr + c * 16), acc);
  };
  auto dot_tail = [&](__m512& acc, const float* wr, const float* xr) {
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, wr + chunks * 16),
                          _mm512_maskz_loadu_ps(tail, xr + chunks * 16), acc);
  };
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const float* w0 = w + n * k;
    const float* w1 = w0 + k;
    const float* w2 = w1 + k;
    const float* w3 = w2 + k;
    for (int64_t m = 0; m < m_rows; ++m) {
      const float* xr = x + m * k;
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        dot(a0, w0, xr, c);
        dot(a1, w1, xr, c);
        dot(a2, w2, xr, c);
        dot(a3, w3, xr, c);
      }
      if (rem) {
        dot_tail(a0, w0, xr);
        dot_tail(a1, w1, xr);
        dot_tail(a2, w2, xr);
        dot_tail(a3, w3, xr);
      }
      float* yr = y + m * n_total + n;
      yr[0] = _mm512_reduce_add_ps(a0);
      yr[1] = _mm512_reduce_add_ps(a1);
      yr[2] = _mm512_reduce_add_ps(a2);
      yr[3] = _mm512_reduce_add_ps(a3);
    }
  }
  for (; n < n1; ++n) {
    const float* w0 = w + n * k;
    for (int64_t m = 0; m < m_rows; ++m) {
      const float* xr = x + m * k;
      __m512 a0 = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) dot(a0, w0, xr, c);
      if (rem) dot_tail(a0, w0, xr);
      y[m * n_total + n] = _mm512_reduce_add_ps(a0);
    }
  }
}

}  // namespace knapserve::kernels

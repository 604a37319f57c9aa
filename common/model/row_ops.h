// Row-wise CPU operations of the few-row path (decode, draft and
// verification steps) of LlamaModel: RMSNorm, RoPE, SwiGLU and the residual
// add, each one plain loop over raw rows instead of a chain of LibTorch ops.
//
// Why: for a small model a decode step is dominated by per-op dispatch, not
// arithmetic (a 24-layer model of width 192 ran about 80 LibTorch ops per
// layer). Each function here computes every row the same way whatever the
// number of rows, so a token's result is bit-identical alone or inside a
// verification pass (the batch invariance speculative decoding relies on).
//
// E is float or c10::BFloat16; arithmetic is float32, and a value is rounded
// to E wherever the model's activations are stored in E.
//
// RmsNorm, SiluMul, AddResidual and Round run the SIMD kernels of
// row_kernels.h on the chosen target (common/model/simd_target.h); Rope and
// ToFloat are plain loops.
//
// Thread safety: pure functions over caller-owned buffers; any thread.
#ifndef KNAPSERVE_COMMON_MODEL_ROW_OPS_H_
#define KNAPSERVE_COMMON_MODEL_ROW_OPS_H_

#include <cstdint>

namespace knapserve::row_ops {

// out[r] = w * E(x[r] / sqrt(mean(x[r]^2) + eps)) for `rows` rows of width d
// (row stride d), as Hugging Face's LlamaRMSNorm (normalize in float32,
// round to E, then scale). out may equal x.
template <typename E>
void RmsNorm(const E* x, const E* w, int64_t rows, int64_t d, float eps,
             E* out);

// Rotary embedding in place, rotate-half layout: for each of `rows` rows
// (row r at position pos0 + r, row stride `row_stride` elements) and each of
// `heads` heads of width hd starting at `x`, x <- x * cos + rotate_half(x) *
// sin with cos/sin the [max_positions, hd] tables (rows indexed by position).
template <typename E>
void Rope(E* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t hd,
          int64_t pos0, const E* cos, const E* sin);

// SwiGLU on a fused gate/up projection: gu is float32 [rows, 2 * inter]
// (gate columns, then up columns); out[r, i] = E(silu(E(gate)) * E(up)).
template <typename E>
void SiluMul(const float* gu, int64_t rows, int64_t inter, E* out);

// out[i] = E(h[i] + E(y[i])) for `count` elements: a residual add of a
// float32 projection output rounded to E first, as LibTorch would with an
// E-typed projection. out may equal h.
template <typename E>
void AddResidual(const E* h, const float* y, int64_t count, E* out);

// out[i] = E(y[i]).
template <typename E>
void Round(const float* y, int64_t count, E* out);

// out[i] = float(x[i]).
template <typename E>
void ToFloat(const E* x, int64_t count, float* out);

}  // namespace knapserve::row_ops

#endif  // KNAPSERVE_COMMON_MODEL_ROW_OPS_H_

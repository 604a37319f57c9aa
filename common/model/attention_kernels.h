// The raw CPU kernel behind DecodeAttention (common/model/decode_attention.h)
// for AVX-512 machines: one KV head's query group attending to n cached
// positions. Defined in attention_kernels_avx512.cc, which is compiled for
// AVX-512 and includes no torch or STL header: call only when the CPU has
// AVX-512F and AVX-512BW.
//
// Every output depends only on (q, keys[0..n), values[0..n)) and a fixed
// instruction sequence: the score of key j is a 16-lane FMA chain over the
// head dimension; softmax sums run over 16 lanes by key index modulo 16 and
// are then reduced in a fixed order. So a row's result is the same whatever
// other rows are computed beside it (batch invariance).
#ifndef KNAPSERVE_COMMON_MODEL_ATTENTION_KERNELS_H_
#define KNAPSERVE_COMMON_MODEL_ATTENTION_KERNELS_H_

#include <cstdint>

namespace knapserve::kernels {

// q: [group, hd] fp32. keys, values: [n, hd] rows (bf16 as raw 16-bit
// patterns, or fp32). scores: scratch of group * (n rounded up to 16) floats.
// out: [group, hd] fp32. hd must be a multiple of 16.
void AttendGroupBf16(const float* q, const uint16_t* keys, const uint16_t* values, int64_t n,
                     int64_t hd, int64_t group, float scale, float* scores, float* out);
void AttendGroupF32(const float* q, const float* keys, const float* values, int64_t n, int64_t hd,
                    int64_t group, float scale, float* scores, float* out);

}  // namespace knapserve::kernels

#endif  // KNAPSERVE_COMMON_MODEL_ATTENTION_KERNELS_H_

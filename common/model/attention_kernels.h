// The raw CPU kernel behind DecodeAttention (common/model/decode_attention.h):
// all the query rows of one KV head (the new tokens of a decode or
// verification step x the query heads sharing that KV head) attending to the
// cache. Defined in attention_kernels.cc, one Highway source compiled for
// every SIMD target; the chosen target runs (common/model/simd_target.h).
//
// Multi-query: keys are taken 16 at a time (16 independent FMA chains, then
// one transposing reduction tree) and each group, once loaded, is used by
// every query row that sees it; the weighted sum of values keeps tiles of 6
// query rows x 4 vectors of dimensions in registers, so each value vector is
// loaded once per tile. A k-token verification therefore reads the cached
// K/V about once, not k times.
//
// Every output depends only on (q, keys[0..len), values[0..len)), the target
// and a fixed instruction sequence: the score of key j is an FMA chain over
// the head dimension in vectors of the target's width, whose lanes are summed
// by a fixed tree; softmax sums run over those lanes by key index, then a
// fixed reduction; the weighted sum is one FMA chain over keys in order per
// output element (a key a row does not see adds exactly zero). So within one
// target a row's result is the same whatever other rows are computed beside
// it (batch invariance).
#ifndef KNAPSERVE_COMMON_MODEL_ATTENTION_KERNELS_H_
#define KNAPSERVE_COMMON_MODEL_ATTENTION_KERNELS_H_

#include <cstdint>

namespace knapserve::kernels {

// Where the cached rows of one KV head live: paged K/V (blocks of positions
// anywhere in a pool) and a contiguous cache are the same to the kernels.
// Position j is at element offset
//   blocks[j / block_rows] * block_stride + (j % block_rows) * hd
// from the head's base pointer. block_rows is a multiple of 16, so each
// aligned group of 16 keys lies inside one block. A contiguous
// [capacity, hd] cache is the table {0} with block_rows = capacity rounded
// up to 16.
struct KvBlocks {
  const int32_t* blocks;  // the block table, one entry per block_rows positions
  int64_t block_rows;     // positions per block, a positive multiple of 16
  int64_t block_stride;   // elements from block id b to block id b + 1
};

inline int64_t RowOffset(const KvBlocks& kv, int64_t j, int64_t hd) {
  return kv.blocks[j / kv.block_rows] * kv.block_stride +
         (j % kv.block_rows) * hd;
}

// One KV head. Token row t (0 <= t < rows) has `group` query heads at
// q + t * q_row_stride + g * hd (fp32), and sees keys/values [0, first_len +
// t). keys, values: the head's base pointers; position j is at
// RowOffset(kv, j, hd) (bf16 as raw 16-bit patterns, or fp32). scores: scratch
// of rows * group rows of scores_stride floats, scores_stride >= (first_len +
// rows - 1) rounded up to 16. The output of (t, g) goes to out + t *
// out_row_stride + g * hd (fp32). hd must be a multiple of 16, at most 512.
void AttendKvHeadBf16(const float* q, int64_t q_row_stride, int64_t rows,
                      int64_t group, int64_t first_len, const uint16_t* keys,
                      const uint16_t* values, const KvBlocks& kv, int64_t hd,
                      float scale, float* scores, int64_t scores_stride,
                      float* out, int64_t out_row_stride);
void AttendKvHeadF32(const float* q, int64_t q_row_stride, int64_t rows,
                     int64_t group, int64_t first_len, const float* keys,
                     const float* values, const KvBlocks& kv, int64_t hd,
                     float scale, float* scores, int64_t scores_stride,
                     float* out, int64_t out_row_stride);

// The same kernel for rows that see given numbers of keys, returning the
// softmax's statistics so that a caller can merge this attention with
// attention over other keys (LlamaModel::BranchAttention: the planner's
// candidate branches over the prefix K/V they share, merged with each
// branch's attention over its own tokens). Token row t sees keys [0,
// lens[t]); lens[0..rows) is non-decreasing, each >= 0. For query row i = t *
// group + g, row_max[i] gets the largest score and row_sum[i] the sum of
// exp(score - row_max[i]) over those keys; the output is normalized by that
// sum as above. A row that sees no key gets output 0, row_max -inf and
// row_sum 0. scores_stride >= lens[rows - 1] rounded up to 16; the other
// arguments as above. Each row's result depends only on its own query, its
// keys and values and the target, as above.
void AttendPrefixBf16(const float* q, int64_t q_row_stride, int64_t rows,
                      int64_t group, const int64_t* lens, const uint16_t* keys,
                      const uint16_t* values, const KvBlocks& kv, int64_t hd,
                      float scale, float* scores, int64_t scores_stride,
                      float* out, int64_t out_row_stride, float* row_max,
                      float* row_sum);
void AttendPrefixF32(const float* q, int64_t q_row_stride, int64_t rows,
                     int64_t group, const int64_t* lens, const float* keys,
                     const float* values, const KvBlocks& kv, int64_t hd,
                     float scale, float* scores, int64_t scores_stride,
                     float* out, int64_t out_row_stride, float* row_max,
                     float* row_sum);

}  // namespace knapserve::kernels

#endif  // KNAPSERVE_COMMON_MODEL_ATTENTION_KERNELS_H_

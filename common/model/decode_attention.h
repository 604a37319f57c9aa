// DecodeAttention: causal grouped-query attention for the few new positions
// of a decode, draft or verification step, computed the same way for every
// row whatever the number of rows.
//
// Why it exists: self-speculative decoding is lossless only if the full model
// verifying [last token, draft tokens] in one pass produces exactly the logits
// that decoding those tokens one at a time would. LibTorch's bmm/softmax pick
// different blocking for 1 row than for 5, so greedy output could differ from
// autoregressive output on near-ties. Here each (query row, head) is one
// independent piece of work with a fixed reduction order (fp32 throughout:
// scores, max-subtracted softmax, weighted sum of values), so a token's
// attention output is bit-identical alone or inside a verification pass, and
// independent of how rows are split between threads.
//
// For fp32 and bf16 with head_dim a multiple of 16 the work runs in the SIMD
// kernel of common/model/attention_kernels.h on the chosen target (FMA
// chains, a vectorized exp); other head sizes and fp16 in portable code.
// Which one runs depends on the dtype, head_dim and target, never on T.
//
// Used by LlamaModel::Attention on CPU for T <= kMaxDecodeAttentionRows (longer
// chunks there use the LibTorch path), and by LlamaModel::ForwardBatch for
// every row of a batched step, prefill chunks included, over paged K/V (a
// KvView says where a sequence's positions are).
//
// Thread safety: a pure function of its inputs; it runs on torch's intra-op
// threads.
#ifndef KNAPSERVE_COMMON_MODEL_DECODE_ATTENTION_H_
#define KNAPSERVE_COMMON_MODEL_DECODE_ATTENTION_H_

#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "common/model/attention_kernels.h"

namespace knapserve {

// One layer's K/V of one sequence, wherever it is stored: a contiguous
// [num_kv_heads, capacity, head_dim] cache, or blocks of a paged pool
// ([num_blocks, num_kv_heads, block_rows, head_dim] per layer). Position j of
// KV head g starts at element
//   g * head_stride + RowOffset(blocks, j, head_dim)
// of k and v. A view borrows everything it points to.
struct KvView {
  void* k = nullptr;
  void* v = nullptr;
  torch::ScalarType dtype = torch::kFloat32;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t head_stride = 0;  // elements from KV head g to g + 1
  kernels::KvBlocks blocks{nullptr, 16, 0};
};

// The view of contiguous [num_kv_heads, capacity, head_dim] caches.
KvView ContiguousKvView(const torch::Tensor& keys, const torch::Tensor& values);

// Rows (new positions) up to which the batch-invariant path is used.
inline constexpr int64_t kMaxDecodeAttentionRows = 16;

// Whether DecodeAttention handles these inputs (CPU, T <= the bound, a
// supported dtype).
bool DecodeAttentionApplies(const torch::Tensor& q);

// q: [T, num_heads, head_dim] (RoPE applied) for positions start_pos ..
// start_pos+T-1. keys/values: [num_kv_heads, capacity, head_dim] caches that
// already hold positions [0, start_pos+T). Row t attends to positions
// [0, start_pos+t]. Returns [T, num_heads * head_dim] in q's dtype.
torch::Tensor DecodeAttention(const torch::Tensor& q, const torch::Tensor& keys,
                              const torch::Tensor& values, int64_t start_pos,
                              double scale);

// The same over raw buffers, for callers that hold float32 queries already:
// q is [t, num_heads, head_dim] float32 (contiguous), keys/values as above
// (contiguous, same dtype), out receives [t, num_heads * head_dim] float32.
void DecodeAttentionFloat(const float* q, int64_t t, int64_t num_heads,
                          const torch::Tensor& keys,
                          const torch::Tensor& values, int64_t start_pos,
                          float scale, float* out);
// The same over any KvView that holds positions [0, start_pos + t). Any t:
// rows are processed in tiles, and each row's result is the same in any tile.
void DecodeAttentionFloat(const float* q, int64_t t, int64_t num_heads,
                          const KvView& kv, int64_t start_pos, float scale,
                          float* out);

// One sequence's part of a batched attention call: `rows` query rows (fp32,
// [rows, num_heads, head_dim]) at positions start_pos.., attending to `kv`,
// output [rows, num_heads * head_dim] fp32.
struct AttentionJob {
  const float* q = nullptr;
  int64_t rows = 0;
  int64_t start_pos = 0;
  KvView kv;
  float* out = nullptr;
};

// All jobs in one parallel region (one fork/join for a whole batched step,
// not one per sequence). Every job's K/V must have the same dtype, head
// count and head_dim. Each row's result is exactly what DecodeAttentionFloat
// gives it alone.
void DecodeAttentionBatch(const AttentionJob* jobs, int64_t num_jobs,
                          int64_t num_heads, float scale);

// Many query rows over one shared prefix, for the planner's candidate
// branches (LlamaModel::BranchAttention): q is [B, r, num_heads, head_dim]
// float32 (contiguous, RoPE applied), B branches of the same r tokens;
// keys/values are contiguous [num_kv_heads, capacity, head_dim] caches;
// token t of every branch sees positions [0, lens[t]) of them (r entries,
// non-decreasing, each >= 0 and <= capacity). Returns out [B, r, num_heads,
// head_dim] (the softmax over those positions, normalized) and, per query
// row, max and sum [B, r, num_heads, 1]: the largest score and the sum of
// exp(score - max), with which the caller merges this attention with one
// over other keys (-inf and 0, and out 0, for a token that sees nothing).
// float32 throughout, in the SIMD kernel of attention_kernels.h: each row's
// scores, softmax and weighted sum are the same whatever rows run beside it.
// The rows run on at::parallel_for (the calling thread's intra-op threads:
// a planner's solve threads), not on the decode's kernel pool.
struct SharedPrefixAttention {
  torch::Tensor out;
  torch::Tensor max;
  torch::Tensor sum;
};
// Whether AttendSharedPrefix handles K/V of `dtype` and `head_dim` on
// `device` (CPU, fp32 or bf16, head_dim a multiple of 16 up to 512).
bool SharedPrefixAttentionApplies(const torch::Device& device,
                                  torch::ScalarType dtype, int64_t head_dim);
SharedPrefixAttention AttendSharedPrefix(const torch::Tensor& q,
                                         const torch::Tensor& keys,
                                         const torch::Tensor& values,
                                         const std::vector<int64_t>& lens,
                                         float scale);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_MODEL_DECODE_ATTENTION_H_

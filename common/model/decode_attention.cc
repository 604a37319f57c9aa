#include "common/model/decode_attention.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/model/attention_kernels.h"
#include "common/model/parallel_for.h"

namespace knapserve {
namespace {

// Lanes of the per-dot accumulator: the dot product of one query head with
// one key is summed as 16 interleaved partial sums (which the compiler turns
// into vector code) then those 16 in index order. The order is fixed by the
// code, never by the shapes, which is what makes the result batch-invariant.
constexpr int64_t kLanes = 16;
constexpr int64_t kMaxHeadDim = 512;

template <typename E>
void ToFloatRow(const E* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// One KV head, one query row: the `group` query heads sharing this KV head
// attend to positions [0, n) of keys/values (laid out as `blocks` says).
// q: [group, hd] fp32; out: [group, hd] fp32. scores: scratch of group * n
// floats.
template <typename E>
void AttendGroup(const float* q, const E* keys, const E* values,
                 const kernels::KvBlocks& blocks, int64_t n, int64_t hd,
                 int64_t group, float scale, float* scores, float* out) {
  const int64_t full = hd / kLanes * kLanes;
  float row[kMaxHeadDim];
  for (int64_t j = 0; j < n; ++j) {
    ToFloatRow(keys + kernels::RowOffset(blocks, j, hd), hd, row);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * hd;
      float acc[kLanes] = {};
      for (int64_t d = 0; d < full; d += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) acc[l] += qg[d + l] * row[d + l];
      }
      float s = 0.0f;
      for (int64_t d = full; d < hd; ++d) s += qg[d] * row[d];
      for (int64_t l = 0; l < kLanes; ++l) s += acc[l];
      scores[g * n + j] = s * scale;
    }
  }
  std::vector<float> inv_sum(group);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) max = std::max(max, sg[j]);
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      sg[j] = std::exp(sg[j] - max);
      sum += sg[j];
    }
    inv_sum[g] = 1.0f / sum;
  }
  std::fill(out, out + group * hd, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    ToFloatRow(values + kernels::RowOffset(blocks, j, hd), hd, row);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + j];
      float* og = out + g * hd;
      for (int64_t d = 0; d < hd; ++d) og[d] += p * row[d];
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < hd; ++d) out[g * hd + d] *= inv_sum[g];
  }
}

// Query rows per kernel call: bounds the score scratch for long prefill
// chunks. A row's result does not depend on the tile it is in.
constexpr int64_t kRowTile = 64;

// One piece of work: rows [r0, r0 + rows) of one job for one KV head.
struct WorkItem {
  int64_t job;
  int64_t kvh;
  int64_t r0;
  int64_t rows;
};

template <typename E>
void RunDecodeAttention(const AttentionJob* jobs, int64_t num_jobs, int64_t nh,
                        float scale) {
  if (num_jobs == 0) return;
  const int64_t hd = jobs[0].kv.head_dim;
  const int64_t nkv = jobs[0].kv.num_kv_heads;
  const int64_t group = nh / nkv;
  int64_t total_rows = 0;
  for (int64_t j = 0; j < num_jobs; ++j)
    total_rows += std::max<int64_t>(0, jobs[j].rows);
  int64_t threads = std::max(1, at::get_num_threads());
  if (const int pass = PassThreads(total_rows); pass > 0)
    threads = std::min<int64_t>(threads, pass);
  // Items are (job, KV head, chunk of rows): the rows of a chunk share every
  // load of K/V. A job's rows are split when there are fewer KV heads than
  // threads, and into tiles of at most kRowTile rows. Each row's result is
  // the same in any chunk, so the split never changes a bit.
  std::vector<WorkItem> items;
  int64_t work = 0;  // multiply-adds, to decide whether to fork at all
  for (int64_t j = 0; j < num_jobs; ++j) {
    const int64_t t = jobs[j].rows;
    if (t <= 0) continue;
    work += (jobs[j].start_pos + t) * hd * group * t * nkv;
    const int64_t chunks =
        std::min(t, std::max<int64_t>({1, (threads + nkv - 1) / nkv,
                                       (t + kRowTile - 1) / kRowTile}));
    const int64_t per_chunk = (t + chunks - 1) / chunks;
    for (int64_t kvh = 0; kvh < nkv; ++kvh) {
      for (int64_t r0 = 0; r0 < t; r0 += per_chunk) {
        items.push_back({j, kvh, r0, std::min(per_chunk, t - r0)});
      }
    }
  }
  const int64_t n = static_cast<int64_t>(items.size());
  // Below this much work a fork/join costs more than it saves.
  const int64_t grain = work < 65536 ? std::max<int64_t>(n, 1) : 1;
  // The SIMD kernel (attention_kernels.h) for fp32 and bf16 K/V with
  // head_dim a multiple of 16, on whichever target is chosen.
  constexpr bool kFastDtype =
      std::is_same_v<E, at::BFloat16> || std::is_same_v<E, float>;
  if (kFastDtype && hd % 16 == 0 && hd <= kMaxHeadDim) {
    ParallelFor(
        0, n, grain,
        [&](int64_t begin, int64_t end) {
          std::vector<float> scores;
          for (int64_t w = begin; w < end; ++w) {
            const WorkItem& item = items[w];
            const AttentionJob& job = jobs[item.job];
            const KvView& kv = job.kv;
            const E* k =
                static_cast<const E*>(kv.k) + item.kvh * kv.head_stride;
            const E* v =
                static_cast<const E*>(kv.v) + item.kvh * kv.head_stride;
            const int64_t padded =
                (job.start_pos + item.r0 + item.rows + 15) / 16 * 16;
            scores.resize(item.rows * group * padded);
            const float* qi = job.q + (item.r0 * nh + item.kvh * group) * hd;
            float* oi = job.out + (item.r0 * nh + item.kvh * group) * hd;
            const int64_t first_len = job.start_pos + item.r0 + 1;
            if constexpr (std::is_same_v<E, at::BFloat16>) {
              kernels::AttendKvHeadBf16(
                  qi, nh * hd, item.rows, group, first_len,
                  reinterpret_cast<const uint16_t*>(k),
                  reinterpret_cast<const uint16_t*>(v), kv.blocks, hd, scale,
                  scores.data(), padded, oi, nh * hd);
            } else if constexpr (std::is_same_v<E, float>) {
              kernels::AttendKvHeadF32(qi, nh * hd, item.rows, group, first_len,
                                       k, v, kv.blocks, hd, scale,
                                       scores.data(), padded, oi, nh * hd);
            }
          }
        },
        static_cast<int>(threads));
    return;
  }
  // Other head sizes and fp16: one query row at a time within each item.
  ParallelFor(
      0, n, grain,
      [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        for (int64_t w = begin; w < end; ++w) {
          const WorkItem& item = items[w];
          const AttentionJob& job = jobs[item.job];
          const KvView& kv = job.kv;
          const E* k = static_cast<const E*>(kv.k) + item.kvh * kv.head_stride;
          const E* v = static_cast<const E*>(kv.v) + item.kvh * kv.head_stride;
          for (int64_t row = item.r0; row < item.r0 + item.rows; ++row) {
            const int64_t len = job.start_pos + row + 1;
            scores.resize(group * len);
            const int64_t offset = (row * nh + item.kvh * group) * hd;
            AttendGroup<E>(job.q + offset, k, v, kv.blocks, len, hd, group,
                           scale, scores.data(), job.out + offset);
          }
        }
      },
      static_cast<int>(threads));
}

const int32_t kFirstBlock = 0;

}  // namespace

bool DecodeAttentionApplies(const torch::Tensor& q) {
  const auto dtype = q.scalar_type();
  return q.device().is_cpu() && q.dim() == 3 && q.size(0) > 0 &&
         q.size(0) <= kMaxDecodeAttentionRows && q.size(2) <= kMaxHeadDim &&
         (dtype == torch::kFloat32 || dtype == torch::kBFloat16 ||
          dtype == torch::kFloat16);
}

torch::Tensor DecodeAttention(const torch::Tensor& q, const torch::Tensor& keys,
                              const torch::Tensor& values, int64_t start_pos,
                              double scale) {
  c10::InferenceMode guard;
  TORCH_CHECK(DecodeAttentionApplies(q),
              "DecodeAttention: unsupported query shape or dtype");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(),
              "DecodeAttention: K/V caches must be contiguous");
  TORCH_CHECK(keys.scalar_type() == q.scalar_type() &&
                  values.scalar_type() == q.scalar_type(),
              "DecodeAttention: q and K/V dtypes differ");
  TORCH_CHECK(q.size(1) % keys.size(0) == 0,
              "DecodeAttention: heads not a multiple of KV heads");
  TORCH_CHECK(start_pos + q.size(0) <= keys.size(1),
              "DecodeAttention: past KV capacity");
  const torch::Tensor qf = q.to(torch::kFloat32).contiguous();
  torch::Tensor out =
      torch::empty({q.size(0), q.size(1) * q.size(2)},
                   torch::TensorOptions().dtype(torch::kFloat32));
  DecodeAttentionFloat(qf.data_ptr<float>(), q.size(0), q.size(1), keys, values,
                       start_pos, static_cast<float>(scale),
                       out.data_ptr<float>());
  return q.scalar_type() == torch::kFloat32 ? out : out.to(q.scalar_type());
}

KvView ContiguousKvView(const torch::Tensor& keys,
                        const torch::Tensor& values) {
  KvView view;
  view.k = keys.data_ptr();
  view.v = values.data_ptr();
  view.dtype = keys.scalar_type();
  view.num_kv_heads = keys.size(0);
  view.head_dim = keys.size(2);
  view.head_stride = keys.size(1) * keys.size(2);
  // One block covering the whole capacity.
  view.blocks = kernels::KvBlocks{
      &kFirstBlock, std::max<int64_t>(16, (keys.size(1) + 15) / 16 * 16), 0};
  return view;
}

void DecodeAttentionFloat(const float* q, int64_t t, int64_t num_heads,
                          const torch::Tensor& keys,
                          const torch::Tensor& values, int64_t start_pos,
                          float scale, float* out) {
  DecodeAttentionFloat(q, t, num_heads, ContiguousKvView(keys, values),
                       start_pos, scale, out);
}

void DecodeAttentionFloat(const float* q, int64_t t, int64_t num_heads,
                          const KvView& kv, int64_t start_pos, float scale,
                          float* out) {
  const AttentionJob job{q, t, start_pos, kv, out};
  DecodeAttentionBatch(&job, 1, num_heads, scale);
}

void DecodeAttentionBatch(const AttentionJob* jobs, int64_t num_jobs,
                          int64_t num_heads, float scale) {
  if (num_jobs == 0) return;
  switch (jobs[0].kv.dtype) {
    case torch::kBFloat16:
      return RunDecodeAttention<at::BFloat16>(jobs, num_jobs, num_heads, scale);
    case torch::kFloat16:
      return RunDecodeAttention<at::Half>(jobs, num_jobs, num_heads, scale);
    default:
      return RunDecodeAttention<float>(jobs, num_jobs, num_heads, scale);
  }
}

bool SharedPrefixAttentionApplies(const torch::Device& device,
                                  torch::ScalarType dtype, int64_t head_dim) {
  return device.is_cpu() &&
         (dtype == torch::kFloat32 || dtype == torch::kBFloat16) &&
         head_dim > 0 && head_dim % 16 == 0 && head_dim <= kMaxHeadDim;
}

SharedPrefixAttention AttendSharedPrefix(const torch::Tensor& q,
                                         const torch::Tensor& keys,
                                         const torch::Tensor& values,
                                         const std::vector<int64_t>& lens,
                                         float scale) {
  c10::InferenceMode guard;
  TORCH_CHECK(
      q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
      "AttendSharedPrefix: q must be contiguous float32 [B, r, H, D]");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() &&
                  keys.dim() == 3 && keys.sizes() == values.sizes() &&
                  keys.scalar_type() == values.scalar_type(),
              "AttendSharedPrefix: K/V must be contiguous [KV, capacity, D]");
  TORCH_CHECK(SharedPrefixAttentionApplies(keys.device(), keys.scalar_type(),
                                           keys.size(2)),
              "AttendSharedPrefix: unsupported K/V dtype or head_dim");
  const int64_t b = q.size(0), r = q.size(1), nh = q.size(2), hd = q.size(3);
  const int64_t nkv = keys.size(0);
  TORCH_CHECK(hd == keys.size(2) && nh % nkv == 0,
              "AttendSharedPrefix: heads do not match the K/V");
  TORCH_CHECK(static_cast<int64_t>(lens.size()) == r,
              "AttendSharedPrefix: one length per token");
  for (int64_t t = 0; t < r; ++t) {
    TORCH_CHECK(lens[t] >= 0 && lens[t] <= keys.size(1) &&
                    (t == 0 || lens[t] >= lens[t - 1]),
                "AttendSharedPrefix: lengths must be non-decreasing and "
                "within the capacity");
  }
  const int64_t group = nh / nkv;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  SharedPrefixAttention result{torch::empty({b, r, nh, hd}, f32),
                               torch::empty({b, r, nh, 1}, f32),
                               torch::empty({b, r, nh, 1}, f32)};
  if (b == 0 || r == 0) return result;
  const KvView kv = ContiguousKvView(keys, values);
  const float* qp = q.data_ptr<float>();
  float* out = result.out.data_ptr<float>();
  float* row_max = result.max.data_ptr<float>();
  float* row_sum = result.sum.data_ptr<float>();
  const bool bf16 = keys.scalar_type() == torch::kBFloat16;
  const int64_t padded = std::max<int64_t>(16, (lens[r - 1] + 15) / 16 * 16);
  // One item per (branch, KV head): its r tokens x `group` query heads share
  // every load of the prefix K/V.
  at::parallel_for(0, b * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(r * group * padded);
    std::vector<float> stats(2 * r * group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t branch = item / nkv, kvh = item % nkv;
      const int64_t offset = (branch * r * nh + kvh * group) * hd;
      const int64_t head_offset = kvh * kv.head_stride;
      if (bf16) {
        kernels::AttendPrefixBf16(
            qp + offset, nh * hd, r, group, lens.data(),
            static_cast<const uint16_t*>(kv.k) + head_offset,
            static_cast<const uint16_t*>(kv.v) + head_offset, kv.blocks, hd,
            scale, scores.data(), padded, out + offset, nh * hd, stats.data(),
            stats.data() + r * group);
      } else {
        kernels::AttendPrefixF32(qp + offset, nh * hd, r, group, lens.data(),
                                 static_cast<const float*>(kv.k) + head_offset,
                                 static_cast<const float*>(kv.v) + head_offset,
                                 kv.blocks, hd, scale, scores.data(), padded,
                                 out + offset, nh * hd, stats.data(),
                                 stats.data() + r * group);
      }
      // Query row t * group + g is head kvh * group + g of token t.
      for (int64_t t = 0; t < r; ++t) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t at = (branch * r + t) * nh + kvh * group + g;
          row_max[at] = stats[t * group + g];
          row_sum[at] = stats[r * group + t * group + g];
        }
      }
    }
  });
  return result;
}

}  // namespace knapserve

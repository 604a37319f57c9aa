#include "common/model/decode_attention.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/model/attention_kernels.h"

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
// attend to keys/values [0, n). q: [group, hd] fp32; out: [group, hd] fp32.
// scores: scratch of group * n floats.
template <typename E>
void AttendGroup(const float* q, const E* keys, const E* values, int64_t n,
                 int64_t hd, int64_t group, float scale, float* scores,
                 float* out) {
  const int64_t full = hd / kLanes * kLanes;
  float row[kMaxHeadDim];
  for (int64_t j = 0; j < n; ++j) {
    ToFloatRow(keys + j * hd, hd, row);
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
    ToFloatRow(values + j * hd, hd, row);
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

// Whether this CPU runs the AVX-512 kernel (common/model/attention_kernels.h).
bool CpuHasAvx512() {
#if defined(__x86_64__)
  static const bool has =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return has;
#else
  return false;
#endif
}

template <typename E>
void RunDecodeAttention(const float* q, int64_t t, int64_t nh,
                        const torch::Tensor& keys, const torch::Tensor& values,
                        int64_t start_pos, float scale, float* o) {
  const int64_t hd = keys.size(2);
  const int64_t nkv = keys.size(0);
  const int64_t capacity = keys.size(1);
  const int64_t group = nh / nkv;
  const E* k = keys.data_ptr<E>();
  const E* v = values.data_ptr<E>();
  const int64_t threads = std::max(1, at::get_num_threads());
  // Below this much work (multiply-adds) a fork/join costs more than it saves.
  const int64_t work = (start_pos + t) * hd * group * t * nkv;
  const bool inline_only = work < 65536;
  const int64_t padded = (start_pos + t + 15) / 16 * 16;
#if defined(__x86_64__)
  constexpr bool kFastDtype =
      std::is_same_v<E, at::BFloat16> || std::is_same_v<E, float>;
  if (kFastDtype && CpuHasAvx512() && hd % 16 == 0) {
    // Items are (KV head, chunk of rows): the rows of a chunk share every
    // load of K/V. Rows are split only when there are fewer KV heads than
    // threads. Each row's result is the same in any chunk.
    const int64_t row_chunks =
        std::min(t, std::max<int64_t>(1, (threads + nkv - 1) / nkv));
    const int64_t rows_per_chunk = (t + row_chunks - 1) / row_chunks;
    const int64_t items = nkv * row_chunks;
    at::parallel_for(
        0, items, inline_only ? items : 1, [&](int64_t begin, int64_t end) {
          std::vector<float> scores(rows_per_chunk * group * padded);
          for (int64_t item = begin; item < end; ++item) {
            const int64_t kvh = item / row_chunks;
            const int64_t r0 = (item % row_chunks) * rows_per_chunk;
            const int64_t rows = std::min(rows_per_chunk, t - r0);
            if (rows <= 0) continue;
            const float* qi = q + (r0 * nh + kvh * group) * hd;
            float* oi = o + (r0 * nh + kvh * group) * hd;
            if constexpr (std::is_same_v<E, at::BFloat16>) {
              kernels::AttendKvHeadBf16(
                  qi, nh * hd, rows, group, start_pos + r0 + 1,
                  reinterpret_cast<const uint16_t*>(k + kvh * capacity * hd),
                  reinterpret_cast<const uint16_t*>(v + kvh * capacity * hd),
                  hd, scale, scores.data(), padded, oi, nh * hd);
            } else if constexpr (std::is_same_v<E, float>) {
              kernels::AttendKvHeadF32(
                  qi, nh * hd, rows, group, start_pos + r0 + 1,
                  k + kvh * capacity * hd, v + kvh * capacity * hd, hd, scale,
                  scores.data(), padded, oi, nh * hd);
            }
          }
        });
    return;
  }
#endif
  // Portable: items are (row, KV head) pairs, KV-head-major, so one thread's
  // consecutive rows reuse the same keys and values from cache.
  at::parallel_for(
      0, t * nkv, inline_only ? t * nkv : 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores(group * padded);
        for (int64_t item = begin; item < end; ++item) {
          const int64_t kvh = item / t;
          const int64_t row = item % t;
          const int64_t offset = (row * nh + kvh * group) * hd;
          AttendGroup<E>(q + offset, k + kvh * capacity * hd,
                         v + kvh * capacity * hd, start_pos + row + 1, hd,
                         group, scale, scores.data(), o + offset);
        }
      });
}

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

void DecodeAttentionFloat(const float* q, int64_t t, int64_t num_heads,
                          const torch::Tensor& keys,
                          const torch::Tensor& values, int64_t start_pos,
                          float scale, float* out) {
  switch (keys.scalar_type()) {
    case torch::kBFloat16:
      return RunDecodeAttention<at::BFloat16>(q, t, num_heads, keys, values,
                                              start_pos, scale, out);
    case torch::kFloat16:
      return RunDecodeAttention<at::Half>(q, t, num_heads, keys, values,
                                          start_pos, scale, out);
    default:
      return RunDecodeAttention<float>(q, t, num_heads, keys, values, start_pos,
                                       scale, out);
  }
}

}  // namespace knapserve

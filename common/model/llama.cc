#include "common/model/llama.h"

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/checkpoint/safetensors.h"
#include "common/model/decode_attention.h"
#include "common/model/heap_reuse.h"
#include "common/model/linear.h"
#include "common/model/parallel_for.h"
#include "common/model/row_ops.h"

namespace knapserve {
namespace {

using torch::indexing::Slice;

// Runs fn(r0, r1) over the rows [0, rows) of a few-row sublayer, split
// across the kernel pool once there are enough rows to pay for a fork/join.
// The row operations compute each row on its own, so any split gives the
// same bits.
template <typename F>
void ForRows(int64_t rows, const F& fn) {
  constexpr int64_t kRowsPerPart = 4;
  ParallelFor(0, rows, kRowsPerPart, fn);
}

// out = h + E(y), row by row: the residual add of a sublayer's float32
// projection output y ([t, d]) to the hidden states h ([t, d], dtype E).
template <typename E>
void AddResidualRows(const torch::Tensor& h, const torch::Tensor& y,
                     torch::Tensor& out) {
  const int64_t d = h.size(1);
  ForRows(h.size(0), [&](int64_t r0, int64_t r1) {
    row_ops::AddResidual<E>(h.data_ptr<E>() + r0 * d,
                            y.data_ptr<float>() + r0 * d, (r1 - r0) * d,
                            out.data_ptr<E>() + r0 * d);
  });
}

// Loads `name` with `shape` from the checkpoint into the target dtype/device.
absl::StatusOr<torch::Tensor> LoadWeight(const Checkpoint& checkpoint,
                                         const std::string& name,
                                         std::vector<int64_t> shape,
                                         const ModelOptions& options) {
  ASSIGN_OR_RETURN(torch::Tensor view, checkpoint.Get(name, std::move(shape)));
  // The view aliases read-only mapped memory: always copy out of it.
  return view
      .to(options.device, options.dtype, /*non_blocking=*/false, /*copy=*/true)
      .contiguous();
}

int64_t Bytes(const torch::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

}  // namespace

struct LlamaModel::RowSpan {
  int64_t begin = 0;                   // first row in the pass's hidden states
  int64_t rows = 0;                    // number of rows
  int64_t start_pos = 0;               // position of the first row
  KvView view;                         // this layer's K/V of the sequence
  const BatchSequence* seq = nullptr;  // the sequence (torch path only)
};

absl::StatusOr<torch::ScalarType> ParseDtype(const std::string& name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "fp32" || n == "float32" || n == "f32") return torch::kFloat32;
  if (n == "bf16" || n == "bfloat16") return torch::kBFloat16;
  if (n == "fp16" || n == "float16" || n == "f16") return torch::kFloat16;
  return absl::InvalidArgumentError(absl::StrCat(
      "unsupported dtype '", name, "' (supported: fp32, bf16, fp16)"));
}

std::string DtypeName(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat32:
      return "fp32";
    case torch::kBFloat16:
      return "bf16";
    case torch::kFloat16:
      return "fp16";
    default:
      return std::string(c10::toString(dtype));
  }
}

absl::StatusOr<torch::Device> ParseDevice(const std::string& name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "cpu") return torch::Device(torch::kCPU);
  if (n.rfind("cuda", 0) == 0) {
    if (!torch::cuda::is_available()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "device '", name,
          "' requested but this build of torch sees no CUDA device"));
    }
    try {
      return torch::Device(n);
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad device '", name, "'"));
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unsupported device '", name, "' (supported: cpu, cuda, cuda:N)"));
}

torch::Tensor RopeInverseFrequencies(const ModelConfig& config) {
  const int64_t half = config.head_dim / 2;
  // Same arithmetic as Hugging Face: float32 exponents over even indices.
  torch::Tensor idx =
      torch::arange(0, config.head_dim, 2, torch::kInt64).to(torch::kFloat32);
  torch::Tensor inv_freq =
      1.0 / torch::pow(torch::tensor(config.rope_theta, torch::kFloat32),
                       idx / static_cast<float>(config.head_dim));
  TORCH_CHECK(inv_freq.size(0) == half);
  if (!config.rope_scaling.has_value()) return inv_freq;
  const RopeScaling& s = *config.rope_scaling;
  if (s.rope_type == "linear") return inv_freq / s.factor;
  if (s.rope_type == "llama3") {
    const double old_ctx =
        static_cast<double>(s.original_max_position_embeddings);
    const double low_freq_wavelen = old_ctx / s.low_freq_factor;
    const double high_freq_wavelen = old_ctx / s.high_freq_factor;
    torch::Tensor wavelen = 2.0 * M_PI / inv_freq;
    torch::Tensor scaled =
        torch::where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq);
    torch::Tensor smooth = (old_ctx / wavelen - s.low_freq_factor) /
                           (s.high_freq_factor - s.low_freq_factor);
    torch::Tensor smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
    torch::Tensor is_medium =
        (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen);
    return torch::where(is_medium, smoothed, scaled);
  }
  return inv_freq;  // ParseModelConfig rejects other types.
}

LlamaModel::LlamaModel(ModelConfig config, ModelOptions options)
    : config_(std::move(config)), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::Load(
    const std::string& model_dir, const ModelOptions& options) {
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(model_dir));
  ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> checkpoint,
                   Checkpoint::Open(model_dir));
  return FromCheckpoint(config, *checkpoint, options);
}

absl::StatusOr<std::unique_ptr<LlamaModel>> LlamaModel::FromCheckpoint(
    const ModelConfig& config, const Checkpoint& checkpoint,
    const ModelOptions& options) {
  if (options.dtype != torch::kFloat32 && options.dtype != torch::kBFloat16 &&
      options.dtype != torch::kFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported model dtype ", DtypeName(options.dtype)));
  }
  if (options.dtype == torch::kFloat16 && !options.device.is_cuda()) {
    // LibTorch 1.13 has no CPU fp16 kernels for several ops of a layer
    // (bmm, silu), so a CPU fp16 model could not run a pass.
    return absl::InvalidArgumentError(
        "dtype fp16 runs on CUDA only; on a CPU use bf16 (the same memory "
        "per weight) or fp32");
  }
  if (config.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: head_dim ", config.head_dim, " must be even for RoPE"));
  }
  if (options.threads > 0) at::set_num_threads(options.threads);
  SingleThreadedBlas();     // common/model/parallel_for.h says why
  KeepFreedTensorMemory();  // common/model/heap_reuse.h says why
  c10::InferenceMode inference_mode;

  std::unique_ptr<LlamaModel> model(new LlamaModel(config, options));
  const int64_t d = config.hidden_size;
  const int64_t hd = config.head_dim;
  const int64_t nh = config.num_attention_heads;
  const int64_t nkv = config.num_key_value_heads;
  const int64_t inter = config.intermediate_size;
  model->max_context_ = config.max_context();
  model->weights_fingerprint_ = checkpoint.WeightsFingerprint();

  ASSIGN_OR_RETURN(model->embed_,
                   LoadWeight(checkpoint, "model.embed_tokens.weight",
                              {config.vocab_size, d}, options));
  ASSIGN_OR_RETURN(model->final_norm_,
                   LoadWeight(checkpoint, "model.norm.weight", {d}, options));
  if (config.tie_word_embeddings && !checkpoint.Has("lm_head.weight")) {
    model->lm_head_ = LinearWeight(model->embed_);
  } else {
    ASSIGN_OR_RETURN(torch::Tensor lm_head,
                     LoadWeight(checkpoint, "lm_head.weight",
                                {config.vocab_size, d}, options));
    model->lm_head_ = LinearWeight(lm_head);
  }

  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    Layer layer;
    ASSIGN_OR_RETURN(
        layer.input_norm,
        LoadWeight(checkpoint, p + "input_layernorm.weight", {d}, options));
    ASSIGN_OR_RETURN(torch::Tensor q,
                     LoadWeight(checkpoint, p + "self_attn.q_proj.weight",
                                {nh * hd, d}, options));
    ASSIGN_OR_RETURN(torch::Tensor k,
                     LoadWeight(checkpoint, p + "self_attn.k_proj.weight",
                                {nkv * hd, d}, options));
    ASSIGN_OR_RETURN(torch::Tensor v,
                     LoadWeight(checkpoint, p + "self_attn.v_proj.weight",
                                {nkv * hd, d}, options));
    layer.qkv_proj = LinearWeight(torch::cat({q, k, v}, 0));
    if (config.attention_bias) {
      ASSIGN_OR_RETURN(torch::Tensor qb,
                       LoadWeight(checkpoint, p + "self_attn.q_proj.bias",
                                  {nh * hd}, options));
      ASSIGN_OR_RETURN(torch::Tensor kb,
                       LoadWeight(checkpoint, p + "self_attn.k_proj.bias",
                                  {nkv * hd}, options));
      ASSIGN_OR_RETURN(torch::Tensor vb,
                       LoadWeight(checkpoint, p + "self_attn.v_proj.bias",
                                  {nkv * hd}, options));
      layer.qkv_bias = torch::cat({qb, kb, vb}, 0).contiguous();
    }
    if (config.qk_norm) {
      ASSIGN_OR_RETURN(
          layer.q_norm,
          LoadWeight(checkpoint, p + "self_attn.q_norm.weight", {hd}, options));
      ASSIGN_OR_RETURN(
          layer.k_norm,
          LoadWeight(checkpoint, p + "self_attn.k_norm.weight", {hd}, options));
    }
    ASSIGN_OR_RETURN(torch::Tensor o,
                     LoadWeight(checkpoint, p + "self_attn.o_proj.weight",
                                {d, nh * hd}, options));
    layer.o_proj = LinearWeight(o);
    ASSIGN_OR_RETURN(
        layer.post_norm,
        LoadWeight(checkpoint, p + "post_attention_layernorm.weight", {d},
                   options));
    ASSIGN_OR_RETURN(torch::Tensor gate,
                     LoadWeight(checkpoint, p + "mlp.gate_proj.weight",
                                {inter, d}, options));
    ASSIGN_OR_RETURN(
        torch::Tensor up,
        LoadWeight(checkpoint, p + "mlp.up_proj.weight", {inter, d}, options));
    layer.gate_up_proj = LinearWeight(torch::cat({gate, up}, 0));
    ASSIGN_OR_RETURN(torch::Tensor down,
                     LoadWeight(checkpoint, p + "mlp.down_proj.weight",
                                {d, inter}, options));
    layer.down_proj = LinearWeight(down);
    model->weight_bytes_per_token_ +=
        Bytes(layer.input_norm) + layer.qkv_proj.bytes() +
        Bytes(layer.qkv_bias) + Bytes(layer.q_norm) + Bytes(layer.k_norm) +
        layer.o_proj.bytes() + Bytes(layer.post_norm) +
        layer.gate_up_proj.bytes() + layer.down_proj.bytes();
    model->layers_.push_back(std::move(layer));
  }
  model->weight_bytes_per_token_ +=
      Bytes(model->final_norm_) + model->lm_head_.bytes();

  // RoPE tables for every position, in the model dtype (as Hugging Face casts
  // cos/sin to the activations' dtype before rotating).
  torch::Tensor inv_freq = RopeInverseFrequencies(config);
  torch::Tensor pos =
      torch::arange(model->max_context_, torch::kInt64).to(torch::kFloat32);
  torch::Tensor freqs = torch::outer(pos, inv_freq);
  torch::Tensor emb = torch::cat({freqs, freqs}, -1);
  model->rope_cos_ = emb.cos().to(options.device, options.dtype).contiguous();
  model->rope_sin_ = emb.sin().to(options.device, options.dtype).contiguous();
  return model;
}

std::vector<LayerKv> LlamaModel::AllocateKv(int64_t capacity) const {
  TORCH_CHECK(capacity > 0 && capacity <= max_context_, "KV capacity ",
              capacity, " outside [1, ", max_context_, "]");
  auto opts =
      torch::TensorOptions().dtype(options_.dtype).device(options_.device);
  // Zeroed on this thread alone (ScopedSerialAten): as an OpenMP region per
  // tensor, the team's spinning workers took a core from the prefill and
  // the first decode steps that follow.
  ScopedSerialAten serial;
  std::vector<LayerKv> kv;
  kv.reserve(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    kv.push_back(
        {torch::zeros({config_.num_key_value_heads, capacity, config_.head_dim},
                      opts),
         torch::zeros({config_.num_key_value_heads, capacity, config_.head_dim},
                      opts)});
  }
  return kv;
}

PagedKvStorage LlamaModel::AllocatePagedKv(int64_t num_blocks,
                                           int64_t block_rows) const {
  TORCH_CHECK(num_blocks > 0, "paged K/V needs at least one block");
  TORCH_CHECK(block_rows > 0 && block_rows % 16 == 0, "block_rows ", block_rows,
              " must be a positive multiple of 16");
  auto opts =
      torch::TensorOptions().dtype(options_.dtype).device(options_.device);
  PagedKvStorage storage;
  storage.num_blocks = num_blocks;
  storage.block_rows = block_rows;
  storage.layers.reserve(layers_.size());
  const std::vector<int64_t> shape = {num_blocks, config_.num_key_value_heads,
                                      block_rows, config_.head_dim};
  for (size_t i = 0; i < layers_.size(); ++i) {
    storage.layers.push_back(
        {torch::zeros(shape, opts), torch::zeros(shape, opts)});
  }
  return storage;
}

int64_t LlamaModel::KvBytesPerBlock(int64_t block_rows) const {
  return 2 * num_layers() * config_.num_key_value_heads * block_rows *
         config_.head_dim * c10::elementSize(options_.dtype);
}

torch::Tensor LlamaModel::RmsNorm(const torch::Tensor& x,
                                  const torch::Tensor& weight) const {
  // Hugging Face LlamaRMSNorm: normalize in float32, cast back, then scale.
  torch::Tensor xf = x.to(torch::kFloat32);
  torch::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  xf = xf * torch::rsqrt(var + config_.rms_norm_eps);
  return weight * xf.to(x.scalar_type());
}

torch::Tensor LlamaModel::ApplyRope(const torch::Tensor& x,
                                    int64_t start_pos) const {
  // x: [..., T, heads, head_dim]; rotate_half layout (first half / second
  // half); row t is at position start_pos + t.
  const int64_t t = x.size(-3);
  const int64_t half = config_.head_dim / 2;
  torch::Tensor cos = rope_cos_.narrow(0, start_pos, t).unsqueeze(1);
  torch::Tensor sin = rope_sin_.narrow(0, start_pos, t).unsqueeze(1);
  torch::Tensor x1 = x.narrow(-1, 0, half);
  torch::Tensor x2 = x.narrow(-1, half, half);
  torch::Tensor rotated = torch::cat({-x2, x1}, -1);
  return x * cos + rotated * sin;
}

torch::Tensor LlamaModel::Embed(const torch::Tensor& token_ids) const {
  c10::InferenceMode guard;
  // On this thread alone (ScopedSerialAten): a prefill's lookup of a
  // 1000-token prompt was an OpenMP region, whose spinning workers took a
  // core from the first decode steps' kernels. A row copy needs no team.
  ScopedSerialAten serial;
  return embed_.index_select(0, token_ids.to(options_.device, torch::kInt64));
}

bool LlamaModel::FewRowsApply(const torch::Tensor& h) const {
  return h.device().is_cpu() && h.dim() == 2 && h.size(0) >= 1 &&
         h.size(0) <= kMaxDecodeAttentionRows && !layers_.empty() &&
         layers_[0].qkv_proj.packed() &&
         (h.scalar_type() == torch::kFloat32 ||
          h.scalar_type() == torch::kBFloat16);
}

template <typename E>
torch::Tensor LlamaModel::AttentionFewRows(const Layer& layer,
                                           const torch::Tensor& h,
                                           int64_t start_pos,
                                           LayerKv& kv) const {
  TORCH_CHECK(kv.k.is_contiguous() && kv.v.is_contiguous(),
              "K/V cache must be contiguous");
  RowSpan span;
  span.rows = h.size(0);
  span.start_pos = start_pos;
  span.view = ContiguousKvView(kv.k, kv.v);
  return AttentionRows<E>(layer, h, {span});
}

template <typename E>
torch::Tensor LlamaModel::AttentionRows(
    const Layer& layer, const torch::Tensor& h_in,
    const std::vector<RowSpan>& spans) const {
  const torch::Tensor h = h_in.contiguous();
  const int64_t t = h.size(0);
  const int64_t d = config_.hidden_size;
  const int64_t hd = config_.head_dim;
  const int64_t nh = config_.num_attention_heads;
  const int64_t nkv = config_.num_key_value_heads;
  const int64_t width = (nh + 2 * nkv) * hd;
  const float eps = static_cast<float>(config_.rms_norm_eps);

  torch::Tensor x = torch::empty_like(h);
  ForRows(t, [&](int64_t r0, int64_t r1) {
    row_ops::RmsNorm<E>(h.data_ptr<E>() + r0 * d,
                        layer.input_norm.data_ptr<E>(), r1 - r0, d, eps,
                        x.data_ptr<E>() + r0 * d);
  });
  torch::Tensor qkv32 =
      LinearFloatOut(x, layer.qkv_proj);  // [t, width] float32
  if (layer.qkv_bias.defined()) qkv32.add_(layer.qkv_bias.to(torch::kFloat32));
  // The projection's output in the activation dtype, as the LibTorch path has
  // it.
  std::vector<E> qkv(t * width);
  ForRows(t, [&](int64_t r0, int64_t r1) {
    row_ops::Round<E>(qkv32.data_ptr<float>() + r0 * width, (r1 - r0) * width,
                      qkv.data() + r0 * width);
  });
  if (layer.q_norm.defined()) {
    for (int64_t r = 0; r < t; ++r) {
      E* q = qkv.data() + r * width;
      E* k = q + nh * hd;
      row_ops::RmsNorm<E>(q, layer.q_norm.data_ptr<E>(), nh, hd, eps, q);
      row_ops::RmsNorm<E>(k, layer.k_norm.data_ptr<E>(), nkv, hd, eps, k);
    }
  }
  const E* cos = rope_cos_.data_ptr<E>();
  const E* sin = rope_sin_.data_ptr<E>();
  std::vector<float> qf(t * nh * hd);
  std::vector<float> attn(t * nh * hd);
  std::vector<AttentionJob> jobs;
  jobs.reserve(spans.size());
  for (const RowSpan& span : spans) {
    E* q = qkv.data() + span.begin * width;
    E* k = q + nh * hd;
    E* v = k + nkv * hd;
    row_ops::Rope<E>(q, span.rows, width, nh, hd, span.start_pos, cos, sin);
    row_ops::Rope<E>(k, span.rows, width, nkv, hd, span.start_pos, cos, sin);
    // This step's K/V into the sequence's cache, wherever its blocks are.
    E* kc = static_cast<E*>(span.view.k);
    E* vc = static_cast<E*>(span.view.v);
    for (int64_t r = 0; r < span.rows; ++r) {
      const int64_t offset =
          kernels::RowOffset(span.view.blocks, span.start_pos + r, hd);
      for (int64_t g = 0; g < nkv; ++g) {
        const int64_t at = g * span.view.head_stride + offset;
        std::copy_n(k + r * width + g * hd, hd, kc + at);
        std::copy_n(v + r * width + g * hd, hd, vc + at);
      }
    }
    float* qs = qf.data() + span.begin * nh * hd;
    for (int64_t r = 0; r < span.rows; ++r)
      row_ops::ToFloat<E>(q + r * width, nh * hd, qs + r * nh * hd);
    jobs.push_back({qs, span.rows, span.start_pos, span.view,
                    attn.data() + span.begin * nh * hd});
  }
  DecodeAttentionBatch(
      jobs.data(), static_cast<int64_t>(jobs.size()), nh,
      static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd))));
  torch::Tensor attn_e = torch::empty({t, nh * hd}, h.options());
  ForRows(t, [&](int64_t r0, int64_t r1) {
    row_ops::Round<E>(attn.data() + r0 * nh * hd, (r1 - r0) * nh * hd,
                      attn_e.data_ptr<E>() + r0 * nh * hd);
  });
  torch::Tensor y = LinearFloatOut(attn_e, layer.o_proj);
  torch::Tensor out = torch::empty_like(h);
  AddResidualRows<E>(h, y, out);
  return out;
}

template <typename E>
torch::Tensor LlamaModel::MlpFewRows(const Layer& layer,
                                     const torch::Tensor& h_in) const {
  const torch::Tensor h = h_in.contiguous();
  const int64_t t = h.size(0);
  const int64_t d = config_.hidden_size;
  const int64_t inter = config_.intermediate_size;
  torch::Tensor x = torch::empty_like(h);
  const float eps = static_cast<float>(config_.rms_norm_eps);
  ForRows(t, [&](int64_t r0, int64_t r1) {
    row_ops::RmsNorm<E>(h.data_ptr<E>() + r0 * d, layer.post_norm.data_ptr<E>(),
                        r1 - r0, d, eps, x.data_ptr<E>() + r0 * d);
  });
  torch::Tensor gu =
      LinearFloatOut(x, layer.gate_up_proj);  // [t, 2 * inter] float32
  torch::Tensor act = torch::empty({t, inter}, h.options());
  ForRows(t, [&](int64_t r0, int64_t r1) {
    row_ops::SiluMul<E>(gu.data_ptr<float>() + r0 * 2 * inter, r1 - r0, inter,
                        act.data_ptr<E>() + r0 * inter);
  });
  torch::Tensor y = LinearFloatOut(act, layer.down_proj);
  torch::Tensor out = torch::empty_like(h);
  AddResidualRows<E>(h, y, out);
  return out;
}

torch::Tensor LlamaModel::Attention(int layer_index, const torch::Tensor& h,
                                    int64_t start_pos, LayerKv& kv) const {
  c10::InferenceMode guard;
  const Layer& layer = layers_[layer_index];
  const int64_t t = h.size(0);
  const int64_t hd = config_.head_dim;
  const int64_t nh = config_.num_attention_heads;
  const int64_t nkv = config_.num_key_value_heads;
  const int64_t end = start_pos + t;
  TORCH_CHECK(end <= kv.k.size(1), "attention past KV capacity: ", end, " > ",
              kv.k.size(1));
  if (FewRowsApply(h)) {
    return h.scalar_type() == torch::kFloat32
               ? AttentionFewRows<float>(layer, h, start_pos, kv)
               : AttentionFewRows<c10::BFloat16>(layer, h, start_pos, kv);
  }

  torch::Tensor x = RmsNorm(h, layer.input_norm);
  torch::Tensor qkv = Linear(x, layer.qkv_proj, layer.qkv_bias);
  torch::Tensor q = qkv.narrow(1, 0, nh * hd).view({t, nh, hd});
  torch::Tensor k = qkv.narrow(1, nh * hd, nkv * hd).view({t, nkv, hd});
  torch::Tensor v = qkv.narrow(1, (nh + nkv) * hd, nkv * hd).view({t, nkv, hd});
  if (layer.q_norm.defined()) {
    q = RmsNorm(q, layer.q_norm);
    k = RmsNorm(k, layer.k_norm);
  }
  q = ApplyRope(q, start_pos);
  k = ApplyRope(k, start_pos);

  // Write this step's K/V; the cache is [kv_heads, capacity, head_dim].
  kv.k.narrow(1, start_pos, t).copy_(k.transpose(0, 1));
  kv.v.narrow(1, start_pos, t).copy_(v.transpose(0, 1));
  if (DecodeAttentionApplies(q)) {
    // Decode, draft and verification steps: the batch-invariant kernel, so a
    // token gets the same bits alone or inside a verification pass.
    return h + Linear(DecodeAttention(q, kv.k, kv.v, start_pos,
                                      1.0 / std::sqrt(static_cast<double>(hd))),
                      layer.o_proj);
  }
  return h + Linear(AttendTorch(q, kv.k.narrow(1, 0, end),
                                kv.v.narrow(1, 0, end), start_pos),
                    layer.o_proj);
}

torch::Tensor LlamaModel::AttendTorch(const torch::Tensor& q,
                                      const torch::Tensor& keys,
                                      const torch::Tensor& values,
                                      int64_t start_pos) const {
  const int64_t t = q.size(0);
  const int64_t hd = config_.head_dim;
  const int64_t nh = config_.num_attention_heads;
  const int64_t nkv = config_.num_key_value_heads;
  const int64_t group = nh / nkv;
  const int64_t end = start_pos + t;
  // Grouped-query attention without repeating K/V: fold each KV head's query
  // group and the T positions into one batch row block.
  torch::Tensor qg = q.view({t, nkv, group, hd})
                         .permute({1, 2, 0, 3})
                         .reshape({nkv, group * t, hd});
  torch::Tensor scores =
      torch::bmm(qg, keys.transpose(1, 2)).to(torch::kFloat32);
  scores.mul_(1.0 / std::sqrt(static_cast<double>(hd)));
  if (t > 1) {
    // Query at position start_pos+i sees keys 0..start_pos+i.
    auto opts = torch::TensorOptions().device(options_.device);
    torch::Tensor qpos =
        torch::arange(start_pos, end, opts.dtype(torch::kInt64)).unsqueeze(1);
    torch::Tensor kpos =
        torch::arange(0, end, opts.dtype(torch::kInt64)).unsqueeze(0);
    torch::Tensor masked = (kpos > qpos);  // [T, n]
    scores = scores.view({nkv, group, t, end})
                 .masked_fill(masked, -INFINITY)
                 .view({nkv, group * t, end});
  }
  torch::Tensor probs = torch::softmax(scores, -1).to(options_.dtype);
  torch::Tensor out = torch::bmm(probs, values);  // [KV, G*T, hd]
  return out.view({nkv, group, t, hd})
      .permute({2, 0, 1, 3})
      .reshape({t, nh * hd});
}

torch::Tensor LlamaModel::AttentionRowsTorch(
    const Layer& layer, int layer_index, const torch::Tensor& h,
    const std::vector<RowSpan>& spans) const {
  const int64_t t = h.size(0);
  const int64_t hd = config_.head_dim;
  const int64_t nh = config_.num_attention_heads;
  const int64_t nkv = config_.num_key_value_heads;
  torch::Tensor x = RmsNorm(h, layer.input_norm);
  torch::Tensor qkv = Linear(x, layer.qkv_proj, layer.qkv_bias);
  torch::Tensor q_all = qkv.narrow(1, 0, nh * hd).view({t, nh, hd});
  torch::Tensor k_all = qkv.narrow(1, nh * hd, nkv * hd).view({t, nkv, hd});
  torch::Tensor v_all =
      qkv.narrow(1, (nh + nkv) * hd, nkv * hd).view({t, nkv, hd});
  if (layer.q_norm.defined()) {
    q_all = RmsNorm(q_all, layer.q_norm);
    k_all = RmsNorm(k_all, layer.k_norm);
  }
  std::vector<torch::Tensor> outs;
  outs.reserve(spans.size());
  auto index_opts =
      torch::TensorOptions().device(options_.device).dtype(torch::kInt64);
  for (const RowSpan& span : spans) {
    const BatchSequence& seq = *span.seq;
    const int64_t end = span.start_pos + span.rows;
    torch::Tensor q =
        ApplyRope(q_all.narrow(0, span.begin, span.rows), span.start_pos);
    torch::Tensor k =
        ApplyRope(k_all.narrow(0, span.begin, span.rows), span.start_pos);
    torch::Tensor v = v_all.narrow(0, span.begin, span.rows);
    torch::Tensor keys;
    torch::Tensor values;
    if (seq.kv != nullptr) {
      LayerKv& kv = (*seq.kv)[layer_index];
      kv.k.narrow(1, span.start_pos, span.rows).copy_(k.transpose(0, 1));
      kv.v.narrow(1, span.start_pos, span.rows).copy_(v.transpose(0, 1));
      keys = kv.k.narrow(1, 0, end);
      values = kv.v.narrow(1, 0, end);
    } else {
      // Paged: [blocks, KV, block_rows, hd]; position p is row p % B of
      // block table[p / B].
      const LayerKv& pool = seq.paged->layers[layer_index];
      const int64_t rows_per_block = seq.paged->block_rows;
      const int64_t used_blocks = (end + rows_per_block - 1) / rows_per_block;
      std::vector<int64_t> table(seq.blocks.begin(),
                                 seq.blocks.begin() + used_blocks);
      torch::Tensor table_t = torch::tensor(table, index_opts);
      torch::Tensor pos = torch::arange(span.start_pos, end, index_opts);
      torch::Tensor block_of =
          table_t.index_select(0, torch::div(pos, rows_per_block, "floor"));
      torch::Tensor row_of = torch::remainder(pos, rows_per_block);
      using torch::indexing::Slice;
      torch::Tensor kp = pool.k;  // handles share the pool's storage
      torch::Tensor vp = pool.v;
      kp.index_put_({block_of, Slice(), row_of}, k);
      vp.index_put_({block_of, Slice(), row_of}, v);
      keys = kp.index_select(0, table_t)
                 .permute({1, 0, 2, 3})
                 .reshape({nkv, used_blocks * rows_per_block, hd})
                 .narrow(1, 0, end);
      values = vp.index_select(0, table_t)
                   .permute({1, 0, 2, 3})
                   .reshape({nkv, used_blocks * rows_per_block, hd})
                   .narrow(1, 0, end);
    }
    outs.push_back(AttendTorch(q, keys, values, span.start_pos));
  }
  return h + Linear(torch::cat(outs, 0), layer.o_proj);
}

bool LlamaModel::RowPathApplies() const {
  return options_.device.is_cpu() && !layers_.empty() &&
         layers_[0].qkv_proj.packed() &&
         (options_.dtype == torch::kFloat32 ||
          options_.dtype == torch::kBFloat16);
}

std::vector<torch::Tensor> LlamaModel::ForwardBatch(
    absl::Span<const BatchSequence> batch) const {
  c10::InferenceMode guard;
  const int64_t hd = config_.head_dim;
  const int64_t nkv = config_.num_key_value_heads;
  const bool row_path = RowPathApplies();
  // Rows of the pass: each sequence's tokens, in batch order.
  std::vector<int64_t> ids;
  std::vector<int64_t> first_row(batch.size());
  std::vector<int> first_layer(batch.size());
  std::vector<int> last_layer(batch.size());
  bool capture = false;
  bool from_states = false;
  int64_t total_rows = 0;
  for (size_t s = 0; s < batch.size(); ++s) {
    const BatchSequence& seq = batch[s];
    const bool has_states = seq.input_states.defined();
    TORCH_CHECK(has_states != !seq.tokens.empty(), "ForwardBatch: sequence ", s,
                " needs exactly one of tokens and input_states");
    first_layer[s] = seq.first_layer;
    last_layer[s] = seq.last_layer < 0 ? num_layers() : seq.last_layer;
    TORCH_CHECK(0 <= first_layer[s] && first_layer[s] <= last_layer[s] &&
                    last_layer[s] <= num_layers(),
                "ForwardBatch: sequence ", s, " has the layer range [",
                seq.first_layer, ", ", seq.last_layer, "), not within [0, ",
                num_layers(), "]");
    TORCH_CHECK(first_layer[s] == 0 || has_states, "ForwardBatch: sequence ", s,
                " starts at layer ", first_layer[s], " and needs input_states");
    TORCH_CHECK(seq.boundary_states == nullptr ||
                    (!has_states && last_layer[s] == num_layers()),
                "ForwardBatch: sequence ", s,
                " captures boundary states but runs a partial pass");
    if (has_states) {
      TORCH_CHECK(seq.input_states.dim() == 2 && seq.input_states.size(0) > 0 &&
                      seq.input_states.size(1) == config_.hidden_size &&
                      seq.input_states.scalar_type() == options_.dtype &&
                      seq.input_states.device() == options_.device,
                  "ForwardBatch: sequence ", s, " has input_states of shape ",
                  seq.input_states.sizes(), " and dtype ",
                  seq.input_states.scalar_type(), ", wants [rows, ",
                  config_.hidden_size, "] in ", DtypeName(options_.dtype),
                  " on the model's device");
      from_states = true;
    }
    TORCH_CHECK((seq.paged != nullptr) != (seq.kv != nullptr),
                "ForwardBatch: sequence ", s,
                " needs exactly one of paged or contiguous K/V");
    TORCH_CHECK(seq.skip == nullptr || seq.skip->num_layers() == num_layers(),
                "mask has ", seq.skip == nullptr ? 0 : seq.skip->num_layers(),
                " layers, model has ", num_layers());
    const int64_t end = seq.start_pos + seq.rows();
    TORCH_CHECK(end <= max_context_, "ForwardBatch: position ", end,
                " past the context of ", max_context_);
    if (seq.paged != nullptr) {
      TORCH_CHECK(
          static_cast<int64_t>(seq.blocks.size()) * seq.paged->block_rows >=
              end,
          "ForwardBatch: sequence ", s, " has K/V blocks for ",
          seq.blocks.size() * seq.paged->block_rows, " positions, needs ", end);
      for (int32_t b : seq.blocks) {
        TORCH_CHECK(b >= 0 && b < seq.paged->num_blocks,
                    "ForwardBatch: block id ", b, " outside the pool");
      }
    } else {
      TORCH_CHECK(static_cast<int>(seq.kv->size()) == num_layers(), "KV has ",
                  seq.kv->size(), " layers, model has ", num_layers());
      TORCH_CHECK(end <= (*seq.kv)[0].k.size(1),
                  "attention past KV capacity: ", end, " > ",
                  (*seq.kv)[0].k.size(1));
    }
    first_row[s] = total_rows;
    total_rows += seq.rows();
    ids.insert(ids.end(), seq.tokens.begin(), seq.tokens.end());
    capture = capture || seq.boundary_states != nullptr;
  }
  if (batch.empty()) return {};
  torch::Tensor h;
  if (!from_states) {
    h = Embed(torch::tensor(ids, torch::kInt64));
  } else {
    // Embeddings (a row-wise lookup) for the token sequences, the given
    // states for the others, in batch order.
    torch::Tensor embedded;
    if (!ids.empty()) embedded = Embed(torch::tensor(ids, torch::kInt64));
    std::vector<torch::Tensor> pieces;
    int64_t at = 0;
    for (const BatchSequence& seq : batch) {
      if (seq.input_states.defined()) {
        pieces.push_back(seq.input_states);
      } else {
        const int64_t rows = seq.rows();
        pieces.push_back(embedded.narrow(0, at, rows));
        at += rows;
      }
    }
    h = torch::cat(pieces, 0).contiguous();
  }
  std::vector<torch::Tensor> boundaries;
  if (capture) boundaries.push_back(h);

  // The sequences that run sublayer `sublayer`, as spans of the rows they
  // occupy in `h` (all rows) or in the gathered subset; `index` receives the
  // gathered row ids when not all sequences run it.
  auto spans_for = [&](int sublayer, int layer_index, bool attention,
                       std::vector<RowSpan>& spans,
                       std::vector<int64_t>& index) {
    spans.clear();
    index.clear();
    bool all = true;
    int64_t next = 0;
    for (size_t s = 0; s < batch.size(); ++s) {
      const BatchSequence& seq = batch[s];
      const int64_t rows = seq.rows();
      if ((seq.skip != nullptr && seq.skip->skipped(sublayer)) ||
          layer_index < first_layer[s] || layer_index >= last_layer[s]) {
        all = false;
        continue;
      }
      RowSpan span;
      span.begin = next;
      span.rows = rows;
      span.start_pos = seq.start_pos;
      span.seq = &seq;
      if (attention && row_path) {
        if (seq.kv != nullptr) {
          const LayerKv& kv = (*seq.kv)[layer_index];
          span.view = ContiguousKvView(kv.k, kv.v);
        } else {
          const LayerKv& pool = seq.paged->layers[layer_index];
          const int64_t b = seq.paged->block_rows;
          span.view.k = pool.k.data_ptr();
          span.view.v = pool.v.data_ptr();
          span.view.dtype = pool.k.scalar_type();
          span.view.num_kv_heads = nkv;
          span.view.head_dim = hd;
          span.view.head_stride = b * hd;
          span.view.blocks =
              kernels::KvBlocks{seq.blocks.data(), b, nkv * b * hd};
        }
      }
      spans.push_back(span);
      for (int64_t r = 0; r < rows; ++r) index.push_back(first_row[s] + r);
      next += rows;
    }
    return all;
  };

  std::vector<RowSpan> spans;
  std::vector<int64_t> index;
  for (int i = 0; i < num_layers(); ++i) {
    const Layer& layer = layers_[i];
    // Sequences told to stop (an early exit) run no layer from here on.
    for (size_t s = 0; s < batch.size(); ++s) {
      if (batch[s].stop != nullptr && *batch[s].stop && i < last_layer[s])
        last_layer[s] = std::max(first_layer[s], i);
    }
    for (int part = 0; part < 2; ++part) {
      const bool attention = part == 0;
      const bool all = spans_for(2 * i + part, i, attention, spans, index);
      if (!spans.empty()) {
        torch::Tensor index_t;
        torch::Tensor x = h;
        // The running rows are often one block of h (an early exit's rows,
        // a lone sequence): a view, then, and no gather.
        const int64_t count = static_cast<int64_t>(index.size());
        const bool block =
            !all && !capture && index.back() - index.front() + 1 == count;
        if (block) {
          x = h.narrow(0, index.front(), count);
        } else if (!all) {
          index_t = torch::tensor(index, torch::kInt64).to(options_.device);
          x = h.index_select(0, index_t);
        }
        torch::Tensor y;
        if (attention) {
          if (!row_path) {
            y = AttentionRowsTorch(layer, i, x, spans);
          } else if (options_.dtype == torch::kFloat32) {
            y = AttentionRows<float>(layer, x, spans);
          } else {
            y = AttentionRows<c10::BFloat16>(layer, x, spans);
          }
        } else if (row_path) {
          y = options_.dtype == torch::kFloat32
                  ? MlpFewRows<float>(layer, x)
                  : MlpFewRows<c10::BFloat16>(layer, x);
        } else {
          y = Mlp(i, x);
        }
        if (block) {
          // In place: no boundary state shares h's storage (block needs
          // !capture), and h is this pass's own tensor.
          h.narrow(0, index.front(), count).copy_(y);
        } else {
          // Out of place: earlier boundary states keep their values.
          h = all ? y : h.index_copy(0, index_t, y);
        }
      }
      if (capture) boundaries.push_back(h);
    }
    for (size_t s = 0; s < batch.size(); ++s) {
      if (batch[s].after_layer && first_layer[s] <= i && i < last_layer[s]) {
        batch[s].after_layer(
            i, h.narrow(0, first_row[s] + batch[s].rows() - 1, 1));
      }
    }
  }

  // Logits rows: each sequence's last num_logits rows, in one LM-head pass.
  std::vector<int64_t> logit_rows;
  std::vector<int64_t> logit_count(batch.size());
  for (size_t s = 0; s < batch.size(); ++s) {
    const int64_t rows = batch[s].rows();
    const int64_t n =
        batch[s].num_logits < 0 ? rows : std::min(batch[s].num_logits, rows);
    logit_count[s] = n;
    for (int64_t r = rows - n; r < rows; ++r)
      logit_rows.push_back(first_row[s] + r);
  }
  torch::Tensor logits;
  if (!logit_rows.empty()) {
    torch::Tensor x = h.index_select(
        0, torch::tensor(logit_rows, torch::kInt64).to(options_.device));
    logits = row_path ? RowLogits(x) : Logits(x);
  }
  std::vector<torch::Tensor> out(batch.size());
  int64_t at = 0;
  for (size_t s = 0; s < batch.size(); ++s) {
    if (batch[s].reached_layer != nullptr)
      *batch[s].reached_layer = last_layer[s];
    if (logit_count[s] > 0) out[s] = logits.narrow(0, at, logit_count[s]);
    at += logit_count[s];
    if (batch[s].output_states != nullptr) {
      *batch[s].output_states = h.narrow(0, first_row[s], batch[s].rows());
    }
    if (batch[s].boundary_states != nullptr) {
      const int64_t rows = batch[s].rows();
      std::vector<torch::Tensor> mine;
      mine.reserve(boundaries.size());
      for (const torch::Tensor& b : boundaries)
        mine.push_back(b.narrow(0, first_row[s], rows));
      *batch[s].boundary_states = torch::stack(mine);
    }
  }
  return out;
}

torch::Tensor LlamaModel::Mlp(int layer_index, const torch::Tensor& h) const {
  c10::InferenceMode guard;
  const Layer& layer = layers_[layer_index];
  if (FewRowsApply(h)) {
    return h.scalar_type() == torch::kFloat32
               ? MlpFewRows<float>(layer, h)
               : MlpFewRows<c10::BFloat16>(layer, h);
  }
  const int64_t inter = config_.intermediate_size;
  torch::Tensor x =
      RmsNorm(h, layer.post_norm).reshape({-1, config_.hidden_size});
  torch::Tensor gu = Linear(x, layer.gate_up_proj);
  torch::Tensor act =
      torch::silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter);
  return h + Linear(act.contiguous(), layer.down_proj).view(h.sizes());
}

namespace {

// BranchAttention's attention output (before o_proj) with its prefix part in
// the shared-prefix kernel (decode_attention.h) and each branch's attention
// over its own tokens in LibTorch, the two merged by their softmax maxima and
// sums. q [B, r, H, D], k / v [B, r, KV, D] in the model dtype, RoPE applied;
// returns [B * r, H * D] in q's dtype. float32 throughout, as the LibTorch
// path.
torch::Tensor BranchAttentionByKernel(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const LayerKv& prefix, int64_t prefix_len,
    absl::Span<const int64_t> row_prefix_limits, float scale) {
  const int64_t b = q.size(0), r = q.size(1), nh = q.size(2), hd = q.size(3);
  const int64_t nkv = k.size(2), group = nh / nkv;
  const bool per_row = !row_prefix_limits.empty();
  std::vector<int64_t> lens(r, prefix_len);
  if (per_row) lens.assign(row_prefix_limits.begin(), row_prefix_limits.end());
  const torch::Tensor qf = q.to(torch::kFloat32).contiguous();
  SharedPrefixAttention shared =
      AttendSharedPrefix(qf, prefix.k, prefix.v, lens, scale);

  // Each branch's own tokens: query rows (token t, head g of the KV head) as
  // [B, KV, r * G], keys and values [B, KV, r, D].
  torch::Tensor qs = (qf * scale)
                         .view({b, r, nkv, group, hd})
                         .permute({0, 2, 1, 3, 4})
                         .reshape({b, nkv, r * group, hd});
  torch::Tensor own_k = k.permute({0, 2, 3, 1}).to(torch::kFloat32);
  torch::Tensor own_v = v.permute({0, 2, 1, 3}).to(torch::kFloat32);
  auto opts = torch::TensorOptions().dtype(torch::kInt64);
  // Row t * G + g is token t; later tokens are hidden (causal), or with
  // per-row prefix limits every other one.
  torch::Tensor row_token =
      torch::arange(r, opts).repeat_interleave(group).unsqueeze(1);
  torch::Tensor column = torch::arange(r, opts).unsqueeze(0);
  torch::Tensor hidden = per_row ? column != row_token : column > row_token;
  torch::Tensor scores =
      torch::matmul(qs, own_k).masked_fill(hidden, -INFINITY);
  torch::Tensor own_max = scores.amax(-1, /*keepdim=*/true);
  torch::Tensor own_exp = (scores - own_max).exp_();
  torch::Tensor own_sum = own_exp.sum(-1, /*keepdim=*/true);
  torch::Tensor own_out = torch::matmul(own_exp, own_v);  // not normalized
  // [B, KV, r * G, x] -> [B, r, H, x], the kernel's layout.
  auto to_heads = [&](const torch::Tensor& t) {
    return t.view({b, nkv, r, group, t.size(-1)})
        .permute({0, 2, 1, 3, 4})
        .reshape({b, r, nh, t.size(-1)});
  };
  own_max = to_heads(own_max);
  own_sum = to_heads(own_sum);
  own_out = to_heads(own_out);
  // Every row sees its own token, so own_max is finite; a row that sees no
  // prefix entry has shared.max = -inf and shared.sum = 0, so its prefix
  // weight is 0.
  torch::Tensor max = torch::maximum(shared.max, own_max);
  torch::Tensor prefix_weight = shared.sum * (shared.max - max).exp_();
  torch::Tensor own_weight = (own_max - max).exp_();
  torch::Tensor out = (shared.out * prefix_weight + own_out * own_weight) /
                      (prefix_weight + own_sum * own_weight);
  return out.reshape({b * r, nh * hd}).to(q.scalar_type());
}

}  // namespace

torch::Tensor LlamaModel::BranchAttention(
    int layer_index, const torch::Tensor& h, int64_t first_position,
    const LayerKv& prefix, int64_t prefix_len,
    absl::Span<const int64_t> row_prefix_limits) const {
  c10::InferenceMode guard;
  const Layer& layer = layers_[layer_index];
  TORCH_CHECK(h.dim() == 3, "BranchAttention wants [B, r, hidden]");
  const int64_t b = h.size(0);
  const int64_t r = h.size(1);
  const int64_t hd = config_.head_dim;
  const int64_t nh = config_.num_attention_heads;
  const int64_t nkv = config_.num_key_value_heads;
  const int64_t group = nh / nkv;
  TORCH_CHECK(first_position + r <= max_context_,
              "BranchAttention past the context");
  const bool per_row = !row_prefix_limits.empty();
  if (per_row) {
    TORCH_CHECK(static_cast<int64_t>(row_prefix_limits.size()) == r,
                "BranchAttention: one prefix limit per token");
    for (int64_t i = 0; i < r; ++i) {
      TORCH_CHECK(
          row_prefix_limits[i] >= 0 && row_prefix_limits[i] <= prefix_len &&
              (i == 0 || row_prefix_limits[i] >= row_prefix_limits[i - 1]),
          "BranchAttention: prefix limits must be non-decreasing and "
          "within prefix_len");
    }
  }

  torch::Tensor x =
      RmsNorm(h, layer.input_norm).reshape({b * r, config_.hidden_size});
  torch::Tensor qkv = Linear(x, layer.qkv_proj, layer.qkv_bias);
  torch::Tensor q = qkv.narrow(1, 0, nh * hd).reshape({b, r, nh, hd});
  torch::Tensor k = qkv.narrow(1, nh * hd, nkv * hd).reshape({b, r, nkv, hd});
  torch::Tensor v =
      qkv.narrow(1, (nh + nkv) * hd, nkv * hd).reshape({b, r, nkv, hd});
  if (layer.q_norm.defined()) {
    q = RmsNorm(q, layer.q_norm);
    k = RmsNorm(k, layer.k_norm);
  }
  q = ApplyRope(q, first_position);
  k = ApplyRope(k, first_position);

  // On a CPU with fp32 or bf16 K/V and a head size the SIMD kernel takes,
  // the prefix part runs in it (BranchAttentionByKernel above: 26-27 ms
  // against 36-39 ms for a stories-24l-skip layer over 55 branches x 16
  // tokens at a 1035-token prefix). Elsewhere (CUDA, fp16, other head
  // sizes, no prefix) LibTorch, as follows.
  //
  // Rows grouped by KV head: [KV, B, G*r, hd], each KV head's query group
  // and the r tokens of every branch as rows. The prefix K/V is the same for
  // every branch, so the prefix part is one [B*G*r, hd] x [hd, P] product per
  // KV head (a broadcast matmul over B would copy the prefix K and V for
  // every branch and run B small products: 3x slower at P = 1k). The
  // attention itself runs in float32 for every model dtype: LibTorch's CPU
  // bf16 products are slower than float32 ones, and the decode's kernels
  // accumulate attention in float32 too.
  const float scale =
      static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  if (prefix_len > 0 &&
      SharedPrefixAttentionApplies(prefix.k.device(), prefix.k.scalar_type(),
                                   hd) &&
      prefix.k.is_contiguous() && prefix.v.is_contiguous()) {
    return h + Linear(BranchAttentionByKernel(q, k, v, prefix, prefix_len,
                                              row_prefix_limits, scale),
                      layer.o_proj)
                   .view(h.sizes());
  }
  const auto f32 = torch::kFloat32;
  torch::Tensor qg = q.view({b, r, nkv, group, hd})
                         .permute({2, 0, 3, 1, 4})
                         .to(f32)
                         .reshape({nkv, b, group * r, hd});
  torch::Tensor own_k = k.permute({2, 0, 3, 1}).to(f32);  // [KV, B, hd, r]
  torch::Tensor own_v = v.permute({2, 0, 1, 3}).to(f32);  // [KV, B, r, hd]
  // The scale goes on the queries (small), not on the scores (large).
  qg = qg * scale;
  torch::Tensor self_scores = torch::matmul(qg, own_k);
  auto opts =
      torch::TensorOptions().device(options_.device).dtype(torch::kInt64);
  // Branch tokens a row may not see: later ones (causal), or with per-row
  // prefix limits every other one.
  torch::Tensor column = torch::arange(r, opts).unsqueeze(0);
  torch::Tensor row = torch::arange(r, opts).unsqueeze(1);
  torch::Tensor hidden = per_row ? column != row : column > row;
  // [KV, B*G*r, r]; every row keeps its own token, so its max is finite.
  self_scores = self_scores.reshape({nkv, b, group, r, r})
                    .masked_fill(hidden, -INFINITY)
                    .reshape({nkv, b * group * r, r});
  torch::Tensor max = self_scores.amax(-1, /*keepdim=*/true);
  torch::Tensor prefix_exp;  // [KV, B*G*r, P]
  if (prefix_len > 0) {
    torch::Tensor pk = prefix.k.narrow(1, 0, prefix_len).to(f32);  // [KV,P,hd]
    prefix_exp =
        torch::matmul(qg.reshape({nkv, b * group * r, hd}), pk.transpose(1, 2));
    if (per_row) {
      // Row i sees entries [0, limit_i): exp(-inf - max) = 0 below.
      torch::Tensor limits =
          torch::tensor(std::vector<int64_t>(row_prefix_limits.begin(),
                                             row_prefix_limits.end()),
                        opts)
              .unsqueeze(1);  // [r, 1]
      torch::Tensor beyond =
          torch::arange(prefix_len, opts).unsqueeze(0) >= limits;  // [r, P]
      prefix_exp = prefix_exp.reshape({nkv, b * group, r, prefix_len})
                       .masked_fill(beyond, -INFINITY)
                       .reshape({nkv, b * group * r, prefix_len});
    }
    max = torch::maximum(max, prefix_exp.amax(-1, /*keepdim=*/true));
  }
  // The softmax over [prefix, own tokens] in parts, without concatenating
  // the scores: exp(s - max), normalized after the products.
  torch::Tensor self_exp = (self_scores - max).exp_();
  torch::Tensor denominator = self_exp.sum(-1, /*keepdim=*/true);
  torch::Tensor out =
      torch::matmul(self_exp.reshape({nkv, b, group * r, r}), own_v)
          .reshape({nkv, b * group * r, hd});
  if (prefix_len > 0) {
    prefix_exp.sub_(max).exp_();
    denominator = denominator + prefix_exp.sum(-1, /*keepdim=*/true);
    out = out +
          torch::matmul(prefix_exp, prefix.v.narrow(1, 0, prefix_len).to(f32));
  }
  out = (out / denominator).to(options_.dtype);
  // [KV, B*G*r, hd] -> [B, r, H*hd]
  out = out.reshape({nkv, b, group, r, hd})
            .permute({1, 3, 0, 2, 4})
            .reshape({b * r, nh * hd});
  return h + Linear(out, layer.o_proj).view(h.sizes());
}

torch::Tensor LlamaModel::RowLogits(const torch::Tensor& h) const {
  const torch::Tensor x = h.contiguous();
  // The final norm row by row, so a row's logits never depend on the number
  // of rows.
  torch::Tensor normed = torch::empty_like(x);
  const int64_t n = x.size(0);
  const float eps = static_cast<float>(config_.rms_norm_eps);
  if (options_.dtype == torch::kFloat32) {
    row_ops::RmsNorm<float>(x.data_ptr<float>(), final_norm_.data_ptr<float>(),
                            n, config_.hidden_size, eps,
                            normed.data_ptr<float>());
  } else {
    row_ops::RmsNorm<c10::BFloat16>(
        x.data_ptr<c10::BFloat16>(), final_norm_.data_ptr<c10::BFloat16>(), n,
        config_.hidden_size, eps, normed.data_ptr<c10::BFloat16>());
  }
  torch::Tensor logits = LinearFloatOut(normed, lm_head_);
  if (options_.dtype != torch::kFloat32) {
    // As the LibTorch path: the LM head's output in the model dtype, then
    // float32. On this thread alone (ScopedSerialAten): over a vocabulary
    // above 32,768 each conversion was an OpenMP region, whose spinning
    // workers took a core from the next pass's kernels (smollm2-135m bf16,
    // 2 threads: 73-80 tok/s, 110-162 without them; 2-core Zen 4 VM).
    ScopedSerialAten serial;
    logits = logits.to(options_.dtype).to(torch::kFloat32);
  }
  return logits;
}

torch::Tensor LlamaModel::Logits(const torch::Tensor& h) const {
  c10::InferenceMode guard;
  // A few rows (a decode step's, an exit check's) take the row-wise path,
  // bit for bit the logits ForwardBatch gives the same states.
  if (h.dim() == 2 && h.scalar_type() == options_.dtype && FewRowsApply(h) &&
      RowPathApplies()) {
    return RowLogits(h);
  }
  torch::Tensor x = RmsNorm(h, final_norm_);
  std::vector<int64_t> out_shape = h.sizes().vec();
  out_shape.back() = config_.vocab_size;
  return Linear(x.reshape({-1, config_.hidden_size}), lm_head_)
      .to(torch::kFloat32)
      .view(out_shape);
}

torch::Tensor LlamaModel::LmHead(const torch::Tensor& x) const {
  c10::InferenceMode guard;
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = config_.vocab_size;
  return Linear(x.reshape({-1, config_.hidden_size}).contiguous(), lm_head_)
      .to(torch::kFloat32)
      .view(out_shape);
}

torch::Tensor LlamaModel::Forward(const torch::Tensor& token_ids,
                                  int64_t start_pos, std::vector<LayerKv>& kv,
                                  int64_t num_logits) const {
  ForwardOptions options;
  options.num_logits = num_logits;
  return Forward(token_ids, start_pos, kv, options);
}

torch::Tensor LlamaModel::Forward(const torch::Tensor& token_ids,
                                  int64_t start_pos, std::vector<LayerKv>& kv,
                                  const ForwardOptions& options) const {
  c10::InferenceMode guard;
  TORCH_CHECK(static_cast<int>(kv.size()) == num_layers(), "KV has ", kv.size(),
              " layers, model has ", num_layers());
  const LayerMask* skip = options.skip;
  TORCH_CHECK(skip == nullptr || skip->num_layers() == num_layers(),
              "mask has ", skip == nullptr ? 0 : skip->num_layers(),
              " layers, model has ", num_layers());
  torch::Tensor h = Embed(token_ids);
  std::vector<torch::Tensor> boundaries;
  if (options.boundary_states != nullptr) {
    boundaries.reserve(num_sublayers() + 1);
    boundaries.push_back(h);
  }
  for (int i = 0; i < num_layers(); ++i) {
    if (skip == nullptr || !skip->skip_attention(i))
      h = Attention(i, h, start_pos, kv[i]);
    if (options.boundary_states != nullptr) boundaries.push_back(h);
    if (skip == nullptr || !skip->skip_mlp(i)) h = Mlp(i, h);
    if (options.boundary_states != nullptr) boundaries.push_back(h);
  }
  if (options.boundary_states != nullptr)
    *options.boundary_states = torch::stack(boundaries);
  const int64_t t = h.size(0);
  const int64_t num_logits = options.num_logits;
  if (num_logits >= 0 && num_logits < t)
    h = h.narrow(0, t - num_logits, num_logits);
  return Logits(h);
}

torch::Tensor LlamaModel::Prefill(const torch::Tensor& token_ids,
                                  int64_t start_pos, std::vector<LayerKv>& kv,
                                  int64_t chunk_size) const {
  c10::InferenceMode guard;
  TORCH_CHECK(chunk_size > 0, "chunk_size must be positive");
  const int64_t n = token_ids.size(0);
  TORCH_CHECK(n > 0, "Prefill needs at least one token");
  torch::Tensor logits;
  for (int64_t begin = 0; begin < n; begin += chunk_size) {
    const int64_t len = std::min(chunk_size, n - begin);
    const bool last = begin + len == n;
    logits = Forward(token_ids.narrow(0, begin, len), start_pos + begin, kv,
                     last ? 1 : 0);
  }
  return logits[0];
}

}  // namespace knapserve

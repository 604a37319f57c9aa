// LlamaModel: the Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3,
// SmolLM) in LibTorch, with a sublayer-level API.
//
// A model with L layers is 2L sublayers in order: attention 0, MLP 0,
// attention 1, ... Each sublayer includes its own RMSNorm and its residual add,
// so a caller can run any subset of them in order (the self-speculative draft
// skips some) and the full model is simply all of them:
//
//   h = Embed(ids)
//   for i in 0..L-1: h = Attention(i, h, start, kv[i]); h = Mlp(i, h)
//   logits = Logits(h)
//
// Hidden states are [T, hidden] tensors (one sequence, T new positions) in the
// model's dtype on the model's device; logits are always float32.
//
// Ownership: the model owns its weights (copied out of the checkpoint into the
// requested dtype and device; the checkpoint is closed after Load). K/V storage
// is owned by the caller (see AllocateKv and executor/engine/kv_cache.h), so
// many sequences can share one model.
//
// Thread safety: a loaded model is immutable; all const methods may be called
// from several threads at once as long as each thread passes its own KV
// storage. Torch's intra-op thread count is process-wide
// (ModelOptions.threads).
#ifndef KNAPSERVE_COMMON_MODEL_LLAMA_H_
#define KNAPSERVE_COMMON_MODEL_LLAMA_H_

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/checkpoint/model_config.h"
#include "common/model/layer_mask.h"
#include "common/model/linear.h"

namespace knapserve {

class Checkpoint;

// How to materialize a model. Like LibTorch's options structs: set what you
// need, the rest keeps its default.
struct ModelOptions {
  torch::Device device = torch::kCPU;
  torch::ScalarType dtype = torch::kFloat32;  // kFloat32, kBFloat16 or kFloat16
  // Torch intra-op threads for this process; 0 leaves the current setting.
  int threads = 0;
};

// Parses "fp32" / "float32", "bf16" / "bfloat16", "fp16" / "float16".
absl::StatusOr<torch::ScalarType> ParseDtype(const std::string& name);
// "fp32", "bf16" or "fp16".
std::string DtypeName(torch::ScalarType dtype);
// Parses "cpu", "cuda", "cuda:N". Errors if CUDA is asked for but unavailable.
absl::StatusOr<torch::Device> ParseDevice(const std::string& name);

// One layer's preallocated K/V storage, each [num_kv_heads, capacity, head_dim]
// in the model's dtype and device. Position p of the sequence lives at index p.
struct LayerKv {
  torch::Tensor k;
  torch::Tensor v;
};

// The K/V memory of a paged pool (executor/engine/kv_pool.h owns one): per
// layer, K and V of [num_blocks, num_kv_heads, block_rows, head_dim] in the
// model's dtype and device. A sequence owns some of the blocks, listed in its
// block table: position p lives in block table[p / block_rows], row
// p % block_rows.
struct PagedKvStorage {
  std::vector<LayerKv> layers;
  int64_t num_blocks = 0;
  int64_t block_rows = 0;  // positions per block, a positive multiple of 16
};

// One sequence's part of a batched forward pass (LlamaModel::ForwardBatch).
// Everything is borrowed for the duration of the call.
//
// Partial passes (SpecBound's early-exit drafting,
// executor/engine/specbound.h): a sequence may run only the layers
// [first_layer, last_layer). It then starts from `input_states` instead of
// `tokens` (the hidden states after layer first_layer - 1 of positions whose
// K/V in layers [0, first_layer) the caller has already written), and its
// logits and `output_states` are taken after layer last_layer - 1. Running
// [0, a) and then [a, L) with the first pass's output_states as the second's
// input_states gives bit-identically the logits and K/V of one full pass on
// the row-wise CPU path (see ForwardBatch's batch invariance).
struct BatchSequence {
  // The new tokens, at positions start_pos .. start_pos + size - 1. Empty
  // when `input_states` gives the rows.
  absl::Span<const int32_t> tokens;
  // Instead of `tokens`: [rows, hidden] hidden states in the model's dtype
  // on its device, the input of layer first_layer. Exactly one of `tokens`
  // and `input_states`; first_layer > 0 needs input_states.
  torch::Tensor input_states;
  // The layers this sequence runs: [first_layer, last_layer), with
  // 0 <= first_layer <= last_layer <= L; last_layer < 0 means L. An empty
  // range runs no layer (logits straight from input_states).
  int first_layer = 0;
  int last_layer = -1;
  // If set, receives the hidden states after layer last_layer - 1 (before
  // the final norm), [rows, hidden] in the model dtype.
  torch::Tensor* output_states = nullptr;
  int64_t start_pos = 0;
  // Its K/V, which must hold positions [0, start_pos) and room up to
  // start_pos + size: paged (`paged` and the block table `blocks`) or
  // contiguous (`kv`, one LayerKv per layer). Exactly one of them.
  const PagedKvStorage* paged = nullptr;
  absl::Span<const int32_t> blocks;
  std::vector<LayerKv>* kv = nullptr;
  // Sublayers this sequence skips (a draft); nullptr runs all of them. Each
  // sequence of a batch may have its own mask.
  const LayerMask* skip = nullptr;
  // Logits for the last `num_logits` rows (0 = none, < 0 = all rows).
  int64_t num_logits = 1;
  // If set, receives this sequence's hidden states at all 2L+1 sublayer
  // boundaries, [2L+1, size, hidden] (as ForwardOptions::boundary_states).
  // Only for a sequence that runs all layers from its tokens.
  torch::Tensor* boundary_states = nullptr;

  // Early exit inside the pass (SpecBound's exit checks,
  // executor/engine/specbound.h). `after_layer`, if set, is called on the
  // calling thread after each layer l this sequence runs, with l and the
  // hidden state of its last row after l ([1, hidden], valid during the
  // call); it must not throw. `stop`, if set, is read before every layer:
  // once true, the sequence runs no further layer (one that has not reached
  // its first_layer yet runs none), and its logits and output_states are
  // taken where it stopped. Several sequences may share one flag: rows of
  // one draft that join the pass at different layers stop together, after
  // the layer whose after_layer set it. `reached_layer`, if set, receives
  // the end of the layers it ran: last_layer, or where it stopped
  // (first_layer if it ran none).
  std::function<void(int layer, const torch::Tensor& state)> after_layer;
  const bool* stop = nullptr;
  int* reached_layer = nullptr;

  // Rows of this sequence in the pass (tokens or input_states).
  int64_t rows() const {
    return input_states.defined() ? input_states.size(0)
                                  : static_cast<int64_t>(tokens.size());
  }
};

// Options of one whole-model pass (LlamaModel::Forward).
struct ForwardOptions {
  // Sublayers to skip (the self-speculative draft); nullptr runs all of them.
  // A skipped attention sublayer computes nothing and writes no K/V.
  const LayerMask* skip = nullptr;
  // Logits for the last `num_logits` rows only; < 0 means all rows.
  int64_t num_logits = -1;
  // If set, receives the hidden states at all 2L+1 sublayer boundaries
  // (0 = embeddings, 2i+1 = after attention i, 2i+2 = after MLP i) as one
  // [2L+1, T, hidden] tensor in the model dtype.
  torch::Tensor* boundary_states = nullptr;
};

class LlamaModel {
 public:
  // Loads config.json (+ generation_config.json) and the safetensors weights
  // from `model_dir`. Errors name the file and the problem: a missing or
  // misshapen tensor, an unsupported model_type or dtype.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> Load(
      const std::string& model_dir, const ModelOptions& options);
  // Same, from an already parsed config and an open checkpoint.
  static absl::StatusOr<std::unique_ptr<LlamaModel>> FromCheckpoint(
      const ModelConfig& config, const Checkpoint& checkpoint,
      const ModelOptions& options);

  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  const ModelConfig& config() const { return config_; }
  int num_layers() const { return static_cast<int>(layers_.size()); }
  int num_sublayers() const { return 2 * num_layers(); }
  // The longest sequence (prompt + generated) this model accepts.
  int64_t max_context() const { return max_context_; }
  torch::Device device() const { return options_.device; }
  torch::ScalarType dtype() const { return options_.dtype; }
  // Bytes of weights one decode step reads (all layers, final norm, LM head).
  int64_t weight_bytes_per_token() const { return weight_bytes_per_token_; }
  // The checkpoint's Checkpoint::WeightsFingerprint(): which weights these
  // are (config().Fingerprint() only says which architecture). Files that
  // hold hidden states of this model (KNN-SSD anchors) are keyed by it.
  const std::string& weights_fingerprint() const {
    return weights_fingerprint_;
  }

  // K/V storage for `capacity` positions (capacity <= max_context()), one
  // entry per layer, zero-filled.
  std::vector<LayerKv> AllocateKv(int64_t capacity) const;
  // Paged K/V memory: `num_blocks` blocks of `block_rows` positions (a
  // positive multiple of 16) for every layer, zero-filled.
  PagedKvStorage AllocatePagedKv(int64_t num_blocks, int64_t block_rows) const;
  // Bytes one block of `block_rows` positions takes across all layers (K and
  // V).
  int64_t KvBytesPerBlock(int64_t block_rows) const;

  // ---- Sublayer API ----
  // [T] int64 token ids (any device) -> [T, hidden].
  torch::Tensor Embed(const torch::Tensor& token_ids) const;
  // Attention sublayer `layer`: h + o_proj(attn(rmsnorm(h))). The T rows of h
  // are positions start_pos .. start_pos+T-1. Writes their K/V into `kv` and
  // attends causally over positions [0, start_pos+T) of `kv`.
  torch::Tensor Attention(int layer, const torch::Tensor& h, int64_t start_pos,
                          LayerKv& kv) const;
  // MLP sublayer `layer`: h + down(silu(gate(x)) * up(x)), x = rmsnorm(h).
  // h may have leading batch dimensions ([..., hidden]).
  torch::Tensor Mlp(int layer, const torch::Tensor& h) const;
  // Attention sublayer `layer` for the planner's knapsack DP: h is
  // [B, r, hidden], B candidate branches of the same r tokens at positions
  // first_position .. first_position+r-1. Each token attends to `prefix`
  // positions [0, prefix_len) (the full model's K/V, shared by all branches)
  // and causally to its own branch's tokens; nothing is written to any cache.
  // prefix_len may be < first_position when only a window of K/V is known.
  //
  // With `row_prefix_limits` (r entries, non-decreasing, each <= prefix_len)
  // token i instead attends to prefix entries [0, row_prefix_limits[i]) and
  // to itself only: the first token of a draft, which sees the full model's
  // K/V of every earlier position (the prefix then holds the r tokens' own
  // entries too, written by the full model) and its own.
  // float32 attention for every dtype; on a CPU the prefix part runs in the
  // decode's SIMD kernel where it applies (AttendSharedPrefix,
  // decode_attention.h), on the calling thread's intra-op threads.
  torch::Tensor BranchAttention(
      int layer, const torch::Tensor& h, int64_t first_position,
      const LayerKv& prefix, int64_t prefix_len,
      absl::Span<const int64_t> row_prefix_limits = {}) const;
  // Final RMSNorm and LM head: [..., hidden] -> float32 [..., vocab].
  torch::Tensor Logits(const torch::Tensor& h) const;
  // The LM head alone (no norm): [..., hidden] in the model dtype -> float32
  // [..., vocab]. Trained exit heads (exit_heads.h) feed it.
  torch::Tensor LmHead(const torch::Tensor& x) const;
  // The final RMSNorm's weight [hidden] and the LM head's [vocab, hidden]
  // (a fresh dense copy), for training exit heads.
  const torch::Tensor& final_norm_weight() const { return final_norm_; }
  torch::Tensor LmHeadWeight() const { return lm_head_.ToDense(); }

  // ---- Whole-model passes ----
  // Runs every sublayer over `token_ids` ([T] int64) at positions
  // start_pos.. and returns float32 logits for the last `num_logits` rows
  // (all rows if num_logits < 0). `kv` must hold start_pos+T positions.
  torch::Tensor Forward(const torch::Tensor& token_ids, int64_t start_pos,
                        std::vector<LayerKv>& kv,
                        int64_t num_logits = -1) const;
  // The same with a layer mask and/or boundary-state capture.
  torch::Tensor Forward(const torch::Tensor& token_ids, int64_t start_pos,
                        std::vector<LayerKv>& kv,
                        const ForwardOptions& options) const;
  // One pass over several sequences at once (continuous batching): every
  // sequence has its own positions, K/V, mask and logits rows; the linear
  // layers run over all rows together. Returns, per sequence, float32 logits
  // [num_logits, vocab] (an undefined tensor for num_logits == 0).
  //
  // Batch invariance: on CPU in fp32 or bf16 with packed weights, every row
  // is computed by the row-wise path (row_ops.h, the packed Linear, the
  // multi-query attention kernel), whose result for a row depends only on
  // that row and its own sequence's K/V. So a sequence's logits and K/V are
  // bit-identical whichever other sequences share the pass, and however its
  // tokens are split into passes (a prompt prefilled in any chunks). Other
  // devices and dtypes use LibTorch ops, which are not guaranteed
  // batch-invariant. The same holds for partial passes (BatchSequence's
  // first_layer / last_layer): a row's bits do not depend on which layers
  // of it ran in which pass.
  //
  // Throws (c10::Error) on a malformed batch: no rows, both or neither of
  // tokens and input_states, a bad layer range, input_states of the wrong
  // shape or dtype, K/V too short.
  std::vector<torch::Tensor> ForwardBatch(
      absl::Span<const BatchSequence> batch) const;

  // Forward in chunks of at most `chunk_size` positions (bounds the attention
  // score memory for long prompts); returns the last position's logits [vocab].
  torch::Tensor Prefill(const torch::Tensor& token_ids, int64_t start_pos,
                        std::vector<LayerKv>& kv,
                        int64_t chunk_size = 512) const;

 private:
  struct Layer {
    torch::Tensor input_norm;  // [hidden]
    LinearWeight
        qkv_proj;  // [(H + 2*KV) * head_dim, hidden]: q, k, v rows fused
    torch::Tensor qkv_bias;   // [(H + 2*KV) * head_dim] or undefined
    torch::Tensor q_norm;     // [head_dim] (qwen3) or undefined
    torch::Tensor k_norm;     // [head_dim] (qwen3) or undefined
    LinearWeight o_proj;      // [hidden, H * head_dim]
    torch::Tensor post_norm;  // [hidden]
    LinearWeight
        gate_up_proj;  // [2 * intermediate, hidden]: gate rows then up rows
    LinearWeight down_proj;  // [hidden, intermediate]
  };

  LlamaModel(ModelConfig config, ModelOptions options);
  // Whether the few-row CPU path (row_ops.h, packed Linear, DecodeAttention)
  // runs for hidden states h: CPU, fp32 or bf16, packed weights, a 2-D h of at
  // most kMaxDecodeAttentionRows rows. Decode, draft and verification steps.
  bool FewRowsApply(const torch::Tensor& h) const;
  template <typename E>
  torch::Tensor AttentionFewRows(const Layer& layer, const torch::Tensor& h,
                                 int64_t start_pos, LayerKv& kv) const;
  template <typename E>
  torch::Tensor MlpFewRows(const Layer& layer, const torch::Tensor& h) const;
  // A range of rows of a batched pass that belongs to one sequence.
  struct RowSpan;
  // The attention sublayer over rows of several sequences (row-wise path;
  // h is [rows, hidden], contiguous); returns the new hidden states.
  template <typename E>
  torch::Tensor AttentionRows(const Layer& layer, const torch::Tensor& h,
                              const std::vector<RowSpan>& spans) const;
  // The same with LibTorch ops (other devices and dtypes).
  torch::Tensor AttentionRowsTorch(const Layer& layer, int layer_index,
                                   const torch::Tensor& h,
                                   const std::vector<RowSpan>& spans) const;
  // Whether ForwardBatch can take the row-wise path (see ForwardBatch).
  bool RowPathApplies() const;
  // Final norm and LM head of [rows, hidden] states on the row-wise path:
  // float32 [rows, vocab].
  torch::Tensor RowLogits(const torch::Tensor& h) const;
  // Attention of q [T, heads, head_dim] (RoPE applied) over keys/values
  // [kv_heads, n, head_dim] holding positions [0, start_pos + T), causal,
  // with LibTorch ops; returns [T, heads * head_dim].
  torch::Tensor AttendTorch(const torch::Tensor& q, const torch::Tensor& keys,
                            const torch::Tensor& values,
                            int64_t start_pos) const;
  torch::Tensor RmsNorm(const torch::Tensor& x,
                        const torch::Tensor& weight) const;
  torch::Tensor ApplyRope(const torch::Tensor& x, int64_t start_pos) const;

  ModelConfig config_;
  ModelOptions options_;
  int64_t max_context_ = 0;
  int64_t weight_bytes_per_token_ = 0;
  std::string weights_fingerprint_;
  torch::Tensor embed_;  // [vocab, hidden]
  torch::Tensor final_norm_;
  LinearWeight lm_head_;    // [vocab, hidden]; packed from embed_ when tied
  torch::Tensor rope_cos_;  // [max_context, head_dim] in the model dtype
  torch::Tensor rope_sin_;
  std::vector<Layer> layers_;
};

// The inverse frequencies RoPE uses for `config` ([head_dim / 2] float32),
// including rope_scaling (llama3, linear). Exposed for tests.
torch::Tensor RopeInverseFrequencies(const ModelConfig& config);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_MODEL_LLAMA_H_

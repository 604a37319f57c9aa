// The architecture of a Llama-family checkpoint, parsed from Hugging Face's
// config.json (+ generation_config.json).
//
// Supported model_type values: "llama", "mistral", "qwen2", "qwen3". They
// share one decoder; the differences are flags here (attention_bias for qwen2,
// qk_norm for qwen3, sliding_window for mistral/qwen2, rope_scaling for
// llama 3.x).
//
//   ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig("/models/smollm2"));
//
// Errors are InvalidArgument naming the source file and the field. A
// ModelConfig is a plain value: copy it freely; the functions are thread-safe.
#ifndef KNAPSERVE_COMMON_CHECKPOINT_MODEL_CONFIG_H_
#define KNAPSERVE_COMMON_CHECKPOINT_MODEL_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace knapserve {

// config.json's "rope_scaling" when it is set and not "default".
struct RopeScaling {
  std::string rope_type;  // "llama3" or "linear".
  double factor = 1;
  double low_freq_factor = 1;                       // llama3 only.
  double high_freq_factor = 4;                      // llama3 only.
  int64_t original_max_position_embeddings = 8192;  // llama3 only.
};

struct ModelConfig {
  std::string model_type;  // "llama", "mistral", "qwen2", "qwen3".
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // Defaults to num_attention_heads.
  int64_t head_dim = 0;  // Defaults to hidden_size / num_attention_heads.
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000;
  std::optional<RopeScaling> rope_scaling;
  bool tie_word_embeddings = false;
  // q/k/v projections have biases (qwen2: always; llama: "attention_bias").
  bool attention_bias = false;
  // qwen3: per-head RMSNorm on q and k (q_norm, k_norm weights of head_dim).
  bool qk_norm = false;
  // mistral/qwen2 when enabled; the engine caps the context at it.
  std::optional<int64_t> sliding_window;
  std::optional<int32_t> bos_token_id;
  // config.json's eos_token_id (int or list), overridden by
  // generation_config.json's if present there.
  std::vector<int32_t> eos_token_ids;
  std::string torch_dtype;  // As written; informational.

  // max_position_embeddings, capped by sliding_window when set.
  int64_t max_context() const;
  // Stable 16-hex-digit hash of the architecture fields (not token ids or
  // dtype): two configs with the same fingerprint run the same shapes.
  std::string Fingerprint() const;
};

// Parses config.json text. `source_name` prefixes error messages (e.g.
// "config.json" or a full path).
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view config_json,
                                             std::string_view source_name);

// Applies generation_config.json text to `config`: its bos_token_id and
// eos_token_id (int or list), where present and not null, replace config's.
// InvalidArgument prefixed with `source_name` for malformed JSON, a
// non-object, or a token id that is not an int32 >= 0; `config` is then
// unchanged.
absl::Status ApplyGenerationConfig(std::string_view generation_json,
                                   std::string_view source_name,
                                   ModelConfig& config);

// Reads `model_dir`/config.json and, if present, generation_config.json
// (whose bos/eos token ids override config.json's).
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir);

// HF-style config.json text (pretty-printed), which ParseModelConfig reads
// back to an equal config.
std::string ModelConfigToJson(const ModelConfig& config);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_CHECKPOINT_MODEL_CONFIG_H_

#include "common/checkpoint/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/file_util.h"
#include "common/base/json_fields.h"
#include "common/base/status.h"
#include "nlohmann/json.hpp"

namespace knapserve {
namespace {

constexpr const char* kSupportedTypes = "llama, mistral, qwen2, qwen3";

// A required (if `required`) positive integer field; 0 if absent and optional.
absl::StatusOr<int64_t> PositiveInteger(const JsonReader& object,
                                        std::string_view field, bool required) {
  if (!required && !object.Has(field)) return 0;
  ASSIGN_OR_RETURN(int64_t v, object.RequiredInt64(field));
  if (v <= 0)
    return object.FieldError(field, absl::StrCat("must be positive, got ", v));
  return v;
}

absl::StatusOr<double> PositiveNumber(const JsonReader& object,
                                      std::string_view field,
                                      double default_value) {
  ASSIGN_OR_RETURN(double v, object.OptionalDouble(field, default_value));
  if (!(v > 0) || !std::isfinite(v)) {
    return object.FieldError(field, absl::StrCat("must be positive, got ", v));
  }
  return v;
}

// A token id: an integer in [0, 2^31).
absl::StatusOr<int32_t> TokenId(const JsonReader& value, int64_t id) {
  if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
    return value.Error(absl::StrCat("expected a token id (0 to ",
                                    std::numeric_limits<int32_t>::max(),
                                    "), got ", id));
  }
  return static_cast<int32_t>(id);
}

// bos_token_id (int) and eos_token_id (int or list) of config.json or
// generation_config.json. Absent or null fields leave the config unchanged.
absl::Status ParseTokenIds(const JsonReader& object, ModelConfig& config) {
  if (object.Has("bos_token_id")) {
    const JsonReader bos = object.Field("bos_token_id");
    ASSIGN_OR_RETURN(int64_t id, bos.AsInt64());
    ASSIGN_OR_RETURN(config.bos_token_id, TokenId(bos, id));
  }
  if (object.Has("eos_token_id")) {
    const JsonReader eos = object.Field("eos_token_id");
    ASSIGN_OR_RETURN(const std::vector<int64_t> values, eos.AsInt64OrList());
    std::vector<int32_t> ids;
    for (size_t i = 0; i < values.size(); ++i) {
      ASSIGN_OR_RETURN(
          int32_t id,
          TokenId(eos.value().is_array() ? eos.Element(i) : eos, values[i]));
      ids.push_back(id);
    }
    config.eos_token_ids = std::move(ids);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<RopeScaling>> ParseRopeScaling(
    const JsonReader& config) {
  ASSIGN_OR_RETURN(std::optional<JsonReader> value,
                   config.OptionalChild("rope_scaling"));
  if (!value.has_value()) return std::nullopt;
  // "rope_type", or the older "type".
  const char* type_key = value->Has("rope_type") ? "rope_type" : "type";
  if (!value->Has(type_key))
    return value->Error("has no \"rope_type\" or \"type\"");
  ASSIGN_OR_RETURN(const std::string rope_type,
                   value->RequiredString(type_key));
  if (rope_type == "default") return std::nullopt;
  if (rope_type != "llama3" && rope_type != "linear") {
    return value->FieldError(
        type_key, absl::StrCat("unsupported rope_scaling type '", rope_type,
                               "' (supported: llama3, linear, default)"));
  }
  RopeScaling scaling;
  scaling.rope_type = rope_type;
  if (!value->Has("factor"))
    return value->FieldError("factor", "required but missing");
  ASSIGN_OR_RETURN(scaling.factor, PositiveNumber(*value, "factor", 1));
  if (rope_type == "llama3") {
    ASSIGN_OR_RETURN(scaling.low_freq_factor,
                     PositiveNumber(*value, "low_freq_factor", 1));
    ASSIGN_OR_RETURN(scaling.high_freq_factor,
                     PositiveNumber(*value, "high_freq_factor", 4));
    ASSIGN_OR_RETURN(
        int64_t original,
        PositiveInteger(*value, "original_max_position_embeddings", false));
    if (original > 0) scaling.original_max_position_embeddings = original;
    if (!(scaling.high_freq_factor > scaling.low_freq_factor)) {
      return value->Error(absl::StrCat(
          "needs high_freq_factor > low_freq_factor, got ",
          scaling.high_freq_factor, " and ", scaling.low_freq_factor));
    }
  }
  return scaling;
}

absl::StatusOr<ModelConfig> ParseConfigObject(const JsonReader& json) {
  RETURN_IF_ERROR(json.ExpectObject());
  ModelConfig config;
  ASSIGN_OR_RETURN(config.model_type, json.RequiredString("model_type"));
  const std::string& t = config.model_type;
  if (t != "llama" && t != "mistral" && t != "qwen2" && t != "qwen3") {
    return json.FieldError(
        "model_type", absl::StrCat("unsupported model_type '", t,
                                   "' (supported: ", kSupportedTypes, ")"));
  }

  ASSIGN_OR_RETURN(config.vocab_size,
                   PositiveInteger(json, "vocab_size", true));
  ASSIGN_OR_RETURN(config.hidden_size,
                   PositiveInteger(json, "hidden_size", true));
  ASSIGN_OR_RETURN(config.intermediate_size,
                   PositiveInteger(json, "intermediate_size", true));
  ASSIGN_OR_RETURN(config.num_hidden_layers,
                   PositiveInteger(json, "num_hidden_layers", true));
  ASSIGN_OR_RETURN(config.num_attention_heads,
                   PositiveInteger(json, "num_attention_heads", true));
  ASSIGN_OR_RETURN(config.num_key_value_heads,
                   PositiveInteger(json, "num_key_value_heads", false));
  ASSIGN_OR_RETURN(config.head_dim, PositiveInteger(json, "head_dim", false));
  ASSIGN_OR_RETURN(config.max_position_embeddings,
                   PositiveInteger(json, "max_position_embeddings", true));

  if (config.num_key_value_heads == 0)
    config.num_key_value_heads = config.num_attention_heads;
  if (config.head_dim == 0) {
    if (config.hidden_size % config.num_attention_heads != 0) {
      return json.Error(absl::StrCat(
          "hidden_size ", config.hidden_size,
          " is not divisible by num_attention_heads ",
          config.num_attention_heads, " (and head_dim is not given)"));
    }
    config.head_dim = config.hidden_size / config.num_attention_heads;
  }
  if (config.num_attention_heads % config.num_key_value_heads != 0) {
    return json.Error(absl::StrCat("num_attention_heads ",
                                   config.num_attention_heads,
                                   " is not divisible by num_key_value_heads ",
                                   config.num_key_value_heads));
  }

  ASSIGN_OR_RETURN(config.rms_norm_eps,
                   PositiveNumber(json, "rms_norm_eps", 1e-6));
  ASSIGN_OR_RETURN(config.rope_theta,
                   PositiveNumber(json, "rope_theta", 10000));
  ASSIGN_OR_RETURN(config.rope_scaling, ParseRopeScaling(json));
  ASSIGN_OR_RETURN(config.tie_word_embeddings,
                   json.OptionalBool("tie_word_embeddings", false));
  ASSIGN_OR_RETURN(config.attention_bias,
                   json.OptionalBool("attention_bias", false));
  if (t == "qwen2") config.attention_bias = true;
  config.qk_norm = t == "qwen3";

  // Sliding window: mistral when non-null; qwen2/qwen3 only with
  // use_sliding_window; llama never.
  if (t == "mistral" || t == "qwen2" || t == "qwen3") {
    bool enabled = true;
    if (t != "mistral") {
      ASSIGN_OR_RETURN(enabled, json.OptionalBool("use_sliding_window", false));
    }
    if (enabled) {
      ASSIGN_OR_RETURN(int64_t window,
                       PositiveInteger(json, "sliding_window", false));
      if (window > 0) config.sliding_window = window;
    }
  }

  RETURN_IF_ERROR(ParseTokenIds(json, config));
  // Informational, so a value of another type is ignored rather than refused.
  const char* dtype_key = json.Has("torch_dtype") ? "torch_dtype" : "dtype";
  if (json.Field(dtype_key).value().is_string()) {
    ASSIGN_OR_RETURN(config.torch_dtype, json.RequiredString(dtype_key));
  }
  return config;
}

std::string Architecture(const std::string& model_type) {
  if (model_type == "mistral") return "MistralForCausalLM";
  if (model_type == "qwen2") return "Qwen2ForCausalLM";
  if (model_type == "qwen3") return "Qwen3ForCausalLM";
  return "LlamaForCausalLM";
}

}  // namespace

int64_t ModelConfig::max_context() const {
  if (sliding_window.has_value())
    return std::min(max_position_embeddings, *sliding_window);
  return max_position_embeddings;
}

std::string ModelConfig::Fingerprint() const {
  // Canonical text of the architecture fields, hashed with 64-bit FNV-1a.
  std::string canonical = absl::StrCat(
      model_type, "|v", vocab_size, "|h", hidden_size, "|i", intermediate_size,
      "|l", num_hidden_layers, "|a", num_attention_heads, "|k",
      num_key_value_heads, "|d", head_dim, "|p", max_position_embeddings, "|e",
      absl::StrFormat("%.17g", rms_norm_eps), "|t",
      absl::StrFormat("%.17g", rope_theta), "|tie", tie_word_embeddings, "|b",
      attention_bias, "|q", qk_norm, "|w", sliding_window.value_or(0));
  if (rope_scaling.has_value()) {
    absl::StrAppend(&canonical, "|rs", rope_scaling->rope_type,
                    absl::StrFormat(",%.17g,%.17g,%.17g,", rope_scaling->factor,
                                    rope_scaling->low_freq_factor,
                                    rope_scaling->high_freq_factor),
                    rope_scaling->original_max_position_embeddings);
  }
  uint64_t hash = 14695981039346656037ull;
  for (unsigned char c : canonical) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return absl::StrFormat("%016x", hash);
}

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view config_json,
                                             std::string_view source_name) {
  ASSIGN_OR_RETURN(const nlohmann::json json,
                   ParseJsonText(config_json, source_name));
  return ParseConfigObject(JsonReader(json, std::string(source_name)));
}

absl::Status ApplyGenerationConfig(std::string_view generation_json,
                                   std::string_view source_name,
                                   ModelConfig& config) {
  ASSIGN_OR_RETURN(const nlohmann::json generation,
                   ParseJsonText(generation_json, source_name));
  const JsonReader reader(generation, std::string(source_name));
  RETURN_IF_ERROR(reader.ExpectObject());
  ModelConfig updated = config;
  RETURN_IF_ERROR(ParseTokenIds(reader, updated));
  config = std::move(updated);
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  const std::string config_path = model_dir + "/config.json";
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(config_path));
  ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(text, config_path));

  const std::string generation_path = model_dir + "/generation_config.json";
  std::error_code error;
  if (std::filesystem::exists(generation_path, error)) {
    ASSIGN_OR_RETURN(std::string generation_text,
                     ReadFileToString(generation_path));
    RETURN_IF_ERROR(
        ApplyGenerationConfig(generation_text, generation_path, config));
  }
  return config;
}

std::string ModelConfigToJson(const ModelConfig& config) {
  nlohmann::ordered_json json;
  json["architectures"] = {Architecture(config.model_type)};
  json["model_type"] = config.model_type;
  json["vocab_size"] = config.vocab_size;
  json["hidden_size"] = config.hidden_size;
  json["intermediate_size"] = config.intermediate_size;
  json["num_hidden_layers"] = config.num_hidden_layers;
  json["num_attention_heads"] = config.num_attention_heads;
  json["num_key_value_heads"] = config.num_key_value_heads;
  json["head_dim"] = config.head_dim;
  json["max_position_embeddings"] = config.max_position_embeddings;
  json["hidden_act"] = "silu";
  json["rms_norm_eps"] = config.rms_norm_eps;
  json["rope_theta"] = config.rope_theta;
  if (config.rope_scaling.has_value()) {
    const RopeScaling& scaling = *config.rope_scaling;
    nlohmann::ordered_json rope;
    rope["rope_type"] = scaling.rope_type;
    rope["factor"] = scaling.factor;
    if (scaling.rope_type == "llama3") {
      rope["low_freq_factor"] = scaling.low_freq_factor;
      rope["high_freq_factor"] = scaling.high_freq_factor;
      rope["original_max_position_embeddings"] =
          scaling.original_max_position_embeddings;
    }
    json["rope_scaling"] = std::move(rope);
  } else {
    json["rope_scaling"] = nullptr;
  }
  json["tie_word_embeddings"] = config.tie_word_embeddings;
  if (config.model_type != "qwen2")
    json["attention_bias"] = config.attention_bias;
  if (config.model_type == "mistral") {
    json["sliding_window"] =
        config.sliding_window.has_value()
            ? nlohmann::ordered_json(*config.sliding_window)
            : nlohmann::ordered_json(nullptr);
  } else if (config.model_type == "qwen2" || config.model_type == "qwen3") {
    json["use_sliding_window"] = config.sliding_window.has_value();
    json["sliding_window"] =
        config.sliding_window.has_value()
            ? nlohmann::ordered_json(*config.sliding_window)
            : nlohmann::ordered_json(nullptr);
    json["max_window_layers"] = config.num_hidden_layers;
  }
  json["bos_token_id"] = config.bos_token_id.has_value()
                             ? nlohmann::ordered_json(*config.bos_token_id)
                             : nlohmann::ordered_json(nullptr);
  if (config.eos_token_ids.empty()) {
    json["eos_token_id"] = nullptr;
  } else if (config.eos_token_ids.size() == 1) {
    json["eos_token_id"] = config.eos_token_ids[0];
  } else {
    json["eos_token_id"] = config.eos_token_ids;
  }
  if (!config.torch_dtype.empty()) json["torch_dtype"] = config.torch_dtype;
  return json.dump(2) + "\n";
}

}  // namespace knapserve

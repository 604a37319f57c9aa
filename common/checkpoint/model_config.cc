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
#include "common/base/status.h"
#include "nlohmann/json.hpp"

namespace knapserve {
namespace {

using Json = nlohmann::json;

constexpr const char* kSupportedTypes = "llama, mistral, qwen2, qwen3";

absl::Status FieldError(std::string_view field, std::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("field '", std::string(field), "' ", std::string(problem)));
}

// Returns the field if present and not null, else nullptr.
const Json* FindField(const Json& object, std::string_view field) {
  auto it = object.find(field);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

// An integer field. Accepts integral floats (some exporters write 512.0).
absl::StatusOr<int64_t> AsInteger(const Json& value, std::string_view field) {
  if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return FieldError(field, "is too large");
    }
    return static_cast<int64_t>(v);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_float()) {
    const double v = value.get<double>();
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9e18) {
      return static_cast<int64_t>(v);
    }
  }
  return FieldError(field, absl::StrCat("must be an integer, got ", value.dump()));
}

// A required (if `required`) positive integer field; 0 if absent and optional.
absl::StatusOr<int64_t> PositiveInteger(const Json& config, std::string_view field, bool required) {
  const Json* value = FindField(config, field);
  if (value == nullptr) {
    if (required) return FieldError(field, "is missing");
    return 0;
  }
  ASSIGN_OR_RETURN(int64_t v, AsInteger(*value, field));
  if (v <= 0) return FieldError(field, absl::StrCat("must be positive, got ", v));
  return v;
}

absl::StatusOr<double> PositiveNumber(const Json& object, std::string_view field,
                                      double default_value) {
  const Json* value = FindField(object, field);
  if (value == nullptr) return default_value;
  if (!value->is_number()) {
    return FieldError(field, absl::StrCat("must be a number, got ", value->dump()));
  }
  const double v = value->get<double>();
  if (!(v > 0) || !std::isfinite(v)) {
    return FieldError(field, absl::StrCat("must be positive, got ", value->dump()));
  }
  return v;
}

absl::StatusOr<bool> Bool(const Json& object, std::string_view field, bool default_value) {
  const Json* value = FindField(object, field);
  if (value == nullptr) return default_value;
  if (!value->is_boolean()) {
    return FieldError(field, absl::StrCat("must be true or false, got ", value->dump()));
  }
  return value->get<bool>();
}

absl::StatusOr<int32_t> TokenId(const Json& value, std::string_view field) {
  ASSIGN_OR_RETURN(int64_t id, AsInteger(value, field));
  if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
    return FieldError(field, absl::StrCat("is not a valid token id: ", id));
  }
  return static_cast<int32_t>(id);
}

// bos_token_id (int) and eos_token_id (int or list) of config.json or
// generation_config.json. Absent or null fields leave the config unchanged.
absl::Status ParseTokenIds(const Json& object, ModelConfig& config) {
  if (const Json* bos = FindField(object, "bos_token_id")) {
    ASSIGN_OR_RETURN(config.bos_token_id, TokenId(*bos, "bos_token_id"));
  }
  if (const Json* eos = FindField(object, "eos_token_id")) {
    std::vector<int32_t> ids;
    if (eos->is_array()) {
      for (const Json& id : *eos) {
        ASSIGN_OR_RETURN(int32_t value, TokenId(id, "eos_token_id"));
        ids.push_back(value);
      }
    } else {
      ASSIGN_OR_RETURN(int32_t value, TokenId(*eos, "eos_token_id"));
      ids.push_back(value);
    }
    config.eos_token_ids = std::move(ids);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<RopeScaling>> ParseRopeScaling(const Json& config) {
  const Json* value = FindField(config, "rope_scaling");
  if (value == nullptr) return std::nullopt;
  if (!value->is_object()) {
    return FieldError("rope_scaling",
                      absl::StrCat("must be an object or null, got ", value->dump()));
  }
  const Json* type = FindField(*value, "rope_type");
  if (type == nullptr) type = FindField(*value, "type");
  if (type == nullptr) return FieldError("rope_scaling", "has no 'rope_type' or 'type'");
  if (!type->is_string()) {
    return FieldError("rope_scaling.rope_type",
                      absl::StrCat("must be a string, got ", type->dump()));
  }
  const std::string rope_type = type->get<std::string>();
  if (rope_type == "default") return std::nullopt;
  if (rope_type != "llama3" && rope_type != "linear") {
    return absl::InvalidArgumentError(absl::StrCat("unsupported rope_scaling type '", rope_type,
                                                   "' (supported: llama3, linear, default)"));
  }
  RopeScaling scaling;
  scaling.rope_type = rope_type;
  auto annotate = [](const absl::Status& status) { return Annotate(status, "rope_scaling"); };
  if (FindField(*value, "factor") == nullptr)
    return FieldError("rope_scaling.factor", "is missing");
  absl::StatusOr<double> factor = PositiveNumber(*value, "factor", 1);
  if (!factor.ok()) return annotate(factor.status());
  scaling.factor = *factor;
  if (rope_type == "llama3") {
    absl::StatusOr<double> low = PositiveNumber(*value, "low_freq_factor", 1);
    if (!low.ok()) return annotate(low.status());
    absl::StatusOr<double> high = PositiveNumber(*value, "high_freq_factor", 4);
    if (!high.ok()) return annotate(high.status());
    absl::StatusOr<int64_t> original =
        PositiveInteger(*value, "original_max_position_embeddings", /*required=*/false);
    if (!original.ok()) return annotate(original.status());
    scaling.low_freq_factor = *low;
    scaling.high_freq_factor = *high;
    if (*original > 0) scaling.original_max_position_embeddings = *original;
    if (!(scaling.high_freq_factor > scaling.low_freq_factor)) {
      return FieldError("rope_scaling",
                        absl::StrCat("needs high_freq_factor > low_freq_factor, got ",
                                     scaling.high_freq_factor, " and ", scaling.low_freq_factor));
    }
  }
  return scaling;
}

absl::StatusOr<ModelConfig> ParseConfigObject(const Json& json) {
  if (!json.is_object()) return absl::InvalidArgumentError("not a JSON object");
  ModelConfig config;
  const Json* type = FindField(json, "model_type");
  if (type == nullptr) return FieldError("model_type", "is missing");
  if (!type->is_string()) {
    return FieldError("model_type", absl::StrCat("must be a string, got ", type->dump()));
  }
  config.model_type = type->get<std::string>();
  const std::string& t = config.model_type;
  if (t != "llama" && t != "mistral" && t != "qwen2" && t != "qwen3") {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported model_type '", t, "' (supported: ", kSupportedTypes, ")"));
  }

  ASSIGN_OR_RETURN(config.vocab_size, PositiveInteger(json, "vocab_size", true));
  ASSIGN_OR_RETURN(config.hidden_size, PositiveInteger(json, "hidden_size", true));
  ASSIGN_OR_RETURN(config.intermediate_size, PositiveInteger(json, "intermediate_size", true));
  ASSIGN_OR_RETURN(config.num_hidden_layers, PositiveInteger(json, "num_hidden_layers", true));
  ASSIGN_OR_RETURN(config.num_attention_heads, PositiveInteger(json, "num_attention_heads", true));
  ASSIGN_OR_RETURN(config.num_key_value_heads, PositiveInteger(json, "num_key_value_heads", false));
  ASSIGN_OR_RETURN(config.head_dim, PositiveInteger(json, "head_dim", false));
  ASSIGN_OR_RETURN(config.max_position_embeddings,
                   PositiveInteger(json, "max_position_embeddings", true));

  if (config.num_key_value_heads == 0) config.num_key_value_heads = config.num_attention_heads;
  if (config.head_dim == 0) {
    if (config.hidden_size % config.num_attention_heads != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "hidden_size ", config.hidden_size, " is not divisible by num_attention_heads ",
          config.num_attention_heads, " (and head_dim is not given)"));
    }
    config.head_dim = config.hidden_size / config.num_attention_heads;
  }
  if (config.num_attention_heads % config.num_key_value_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_attention_heads ", config.num_attention_heads,
                     " is not divisible by num_key_value_heads ", config.num_key_value_heads));
  }

  ASSIGN_OR_RETURN(config.rms_norm_eps, PositiveNumber(json, "rms_norm_eps", 1e-6));
  ASSIGN_OR_RETURN(config.rope_theta, PositiveNumber(json, "rope_theta", 10000));
  ASSIGN_OR_RETURN(config.rope_scaling, ParseRopeScaling(json));
  ASSIGN_OR_RETURN(config.tie_word_embeddings, Bool(json, "tie_word_embeddings", false));
  ASSIGN_OR_RETURN(config.attention_bias, Bool(json, "attention_bias", false));
  if (t == "qwen2") config.attention_bias = true;
  config.qk_norm = t == "qwen3";

  // Sliding window: mistral when non-null; qwen2/qwen3 only with
  // use_sliding_window; llama never.
  if (t == "mistral" || t == "qwen2" || t == "qwen3") {
    bool enabled = true;
    if (t != "mistral") {
      ASSIGN_OR_RETURN(enabled, Bool(json, "use_sliding_window", false));
    }
    if (enabled) {
      ASSIGN_OR_RETURN(int64_t window, PositiveInteger(json, "sliding_window", false));
      if (window > 0) config.sliding_window = window;
    }
  }

  RETURN_IF_ERROR(ParseTokenIds(json, config));
  const Json* dtype = FindField(json, "torch_dtype");
  if (dtype == nullptr) dtype = FindField(json, "dtype");
  if (dtype != nullptr && dtype->is_string()) config.torch_dtype = dtype->get<std::string>();
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
  if (sliding_window.has_value()) return std::min(max_position_embeddings, *sliding_window);
  return max_position_embeddings;
}

std::string ModelConfig::Fingerprint() const {
  // Canonical text of the architecture fields, hashed with 64-bit FNV-1a.
  std::string canonical = absl::StrCat(
      model_type, "|v", vocab_size, "|h", hidden_size, "|i", intermediate_size, "|l",
      num_hidden_layers, "|a", num_attention_heads, "|k", num_key_value_heads, "|d", head_dim, "|p",
      max_position_embeddings, "|e", absl::StrFormat("%.17g", rms_norm_eps), "|t",
      absl::StrFormat("%.17g", rope_theta), "|tie", tie_word_embeddings, "|b", attention_bias, "|q",
      qk_norm, "|w", sliding_window.value_or(0));
  if (rope_scaling.has_value()) {
    absl::StrAppend(&canonical, "|rs", rope_scaling->rope_type,
                    absl::StrFormat(",%.17g,%.17g,%.17g,", rope_scaling->factor,
                                    rope_scaling->low_freq_factor, rope_scaling->high_freq_factor),
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
  Json json = Json::parse(config_json, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(source_name), ": not valid JSON"));
  }
  absl::StatusOr<ModelConfig> config = ParseConfigObject(json);
  if (!config.ok()) return Annotate(config.status(), source_name);
  return config;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  const std::string config_path = model_dir + "/config.json";
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(config_path));
  ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(text, config_path));

  const std::string generation_path = model_dir + "/generation_config.json";
  std::error_code error;
  if (std::filesystem::exists(generation_path, error)) {
    ASSIGN_OR_RETURN(std::string generation_text, ReadFileToString(generation_path));
    Json generation = Json::parse(generation_text, nullptr, false);
    if (generation.is_discarded() || !generation.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(generation_path, ": not a valid JSON object"));
    }
    RETURN_IF_ERROR(Annotate(ParseTokenIds(generation, config), generation_path));
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
      rope["original_max_position_embeddings"] = scaling.original_max_position_embeddings;
    }
    json["rope_scaling"] = std::move(rope);
  } else {
    json["rope_scaling"] = nullptr;
  }
  json["tie_word_embeddings"] = config.tie_word_embeddings;
  if (config.model_type != "qwen2") json["attention_bias"] = config.attention_bias;
  if (config.model_type == "mistral") {
    json["sliding_window"] = config.sliding_window.has_value()
                                 ? nlohmann::ordered_json(*config.sliding_window)
                                 : nlohmann::ordered_json(nullptr);
  } else if (config.model_type == "qwen2" || config.model_type == "qwen3") {
    json["use_sliding_window"] = config.sliding_window.has_value();
    json["sliding_window"] = config.sliding_window.has_value()
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

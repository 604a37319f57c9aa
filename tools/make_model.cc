#include "tools/make_model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/types.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "common/checkpoint/safetensors.h"
#include "nlohmann/json.hpp"

namespace knapserve {
namespace {

using OrderedJson = nlohmann::ordered_json;

constexpr double kInitStd = 0.02;

// Merges of the synthetic tokenizer, in priority order. Each side is a byte
// token (GPT-2 byte-to-unicode form: 'Ġ' is the space) or an earlier result.
constexpr const char* kMerges[kSyntheticMerges] = {
    "Ġ t", "h e", "Ġ a", "i n", "Ġt he", "e r",  "a n", "o n", "r e", "Ġ s",
    "e n", "a t", "o r", "Ġ w", "e s",   "Ġ o",  "i s", "e d", "Ġ c", "i t",
    "Ġ b", "a r", "Ġ f", "Ġ m", "Ġ p",   "in g", "o u", "Ġ h", "l e", "Ġ d"};

ModelConfig TinyBase(const std::string& model_type) {
  ModelConfig config;
  config.model_type = model_type;
  config.vocab_size = 300;
  config.hidden_size = 64;
  config.intermediate_size = 128;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.head_dim = 16;
  config.max_position_embeddings = 256;
  config.rms_norm_eps = 1e-5;
  config.rope_theta = 10000;
  config.bos_token_id = kSyntheticBosId;
  config.eos_token_ids = {kSyntheticEosId};
  return config;
}

// Every known shape, in KnownModelShapes() order.
std::vector<std::pair<std::string, ModelConfig>> AllShapes() {
  std::vector<std::pair<std::string, ModelConfig>> shapes;
  {
    ModelConfig c;
    c.model_type = "llama";
    c.vocab_size = 49152;
    c.hidden_size = 576;
    c.intermediate_size = 1536;
    c.num_hidden_layers = 30;
    c.num_attention_heads = 9;
    c.num_key_value_heads = 3;
    c.head_dim = 64;
    c.max_position_embeddings = 8192;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 100000;
    c.tie_word_embeddings = true;
    c.bos_token_id = 1;
    c.eos_token_ids = {2};
    shapes.emplace_back("smollm2-135m", c);
  }
  {
    ModelConfig c;
    c.model_type = "llama";
    c.vocab_size = 128256;
    c.hidden_size = 2048;
    c.intermediate_size = 8192;
    c.num_hidden_layers = 16;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 8;
    c.head_dim = 64;
    c.max_position_embeddings = 131072;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = 500000;
    c.rope_scaling = RopeScaling{"llama3", 32, 1, 4, 8192};
    c.tie_word_embeddings = true;
    c.bos_token_id = 128000;
    c.eos_token_ids = {128001, 128008, 128009};
    shapes.emplace_back("llama-3.2-1b", c);
  }
  {
    ModelConfig c;
    c.model_type = "qwen3";
    c.vocab_size = 151936;
    c.hidden_size = 1024;
    c.intermediate_size = 3072;
    c.num_hidden_layers = 28;
    c.num_attention_heads = 16;
    c.num_key_value_heads = 8;
    c.head_dim = 128;
    c.max_position_embeddings = 40960;
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 1e6;
    c.tie_word_embeddings = true;
    c.qk_norm = true;
    c.bos_token_id = 151643;
    c.eos_token_ids = {151645};
    shapes.emplace_back("qwen3-0.6b", c);
  }
  {
    ModelConfig c;
    c.model_type = "qwen2";
    c.vocab_size = 151936;
    c.hidden_size = 896;
    c.intermediate_size = 4864;
    c.num_hidden_layers = 24;
    c.num_attention_heads = 14;
    c.num_key_value_heads = 2;
    c.head_dim = 64;
    c.max_position_embeddings = 32768;
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 1e6;
    c.tie_word_embeddings = true;
    c.attention_bias = true;
    c.bos_token_id = 151643;
    c.eos_token_ids = {151643};
    shapes.emplace_back("qwen2.5-0.5b", c);
  }
  shapes.emplace_back("tiny-llama", TinyBase("llama"));
  {
    ModelConfig c = TinyBase("qwen2");
    c.attention_bias = true;
    c.tie_word_embeddings = true;
    c.rms_norm_eps = 1e-6;
    shapes.emplace_back("tiny-qwen2", c);
  }
  {
    ModelConfig c = TinyBase("qwen3");
    c.head_dim = 32;  // != hidden / heads, as in real Qwen3 models.
    c.qk_norm = true;
    c.tie_word_embeddings = true;
    c.rms_norm_eps = 1e-6;
    shapes.emplace_back("tiny-qwen3", c);
  }
  {
    ModelConfig c = TinyBase("llama");
    // original_max_position_embeddings 64 with head_dim 16 and theta 1e4 puts
    // some frequencies in each llama3 band (kept, smoothed, divided).
    c.rope_scaling = RopeScaling{"llama3", 8, 1, 4, 64};
    c.tie_word_embeddings = true;
    shapes.emplace_back("tiny-llama3", c);
  }
  return shapes;
}

// How a tensor is initialized.
enum class Init { kNormal, kNorm };

struct WeightSpec {
  std::string name;
  std::vector<int64_t> shape;
  Init init;
};

std::vector<WeightSpec> WeightSpecs(const ModelConfig& c) {
  const int64_t q_out = c.num_attention_heads * c.head_dim;
  const int64_t kv_out = c.num_key_value_heads * c.head_dim;
  std::vector<WeightSpec> specs;
  specs.push_back({"model.embed_tokens.weight",
                   {c.vocab_size, c.hidden_size},
                   Init::kNormal});
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    specs.push_back(
        {p + "input_layernorm.weight", {c.hidden_size}, Init::kNorm});
    specs.push_back(
        {p + "self_attn.q_proj.weight", {q_out, c.hidden_size}, Init::kNormal});
    if (c.attention_bias)
      specs.push_back({p + "self_attn.q_proj.bias", {q_out}, Init::kNormal});
    specs.push_back({p + "self_attn.k_proj.weight",
                     {kv_out, c.hidden_size},
                     Init::kNormal});
    if (c.attention_bias)
      specs.push_back({p + "self_attn.k_proj.bias", {kv_out}, Init::kNormal});
    specs.push_back({p + "self_attn.v_proj.weight",
                     {kv_out, c.hidden_size},
                     Init::kNormal});
    if (c.attention_bias)
      specs.push_back({p + "self_attn.v_proj.bias", {kv_out}, Init::kNormal});
    if (c.qk_norm) {
      specs.push_back(
          {p + "self_attn.q_norm.weight", {c.head_dim}, Init::kNorm});
      specs.push_back(
          {p + "self_attn.k_norm.weight", {c.head_dim}, Init::kNorm});
    }
    specs.push_back(
        {p + "self_attn.o_proj.weight", {c.hidden_size, q_out}, Init::kNormal});
    specs.push_back(
        {p + "post_attention_layernorm.weight", {c.hidden_size}, Init::kNorm});
    specs.push_back({p + "mlp.gate_proj.weight",
                     {c.intermediate_size, c.hidden_size},
                     Init::kNormal});
    specs.push_back({p + "mlp.up_proj.weight",
                     {c.intermediate_size, c.hidden_size},
                     Init::kNormal});
    specs.push_back({p + "mlp.down_proj.weight",
                     {c.hidden_size, c.intermediate_size},
                     Init::kNormal});
  }
  specs.push_back({"model.norm.weight", {c.hidden_size}, Init::kNorm});
  if (!c.tie_word_embeddings) {
    specs.push_back(
        {"lm_head.weight", {c.vocab_size, c.hidden_size}, Init::kNormal});
  }
  return specs;
}

// A per-tensor seed: splitmix64 of the user seed mixed with FNV-1a of the name,
// so each tensor's values depend only on (seed, name, shape).
uint64_t TensorSeed(uint64_t seed, const std::string& name) {
  uint64_t hash = 14695981039346656037ull;
  for (unsigned char ch : name) {
    hash ^= ch;
    hash *= 1099511628211ull;
  }
  uint64_t z = seed + 0x9e3779b97f4a7c15ull * (hash | 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

torch::Tensor MakeWeight(const WeightSpec& spec, uint64_t seed,
                         torch::ScalarType dtype) {
  at::Generator generator =
      at::detail::createCPUGenerator(TensorSeed(seed, spec.name));
  torch::Tensor values = torch::empty(spec.shape, torch::kFloat32);
  values.normal_(0.0, kInitStd, generator);
  if (spec.init == Init::kNorm) values.add_(1.0);
  return values.to(dtype);
}

struct DtypeChoice {
  torch::ScalarType scalar_type;
  std::string safetensors;  // "F32"...
  std::string torch_dtype;  // "float32"...
};

absl::StatusOr<DtypeChoice> ParseDtype(const std::string& dtype) {
  if (dtype == "fp32" || dtype == "float32" || dtype == "f32") {
    return DtypeChoice{torch::kFloat32, "F32", "float32"};
  }
  if (dtype == "bf16" || dtype == "bfloat16") {
    return DtypeChoice{torch::kBFloat16, "BF16", "bfloat16"};
  }
  if (dtype == "fp16" || dtype == "float16" || dtype == "f16") {
    return DtypeChoice{torch::kFloat16, "F16", "float16"};
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unsupported dtype '", dtype, "' (supported: fp32, bf16, fp16)"));
}

absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot create"));
  out << text;
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

// UTF-8 encoding of a code point below 0x800 (all bytes_to_unicode needs).
std::string Utf8(int code_point) {
  std::string out;
  if (code_point < 0x80) {
    out.push_back(static_cast<char>(code_point));
  } else {
    out.push_back(static_cast<char>(0xC0 | (code_point >> 6)));
    out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  }
  return out;
}

// GPT-2's bytes_to_unicode, in GPT-2's vocabulary order: the printable bytes
// map to themselves first, then the others to 256, 257, ...
std::vector<std::string> ByteTokens() {
  std::vector<int> bytes;
  std::vector<int> chars;
  for (int b = '!'; b <= '~'; ++b) bytes.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) bytes.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) bytes.push_back(b);
  chars = bytes;
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    if (std::find(bytes.begin(), bytes.end(), b) == bytes.end()) {
      bytes.push_back(b);
      chars.push_back(256 + next++);
    }
  }
  std::vector<std::string> tokens;
  for (int c : chars) tokens.push_back(Utf8(c));
  return tokens;
}

std::string SyntheticTokenizerJson() {
  OrderedJson vocab = OrderedJson::object();
  int next_id = 0;
  for (const std::string& token : ByteTokens()) vocab[token] = next_id++;
  OrderedJson merges = OrderedJson::array();
  for (const char* merge : kMerges) {
    const std::string text = merge;
    const size_t space = text.find(' ');
    vocab[text.substr(0, space) + text.substr(space + 1)] = next_id++;
    merges.push_back(text);
  }
  OrderedJson added = OrderedJson::array();
  for (const auto& [id, content] :
       {std::pair<int32_t, const char*>{kSyntheticBosId, "<|bos|>"},
        std::pair<int32_t, const char*>{kSyntheticEosId, "<|eos|>"}}) {
    vocab[content] = id;
    added.push_back({{"id", id},
                     {"content", content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  const OrderedJson byte_level = {{"type", "ByteLevel"},
                                  {"add_prefix_space", false},
                                  {"trim_offsets", true},
                                  {"use_regex", true}};
  OrderedJson tokenizer;
  tokenizer["version"] = "1.0";
  tokenizer["truncation"] = nullptr;
  tokenizer["padding"] = nullptr;
  tokenizer["added_tokens"] = std::move(added);
  tokenizer["normalizer"] = nullptr;
  tokenizer["pre_tokenizer"] = byte_level;
  tokenizer["post_processor"] = byte_level;
  tokenizer["decoder"] = byte_level;
  tokenizer["model"] = {{"type", "BPE"},
                        {"dropout", nullptr},
                        {"unk_token", nullptr},
                        {"continuing_subword_prefix", nullptr},
                        {"end_of_word_suffix", nullptr},
                        {"fuse_unk", false},
                        {"byte_fallback", false},
                        {"ignore_merges", false},
                        {"vocab", std::move(vocab)},
                        {"merges", std::move(merges)}};
  return tokenizer.dump(2) + "\n";
}

std::string GenerationConfigJson(const ModelConfig& config) {
  OrderedJson json;
  json["bos_token_id"] = config.bos_token_id.has_value()
                             ? OrderedJson(*config.bos_token_id)
                             : OrderedJson(nullptr);
  if (config.eos_token_ids.size() == 1) {
    json["eos_token_id"] = config.eos_token_ids[0];
  } else if (config.eos_token_ids.empty()) {
    json["eos_token_id"] = nullptr;
  } else {
    json["eos_token_id"] = config.eos_token_ids;
  }
  return json.dump(2) + "\n";
}

}  // namespace

std::vector<std::string> KnownModelShapes() {
  std::vector<std::string> names;
  for (const auto& [name, unused] : AllShapes()) names.push_back(name);
  return names;
}

absl::StatusOr<ModelConfig> ModelShapeConfig(const std::string& shape) {
  for (const auto& [name, config] : AllShapes()) {
    if (name == shape) return config;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown model shape '", shape,
                   "' (known: ", absl::StrJoin(KnownModelShapes(), ", "), ")"));
}

absl::Status MakeModel(const MakeModelOptions& options) {
  ASSIGN_OR_RETURN(ModelConfig config, ModelShapeConfig(options.shape));
  ASSIGN_OR_RETURN(DtypeChoice dtype, ParseDtype(options.dtype));
  config.torch_dtype = dtype.torch_dtype;
  if (options.out_dir.empty())
    return absl::InvalidArgumentError("make-model: out_dir is empty");
  if (!options.tokenizer_json.empty() &&
      !std::filesystem::is_regular_file(options.tokenizer_json)) {
    return absl::NotFoundError(absl::StrCat(
        options.tokenizer_json, ": tokenizer.json to copy does not exist"));
  }
  std::error_code error;
  std::filesystem::create_directories(options.out_dir, error);
  if (error) {
    return absl::PermissionDeniedError(absl::StrCat(
        options.out_dir, ": cannot create folder: ", error.message()));
  }
  const std::string dir = options.out_dir;

  RETURN_IF_ERROR(
      WriteTextFile(dir + "/config.json", ModelConfigToJson(config)));
  RETURN_IF_ERROR(WriteTextFile(dir + "/generation_config.json",
                                GenerationConfigJson(config)));
  if (options.tokenizer_json.empty()) {
    RETURN_IF_ERROR(
        WriteTextFile(dir + "/tokenizer.json", SyntheticTokenizerJson()));
  } else {
    std::filesystem::copy_file(
        options.tokenizer_json, dir + "/tokenizer.json",
        std::filesystem::copy_options::overwrite_existing, error);
    if (error) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot copy ", options.tokenizer_json, " to ", dir,
                       ": ", error.message()));
    }
  }

  const std::vector<WeightSpec> weights = WeightSpecs(config);
  std::vector<TensorSpec> specs;
  specs.reserve(weights.size());
  for (const WeightSpec& weight : weights) {
    specs.push_back({weight.name, dtype.safetensors, weight.shape});
  }
  RETURN_IF_ERROR(WriteSafetensorsStreaming(
      dir + "/model.safetensors", specs,
      [&](size_t i) -> absl::StatusOr<torch::Tensor> {
        return MakeWeight(weights[i], options.seed, dtype.scalar_type);
      },
      {{"format", "pt"}, {"knapserve_shape", options.shape}}));

  OrderedJson origin;
  origin["shape"] = options.shape;
  origin["seed"] = options.seed;
  origin["dtype"] = dtype.torch_dtype;
  origin["init_std"] = kInitStd;
  origin["tokenizer"] = options.tokenizer_json.empty()
                            ? std::string("synthetic byte-level BPE")
                            : options.tokenizer_json;
  origin["fingerprint"] = config.Fingerprint();
  return WriteTextFile(dir + "/knapserve_make_model.json",
                       origin.dump(2) + "\n");
}

}  // namespace knapserve

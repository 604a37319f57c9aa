#include "tools/make_model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/types.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint/model_config.h"
#include "common/checkpoint/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_util.h"

namespace knapserve {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

using testing::Message;
using testing::ReadFile;

// The tensors a checkpoint of `c` must hold, written out independently of
// make_model.cc.
std::map<std::string, std::vector<int64_t>> ExpectedTensors(
    const ModelConfig& c) {
  const int64_t d = c.hidden_size, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim,
                m = c.intermediate_size;
  std::map<std::string, std::vector<int64_t>> tensors;
  tensors["model.embed_tokens.weight"] = {c.vocab_size, d};
  tensors["model.norm.weight"] = {d};
  if (!c.tie_word_embeddings) tensors["lm_head.weight"] = {c.vocab_size, d};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    tensors[p + "input_layernorm.weight"] = {d};
    tensors[p + "post_attention_layernorm.weight"] = {d};
    tensors[p + "self_attn.q_proj.weight"] = {q, d};
    tensors[p + "self_attn.k_proj.weight"] = {kv, d};
    tensors[p + "self_attn.v_proj.weight"] = {kv, d};
    tensors[p + "self_attn.o_proj.weight"] = {d, q};
    if (c.attention_bias) {
      tensors[p + "self_attn.q_proj.bias"] = {q};
      tensors[p + "self_attn.k_proj.bias"] = {kv};
      tensors[p + "self_attn.v_proj.bias"] = {kv};
    }
    if (c.qk_norm) {
      tensors[p + "self_attn.q_norm.weight"] = {c.head_dim};
      tensors[p + "self_attn.k_norm.weight"] = {c.head_dim};
    }
    tensors[p + "mlp.gate_proj.weight"] = {m, d};
    tensors[p + "mlp.up_proj.weight"] = {m, d};
    tensors[p + "mlp.down_proj.weight"] = {d, m};
  }
  return tensors;
}

TEST(MakeModelTest, KnownShapes) {
  EXPECT_THAT(
      KnownModelShapes(),
      ElementsAre("smollm2-135m", "llama-3.2-1b", "qwen3-0.6b", "qwen2.5-0.5b",
                  "tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-llama3"));
  auto unknown = ModelShapeConfig("gpt-5");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(unknown.status()),
              AllOf(HasSubstr("'gpt-5'"), HasSubstr("smollm2-135m"),
                    HasSubstr("tiny-llama3")));
}

TEST(MakeModelTest, EveryShapeConfigRoundTripsThroughJson) {
  std::set<std::string> fingerprints;
  for (const std::string& shape : KnownModelShapes()) {
    auto config = ModelShapeConfig(shape);
    ASSERT_TRUE(config.ok()) << config.status();
    auto parsed = ParseModelConfig(ModelConfigToJson(*config), shape);
    ASSERT_TRUE(parsed.ok()) << shape << ": " << parsed.status();
    EXPECT_EQ(parsed->Fingerprint(), config->Fingerprint()) << shape;
    EXPECT_EQ(parsed->attention_bias, config->attention_bias) << shape;
    EXPECT_EQ(parsed->qk_norm, config->qk_norm) << shape;
    EXPECT_EQ(parsed->eos_token_ids, config->eos_token_ids) << shape;
    EXPECT_EQ(parsed->bos_token_id, config->bos_token_id) << shape;
    fingerprints.insert(config->Fingerprint());
  }
  EXPECT_EQ(fingerprints.size(), KnownModelShapes().size());
}

TEST(MakeModelTest, Smollm2Config) {
  auto c = ModelShapeConfig("smollm2-135m");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_EQ(c->num_hidden_layers, 30);
  EXPECT_EQ(c->hidden_size, 576);
  EXPECT_EQ(c->num_attention_heads, 9);
  EXPECT_EQ(c->num_key_value_heads, 3);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->intermediate_size, 1536);
  EXPECT_EQ(c->vocab_size, 49152);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c->rope_theta, 100000);
  EXPECT_EQ(c->max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(2));
  EXPECT_FALSE(c->rope_scaling.has_value());
  EXPECT_FALSE(c->attention_bias);
  EXPECT_FALSE(c->qk_norm);
  // About 135M parameters (tied embeddings counted once).
  int64_t params = 0;
  for (const auto& [name, shape] : ExpectedTensors(*c)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    params += n;
  }
  EXPECT_NEAR(static_cast<double>(params), 134.5e6, 1e6);
}

TEST(MakeModelTest, RealShapeConfigs) {
  auto llama = ModelShapeConfig("llama-3.2-1b");
  ASSERT_TRUE(llama.ok());
  EXPECT_EQ(llama->num_hidden_layers, 16);
  EXPECT_EQ(llama->hidden_size, 2048);
  EXPECT_EQ(llama->num_attention_heads, 32);
  EXPECT_EQ(llama->num_key_value_heads, 8);
  EXPECT_EQ(llama->head_dim, 64);
  EXPECT_EQ(llama->intermediate_size, 8192);
  EXPECT_EQ(llama->vocab_size, 128256);
  EXPECT_EQ(llama->max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(llama->rope_theta, 500000);
  ASSERT_TRUE(llama->rope_scaling.has_value());
  EXPECT_EQ(llama->rope_scaling->rope_type, "llama3");
  EXPECT_DOUBLE_EQ(llama->rope_scaling->factor, 32);
  EXPECT_EQ(llama->rope_scaling->original_max_position_embeddings, 8192);
  EXPECT_EQ(llama->bos_token_id, 128000);
  EXPECT_THAT(llama->eos_token_ids, ElementsAre(128001, 128008, 128009));

  auto qwen3 = ModelShapeConfig("qwen3-0.6b");
  ASSERT_TRUE(qwen3.ok());
  EXPECT_EQ(qwen3->model_type, "qwen3");
  EXPECT_TRUE(qwen3->qk_norm);
  EXPECT_EQ(qwen3->head_dim, 128);
  EXPECT_EQ(qwen3->num_hidden_layers, 28);
  EXPECT_EQ(qwen3->vocab_size, 151936);
  EXPECT_EQ(qwen3->max_position_embeddings, 40960);
  EXPECT_THAT(qwen3->eos_token_ids, ElementsAre(151645));

  auto qwen2 = ModelShapeConfig("qwen2.5-0.5b");
  ASSERT_TRUE(qwen2.ok());
  EXPECT_EQ(qwen2->model_type, "qwen2");
  EXPECT_TRUE(qwen2->attention_bias);
  EXPECT_EQ(qwen2->head_dim, 64);
  EXPECT_EQ(qwen2->num_key_value_heads, 2);
  EXPECT_EQ(qwen2->intermediate_size, 4864);
  EXPECT_FALSE(qwen2->sliding_window.has_value());
}

TEST(MakeModelTest, WritesEveryTinyShapeAndItLoadsBack) {
  for (const std::string shape :
       {"tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-llama3"}) {
    SCOPED_TRACE(shape);
    const testing::ScopedTempDir temp("make_model");
    const std::string& dir = temp.path();
    MakeModelOptions options;
    options.shape = shape;
    options.out_dir = dir + "/model";  // Created by MakeModel.
    options.dtype = "fp32";
    options.seed = 7;
    ASSERT_TRUE(MakeModel(options).ok());

    auto expected_config = ModelShapeConfig(shape);
    ASSERT_TRUE(expected_config.ok());
    auto config = LoadModelConfig(options.out_dir);
    ASSERT_TRUE(config.ok()) << config.status();
    EXPECT_EQ(config->Fingerprint(), expected_config->Fingerprint());
    EXPECT_EQ(config->torch_dtype, "float32");
    EXPECT_EQ(config->bos_token_id, kSyntheticBosId);
    EXPECT_THAT(config->eos_token_ids, ElementsAre(kSyntheticEosId));
    EXPECT_LE(kSyntheticVocabSize, config->vocab_size);

    auto checkpoint = Checkpoint::Open(options.out_dir);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    const auto expected = ExpectedTensors(*config);
    std::vector<std::string> expected_names;
    for (const auto& [name, unused] : expected) expected_names.push_back(name);
    EXPECT_EQ((*checkpoint)->TensorNames(), expected_names);
    for (const auto& [name, tensor_shape] : expected) {
      auto tensor = (*checkpoint)->Get(name, tensor_shape);
      ASSERT_TRUE(tensor.ok()) << tensor.status();
      EXPECT_EQ(tensor->scalar_type(), torch::kFloat32);
      EXPECT_TRUE(torch::isfinite(*tensor).all().item<bool>()) << name;
      const bool is_norm = name.find("norm") != std::string::npos;
      const double mean = tensor->mean().item<double>();
      const double std = tensor->std().item<double>();
      if (is_norm) {
        EXPECT_NEAR(mean, 1.0, 0.02) << name;
      } else {
        EXPECT_NEAR(mean, 0.0, 0.02) << name;
        EXPECT_NEAR(std, 0.02, 0.008) << name;
      }
    }

    // Tied shapes have no lm_head; the others do.
    EXPECT_EQ((*checkpoint)->Has("lm_head.weight"),
              !config->tie_word_embeddings);
    if (shape == std::string("tiny-qwen2")) {
      EXPECT_TRUE(config->attention_bias);
    }
    if (shape == std::string("tiny-qwen3")) {
      EXPECT_TRUE(config->qk_norm);
      EXPECT_EQ(config->head_dim, 32);
      EXPECT_NE(config->head_dim * config->num_attention_heads,
                config->hidden_size);
    }
    if (shape == std::string("tiny-llama3")) {
      ASSERT_TRUE(config->rope_scaling.has_value());
      EXPECT_EQ(config->rope_scaling->rope_type, "llama3");
    }

    nlohmann::json origin = nlohmann::json::parse(
        ReadFile(options.out_dir + "/knapserve_make_model.json"));
    EXPECT_EQ(origin["shape"], shape);
    EXPECT_EQ(origin["seed"], 7);
    EXPECT_EQ(origin["dtype"], "float32");
    EXPECT_TRUE(std::filesystem::exists(options.out_dir + "/tokenizer.json"));
    EXPECT_TRUE(
        std::filesystem::exists(options.out_dir + "/generation_config.json"));
  }
}

TEST(MakeModelTest, SameSeedSameBytesDifferentSeedDifferentBytes) {
  const testing::ScopedTempDir temp("make_model");
  const std::string& dir = temp.path();
  MakeModelOptions options;
  options.shape = "tiny-llama";
  options.seed = 1;
  options.out_dir = dir + "/a";
  ASSERT_TRUE(MakeModel(options).ok());
  options.out_dir = dir + "/b";
  ASSERT_TRUE(MakeModel(options).ok());
  options.seed = 2;
  options.out_dir = dir + "/c";
  ASSERT_TRUE(MakeModel(options).ok());
  const std::string a = ReadFile(dir + "/a/model.safetensors");
  const std::string b = ReadFile(dir + "/b/model.safetensors");
  const std::string c = ReadFile(dir + "/c/model.safetensors");
  EXPECT_GT(a.size(), 100000u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_EQ(a.size(), c.size());

  // Each tensor differs between seeds, and different tensors differ.
  auto ca = Checkpoint::Open(dir + "/a");
  auto cc = Checkpoint::Open(dir + "/c");
  ASSERT_TRUE(ca.ok() && cc.ok());
  for (const std::string& name : (*ca)->TensorNames()) {
    auto info = SafetensorsFile::Open(dir + "/a/model.safetensors");
    ASSERT_TRUE(info.ok());
    auto ta = (*ca)->Get(name, (*info)->Find(name)->shape);
    auto tc = (*cc)->Get(name, (*info)->Find(name)->shape);
    ASSERT_TRUE(ta.ok() && tc.ok());
    EXPECT_FALSE(torch::equal(*ta, *tc)) << name;
  }
  auto q = (*ca)->Get("model.layers.0.self_attn.k_proj.weight", {32, 64});
  auto v = (*ca)->Get("model.layers.0.self_attn.v_proj.weight", {32, 64});
  ASSERT_TRUE(q.ok() && v.ok());
  EXPECT_FALSE(torch::equal(*q, *v));
}

TEST(MakeModelTest, Dtypes) {
  const testing::ScopedTempDir temp("make_model");
  const std::string& dir = temp.path();
  for (const auto& [dtype, safetensors_dtype, scalar_type] :
       std::vector<std::tuple<std::string, std::string, torch::ScalarType>>{
           {"bf16", "BF16", torch::kBFloat16},
           {"fp16", "F16", torch::kFloat16}}) {
    MakeModelOptions options;
    options.shape = "tiny-qwen3";
    options.dtype = dtype;
    options.out_dir = dir + "/" + dtype;
    ASSERT_TRUE(MakeModel(options).ok());
    auto file = SafetensorsFile::Open(options.out_dir + "/model.safetensors");
    ASSERT_TRUE(file.ok());
    for (const TensorInfo& info : (*file)->tensors())
      EXPECT_EQ(info.dtype, safetensors_dtype);
    auto view = (*file)->View("model.norm.weight");
    ASSERT_TRUE(view.ok());
    EXPECT_EQ(view->scalar_type(), scalar_type);
    // The same seed gives the fp32 values, rounded.
    MakeModelOptions fp32 = options;
    fp32.dtype = "fp32";
    fp32.out_dir = dir + "/fp32";
    ASSERT_TRUE(MakeModel(fp32).ok());
    auto full = SafetensorsFile::Open(fp32.out_dir + "/model.safetensors");
    ASSERT_TRUE(full.ok());
    auto full_view = (*full)->View("model.layers.1.mlp.down_proj.weight");
    auto low_view = (*file)->View("model.layers.1.mlp.down_proj.weight");
    ASSERT_TRUE(full_view.ok() && low_view.ok());
    EXPECT_TRUE(torch::equal(full_view->to(scalar_type), *low_view));
    auto config = LoadModelConfig(options.out_dir);
    ASSERT_TRUE(config.ok());
    EXPECT_EQ(config->torch_dtype, dtype == "bf16" ? "bfloat16" : "float16");
  }
}

TEST(MakeModelTest, BadOptions) {
  const testing::ScopedTempDir temp("make_model");
  const std::string& dir = temp.path();
  MakeModelOptions options;
  options.shape = "tiny-llama";
  options.out_dir = dir + "/m";
  options.dtype = "int8";
  absl::Status status = MakeModel(options);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(status), HasSubstr("'int8'"));
  options.dtype = "fp32";
  options.shape = "huge";
  EXPECT_EQ(MakeModel(options).code(), absl::StatusCode::kInvalidArgument);
  options.shape = "tiny-llama";
  options.tokenizer_json = dir + "/absent.json";
  status = MakeModel(options);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(status), HasSubstr("absent.json"));
  EXPECT_FALSE(std::filesystem::exists(options.out_dir));
}

TEST(MakeModelTest, CopiesGivenTokenizer) {
  const testing::ScopedTempDir temp("make_model");
  const std::string& dir = temp.path();
  {
    std::ofstream out(dir + "/my_tokenizer.json");
    out << R"({"version": "1.0", "marker": 42})";
  }
  MakeModelOptions options;
  options.shape = "tiny-qwen2";
  options.out_dir = dir + "/m";
  options.tokenizer_json = dir + "/my_tokenizer.json";
  ASSERT_TRUE(MakeModel(options).ok());
  EXPECT_EQ(ReadFile(options.out_dir + "/tokenizer.json"),
            R"({"version": "1.0", "marker": 42})");
}

TEST(MakeModelTest, SyntheticTokenizerIsConsistentByteLevelBpe) {
  const testing::ScopedTempDir temp("make_model");
  const std::string& dir = temp.path();
  MakeModelOptions options;
  options.shape = "tiny-llama";
  options.out_dir = dir;
  ASSERT_TRUE(MakeModel(options).ok());
  nlohmann::json tokenizer =
      nlohmann::json::parse(ReadFile(dir + "/tokenizer.json"));
  const nlohmann::json& model = tokenizer["model"];
  EXPECT_EQ(model["type"], "BPE");
  EXPECT_EQ(tokenizer["pre_tokenizer"]["type"], "ByteLevel");
  EXPECT_EQ(tokenizer["pre_tokenizer"]["add_prefix_space"], false);
  EXPECT_EQ(tokenizer["pre_tokenizer"]["use_regex"], true);
  EXPECT_EQ(tokenizer["decoder"]["type"], "ByteLevel");
  EXPECT_EQ(tokenizer["post_processor"]["type"], "ByteLevel");

  // Ids 0..N-1, each once.
  const nlohmann::json& vocab = model["vocab"];
  ASSERT_EQ(vocab.size(), static_cast<size_t>(kSyntheticVocabSize));
  std::set<int> ids;
  for (const auto& [token, id] : vocab.items()) ids.insert(id.get<int>());
  EXPECT_EQ(ids.size(), vocab.size());
  EXPECT_EQ(*ids.begin(), 0);
  EXPECT_EQ(*ids.rbegin(), kSyntheticVocabSize - 1);

  // GPT-2 byte tokens: '!' is 0, the space byte is "Ġ" (U+0120).
  EXPECT_EQ(vocab["!"], 0);
  EXPECT_EQ(vocab["A"], 'A' - '!');
  EXPECT_LT(vocab["\xC4\xA0"].get<int>(), 256);

  // Every merge joins two known tokens into the next known token.
  ASSERT_EQ(model["merges"].size(), static_cast<size_t>(kSyntheticMerges));
  int expected_id = 256;
  for (const nlohmann::json& merge : model["merges"]) {
    const std::string text = merge.get<std::string>();
    const size_t space = text.find(' ');
    ASSERT_NE(space, std::string::npos);
    const std::string left = text.substr(0, space),
                      right = text.substr(space + 1);
    EXPECT_TRUE(vocab.contains(left)) << text;
    EXPECT_TRUE(vocab.contains(right)) << text;
    EXPECT_EQ(vocab[left + right], expected_id++) << text;
  }
  EXPECT_EQ(vocab["\xC4\xA0the"], vocab["\xC4\xA0t"].get<int>() + 4);

  // Special tokens sit at the config's bos/eos ids.
  ASSERT_EQ(tokenizer["added_tokens"].size(), 2u);
  EXPECT_EQ(tokenizer["added_tokens"][0]["content"], "<|bos|>");
  EXPECT_EQ(tokenizer["added_tokens"][0]["id"], kSyntheticBosId);
  EXPECT_EQ(tokenizer["added_tokens"][1]["content"], "<|eos|>");
  EXPECT_EQ(tokenizer["added_tokens"][1]["id"], kSyntheticEosId);
  EXPECT_EQ(tokenizer["added_tokens"][1]["special"], true);
}

}  // namespace
}  // namespace knapserve

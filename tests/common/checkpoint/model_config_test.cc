#include "common/checkpoint/model_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_models.h"
#include "tests/testing/test_util.h"
#include "tools/shared_data.h"

namespace knapserve {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

using testing::Message;
using testing::WriteFile;

// A valid llama config.json; tests patch fields on top of it.
nlohmann::json LlamaJson() {
  return nlohmann::json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": null, "tie_word_embeddings": true, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "bfloat16"})");
}

absl::StatusOr<ModelConfig> Parse(const nlohmann::json& json) {
  return ParseModelConfig(json.dump(), "config.json");
}

absl::Status ParseError(const nlohmann::json& json) {
  absl::StatusOr<ModelConfig> config = Parse(json);
  EXPECT_FALSE(config.ok());
  if (config.ok()) return absl::OkStatus();
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(config.status()), HasSubstr("config.json: "));
  return config.status();
}

void ExpectSameConfig(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_DOUBLE_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_DOUBLE_EQ(a.rope_theta, b.rope_theta);
  ASSERT_EQ(a.rope_scaling.has_value(), b.rope_scaling.has_value());
  if (a.rope_scaling.has_value()) {
    EXPECT_EQ(a.rope_scaling->rope_type, b.rope_scaling->rope_type);
    EXPECT_DOUBLE_EQ(a.rope_scaling->factor, b.rope_scaling->factor);
    EXPECT_DOUBLE_EQ(a.rope_scaling->low_freq_factor,
                     b.rope_scaling->low_freq_factor);
    EXPECT_DOUBLE_EQ(a.rope_scaling->high_freq_factor,
                     b.rope_scaling->high_freq_factor);
    EXPECT_EQ(a.rope_scaling->original_max_position_embeddings,
              b.rope_scaling->original_max_position_embeddings);
  }
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.attention_bias, b.attention_bias);
  EXPECT_EQ(a.qk_norm, b.qk_norm);
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  EXPECT_EQ(a.bos_token_id, b.bos_token_id);
  EXPECT_EQ(a.eos_token_ids, b.eos_token_ids);
  EXPECT_EQ(a.torch_dtype, b.torch_dtype);
  EXPECT_EQ(a.Fingerprint(), b.Fingerprint());
}

TEST(ModelConfigTest, ParsesLlama) {
  auto config = Parse(LlamaJson());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->model_type, "llama");
  EXPECT_EQ(config->vocab_size, 1000);
  EXPECT_EQ(config->hidden_size, 128);
  EXPECT_EQ(config->intermediate_size, 256);
  EXPECT_EQ(config->num_hidden_layers, 4);
  EXPECT_EQ(config->num_attention_heads, 8);
  EXPECT_EQ(config->num_key_value_heads, 2);
  EXPECT_EQ(config->head_dim, 16);  // hidden / heads.
  EXPECT_EQ(config->max_position_embeddings, 2048);
  EXPECT_DOUBLE_EQ(config->rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(config->rope_theta, 500000);
  EXPECT_FALSE(config->rope_scaling.has_value());
  EXPECT_TRUE(config->tie_word_embeddings);
  EXPECT_FALSE(config->attention_bias);
  EXPECT_FALSE(config->qk_norm);
  EXPECT_FALSE(config->sliding_window.has_value());
  EXPECT_EQ(config->bos_token_id, 1);
  EXPECT_THAT(config->eos_token_ids, ElementsAre(2));
  EXPECT_EQ(config->torch_dtype, "bfloat16");
  EXPECT_EQ(config->max_context(), 2048);
}

TEST(ModelConfigTest, Defaults) {
  nlohmann::json json = LlamaJson();
  for (const char* field :
       {"num_key_value_heads", "rms_norm_eps", "rope_theta", "rope_scaling",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "torch_dtype"}) {
    json.erase(field);
  }
  json["head_dim"] = nullptr;
  auto config = Parse(json);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->num_key_value_heads, 8);
  EXPECT_EQ(config->head_dim, 16);
  EXPECT_DOUBLE_EQ(config->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(config->rope_theta, 10000);
  EXPECT_FALSE(config->tie_word_embeddings);
  EXPECT_FALSE(config->bos_token_id.has_value());
  EXPECT_TRUE(config->eos_token_ids.empty());
  EXPECT_EQ(config->torch_dtype, "");
}

TEST(ModelConfigTest, LlamaAttentionBiasAndEosList) {
  nlohmann::json json = LlamaJson();
  json["attention_bias"] = true;
  json["eos_token_id"] = {128001, 128008, 128009};
  json["sliding_window"] = 100;  // Llama ignores it.
  auto config = Parse(json);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->attention_bias);
  EXPECT_THAT(config->eos_token_ids, ElementsAre(128001, 128008, 128009));
  EXPECT_FALSE(config->sliding_window.has_value());
}

TEST(ModelConfigTest, RopeScalingLlama3) {
  nlohmann::json json = LlamaJson();
  json["rope_scaling"] = {{"rope_type", "llama3"},
                          {"factor", 32.0},
                          {"low_freq_factor", 1.0},
                          {"high_freq_factor", 4.0},
                          {"original_max_position_embeddings", 8192}};
  auto config = Parse(json);
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_TRUE(config->rope_scaling.has_value());
  EXPECT_EQ(config->rope_scaling->rope_type, "llama3");
  EXPECT_DOUBLE_EQ(config->rope_scaling->factor, 32);
  EXPECT_DOUBLE_EQ(config->rope_scaling->low_freq_factor, 1);
  EXPECT_DOUBLE_EQ(config->rope_scaling->high_freq_factor, 4);
  EXPECT_EQ(config->rope_scaling->original_max_position_embeddings, 8192);

  // The older "type" key is accepted too.
  json["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  config = Parse(json);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->rope_scaling->rope_type, "linear");
  EXPECT_DOUBLE_EQ(config->rope_scaling->factor, 2);

  json["rope_scaling"] = {{"rope_type", "default"}};
  config = Parse(json);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->rope_scaling.has_value());
}

TEST(ModelConfigTest, RopeScalingErrors) {
  nlohmann::json json = LlamaJson();
  json["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_THAT(Message(ParseError(json)),
              HasSubstr("unsupported rope_scaling type 'yarn'"));
  json["rope_scaling"] = {{"type", "dynamic"}, {"factor", 4.0}};
  EXPECT_THAT(Message(ParseError(json)),
              HasSubstr("unsupported rope_scaling type 'dynamic'"));
  json["rope_scaling"] = {{"factor", 4.0}};
  EXPECT_THAT(Message(ParseError(json)), HasSubstr("rope_type"));
  json["rope_scaling"] = {{"rope_type", "linear"}};
  EXPECT_THAT(Message(ParseError(json)), HasSubstr("rope_scaling.factor"));
  json["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", -1.0}};
  EXPECT_THAT(Message(ParseError(json)), HasSubstr("factor"));
  json["rope_scaling"] = {{"rope_type", "llama3"},
                          {"factor", 8.0},
                          {"low_freq_factor", 4.0},
                          {"high_freq_factor", 1.0}};
  EXPECT_THAT(Message(ParseError(json)),
              HasSubstr("high_freq_factor > low_freq_factor"));
  json["rope_scaling"] = "llama3";
  EXPECT_THAT(Message(ParseError(json)), HasSubstr("rope_scaling"));
}

TEST(ModelConfigTest, Qwen2AlwaysHasBiasAndOptionalSlidingWindow) {
  nlohmann::json json = LlamaJson();
  json["model_type"] = "qwen2";
  json["sliding_window"] = 1024;
  json["use_sliding_window"] = false;
  auto config = Parse(json);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->attention_bias);
  EXPECT_FALSE(config->qk_norm);
  EXPECT_FALSE(config->sliding_window.has_value());
  EXPECT_EQ(config->max_context(), 2048);

  json["use_sliding_window"] = true;
  config = Parse(json);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->sliding_window, 1024);
  EXPECT_EQ(config->max_context(), 1024);
}

TEST(ModelConfigTest, Qwen3HasQkNormAndExplicitHeadDim) {
  nlohmann::json json = LlamaJson();
  json["model_type"] = "qwen3";
  json["hidden_size"] = 1024;
  json["num_attention_heads"] = 16;
  json["num_key_value_heads"] = 8;
  json["head_dim"] = 128;
  json["attention_bias"] = false;
  auto config = Parse(json);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->qk_norm);
  EXPECT_FALSE(config->attention_bias);
  EXPECT_EQ(config->head_dim, 128);
  EXPECT_FALSE(config->sliding_window.has_value());
}

TEST(ModelConfigTest, MistralSlidingWindowWhenNonNull) {
  nlohmann::json json = LlamaJson();
  json["model_type"] = "mistral";
  json["sliding_window"] = 512;
  auto config = Parse(json);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->sliding_window, 512);
  EXPECT_EQ(config->max_context(), 512);
  EXPECT_FALSE(config->attention_bias);

  json["sliding_window"] = nullptr;
  config = Parse(json);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->sliding_window.has_value());
  // A window larger than max_position_embeddings does not raise the cap.
  json["sliding_window"] = 4096;
  config = Parse(json);
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->max_context(), 2048);

  json["sliding_window"] = 0;
  EXPECT_THAT(
      Message(ParseError(json)),
      HasSubstr(
          "config.json: field \"sliding_window\": must be positive, got 0"));
}

TEST(ModelConfigTest, UnsupportedModelType) {
  nlohmann::json json = LlamaJson();
  json["model_type"] = "gpt2";
  EXPECT_EQ(Message(ParseError(json)),
            "config.json: field \"model_type\": unsupported model_type 'gpt2' "
            "(supported: llama, "
            "mistral, qwen2, qwen3)");
  json.erase("model_type");
  EXPECT_THAT(Message(ParseError(json)),
              HasSubstr("field \"model_type\": required but missing"));
  json["model_type"] = 3;
  EXPECT_THAT(
      Message(ParseError(json)),
      HasSubstr("field \"model_type\": expected a string, got number 3"));
}

TEST(ModelConfigTest, RequiredFieldsAreNamed) {
  for (const char* field :
       {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "max_position_embeddings"}) {
    nlohmann::json json = LlamaJson();
    json.erase(field);
    EXPECT_THAT(Message(ParseError(json)),
                HasSubstr(std::string("field \"") + field +
                          "\": required but missing"));
    json[field] = 0;
    EXPECT_THAT(Message(ParseError(json)),
                AllOf(HasSubstr(std::string("field \"") + field + "\""),
                      HasSubstr("must be positive, got 0")));
    json[field] = -3;
    EXPECT_THAT(Message(ParseError(json)),
                HasSubstr("must be positive, got -3"));
    json[field] = "12";
    EXPECT_THAT(Message(ParseError(json)),
                HasSubstr("expected an integer, got string \"12\""));
    json[field] = 12.5;
    EXPECT_THAT(Message(ParseError(json)),
                HasSubstr("expected an integer, got number 12.5"));
  }
  for (const char* field : {"num_key_value_heads", "head_dim"}) {
    nlohmann::json json = LlamaJson();
    json[field] = -1;
    EXPECT_THAT(Message(ParseError(json)),
                HasSubstr(std::string("field \"") + field + "\""));
  }
  nlohmann::json json = LlamaJson();
  json["rms_norm_eps"] = 0;
  EXPECT_THAT(Message(ParseError(json)),
              HasSubstr("field \"rms_norm_eps\": must be positive"));
  json = LlamaJson();
  json["rope_theta"] = "big";
  EXPECT_THAT(Message(ParseError(json)),
              HasSubstr("field \"rope_theta\": expected a number"));
  json = LlamaJson();
  json["tie_word_embeddings"] = 1;
  EXPECT_THAT(
      Message(ParseError(json)),
      HasSubstr("field \"tie_word_embeddings\": expected true or false"));
  json = LlamaJson();
  json["eos_token_id"] = {2, -1};
  EXPECT_THAT(Message(ParseError(json)),
              HasSubstr("field \"eos_token_id[1]\": expected a token id (0 to "
                        "2147483647), got -1"));
  // Integral floats are accepted.
  json = LlamaJson();
  json["vocab_size"] = 1000.0;
  EXPECT_TRUE(Parse(json).ok());
}

TEST(ModelConfigTest, MalformedFieldNamesFileAndField) {
  nlohmann::json json = LlamaJson();
  json["num_hidden_layers"] = "4";
  EXPECT_EQ(
      Message(ParseModelConfig(json.dump(), "models/x/config.json").status()),
      "models/x/config.json: field \"num_hidden_layers\": expected an integer, "
      "got "
      "string \"4\"");
  json = LlamaJson();
  json["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", "eight"}};
  EXPECT_EQ(Message(ParseError(json)),
            "config.json: field \"rope_scaling.factor\": expected a number, "
            "got string "
            "\"eight\"");
}

TEST(ModelConfigTest, HeadDivisibility) {
  nlohmann::json json = LlamaJson();
  json["num_attention_heads"] = 7;
  json["num_key_value_heads"] = 7;
  EXPECT_THAT(
      Message(ParseError(json)),
      HasSubstr("hidden_size 128 is not divisible by num_attention_heads 7"));
  json["head_dim"] = 16;  // An explicit head_dim needs no divisibility.
  EXPECT_TRUE(Parse(json).ok());

  json = LlamaJson();
  json["num_key_value_heads"] = 3;
  EXPECT_THAT(
      Message(ParseError(json)),
      HasSubstr(
          "num_attention_heads 8 is not divisible by num_key_value_heads 3"));
}

TEST(ModelConfigTest, NotJson) {
  auto config = ParseModelConfig("{\"model_type\": ", "some/config.json");
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(config.status()),
              StartsWith("some/config.json: not valid JSON: "));
  config = ParseModelConfig("[1]", "config.json");
  EXPECT_EQ(Message(config.status()),
            "config.json: expected an object, got array");
}

TEST(ModelConfigTest, LoadsStories260k) {
  auto config = LoadModelConfig(testing::Stories260kDir());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->model_type, "llama");
  EXPECT_EQ(config->vocab_size, 512);
  EXPECT_EQ(config->hidden_size, 64);
  EXPECT_EQ(config->intermediate_size, 172);
  EXPECT_EQ(config->num_hidden_layers, 5);
  EXPECT_EQ(config->num_attention_heads, 8);
  EXPECT_EQ(config->num_key_value_heads, 4);
  EXPECT_EQ(config->head_dim, 8);
  EXPECT_EQ(config->max_position_embeddings, 512);
  EXPECT_TRUE(config->tie_word_embeddings);
  EXPECT_FALSE(config->attention_bias);
  EXPECT_DOUBLE_EQ(config->rms_norm_eps, 1e-5);
  EXPECT_EQ(config->bos_token_id, 1);
  EXPECT_THAT(config->eos_token_ids, ElementsAre(2));
  EXPECT_EQ(config->torch_dtype, "float32");
}

TEST(ModelConfigTest, GenerationConfigOverridesTokenIds) {
  const testing::ScopedTempDir temp("model_config");
  const std::string& dir = temp.path();
  WriteFile(dir + "/config.json", LlamaJson().dump());
  WriteFile(
      dir + "/generation_config.json",
      R"({"bos_token_id": 5, "eos_token_id": [7, 8], "temperature": 0.6})");
  auto config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->bos_token_id, 5);
  EXPECT_THAT(config->eos_token_ids, ElementsAre(7, 8));

  // Fields absent or null in generation_config.json keep config.json's.
  WriteFile(dir + "/generation_config.json", R"({"eos_token_id": null})");
  config = LoadModelConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->bos_token_id, 1);
  EXPECT_THAT(config->eos_token_ids, ElementsAre(2));

  WriteFile(dir + "/generation_config.json", "{oops");
  config = LoadModelConfig(dir);
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(config.status()),
              HasSubstr(dir + "/generation_config.json"));

  WriteFile(dir + "/generation_config.json", R"({"eos_token_id": "x"})");
  config = LoadModelConfig(dir);
  EXPECT_THAT(Message(config.status()),
              HasSubstr("generation_config.json: field \"eos_token_id\": "
                        "expected an integer or a "
                        "list of integers, got string \"x\""));

  WriteFile(dir + "/config.json", R"({"model_type": "gpt2"})");
  config = LoadModelConfig(dir);
  EXPECT_THAT(Message(config.status()),
              AllOf(HasSubstr(dir + "/config.json"),
                    HasSubstr("unsupported model_type 'gpt2'")));
}

TEST(ModelConfigTest, MissingFolder) {
  const testing::ScopedTempDir empty("model_config");
  auto config = LoadModelConfig(empty.path());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(config.status()), HasSubstr("config.json"));
}

TEST(ModelConfigTest, JsonRoundTrip) {
  std::vector<nlohmann::json> inputs;
  inputs.push_back(LlamaJson());
  nlohmann::json llama3 = LlamaJson();
  llama3["rope_scaling"] = {{"rope_type", "llama3"},
                            {"factor", 32.0},
                            {"low_freq_factor", 1.0},
                            {"high_freq_factor", 4.0},
                            {"original_max_position_embeddings", 8192}};
  llama3["eos_token_id"] = {128001, 128009};
  llama3["attention_bias"] = true;
  inputs.push_back(llama3);
  nlohmann::json linear = LlamaJson();
  linear["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  linear.erase("bos_token_id");
  linear.erase("eos_token_id");
  inputs.push_back(linear);
  nlohmann::json qwen2 = LlamaJson();
  qwen2["model_type"] = "qwen2";
  qwen2["use_sliding_window"] = true;
  qwen2["sliding_window"] = 1000;
  inputs.push_back(qwen2);
  nlohmann::json qwen3 = LlamaJson();
  qwen3["model_type"] = "qwen3";
  qwen3["head_dim"] = 64;
  inputs.push_back(qwen3);
  nlohmann::json mistral = LlamaJson();
  mistral["model_type"] = "mistral";
  mistral["sliding_window"] = 4096;
  inputs.push_back(mistral);

  for (const nlohmann::json& input : inputs) {
    auto config = Parse(input);
    ASSERT_TRUE(config.ok()) << config.status();
    const std::string text = ModelConfigToJson(*config);
    auto again = ParseModelConfig(text, "roundtrip");
    ASSERT_TRUE(again.ok()) << again.status() << "\n" << text;
    ExpectSameConfig(*config, *again);
    nlohmann::json written = nlohmann::json::parse(text);
    EXPECT_TRUE(written.contains("architectures"));
    EXPECT_EQ(written["hidden_act"], "silu");
  }
}

TEST(ModelConfigTest, Fingerprint) {
  auto base = Parse(LlamaJson());
  ASSERT_TRUE(base.ok());
  const std::string fingerprint = base->Fingerprint();
  EXPECT_EQ(fingerprint.size(), 16u);
  EXPECT_EQ(fingerprint.find_first_not_of("0123456789abcdef"),
            std::string::npos);
  EXPECT_EQ(fingerprint, Parse(LlamaJson())->Fingerprint());

  // Token ids and dtype are not architecture.
  ModelConfig other = *base;
  other.eos_token_ids = {9};
  other.bos_token_id.reset();
  other.torch_dtype = "float32";
  EXPECT_EQ(other.Fingerprint(), fingerprint);

  other = *base;
  other.num_hidden_layers = 5;
  EXPECT_NE(other.Fingerprint(), fingerprint);
  other = *base;
  other.rope_scaling = RopeScaling{"llama3", 8, 1, 4, 8192};
  EXPECT_NE(other.Fingerprint(), fingerprint);
  other = *base;
  other.qk_norm = true;
  EXPECT_NE(other.Fingerprint(), fingerprint);
}

}  // namespace
}  // namespace knapserve

// Tests of the Llama-family decoder: the stories260k golden continuation from
// an independent implementation, incremental decode vs one full forward,
// chunked vs one-shot prefill, every architecture variant (Qwen2 biases, Qwen3
// q/k norms, Llama-3 RoPE scaling) against a plain reference written the way
// Hugging Face's modeling code reads, and bf16 staying close to fp32.
#include "common/model/llama.h"

#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/checkpoint/safetensors.h"
#include "tests/testing/test_models.h"
#include "tests/testing/test_util.h"

namespace knapserve {
namespace {

using testing::LoadModelOrFail;
using testing::RandomModelDir;
using testing::Stories260kDir;

torch::Tensor Ids(const std::vector<int64_t>& ids) {
  return torch::tensor(ids, torch::kInt64);
}

// Greedy loop over the sublayer API, one token per step.
std::vector<int64_t> GreedyTokens(const LlamaModel& model,
                                  const std::vector<int64_t>& prompt,
                                  int steps) {
  c10::InferenceMode guard;
  auto kv = model.AllocateKv(static_cast<int64_t>(prompt.size()) + steps);
  torch::Tensor logits = model.Forward(Ids(prompt), 0, kv, 1)[0];
  std::vector<int64_t> out;
  int64_t pos = static_cast<int64_t>(prompt.size());
  for (int i = 0; i < steps; ++i) {
    const int64_t next = logits.argmax().item<int64_t>();
    out.push_back(next);
    logits = model.Forward(Ids({next}), pos++, kv, 1)[0];
  }
  return out;
}

TEST(LlamaModelTest, Stories260kReproducesGoldenGreedyContinuation) {
  if (!std::filesystem::exists(Stories260kDir() + "/model.safetensors")) {
    GTEST_SKIP() << "stories260k not found under " << Stories260kDir();
  }
  auto model = LoadModelOrFail(Stories260kDir());
  ASSERT_NE(model, nullptr);
  // From ../shared/models/stories260k/SOURCE.md (llama2.c convention, numpy).
  const std::vector<int64_t> prompt = {1, 410, 469, 347};
  const std::vector<int64_t> golden = {
      286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410,
      408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394,
      261, 370, 432, 352, 266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 312,
      432, 398, 358, 279, 292, 416, 439, 413, 391, 267, 337, 335};
  EXPECT_EQ(GreedyTokens(*model, prompt, static_cast<int>(golden.size())),
            golden);
}

// A deliberately plain forward pass, written the way Hugging Face's
// modeling_llama / modeling_qwen3 read: separate q/k/v projections, repeat_kv,
// a full causal mask, no cache. It reads the weights straight from the
// checkpoint, so it shares no code with LlamaModel.
torch::Tensor ReferenceLogits(const std::string& dir, const ModelConfig& c,
                              const std::vector<int64_t>& ids) {
  c10::InferenceMode guard;
  auto checkpoint = Checkpoint::Open(dir);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
  auto w = [&](const std::string& name) {
    return (*checkpoint)->View(name).value().to(torch::kFloat32);
  };
  auto rms = [&](torch::Tensor x, torch::Tensor weight) {
    return weight *
           (x * torch::rsqrt(x.pow(2).mean(-1, true) + c.rms_norm_eps));
  };
  const int64_t t = static_cast<int64_t>(ids.size());
  const int64_t hd = c.head_dim, nh = c.num_attention_heads,
                nkv = c.num_key_value_heads;
  torch::Tensor inv_freq = RopeInverseFrequencies(c);
  torch::Tensor freqs =
      torch::outer(torch::arange(t).to(torch::kFloat32), inv_freq);
  torch::Tensor emb = torch::cat({freqs, freqs}, -1);
  torch::Tensor cos = emb.cos().unsqueeze(0),
                sin = emb.sin().unsqueeze(0);  // [1, T, hd]
  auto rotate_half = [&](torch::Tensor x) {
    return torch::cat({-x.narrow(-1, hd / 2, hd / 2), x.narrow(-1, 0, hd / 2)},
                      -1);
  };
  torch::Tensor h = w("model.embed_tokens.weight").index_select(0, Ids(ids));
  torch::Tensor causal = torch::ones({t, t}, torch::kBool).triu(1);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    torch::Tensor x = rms(h, w(p + "input_layernorm.weight"));
    auto proj = [&](const std::string& name) {
      torch::Tensor y =
          torch::matmul(x, w(p + "self_attn." + name + ".weight").t());
      if (c.attention_bias) y = y + w(p + "self_attn." + name + ".bias");
      return y;
    };
    torch::Tensor q =
        proj("q_proj").view({t, nh, hd}).transpose(0, 1);  // [H, T, hd]
    torch::Tensor k =
        proj("k_proj").view({t, nkv, hd}).transpose(0, 1);  // [KV, T, hd]
    torch::Tensor v = proj("v_proj").view({t, nkv, hd}).transpose(0, 1);
    if (c.qk_norm) {
      q = rms(q, w(p + "self_attn.q_norm.weight"));
      k = rms(k, w(p + "self_attn.k_norm.weight"));
    }
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    k = k.repeat_interleave(nh / nkv, 0);
    v = v.repeat_interleave(nh / nkv, 0);
    torch::Tensor scores = torch::matmul(q, k.transpose(1, 2)) /
                           std::sqrt(static_cast<double>(hd));
    scores = scores.masked_fill(causal, -INFINITY);
    torch::Tensor attn =
        torch::matmul(torch::softmax(scores, -1), v);  // [H, T, hd]
    attn = attn.transpose(0, 1).reshape({t, nh * hd});
    h = h + torch::matmul(attn, w(p + "self_attn.o_proj.weight").t());
    x = rms(h, w(p + "post_attention_layernorm.weight"));
    torch::Tensor act =
        torch::silu(torch::matmul(x, w(p + "mlp.gate_proj.weight").t())) *
        torch::matmul(x, w(p + "mlp.up_proj.weight").t());
    h = h + torch::matmul(act, w(p + "mlp.down_proj.weight").t());
  }
  h = rms(h, w("model.norm.weight"));
  const std::string head = (*checkpoint)->Has("lm_head.weight")
                               ? "lm_head.weight"
                               : "model.embed_tokens.weight";
  return torch::matmul(h, w(head).t());
}

std::vector<int64_t> SomeIds(int64_t vocab, int n, int64_t seed) {
  std::vector<int64_t> ids;
  for (int i = 0; i < n; ++i)
    ids.push_back((seed * 7919 + i * 104729 + i * i * 31) % vocab);
  return ids;
}

class ArchitectureTest : public ::testing::TestWithParam<std::string> {};

// The checkpoint folder of an ArchitectureTest parameter.
std::string ParamModelDir(const std::string& param) {
  return param == "stories260k" ? Stories260kDir() : RandomModelDir(param);
}

// A fresh K/V store of `capacity` positions whose layer `layer` holds the
// first `entries` entries of `from` (the rest zero).
std::vector<LayerKv> ScratchKv(const LlamaModel& model, int64_t capacity,
                               int layer, const LayerKv& from,
                               int64_t entries) {
  std::vector<LayerKv> scratch = model.AllocateKv(capacity);
  scratch[layer].k.narrow(1, 0, entries).copy_(from.k.narrow(1, 0, entries));
  scratch[layer].v.narrow(1, 0, entries).copy_(from.v.narrow(1, 0, entries));
  return scratch;
}

TEST_P(ArchitectureTest, MatchesPlainReferenceForward) {
  const std::string dir = ParamModelDir(GetParam());
  ASSERT_FALSE(dir.empty());
  auto model = LoadModelOrFail(dir);
  ASSERT_NE(model, nullptr);
  const std::vector<int64_t> ids = SomeIds(model->config().vocab_size, 21, 3);
  c10::InferenceMode guard;
  auto kv = model->AllocateKv(static_cast<int64_t>(ids.size()));
  torch::Tensor ours = model->Forward(Ids(ids), 0, kv);
  torch::Tensor reference = ReferenceLogits(dir, model->config(), ids);
  ASSERT_EQ(ours.sizes(), reference.sizes());
  EXPECT_LT((ours - reference).abs().max().item<double>(),
            1e-3 * (1 + reference.abs().max().item<double>()));
  EXPECT_TRUE(torch::equal(ours.argmax(-1), reference.argmax(-1)));
}

TEST_P(ArchitectureTest, IncrementalDecodeMatchesFullForward) {
  const std::string dir = ParamModelDir(GetParam());
  ASSERT_FALSE(dir.empty());
  auto model = LoadModelOrFail(dir);
  ASSERT_NE(model, nullptr);
  const std::vector<int64_t> ids = SomeIds(model->config().vocab_size, 40, 5);
  c10::InferenceMode guard;
  auto kv_full = model->AllocateKv(40);
  torch::Tensor full = model->Forward(Ids(ids), 0, kv_full);  // [40, vocab]
  auto kv_step = model->AllocateKv(40);
  for (int64_t pos = 0; pos < 40; ++pos) {
    torch::Tensor step = model->Forward(Ids({ids[pos]}), pos, kv_step)[0];
    ASSERT_TRUE(torch::allclose(step, full[pos], 1e-4, 1e-4))
        << "position " << pos;
  }
  for (int layer = 0; layer < model->num_layers(); ++layer) {
    EXPECT_TRUE(
        torch::allclose(kv_full[layer].k, kv_step[layer].k, 1e-5, 1e-5));
    EXPECT_TRUE(
        torch::allclose(kv_full[layer].v, kv_step[layer].v, 1e-5, 1e-5));
  }
}

TEST_P(ArchitectureTest, ChunkedPrefillMatchesOneShot) {
  const std::string dir = ParamModelDir(GetParam());
  ASSERT_FALSE(dir.empty());
  auto model = LoadModelOrFail(dir);
  ASSERT_NE(model, nullptr);
  const std::vector<int64_t> ids = SomeIds(model->config().vocab_size, 37, 9);
  c10::InferenceMode guard;
  auto kv_one = model->AllocateKv(37);
  torch::Tensor one = model->Prefill(Ids(ids), 0, kv_one, /*chunk_size=*/512);
  for (int64_t chunk : {1, 5, 16}) {
    auto kv_chunked = model->AllocateKv(37);
    torch::Tensor chunked = model->Prefill(Ids(ids), 0, kv_chunked, chunk);
    EXPECT_TRUE(torch::allclose(one, chunked, 1e-4, 1e-4)) << "chunk " << chunk;
    for (int layer = 0; layer < model->num_layers(); ++layer) {
      EXPECT_TRUE(
          torch::allclose(kv_one[layer].k, kv_chunked[layer].k, 1e-5, 1e-5));
    }
  }
}

TEST_P(ArchitectureTest, Bf16StaysCloseToFp32) {
  const std::string dir = ParamModelDir(GetParam());
  ASSERT_FALSE(dir.empty());
  auto fp32 = LoadModelOrFail(dir);
  auto bf16 = LoadModelOrFail(dir, torch::kBFloat16);
  ASSERT_NE(fp32, nullptr);
  ASSERT_NE(bf16, nullptr);
  const std::vector<int64_t> ids = SomeIds(fp32->config().vocab_size, 16, 1);
  c10::InferenceMode guard;
  auto kv32 = fp32->AllocateKv(16);
  auto kv16 = bf16->AllocateKv(16);
  torch::Tensor a = fp32->Forward(Ids(ids), 0, kv32);
  torch::Tensor b = bf16->Forward(Ids(ids), 0, kv16);
  EXPECT_EQ(b.scalar_type(), torch::kFloat32);
  const double cosine =
      torch::cosine_similarity(a.reshape({1, -1}), b.reshape({1, -1}))
          .item<double>();
  EXPECT_GT(cosine, 0.99);
}

INSTANTIATE_TEST_SUITE_P(Shapes, ArchitectureTest,
                         ::testing::Values("stories260k", "tiny-llama",
                                           "tiny-qwen2", "tiny-qwen3",
                                           "tiny-llama3"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& ch : name) {
                             if (ch == '-' || ch == '.') ch = '_';
                           }
                           return name;
                         });

TEST_P(ArchitectureTest, BranchAttentionMatchesCachedAttentionPerBranch) {
  const std::string dir = ParamModelDir(GetParam());
  ASSERT_FALSE(dir.empty());
  auto model = LoadModelOrFail(dir);
  ASSERT_NE(model, nullptr);
  c10::InferenceMode guard;
  const int64_t prefix_len = 11, r = 4;
  const std::vector<int64_t> ids =
      SomeIds(model->config().vocab_size, prefix_len + r, 4);
  auto kv = model->AllocateKv(prefix_len + r);
  model->Forward(
      Ids(std::vector<int64_t>(ids.begin(), ids.begin() + prefix_len)), 0, kv);
  // Two branches: the real embeddings of the r tokens, and a perturbed copy.
  torch::Tensor h0 = model->Embed(
      Ids(std::vector<int64_t>(ids.begin() + prefix_len, ids.end())));
  torch::Tensor h1 = h0 * 1.5 + 0.01;
  torch::Tensor branches = torch::stack({h0, h1});
  for (int layer = 0; layer < model->num_layers(); ++layer) {
    torch::Tensor got = model->BranchAttention(layer, branches, prefix_len,
                                               kv[layer], prefix_len);
    for (int64_t b = 0; b < 2; ++b) {
      auto scratch =
          ScratchKv(*model, prefix_len + r, layer, kv[layer], prefix_len);
      torch::Tensor want =
          model->Attention(layer, branches[b], prefix_len, scratch[layer]);
      EXPECT_TRUE(torch::allclose(got[b], want, 1e-4, 1e-5))
          << "layer " << layer << " branch " << b;
    }
  }
  // The prefix cache is only read.
  auto fresh = model->AllocateKv(prefix_len + r);
  model->Forward(
      Ids(std::vector<int64_t>(ids.begin(), ids.begin() + prefix_len)), 0,
      fresh);
  EXPECT_TRUE(torch::equal(fresh[0].k, kv[0].k));
  // Batched MLP equals per-branch MLP.
  torch::Tensor mlp = model->Mlp(0, branches);
  EXPECT_TRUE(torch::allclose(mlp[1], model->Mlp(0, h1), 1e-5, 1e-6));
}

// With per-row prefix limits each branch token is the first token of a
// draft: it attends to the full model's K/V before its position (the prefix
// now holds the r tokens' own entries too) and to itself only. Token i must
// equal one cached attention step at its position over exactly those
// entries.
TEST_P(ArchitectureTest, BranchAttentionWithRowLimitsIsAFirstDraftPerToken) {
  const std::string dir = ParamModelDir(GetParam());
  ASSERT_FALSE(dir.empty());
  auto model = LoadModelOrFail(dir);
  ASSERT_NE(model, nullptr);
  c10::InferenceMode guard;
  const int64_t first = 9, r = 5;
  const std::vector<int64_t> ids =
      SomeIds(model->config().vocab_size, first + r, 6);
  auto kv = model->AllocateKv(first + r);
  model->Forward(Ids(ids), 0, kv);  // the full model's K/V of every position
  torch::Tensor h0 =
      model->Embed(Ids(std::vector<int64_t>(ids.begin() + first, ids.end())));
  torch::Tensor branches = torch::stack({h0, h0 * 0.5 - 0.02});
  // Contiguous entries (limit i = first + i), and a window that lacks the
  // last two reference tokens' entries.
  const std::vector<std::vector<int64_t>> all_limits = {{9, 10, 11, 12, 13},
                                                        {9, 10, 11, 11, 11}};
  for (const std::vector<int64_t>& limits : all_limits) {
    const int64_t prefix_len = limits.back();
    for (int layer = 0; layer < model->num_layers(); ++layer) {
      torch::Tensor got = model->BranchAttention(layer, branches, first,
                                                 kv[layer], prefix_len, limits);
      for (int64_t b = 0; b < 2; ++b) {
        for (int64_t i = 0; i < r; ++i) {
          // One token at position first + i over `limits[i]` entries: the
          // entries copied to [0, limits[i]), the token written after them
          // at its own position's rotation.
          if (limits[i] != first + i) continue;  // a window: checked below
          auto scratch =
              ScratchKv(*model, first + r, layer, kv[layer], limits[i]);
          torch::Tensor want = model->Attention(
              layer, branches[b].narrow(0, i, 1), first + i, scratch[layer]);
          EXPECT_TRUE(torch::allclose(got[b].narrow(0, i, 1), want, 1e-4, 1e-5))
              << "layer " << layer << " branch " << b << " token " << i;
        }
      }
      if (limits[4] == 11) {
        // The windowed rows see fewer entries than the contiguous ones.
        torch::Tensor full = model->BranchAttention(
            layer, branches, first, kv[layer], 13, all_limits[0]);
        EXPECT_TRUE(torch::allclose(got.narrow(1, 0, 3), full.narrow(1, 0, 3),
                                    1e-5, 1e-6));
        EXPECT_FALSE(torch::allclose(got.narrow(1, 3, 2), full.narrow(1, 3, 2),
                                     1e-5, 1e-6));
      }
    }
  }
  // Limits must fit: one per token, non-decreasing, within prefix_len.
  EXPECT_THROW(model->BranchAttention(0, branches, first, kv[0], 13,
                                      std::vector<int64_t>{9, 10}),
               c10::Error);
  EXPECT_THROW(
      model->BranchAttention(0, branches, first, kv[0], 12, all_limits[0]),
      c10::Error);
  EXPECT_THROW(model->BranchAttention(0, branches, first, kv[0], 13,
                                      std::vector<int64_t>{9, 10, 9, 12, 13}),
               c10::Error);
}

// The goldens of the deep trained models: their SOURCE.md gives prompt ids
// and the first 64 greedy ids of an independent plain PyTorch forward
// (float32). Read from the file, so the test follows the data.
std::vector<std::vector<int64_t>> IdListsIn(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::vector<std::vector<int64_t>> lists;
  const std::string s = text.str();
  for (size_t at = s.find("```\n["); at != std::string::npos;
       at = s.find("```\n[", at + 1)) {
    const size_t end = s.find(']', at);
    std::vector<int64_t> ids;
    std::stringstream items(s.substr(at + 5, end - at - 5));
    for (std::string item; std::getline(items, item, ',');)
      ids.push_back(std::stoll(item));
    lists.push_back(std::move(ids));
  }
  return lists;
}

class DeepGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DeepGoldenTest, ReproducesGoldenGreedyContinuation) {
  KNAPSERVE_SKIP_WITHOUT_SHARED_MODEL(GetParam());
  const std::string dir = testing::SharedModelDir(GetParam());
  const std::vector<std::vector<int64_t>> lists = IdListsIn(dir + "/SOURCE.md");
  ASSERT_GE(lists.size(), 2u) << "SOURCE.md lists prompt and golden ids";
  auto model = LoadModelOrFail(dir);
  ASSERT_NE(model, nullptr);
  const std::vector<int64_t>& golden = lists[1];
  ASSERT_EQ(golden.size(), 64u);
  EXPECT_EQ(GreedyTokens(*model, lists[0], static_cast<int>(golden.size())),
            golden);
}

INSTANTIATE_TEST_SUITE_P(Models, DeepGoldenTest,
                         ::testing::Values("stories-24l", "stories-24l-skip"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

TEST(LlamaModelTest, RopeLlama3ScalingMatchesHuggingFaceFormula) {
  ModelConfig c;
  c.head_dim = 64;
  c.rope_theta = 500000;
  torch::Tensor plain = RopeInverseFrequencies(c);
  c.rope_scaling = RopeScaling{"llama3", 32, 1, 4, 8192};
  torch::Tensor scaled = RopeInverseFrequencies(c);
  // High frequencies (wavelength < 8192/4) stay, low ones (> 8192) are divided
  // by the factor, the band between is interpolated.
  for (int64_t i = 0; i < 32; ++i) {
    const double f = plain[i].item<double>();
    const double wavelen = 2 * M_PI / f;
    const double g = scaled[i].item<double>();
    if (wavelen < 2048) {
      EXPECT_NEAR(g, f, 1e-7 * f);
    } else if (wavelen > 8192) {
      EXPECT_NEAR(g, f / 32, 1e-6 * f);
    } else {
      EXPECT_LE(g, f * (1 + 1e-6));
      EXPECT_GE(g, f / 32 * (1 - 1e-6));
    }
  }
}

TEST(LlamaModelTest, Fp16OnACpuIsAClearError) {
  const std::string src = RandomModelDir("tiny-llama");
  ASSERT_FALSE(src.empty());
  ModelOptions options;
  options.dtype = torch::kFloat16;
  auto model = LlamaModel::Load(src, options);
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(model.status().message().find("fp16 runs on CUDA only"),
            std::string::npos)
      << model.status();
}

TEST(LlamaModelTest, MissingTensorIsAClearError) {
  const std::string src = RandomModelDir("tiny-llama");
  ASSERT_FALSE(src.empty());
  const testing::ScopedTempDir temp("broken");
  const std::string& dir = temp.path();
  for (const char* f :
       {"config.json", "generation_config.json", "tokenizer.json"}) {
    std::filesystem::copy_file(src + "/" + f, dir + "/" + f);
  }
  // Rewrite the checkpoint without one tensor.
  auto checkpoint = Checkpoint::Open(src);
  ASSERT_TRUE(checkpoint.ok());
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const std::string& name : (*checkpoint)->TensorNames()) {
    if (name == "model.layers.1.mlp.up_proj.weight") continue;
    tensors.emplace_back(name, (*checkpoint)->View(name).value().clone());
  }
  ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", tensors).ok());
  auto model = LlamaModel::Load(dir, ModelOptions());
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("model.layers.1.mlp.up_proj.weight"),
            std::string::npos)
      << model.status();
}

TEST(LlamaModelTest, ParsesDtypeAndDeviceNames) {
  EXPECT_EQ(*ParseDtype("bf16"), torch::kBFloat16);
  EXPECT_EQ(*ParseDtype("float32"), torch::kFloat32);
  EXPECT_FALSE(ParseDtype("int8").ok());
  EXPECT_TRUE(ParseDevice("cpu").ok());
  EXPECT_FALSE(ParseDevice("tpu").ok());
  if (!torch::cuda::is_available()) {
    EXPECT_FALSE(ParseDevice("cuda").ok());
  }
}

}  // namespace
}  // namespace knapserve

// The property greedy losslessness rests on, checked on whole models: the
// logits of every row of a k-token pass (verification) equal, bit for bit,
// those of k one-token steps, for k = 1..12, fp32 and bf16, 1 and 2 threads,
// with and without skipped sublayers. It holds because every projection
// (common/model/linear.h), the decode attention (decode_attention.h) and the
// row-wise ops (row_ops.h) compute a row the same way whatever the row count
// and thread split.
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/model/layer_mask.h"
#include "common/model/llama.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

struct Case {
  std::string model;  // a CachedModel name
  std::string skip;   // layer mask text, "" = full model
};

class MultiTokenPassTest : public ::testing::TestWithParam<Case> {};

TEST_P(MultiTokenPassTest, EveryRowEqualsOneTokenSteps) {
  const Case c = GetParam();
  const std::string shape = c.model.substr(0, c.model.find('/'));
  if (shape.rfind("stories", 0) == 0 && shape != "stories260k") {
    KNAPSERVE_SKIP_WITHOUT_SHARED_MODEL(shape);
  }
  const LlamaModel* model = testing::CachedModel(c.model);
  ASSERT_NE(model, nullptr);
  c10::InferenceMode guard;
  auto mask = LayerMask::Parse(c.skip, model->num_layers());
  ASSERT_TRUE(mask.ok()) << mask.status();
  ForwardOptions options;
  options.skip = c.skip.empty() ? nullptr : &*mask;
  constexpr int64_t kMaxK = 12;
  const int64_t vocab = model->config().vocab_size;
  const int64_t prefix = 37;
  const torch::Tensor prompt =
      torch::arange(prefix, torch::kInt64).mul_(31).remainder_(vocab);
  const torch::Tensor rows =
      torch::arange(kMaxK, torch::kInt64).mul_(17).add_(5).remainder_(vocab);
  const int saved_threads = at::get_num_threads();
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    std::vector<LayerKv> steps_kv = model->AllocateKv(prefix + kMaxK);
    std::vector<LayerKv> pass_kv = model->AllocateKv(prefix + kMaxK);
    model->Prefill(prompt, 0, steps_kv);
    model->Prefill(prompt, 0, pass_kv);
    std::vector<torch::Tensor> single;
    for (int64_t i = 0; i < kMaxK; ++i) {
      single.push_back(model->Forward(rows.narrow(0, i, 1), prefix + i,
                                      steps_kv, options)[0]);
    }
    for (int64_t k = 1; k <= kMaxK; ++k) {
      // The pass rewrites positions prefix .. prefix+k-1 of pass_kv, all it
      // reads past prefix.
      const torch::Tensor logits =
          model->Forward(rows.narrow(0, 0, k), prefix, pass_kv, options);
      for (int64_t i = 0; i < k; ++i) {
        EXPECT_TRUE(torch::equal(logits[i], single[i]))
            << c.model << " skip '" << c.skip << "', " << threads
            << " threads: row " << i << " of a " << k
            << "-token pass differs by up to "
            << (logits[i] - single[i]).abs().max().item<float>();
      }
    }
    for (int layer = 0; layer < model->num_layers(); ++layer) {
      EXPECT_TRUE(torch::equal(steps_kv[layer].k, pass_kv[layer].k))
          << "K, layer " << layer;
      EXPECT_TRUE(torch::equal(steps_kv[layer].v, pass_kv[layer].v))
          << "V, layer " << layer;
    }
  }
  at::set_num_threads(saved_threads);
}

INSTANTIATE_TEST_SUITE_P(
    Models, MultiTokenPassTest,
    ::testing::Values(Case{"stories-24l", ""},
                      Case{"stories-24l", "a6,m6,a7,m9,a12,m12,m17"},
                      Case{"stories-24l/bf16", ""},
                      Case{"stories-24l/bf16", "a3,m5,a6,m6,a7,a10,m11,m17"},
                      Case{"stories260k", ""},
                      Case{"stories260k/bf16", "a1,m3"},
                      Case{"tiny-qwen3", "m1"}, Case{"tiny-qwen2/bf16", ""}),
    [](const ::testing::TestParamInfo<Case>& info) {
      std::string name =
          info.param.model + (info.param.skip.empty() ? "_full" : "_masked");
      for (char& ch : name) {
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      }
      return name;
    });

}  // namespace
}  // namespace knapserve

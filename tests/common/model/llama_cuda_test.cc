// The same decoder on torch::kCUDA: logits and greedy tokens match the CPU.
// Every test skips (not fails) where no CUDA device exists, as on the CPU-only
// CI machines; it runs on the GPU machines the project is sometimes lent.
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "common/model/llama.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

class LlamaCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(LlamaCudaTest, LogitsMatchCpu) {
  for (const std::string shape : {"tiny-llama", "tiny-qwen2", "tiny-qwen3"}) {
    const std::string dir = testing::RandomModelDir(shape);
    ModelOptions cpu_options;
    ModelOptions cuda_options;
    cuda_options.device = torch::Device(torch::kCUDA);
    auto cpu = LlamaModel::Load(dir, cpu_options);
    auto cuda = LlamaModel::Load(dir, cuda_options);
    ASSERT_TRUE(cpu.ok() && cuda.ok());
    c10::InferenceMode guard;
    torch::Tensor ids = torch::arange(1, 30, torch::kInt64);
    auto kv_cpu = (*cpu)->AllocateKv(29);
    auto kv_cuda = (*cuda)->AllocateKv(29);
    torch::Tensor a = (*cpu)->Forward(ids, 0, kv_cpu);
    torch::Tensor b = (*cuda)->Forward(ids, 0, kv_cuda).cpu();
    EXPECT_TRUE(torch::allclose(a, b, 1e-3, 1e-3)) << shape;
  }
}

TEST_F(LlamaCudaTest, Bf16RunsOnCuda) {
  ModelOptions options;
  options.device = torch::Device(torch::kCUDA);
  options.dtype = torch::kBFloat16;
  auto model = LlamaModel::Load(testing::RandomModelDir("tiny-llama"), options);
  ASSERT_TRUE(model.ok()) << model.status();
  c10::InferenceMode guard;
  auto kv = (*model)->AllocateKv(8);
  torch::Tensor logits =
      (*model)->Forward(torch::arange(1, 9, torch::kInt64), 0, kv);
  EXPECT_EQ(logits.device().type(), torch::kCUDA);
  EXPECT_TRUE(torch::isfinite(logits).all().item<bool>());
}

}  // namespace
}  // namespace knapserve

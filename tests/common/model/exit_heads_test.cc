// Tests of ExitHeads (common/model/exit_heads.h): the training-free heads are
// the model's final norm and LM head; a few steps of self-distillation on
// stories260k lower the loss; trained heads round-trip through their
// safetensors file (written into a temporary folder) with the model's
// fingerprint; a file for another model, a malformed file and a missing one
// are refused with errors naming the file.
#include "common/model/exit_heads.h"

#include <gtest/gtest.h>

#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "common/text/tokenizer.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::CachedModel;

std::vector<std::vector<int32_t>> Documents() {
  const Tokenizer* tokenizer = testing::StoriesTokenizer();
  std::vector<std::vector<int32_t>> docs;
  for (const char* text :
       {"Once upon a time, there was a little girl named Lily. She loved to "
        "play outside in the park with her friends.",
        "Tom had a big red ball. He liked to kick it very high. One day the "
        "ball went over the fence and Tom was sad.",
        "The sun was shining and the birds were singing. Mom said, \"Let's go "
        "to the beach!\" Everyone was happy."}) {
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer->Encode(text, true);
    EXPECT_TRUE(ids.ok()) << ids.status();
    if (ids.ok()) docs.push_back(*ids);
  }
  return docs;
}

torch::Tensor SomeStates(const LlamaModel& model) {
  torch::manual_seed(3);
  return torch::randn({4, model.config().hidden_size});
}

TEST(ExitHeadsTest, TrainingFreeHeadsAreTheModelsHead) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  const std::shared_ptr<const ExitHeads> heads = ExitHeads::TrainingFree();
  EXPECT_FALSE(heads->trained());
  const torch::Tensor h = SomeStates(*model);
  for (int l = 0; l < model->num_layers(); ++l)
    EXPECT_TRUE(torch::equal(heads->Logits(*model, l, h), model->Logits(h)));
  EXPECT_THROW(heads->Logits(*model, model->num_layers(), h), c10::Error);
  testing::ScopedTempDir dir("exit_heads");
  EXPECT_EQ(heads->Save(dir.path() + "/x.safetensors", *model).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ExitHeadsTest, TrainingLowersTheLossAndTheFileRoundTrips) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  ExitHeadsTrainOptions options;
  options.rank = 8;
  options.steps = 40;
  options.lr = 1e-2;
  options.seq_len = 24;
  options.batch = 2;
  std::vector<double> losses;
  int calls = 0;
  options.on_step = [&](int step, double loss) {
    EXPECT_EQ(step, calls++);
    EXPECT_TRUE(std::isfinite(loss));
  };
  absl::StatusOr<std::shared_ptr<const ExitHeads>> trained =
      TrainExitHeads(*model, Documents(), options, &losses);
  ASSERT_TRUE(trained.ok()) << trained.status();
  ASSERT_EQ(losses.size(), 40u);
  EXPECT_EQ(calls, 40);
  const double first =
      std::accumulate(losses.begin(), losses.begin() + 5, 0.0) / 5;
  const double last = std::accumulate(losses.end() - 5, losses.end(), 0.0) / 5;
  EXPECT_LT(last, 0.9 * first) << "first " << first << ", last " << last;
  EXPECT_TRUE((*trained)->trained());
  EXPECT_EQ((*trained)->rank(), 8);

  const torch::Tensor h = SomeStates(*model);
  // Training moved the heads away from the model's own head.
  EXPECT_FALSE(
      torch::allclose((*trained)->Logits(*model, 0, h), model->Logits(h)));

  testing::ScopedTempDir dir("exit_heads");
  const std::string path = dir.path() + "/heads.safetensors";
  ASSERT_TRUE((*trained)->Save(path, *model).ok());
  absl::StatusOr<std::shared_ptr<const ExitHeads>> loaded =
      ExitHeads::Load(path, *model);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->rank(), 8);
  for (int l = 0; l < model->num_layers(); ++l) {
    EXPECT_TRUE(torch::equal((*loaded)->Logits(*model, l, h),
                             (*trained)->Logits(*model, l, h)))
        << "layer " << l;
  }

  // Another model (another fingerprint) refuses the file, naming it.
  const LlamaModel* other = CachedModel("tiny-llama");
  ASSERT_NE(other, nullptr);
  absl::StatusOr<std::shared_ptr<const ExitHeads>> wrong =
      ExitHeads::Load(path, *other);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find(path), std::string::npos)
      << wrong.status();
  EXPECT_NE(wrong.status().message().find("fingerprint"), std::string::npos)
      << wrong.status();

  // A malformed file and a missing one.
  const std::string junk = dir.path() + "/junk.safetensors";
  std::ofstream(junk) << "not a safetensors file";
  absl::StatusOr<std::shared_ptr<const ExitHeads>> malformed =
      ExitHeads::Load(junk, *model);
  EXPECT_FALSE(malformed.ok());
  EXPECT_NE(malformed.status().message().find(junk), std::string::npos)
      << malformed.status();
  const std::string missing = dir.path() + "/none.safetensors";
  absl::StatusOr<std::shared_ptr<const ExitHeads>> absent =
      ExitHeads::Load(missing, *model);
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(absent.status().message().find(missing), std::string::npos);
}

TEST(ExitHeadsTest, RefusesBadTrainingOptions) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  ExitHeadsTrainOptions options;
  options.rank = 0;
  EXPECT_EQ(
      TrainExitHeads(*model, Documents(), options, nullptr).status().code(),
      absl::StatusCode::kInvalidArgument);
  options.rank = 4;
  options.seq_len = 1;
  EXPECT_FALSE(TrainExitHeads(*model, Documents(), options, nullptr).ok());
  options.seq_len = 16;
  EXPECT_FALSE(TrainExitHeads(*model, {{1}}, options, nullptr).ok());
}

}  // namespace
}  // namespace knapserve

#include "executor/engine/generator.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <stdexcept>

#include "common/checkpoint/safetensors.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

const std::vector<int32_t> kZooPrompt = {1, 410, 469, 347};
// The bundled stories260k's greedy ids after "Zoo" (the text in
// tools/models/stories260k/PROVENANCE.md).
const std::vector<int32_t> kZooGolden = {
    286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410,
    408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394,
    261, 370, 432, 352, 266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 312,
    432, 398, 358, 279, 292, 416, 439, 413, 391, 267, 337, 335};

class GeneratorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = testing::Stories260kDir();
    if (!std::filesystem::exists(dir + "/model.safetensors"))
      GTEST_SKIP() << "no stories260k";
    auto model = LlamaModel::Load(dir, ModelOptions());
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::move(*model);
    auto tokenizer = Tokenizer::FromFile(dir + "/tokenizer.json");
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = std::move(*tokenizer);
  }

  GenerationRequest Greedy(std::vector<int32_t> prompt, int64_t max_new) {
    GenerationRequest r;
    r.prompt_ids = std::move(prompt);
    r.max_new_tokens = max_new;
    return r;
  }

  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_F(GeneratorTest, GreedyReproducesGoldenAndStreamsTheSameText) {
  auto encoded = tokenizer_->Encode("Zoo", /*add_special_tokens=*/true);
  ASSERT_TRUE(encoded.ok());
  EXPECT_EQ(*encoded, kZooPrompt);
  std::string streamed;
  int calls = 0;
  auto result = Generate(*model_, *tokenizer_, Greedy(kZooPrompt, 57),
                         [&](absl::Span<const int32_t> ids,
                             std::string_view text, const StepLogprobs&) {
                           EXPECT_EQ(ids.size(), 1u);
                           streamed += text;
                           ++calls;
                           return true;
                         });
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->output_ids, kZooGolden);
  EXPECT_EQ(result->finish_reason, FinishReason::kLength);
  EXPECT_EQ(calls, 57);
  EXPECT_EQ(streamed, result->text);
  EXPECT_EQ("Zoo" + result->text,
            "Zoo was a little girl named Lily. She loved to play outside in "
            "the park. One day, she "
            "saw a big, red ball. She wanted to play with it, but she didn't "
            "want to play with");
  EXPECT_EQ(result->stats.prompt_tokens, 4);
  EXPECT_EQ(result->stats.completion_tokens, 57);
  EXPECT_GT(result->stats.decode_tokens_per_second(), 0);
}

TEST_F(GeneratorTest, StopStringEndsOutputBeforeIt) {
  GenerationRequest r = Greedy(kZooPrompt, 57);
  r.stop_strings = {"Lily", "never appears"};
  std::string streamed;
  auto result =
      Generate(*model_, *tokenizer_, r, [&](auto, std::string_view text, auto) {
        streamed += text;
        return true;
      });
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->finish_reason, FinishReason::kStopSequence);
  EXPECT_EQ(result->matched_stop, "Lily");
  EXPECT_EQ(result->text, " was a little girl named ");
  EXPECT_EQ(streamed, result->text);
}

TEST_F(GeneratorTest, StopTokenIdEndsAfterIt) {
  GenerationRequest r = Greedy(kZooPrompt, 57);
  r.stop_token_ids = {kZooGolden[2]};
  auto result = Generate(*model_, *tokenizer_, r);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->output_ids,
            std::vector<int32_t>(kZooGolden.begin(), kZooGolden.begin() + 3));
  EXPECT_EQ(result->finish_reason, FinishReason::kStopSequence);
}

TEST_F(GeneratorTest, EosEndsUnlessIgnored) {
  // Same weights, but the config calls the 6th golden token EOS.
  ModelConfig config = model_->config();
  config.eos_token_ids = {kZooGolden[5]};
  auto checkpoint = Checkpoint::Open(testing::Stories260kDir());
  ASSERT_TRUE(checkpoint.ok());
  auto model = LlamaModel::FromCheckpoint(config, **checkpoint, ModelOptions());
  ASSERT_TRUE(model.ok());
  auto result = Generate(**model, *tokenizer_, Greedy(kZooPrompt, 57));
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->finish_reason, FinishReason::kEos);
  EXPECT_EQ(result->output_ids.size(), 6u);
  GenerationRequest r = Greedy(kZooPrompt, 57);
  r.ignore_eos = true;
  result = Generate(**model, *tokenizer_, r);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->output_ids, kZooGolden);
}

TEST_F(GeneratorTest, StopsAtTheContextLimit) {
  std::vector<int32_t> prompt(500, 300);
  prompt[0] = 1;
  auto result = Generate(*model_, *tokenizer_, Greedy(prompt, 100));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->finish_reason, FinishReason::kLength);
  EXPECT_EQ(prompt.size() + result->output_ids.size(), 512u);
}

TEST_F(GeneratorTest, RejectsBadRequestsNamingTheField) {
  auto expect_error = [&](GenerationRequest r, const std::string& field) {
    auto result = Generate(*model_, *tokenizer_, r);
    ASSERT_FALSE(result.ok());
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(result.status().message().find(field), std::string::npos)
        << result.status();
  };
  expect_error(Greedy({}, 5), "prompt");
  expect_error(Greedy(std::vector<int32_t>(512, 5), 5), "prompt");
  expect_error(Greedy({1, 9999}, 5), "prompt");
  expect_error(Greedy(kZooPrompt, 0), "max_new_tokens");
  GenerationRequest r = Greedy(kZooPrompt, 5);
  r.sampling.temperature = -1;
  expect_error(r, "temperature");
  r = Greedy(kZooPrompt, 5);
  r.stop_strings = {""};
  expect_error(r, "stop");
  // A verification pass of max_draft + 1 rows must stay on the few-row,
  // batch-invariant path (common/model/decode_attention.h).
  r = Greedy(kZooPrompt, 5);
  r.speculation.mode = SpeculationMode::kStatic;
  r.speculation.max_draft = 16;
  expect_error(r, "max_draft");
  r.speculation.max_draft = 15;
  EXPECT_TRUE(Generate(*model_, *tokenizer_, r).ok());
}

TEST_F(GeneratorTest, AnExceptionInsideGenerationIsAnInternalErrorNotACrash) {
  int calls = 0;
  auto throwing = [&](absl::Span<const int32_t>, std::string_view,
                      const StepLogprobs&) -> bool {
    if (++calls == 3) throw std::runtime_error("stream broke");
    return true;
  };
  auto result =
      Generate(*model_, *tokenizer_, Greedy(kZooPrompt, 10), throwing);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(result.status().message().find("stream broke"), std::string::npos);
  // The model and tokenizer are untouched: the next request works.
  EXPECT_TRUE(Generate(*model_, *tokenizer_, Greedy(kZooPrompt, 10)).ok());
}

TEST_F(GeneratorTest, SamplingWithASeedIsReproducible) {
  GenerationRequest r = Greedy(kZooPrompt, 40);
  r.sampling.temperature = 1.0;
  r.sampling.top_p = 0.95;
  r.sampling.seed = 42;
  auto a = Generate(*model_, *tokenizer_, r);
  auto b = Generate(*model_, *tokenizer_, r);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->output_ids, b->output_ids);
  EXPECT_EQ(a->seed, 42u);
  r.sampling.seed = 43;
  auto c = Generate(*model_, *tokenizer_, r);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(a->output_ids, c->output_ids);
}

TEST_F(GeneratorTest, CallbackCanAbort) {
  int calls = 0;
  auto result =
      Generate(*model_, *tokenizer_, Greedy(kZooPrompt, 57),
               [&](auto, std::string_view, auto) { return ++calls < 3; });
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->finish_reason, FinishReason::kAborted);
  EXPECT_EQ(result->output_ids.size(), 3u);
}

TEST_F(GeneratorTest, TextStreamHoldsBackPossibleStopPrefixes) {
  // "▁was" then "▁a": a stop string " was a" spans two tokens.
  TextStream stream(*tokenizer_, kZooPrompt, {" was a"});
  auto first = stream.Push(kZooGolden[0]);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, "");  // " was" could begin " was a"
  auto second = stream.Push(kZooGolden[1]);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(*second, "");
  EXPECT_TRUE(stream.stopped());
  EXPECT_EQ(stream.Finish(), "");

  TextStream released(*tokenizer_, kZooPrompt, {" was not"});
  EXPECT_EQ(*released.Push(kZooGolden[0]), "");
  EXPECT_EQ(*released.Push(kZooGolden[1]), " was a");
  EXPECT_FALSE(released.stopped());
}

}  // namespace
}  // namespace knapserve

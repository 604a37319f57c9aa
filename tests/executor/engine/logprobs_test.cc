// Tests of the log-probabilities a generation reports
// (GenerationRequest::logprobs and top_logprobs, executor/engine/generator.h):
// they are the full model's log_softmax at each output position, so the same
// whatever drafts the tokens (plain decoding, a static mask, SpecBound's
// early exits, sampled or greedy), the top ones are sorted and hold the
// chosen token when greedy, they stream with their ids, and bad counts are
// refused naming the field. The prompt's log-probabilities (echo) are
// one forward's over the prompt.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/model/llama.h"
#include "executor/engine/generator.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

GenerationRequest WithLogprobs(int top, int64_t new_tokens) {
  GenerationRequest r;
  r.prompt_ids = {1, 410, 469, 347};  // "Zoo"
  r.max_new_tokens = new_tokens;
  r.ignore_eos = true;
  r.logprobs = true;
  r.top_logprobs = top;
  return r;
}

// The modes that draft differently: a masked pass and an early exit.
std::vector<GenerationRequest> EveryDraftingMode(
    const GenerationRequest& base) {
  std::vector<GenerationRequest> out;
  GenerationRequest masked = base;
  masked.speculation.mode = SpeculationMode::kStatic;
  masked.speculation.skip = "m1,a3";
  masked.speculation.max_draft = 3;
  out.push_back(masked);
  GenerationRequest exits = base;
  exits.speculation.mode = SpeculationMode::kSpecBound;
  exits.speculation.max_draft = 3;
  exits.speculation.specbound.check_every = 1;
  out.push_back(exits);
  return out;
}

void ExpectSameLogprobs(const GenerationResult& a, const GenerationResult& b,
                        const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(a.output_ids, b.output_ids);
  ASSERT_EQ(a.output_logprobs.size(), b.output_logprobs.size());
  ASSERT_EQ(a.output_top_logprobs.size(), b.output_top_logprobs.size());
  for (size_t i = 0; i < a.output_logprobs.size(); ++i) {
    EXPECT_NEAR(a.output_logprobs[i], b.output_logprobs[i], 1e-4) << i;
    const std::vector<TokenLogprob>& ta = a.output_top_logprobs[i];
    const std::vector<TokenLogprob>& tb = b.output_top_logprobs[i];
    ASSERT_EQ(ta.size(), tb.size()) << i;
    for (size_t k = 0; k < ta.size(); ++k) {
      EXPECT_EQ(ta[k].id, tb[k].id) << i << " " << k;
      EXPECT_NEAR(ta[k].logprob, tb[k].logprob, 1e-4) << i << " " << k;
    }
  }
}

TEST(LogprobsTest, TopLogprobsAreTheModelsAndTheSameInEveryMode) {
  for (const std::string name : {"stories260k", "stories-24l"}) {
    if (name == "stories-24l" &&
        !testing::HaveShared("models/stories-24l/model.safetensors")) {
      continue;
    }
    const LlamaModel* model = testing::CachedModel(name);
    ASSERT_NE(model, nullptr) << name;
    const Tokenizer& tokenizer = *testing::StoriesTokenizer();
    for (const double temperature : {0.0, 1.0}) {
      GenerationRequest base = WithLogprobs(/*top=*/5, 48);
      base.sampling.temperature = temperature;
      base.sampling.seed = 7;
      absl::StatusOr<GenerationResult> plain =
          Generate(*model, tokenizer, base);
      ASSERT_TRUE(plain.ok()) << plain.status();
      ASSERT_EQ(plain->output_top_logprobs.size(), plain->output_ids.size());
      for (size_t i = 0; i < plain->output_ids.size(); ++i) {
        const std::vector<TokenLogprob>& top = plain->output_top_logprobs[i];
        ASSERT_EQ(top.size(), 5u);
        for (size_t k = 0; k + 1 < top.size(); ++k) {
          EXPECT_GE(top[k].logprob, top[k + 1].logprob);
        }
        EXPECT_LE(top[0].logprob, 0.0f);
        // The chosen token is among them with the same value, and greedy
        // picks the first.
        if (temperature == 0) {
          EXPECT_EQ(top[0].id, plain->output_ids[i]) << i;
          EXPECT_FLOAT_EQ(top[0].logprob, plain->output_logprobs[i]) << i;
        }
        for (const TokenLogprob& alt : top) {
          if (alt.id == plain->output_ids[i]) {
            EXPECT_FLOAT_EQ(alt.logprob, plain->output_logprobs[i]) << i;
          }
        }
      }
      // Sampled speculation keeps the distribution, not the draws: compare
      // the modes' values where the same prefix was generated, i.e. greedy.
      if (temperature != 0) continue;
      for (const GenerationRequest& spec : EveryDraftingMode(base)) {
        absl::StatusOr<GenerationResult> drafted =
            Generate(*model, tokenizer, spec);
        ASSERT_TRUE(drafted.ok()) << drafted.status();
        ASSERT_GT(drafted->speculation.draft_tokens, 0)
            << SpeculationModeName(spec.speculation.mode);
        ExpectSameLogprobs(
            *plain, *drafted,
            name + " " + SpeculationModeName(spec.speculation.mode));
      }
    }
  }
}

// The stream hands each step's ids their values; together they are the
// result's.
TEST(LogprobsTest, TheStreamCarriesEachIdsValues) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = testing::CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  GenerationRequest request = WithLogprobs(/*top=*/3, 20);
  request.speculation.mode = SpeculationMode::kStatic;
  request.speculation.skip = "m1,a3";
  request.speculation.max_draft = 3;
  std::vector<int32_t> ids;
  std::vector<float> chosen;
  std::vector<std::vector<TokenLogprob>> top;
  absl::StatusOr<GenerationResult> result = Generate(
      *model, *testing::StoriesTokenizer(), request,
      [&](absl::Span<const int32_t> step_ids, std::string_view,
          const StepLogprobs& logprobs) {
        EXPECT_EQ(logprobs.chosen.size(), step_ids.size());
        EXPECT_EQ(logprobs.top.size(), step_ids.size());
        ids.insert(ids.end(), step_ids.begin(), step_ids.end());
        chosen.insert(chosen.end(), logprobs.chosen.begin(),
                      logprobs.chosen.end());
        top.insert(top.end(), logprobs.top.begin(), logprobs.top.end());
        return true;
      });
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(ids, result->output_ids);
  EXPECT_EQ(chosen, result->output_logprobs);
  EXPECT_EQ(top, result->output_top_logprobs);
}

// Prompt log-probabilities (echo): the full model's log_softmax at the
// position before each prompt token, the same as one plain forward over the
// whole prompt computes, whatever the prefill chunks (the prompt spans
// several kPromptLogprobsChunk passes) and the drafting mode; asking for
// them changes nothing else.
TEST(LogprobsTest, PromptLogprobsAreOneForwardsOverThePrompt) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = testing::CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  const Tokenizer& tokenizer = *testing::StoriesTokenizer();
  absl::StatusOr<std::vector<int32_t>> prompt = tokenizer.Encode(
      "Once upon a time, there was a little girl named Lily. She loved to "
      "play outside in the park with her friends. One day, she saw a big "
      "red ball under a tree. She ran to the ball and picked it up. Her "
      "friend Tom came to play with her. They played with the ball all day "
      "and had so much fun. When the sun went down, they went home happy. "
      "The next morning, Lily woke up early and looked out of the window.",
      true);
  ASSERT_TRUE(prompt.ok()) << prompt.status();
  const int64_t n = static_cast<int64_t>(prompt->size());
  ASSERT_GT(n, 2 * kPromptLogprobsChunk);

  GenerationRequest plain = WithLogprobs(/*top=*/3, 12);
  plain.prompt_ids = *prompt;
  absl::StatusOr<GenerationResult> without = Generate(*model, tokenizer, plain);
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_TRUE(without->prompt_logprobs.empty());

  GenerationRequest echo = plain;
  echo.prompt_logprobs = true;
  absl::StatusOr<GenerationResult> with = Generate(*model, tokenizer, echo);
  ASSERT_TRUE(with.ok()) << with.status();
  EXPECT_EQ(with->output_ids, without->output_ids);
  ASSERT_EQ(with->output_logprobs.size(), without->output_logprobs.size());
  for (size_t i = 0; i < with->output_logprobs.size(); ++i) {
    EXPECT_NEAR(with->output_logprobs[i], without->output_logprobs[i], 1e-4);
  }
  ASSERT_EQ(with->prompt_logprobs.size(), static_cast<size_t>(n - 1));
  ASSERT_EQ(with->prompt_top_logprobs.size(), static_cast<size_t>(n - 1));

  // One forward over the whole prompt.
  std::vector<LayerKv> kv = model->AllocateKv(n);
  const torch::Tensor ids = torch::tensor(
      std::vector<int64_t>(prompt->begin(), prompt->end()), torch::kInt64);
  const torch::Tensor reference =
      torch::log_softmax(model->Forward(ids, 0, kv, -1), -1).to(torch::kCPU);
  for (int64_t p = 1; p < n; ++p) {
    const float expected = reference[p - 1][(*prompt)[p]].item<float>();
    EXPECT_NEAR(with->prompt_logprobs[p - 1], expected, 1e-3) << p;
    const std::vector<TokenLogprob>& top = with->prompt_top_logprobs[p - 1];
    ASSERT_EQ(top.size(), 3u);
    EXPECT_GE(top[0].logprob, with->prompt_logprobs[p - 1] - 1e-6) << p;
    EXPECT_NEAR(top[0].logprob, reference[p - 1].max().item<float>(), 1e-3);
  }

  // The same with speculation, and streamed once, with the first tokens.
  GenerationRequest drafted = echo;
  drafted.speculation.mode = SpeculationMode::kStatic;
  drafted.speculation.skip = "m1,a3";
  drafted.speculation.max_draft = 3;
  int calls = 0;
  std::vector<float> streamed;
  absl::StatusOr<GenerationResult> spec = Generate(
      *model, tokenizer, drafted,
      [&](absl::Span<const int32_t>, std::string_view,
          const StepLogprobs& logprobs) {
        if (calls++ == 0) {
          EXPECT_EQ(logprobs.prompt_top.size(), static_cast<size_t>(n - 1));
        } else {
          EXPECT_TRUE(logprobs.prompt.empty());
        }
        streamed.insert(streamed.end(), logprobs.prompt.begin(),
                        logprobs.prompt.end());
        return true;
      });
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->output_ids, with->output_ids);
  ASSERT_EQ(spec->prompt_logprobs.size(), with->prompt_logprobs.size());
  for (size_t i = 0; i < spec->prompt_logprobs.size(); ++i) {
    EXPECT_NEAR(spec->prompt_logprobs[i], with->prompt_logprobs[i], 1e-4) << i;
  }
  EXPECT_EQ(streamed, spec->prompt_logprobs);
}

TEST(LogprobsTest, BadCountsAreRefusedNamingTheField) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = testing::CachedModel("stories260k");
  ASSERT_NE(model, nullptr);
  for (const int top : {-1, kMaxTopLogprobs + 1}) {
    absl::Status status =
        ValidateGenerationRequest(WithLogprobs(top, 4), *model);
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << top;
    EXPECT_NE(status.message().find("top_logprobs"), std::string::npos)
        << status;
  }
  GenerationRequest without = WithLogprobs(2, 4);
  without.logprobs = false;
  EXPECT_NE(ValidateGenerationRequest(without, *model)
                .message()
                .find("needs logprobs"),
            std::string::npos);
  EXPECT_TRUE(
      ValidateGenerationRequest(WithLogprobs(kMaxTopLogprobs, 4), *model).ok());
}

}  // namespace
}  // namespace knapserve

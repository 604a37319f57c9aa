// Tests of the logits processors (executor/engine/logits_processors.h) on
// hand-made logits: each processor's definition (which ids it touches, by
// how much, over which history), the fixed order, a verification's rows each
// with its own history, bans that would empty the vocabulary, min-p and the
// greedy temperature threshold of the Sampler, and the range checks naming
// the field.
#include "executor/engine/logits_processors.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "executor/engine/sampler.h"

namespace knapserve {
namespace {

constexpr int64_t kVocab = 8;
constexpr float kInf = std::numeric_limits<float>::infinity();

// Logits 0..7: {2, -1, 0.5, 3, -2, 1, 0, 4}.
std::vector<float> Raw() { return {2, -1, 0.5f, 3, -2, 1, 0, 4}; }

torch::Tensor RawTensor() {
  return torch::tensor(std::vector<float>(Raw()), torch::kFloat32);
}

// Applies `p`'s steps 1-5 after prompt `prompt`, output `generated` and
// pending drafts `pending`.
std::vector<float> Processed(const SamplingParams& p,
                             const std::vector<int32_t>& prompt,
                             const std::vector<int32_t>& generated,
                             const std::vector<int32_t>& pending = {},
                             const std::vector<int32_t>& end_ids = {}) {
  LogitsProcessors processors(p, prompt, end_ids);
  processors.Commit(generated);
  std::vector<float> logits = Raw();
  processors.ApplyInPlace(absl::MakeSpan(logits), pending);
  return logits;
}

TEST(LogitsProcessorsTest, OffReturnsTheInputTensorItself) {
  SamplingParams p;
  p.temperature = 0.7;
  p.top_k = 3;
  p.top_p = 0.9;
  p.min_p = 0.1;  // steps 6-9 are the Sampler's
  LogitsProcessors processors(p, {1, 2, 3}, {0});
  EXPECT_FALSE(processors.active());
  const torch::Tensor logits = RawTensor();
  EXPECT_TRUE(processors.Apply(logits, {}).is_same(logits));
  const torch::Tensor rows = logits.repeat({3, 1});
  EXPECT_TRUE(processors.ApplyRows(rows, {4, 5}).is_same(rows));
  // A bias of 0, min_tokens without end ids: still off.
  p.logit_bias = {{3, 0.0}};
  p.min_tokens = 4;
  EXPECT_FALSE(LogitsProcessors(p, {}, {}).active());
}

TEST(LogitsProcessorsTest, LogitBiasAddsToTheGivenIds) {
  SamplingParams p;
  p.logit_bias = {{1, 2.5}, {7, -100}};
  const std::vector<float> out = Processed(p, {}, {});
  std::vector<float> want = Raw();
  want[1] += 2.5f;
  want[7] += -100.0f;
  EXPECT_EQ(out, want);
}

TEST(LogitsProcessorsTest, RepetitionPenaltyCoversPromptAndOutputOnce) {
  SamplingParams p;
  p.repetition_penalty = 2.0;
  // Id 0 (positive) in the prompt, 1 (negative) in the output twice, 3 in
  // both: each touched once.
  const std::vector<float> out = Processed(p, {0, 3, 3}, {1, 3, 1});
  std::vector<float> want = Raw();
  want[0] = 2.0f / 2.0f;
  want[1] = -1.0f * 2.0f;
  want[3] = 3.0f / 2.0f;
  EXPECT_EQ(out, want);
}

TEST(LogitsProcessorsTest, PresenceAndFrequencyCountOnlyGeneratedTokens) {
  SamplingParams p;
  p.presence_penalty = 0.5;
  p.frequency_penalty = 0.25;
  // Id 2 only in the prompt: untouched. Id 5 generated 3 times, id 6 once.
  const std::vector<float> out = Processed(p, {2, 2}, {5, 6, 5, 5});
  std::vector<float> want = Raw();
  want[5] = 1.0f - static_cast<float>(0.25 * 3 + 0.5);
  want[6] = 0.0f - static_cast<float>(0.25 * 1 + 0.5);
  EXPECT_EQ(out, want);
  // Negative penalties favour what was generated.
  p.presence_penalty = -2;
  p.frequency_penalty = -1;
  EXPECT_FLOAT_EQ(Processed(p, {}, {6, 6})[6], 0.0f + 2 + 2);
}

TEST(LogitsProcessorsTest, PendingDraftsCountAsHistory) {
  SamplingParams p;
  p.frequency_penalty = 1.0;
  p.repetition_penalty = 1.5;
  // Committed {5}, pending {5, 7}: id 5 twice, id 7 once.
  const std::vector<float> split = Processed(p, {0}, {5}, {5, 7});
  const std::vector<float> committed = Processed(p, {0}, {5, 5, 7});
  EXPECT_EQ(split, committed);
  EXPECT_FLOAT_EQ(split[5], 1.0f / 1.5f - 2.0f);
  EXPECT_FLOAT_EQ(split[7], 4.0f / 1.5f - 1.0f);
  EXPECT_FLOAT_EQ(split[0], 2.0f / 1.5f);  // prompt only
}

TEST(LogitsProcessorsTest, BadWordsBanTheLastIdAfterTheirPrefix) {
  SamplingParams p;
  p.bad_words = {{4}, {1, 2, 3}, {6, 7}};
  // {4} always; {1, 2, 3}: 3 only after ... 1, 2; {6, 7}: 7 after 6.
  std::vector<float> out = Processed(p, {1, 2}, {});
  EXPECT_EQ(out[4], -kInf);
  EXPECT_EQ(out[3], 3.0f) << "the prompt does not count";
  EXPECT_EQ(out[7], 4.0f);
  out = Processed(p, {}, {0, 1, 2});
  EXPECT_EQ(out[3], -kInf);
  EXPECT_EQ(out[7], 4.0f);
  out = Processed(p, {}, {1}, {2});  // the prefix spans committed + pending
  EXPECT_EQ(out[3], -kInf);
  out = Processed(p, {}, {6}, {0});  // 6 is not the newest token
  EXPECT_EQ(out[7], 4.0f);
  out = Processed(p, {}, {}, {6});
  EXPECT_EQ(out[7], -kInf);
  int banned = 0;
  for (float v : out) banned += v == -kInf;
  EXPECT_EQ(banned, 2);  // 4 and 7
}

TEST(LogitsProcessorsTest, MinTokensBansEndIdsUntilEnoughWereGenerated) {
  SamplingParams p;
  p.min_tokens = 3;
  const std::vector<int32_t> end_ids = {7, 2};
  for (int generated = 0; generated <= 4; ++generated) {
    for (int pending = 0; pending <= generated; ++pending) {
      const std::vector<int32_t> all(generated, 5);
      const std::vector<int32_t> committed(all.begin(), all.end() - pending);
      const std::vector<int32_t> drafts(all.end() - pending, all.end());
      const std::vector<float> out =
          Processed(p, {}, committed, drafts, end_ids);
      const bool banned = generated < 3;
      EXPECT_EQ(out[7] == -kInf, banned) << generated << " " << pending;
      EXPECT_EQ(out[2] == -kInf, banned) << generated << " " << pending;
      EXPECT_EQ(out[5], 1.0f);
    }
  }
}

TEST(LogitsProcessorsTest, TheOrderIsBiasBansThenPenalties) {
  SamplingParams p;
  p.logit_bias = {{1, 3.0}, {0, -4.0}};
  p.repetition_penalty = 2.0;
  p.frequency_penalty = 0.5;
  p.presence_penalty = 0.25;
  const std::vector<float> out = Processed(p, {}, {1, 0});
  // Id 1: -1 + 3 = 2 > 0, so divided; then the output penalties.
  EXPECT_FLOAT_EQ(out[1], 2.0f / 2.0f - 0.75f);
  // Id 0: 2 - 4 = -2 < 0, so multiplied.
  EXPECT_FLOAT_EQ(out[0], -2.0f * 2.0f - 0.75f);
  // A banned id stays banned whatever the penalties do.
  p.bad_words = {{1}};
  EXPECT_EQ(Processed(p, {}, {1, 0})[1], -kInf);
}

TEST(LogitsProcessorsTest, BansThatWouldLeaveNoTokenAreDropped) {
  SamplingParams p;
  for (int32_t id = 0; id < kVocab; ++id) {
    if (id != 5) p.bad_words.push_back({id});
  }
  p.bad_words.push_back({3, 5});  // after 3, 5 as well: nothing left
  p.logit_bias = {{2, 1.0}};
  std::vector<float> out = Processed(p, {}, {0});
  for (int32_t id = 0; id < kVocab; ++id)
    EXPECT_EQ(out[id] == -kInf, id != 5) << id;
  out = Processed(p, {}, {3});
  std::vector<float> want = Raw();
  want[2] += 1.0f;  // the bias still applies
  EXPECT_EQ(out, want);
}

TEST(LogitsProcessorsTest, ApplyRowsGivesRowJTheDraftsBeforeIt) {
  SamplingParams p;
  p.frequency_penalty = 1.0;
  p.bad_words = {{3, 7}};
  p.min_tokens = 3;
  LogitsProcessors processors(p, {}, {2});
  processors.Commit({3});
  const std::vector<int32_t> drafts = {5, 3, 5};
  const torch::Tensor logits = RawTensor().repeat({4, 1}).to(torch::kBFloat16);
  const torch::Tensor rows = processors.ApplyRows(logits, drafts);
  ASSERT_EQ(rows.dtype(), torch::kFloat32);
  ASSERT_EQ(rows.sizes(), (std::vector<int64_t>{4, kVocab}));
  for (int64_t j = 0; j < 4; ++j) {
    const torch::Tensor one =
        processors.Apply(logits[j], absl::MakeConstSpan(drafts).subspan(0, j));
    EXPECT_TRUE(torch::equal(rows[j], one)) << "row " << j;
  }
  // Row 0: after {3}: 7 banned, 2 banned (1 generated); row 1: after 3, 5:
  // 7 free, 5 penalized once, 2 still banned; row 2: after 3 again: 7
  // banned, 2 free (3 generated).
  EXPECT_EQ(rows[0][7].item<float>(), -kInf);
  EXPECT_EQ(rows[0][2].item<float>(), -kInf);
  EXPECT_EQ(rows[1][7].item<float>(), 4.0f);
  EXPECT_EQ(rows[1][5].item<float>(), 0.0f);
  EXPECT_EQ(rows[2][7].item<float>(), -kInf);
  EXPECT_EQ(rows[2][2].item<float>(), 0.5f);
  EXPECT_EQ(rows[3][5].item<float>(), -1.0f);
  // The input is not modified.
  EXPECT_TRUE(torch::equal(logits[0].to(torch::kFloat32), RawTensor()));
}

TEST(SamplerMinPTest, DropsWhatIsLessLikelyThanMinPTimesTheTop) {
  SamplingParams p;
  p.temperature = 1.0;
  p.min_p = 0.2;
  Sampler sampler(p);
  const torch::Tensor logits = RawTensor();
  const torch::Tensor full = torch::softmax(logits, 0);
  const torch::Tensor d = sampler.Distribution(logits);
  const float top = full.max().item<float>();
  float kept = 0;
  for (int64_t i = 0; i < kVocab; ++i) {
    if (full[i].item<float>() < 0.2f * top) {
      EXPECT_EQ(d[i].item<float>(), 0.0f) << i;
    } else {
      EXPECT_GT(d[i].item<float>(), 0.0f) << i;
      kept += full[i].item<float>();
    }
  }
  // The kept tokens keep their proportions.
  EXPECT_NEAR(d[7].item<float>(), full[7].item<float>() / kept, 1e-6);
  EXPECT_NEAR(d.sum().item<float>(), 1.0f, 1e-6);
}

TEST(SamplerGreedyThresholdTest, TinyTemperaturesAreGreedyNotNaN) {
  for (double t : {0.0, 1e-39, 1e-300, 9.9e-6}) {
    SamplingParams p;
    p.temperature = t;
    p.seed = 1;
    Sampler sampler(p);
    EXPECT_TRUE(sampler.greedy()) << t;
    const torch::Tensor d = sampler.Distribution(RawTensor());
    EXPECT_EQ(d[7].item<float>(), 1.0f) << t;
    EXPECT_EQ(d.sum().item<float>(), 1.0f) << t;
    EXPECT_EQ(sampler.Sample(RawTensor(), /*position=*/0), 7) << t;
  }
  SamplingParams p;
  p.temperature = kGreedyTemperature;
  EXPECT_FALSE(Sampler(p).greedy());
  EXPECT_FALSE(
      torch::isnan(Sampler(p).Distribution(RawTensor())).any().item<bool>());
}

TEST(ValidateSamplingParamsTest, EveryFieldIsRangeCheckedByName) {
  struct Case {
    std::string field;
    std::function<void(SamplingParams&)> edit;
  };
  const std::vector<Case> cases = {
      {"temperature: ", [](SamplingParams& p) { p.temperature = -1; }},
      {"temperature: ", [](SamplingParams& p) { p.temperature = INFINITY; }},
      {"top_k: ", [](SamplingParams& p) { p.top_k = -1; }},
      {"top_p: ", [](SamplingParams& p) { p.top_p = 0; }},
      {"top_p: ", [](SamplingParams& p) { p.top_p = 1.01; }},
      {"min_p: ", [](SamplingParams& p) { p.min_p = -0.1; }},
      {"min_p: ", [](SamplingParams& p) { p.min_p = 1.5; }},
      {"repetition_penalty: ",
       [](SamplingParams& p) { p.repetition_penalty = 0; }},
      {"repetition_penalty: ",
       [](SamplingParams& p) { p.repetition_penalty = NAN; }},
      {"presence_penalty: ",
       [](SamplingParams& p) { p.presence_penalty = 2.5; }},
      {"frequency_penalty: ",
       [](SamplingParams& p) { p.frequency_penalty = -2.01; }},
      {"frequency_penalty: ",
       [](SamplingParams& p) { p.frequency_penalty = NAN; }},
      {"logit_bias: token id 8 outside",
       [](SamplingParams& p) {
         p.logit_bias = {{8, 1.0}};
       }},
      {"logit_bias: token id -1 outside",
       [](SamplingParams& p) {
         p.logit_bias = {{-1, 1.0}};
       }},
      {"logit_bias: the bias of token id 3",
       [](SamplingParams& p) {
         p.logit_bias = {{3, 101.0}};
       }},
      {"min_tokens: ", [](SamplingParams& p) { p.min_tokens = -1; }},
      {"bad_words: sequence 1 has 0",
       [](SamplingParams& p) {
         p.bad_words = {{1}, {}};
       }},
      {"bad_words: token id 9 outside",
       [](SamplingParams& p) {
         p.bad_words = {{1, 9}};
       }},
      {"bad_words: sequence 0 has 65",
       [](SamplingParams& p) {
         p.bad_words = {std::vector<int32_t>(kMaxBadWordTokens + 1, 1)};
       }},
      {"bad_words: at most 1024",
       [](SamplingParams& p) {
         p.bad_words.assign(kMaxBadWords + 1, std::vector<int32_t>{1});
       }},
  };
  for (const Case& c : cases) {
    SamplingParams p;
    c.edit(p);
    const absl::Status status = ValidateSamplingParams(p, kVocab);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_EQ(std::string(status.message()).rfind(c.field, 0), 0u)
        << "want a message starting with '" << c.field << "', got " << status;
  }
  // The edges of every range are valid.
  SamplingParams p;
  p.temperature = 0;
  p.top_p = 1;
  p.min_p = 1;
  p.repetition_penalty = 1e-3;
  p.presence_penalty = -2;
  p.frequency_penalty = 2;
  p.logit_bias = {{0, -100.0}, {7, 100.0}};
  p.bad_words = {{7}, std::vector<int32_t>(kMaxBadWordTokens, 0)};
  EXPECT_TRUE(ValidateSamplingParams(p, kVocab).ok())
      << ValidateSamplingParams(p, kVocab);
}

}  // namespace
}  // namespace knapserve

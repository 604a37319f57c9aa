// Tests of the planner's reference states (executor/engine/reference_states.h):
// ReferenceStateCollector's schedule (the first m steps of every plan
// interval of T steps) and assembly, and end to end through Generate() with
// speculation on: each snapshot covers exactly the positions committed by the
// first m steps after a boundary, and its states and argmaxes equal those of a
// fresh full forward (ForwardOptions.boundary_states) at those positions.
#include "executor/engine/reference_states.h"

#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model/llama.h"
#include "common/text/tokenizer.h"
#include "executor/engine/generator.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::RandomModelDir;
using testing::Stories260kDir;

// ---------------------------------------------------------------------------
// The collector alone.

TEST(ReferenceStateCollectorTest, WantsTheFirstMStepsOfEveryInterval) {
  ReferenceStateCollector collector(/*interval=*/8, /*steps=*/3);
  for (int64_t step = 0; step < 40; ++step) {
    EXPECT_EQ(collector.Wants(step), step % 8 < 3) << "step " << step;
  }
  EXPECT_TRUE(collector.Wants(0));
  EXPECT_TRUE(collector.Wants(2));
  EXPECT_FALSE(collector.Wants(3));
  EXPECT_FALSE(collector.Wants(7));
  EXPECT_TRUE(collector.Wants(8));
  EXPECT_TRUE(collector.Wants(642));  // 642 = 80 * 8 + 2
  EXPECT_FALSE(collector.Wants(643));

  // The design's defaults: T = 64, m = 5.
  ReferenceStateCollector defaults(64, 5);
  EXPECT_TRUE(defaults.Wants(4));
  EXPECT_FALSE(defaults.Wants(5));
  EXPECT_FALSE(defaults.Wants(63));
  EXPECT_TRUE(defaults.Wants(64));
  EXPECT_TRUE(defaults.Wants(68));
  EXPECT_FALSE(defaults.Wants(69));

  // m = 1: only the boundaries; T = 1: every step is a boundary.
  ReferenceStateCollector boundaries(4, 1);
  for (int64_t step = 0; step < 12; ++step)
    EXPECT_EQ(boundaries.Wants(step), step % 4 == 0);
  ReferenceStateCollector every(1, 1);
  for (int64_t step = 0; step < 5; ++step) EXPECT_TRUE(every.Wants(step));
  // m >= T: every step.
  ReferenceStateCollector all(2, 5);
  for (int64_t step = 0; step < 6; ++step) EXPECT_TRUE(all.Wants(step));
}

// A StepResult as a verification step gives with capture on
// (FinishVerification, executor/engine/speculation_step.h): rows
// positions first..first+rows-1, states filled with the position number.
StepResult FakeStep(int64_t first, int64_t rows, int sublayers = 5,
                    int hidden = 3) {
  c10::InferenceMode guard;
  StepResult result;
  result.first_position = first;
  result.accepted = static_cast<int>(rows - 1);
  result.boundary_states = torch::arange(first, first + rows, torch::kFloat32)
                               .view({1, rows, 1})
                               .expand({sublayers, rows, hidden})
                               .contiguous();
  for (int64_t i = 0; i < rows; ++i) {
    result.tokens.push_back(static_cast<int32_t>(100 + first + i));
    result.target_argmax.push_back(static_cast<int32_t>(1000 + first + i));
  }
  return result;
}

TEST(ReferenceStateCollectorTest,
     GluesTheCapturedStepsOfAnIntervalIntoOneSnapshot) {
  c10::InferenceMode guard;
  ReferenceStateCollector collector(/*interval=*/4, /*steps=*/2);
  // Steps 0 and 1 (3 and 1 rows) make the first snapshot.
  EXPECT_FALSE(collector.Add(0, FakeStep(10, 3), 13).has_value());
  std::optional<ReferenceStates> first = collector.Add(1, FakeStep(13, 1), 14);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->step, 0);
  EXPECT_EQ(first->positions, (std::vector<int64_t>{10, 11, 12, 13}));
  EXPECT_EQ(first->target_argmax,
            (std::vector<int32_t>{1010, 1011, 1012, 1013}));
  EXPECT_EQ(first->context_length, 14);
  ASSERT_EQ(first->states.sizes(), (std::vector<int64_t>{5, 4, 3}));
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(
        torch::all(first->states.select(1, i) == static_cast<float>(10 + i))
            .item<bool>());
  }
  // Steps 2 and 3 are not captured.
  EXPECT_FALSE(collector.Add(2, FakeStep(14, 2), 16).has_value());
  EXPECT_FALSE(collector.Add(3, FakeStep(16, 2), 18).has_value());
  // Steps 4 and 5 make the second, with nothing left over from the first.
  EXPECT_FALSE(collector.Add(4, FakeStep(18, 2), 20).has_value());
  std::optional<ReferenceStates> second = collector.Add(5, FakeStep(20, 4), 24);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->step, 4);
  EXPECT_EQ(second->positions, (std::vector<int64_t>{18, 19, 20, 21, 22, 23}));
  EXPECT_EQ(second->target_argmax.size(), 6u);
  EXPECT_EQ(second->context_length, 24);
  EXPECT_EQ(second->states.size(1), 6);
}

TEST(ReferenceStateCollectorTest, AStepWithoutStatesAddsNothing) {
  c10::InferenceMode guard;
  ReferenceStateCollector collector(4, 1);
  StepResult empty;
  empty.tokens = {5};
  EXPECT_FALSE(collector.Add(0, empty, 1).has_value());
  std::optional<ReferenceStates> snapshot = collector.Add(4, FakeStep(7, 2), 9);
  ASSERT_TRUE(snapshot.has_value());
  EXPECT_EQ(snapshot->step, 4);
  EXPECT_EQ(snapshot->positions, (std::vector<int64_t>{7, 8}));
}

// ---------------------------------------------------------------------------
// End to end through Generate().

const LlamaModel* GetModel(const std::string& name) {
  return testing::CachedModel(name);
}

// stories260k's tokenizer decodes every id of every model used here (the tiny
// shapes' synthetic tokenizer knows only 288 of their 300 ids).
const Tokenizer* GetTokenizer() { return testing::StoriesTokenizer(); }

// Tolerance for the captured states against a fresh full forward in fp32 (the
// same values through different kernels; observed differences at most ~6e-8):
// |a - b| <= kAtol + kRtol * |b|.
constexpr double kAtol = 1e-4;
constexpr double kRtol = 1e-4;

struct ReferenceCase {
  std::string model;
  std::string skip;
  int gamma;
  double temperature;
  int64_t interval;  // T
  int64_t steps;     // m
};

class ReferenceStatesTest : public ::testing::TestWithParam<ReferenceCase> {};

TEST_P(ReferenceStatesTest,
       SnapshotsCoverTheFirstStepsOfEachIntervalAndMatchAFullForward) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const ReferenceCase& param = GetParam();
  const LlamaModel* model = GetModel(param.model);
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config();
  std::mt19937 rng(17);
  std::vector<int32_t> prompt = {c.bos_token_id.value_or(1)};
  for (int i = 0; i < 5; ++i)
    prompt.push_back(static_cast<int32_t>(rng() % c.vocab_size));
  const int64_t n = static_cast<int64_t>(prompt.size());

  GenerationRequest request;
  request.prompt_ids = prompt;
  request.max_new_tokens = 90;
  request.ignore_eos = true;
  request.sampling.temperature = param.temperature;
  request.sampling.seed = 3;
  request.speculation.mode = SpeculationMode::kStatic;
  request.speculation.skip = param.skip;
  request.speculation.max_draft = param.gamma;
  request.speculation.exit_threshold = 0.0;
  request.speculation.plan_interval = param.interval;
  request.speculation.reference_steps = param.steps;

  std::vector<int64_t> committed_per_call;
  std::vector<ReferenceStates> snapshots;
  auto result = Generate(
      *model, *GetTokenizer(), request,
      [&](absl::Span<const int32_t> ids, std::string_view,
          const StepLogprobs&) {
        committed_per_call.push_back(static_cast<int64_t>(ids.size()));
        return true;
      },
      [&](ReferenceStates&& states) {
        snapshots.push_back(std::move(states));
      });
  ASSERT_TRUE(result.ok()) << result.status();
  const int64_t steps = result->stats.steps;
  ASSERT_EQ(static_cast<int64_t>(committed_per_call.size()), 1 + steps);

  // Which positions each decode step committed: step k feeds the newest token
  // at position pos_k and keeps pos_k .. pos_k + (tokens committed) - 1.
  std::vector<int64_t> step_first(steps), step_rows(steps);
  int64_t produced = committed_per_call[0];
  for (int64_t k = 0; k < steps; ++k) {
    step_first[k] = n + produced - 1;
    step_rows[k] = committed_per_call[k + 1];
    produced += step_rows[k];
  }

  // One snapshot per boundary whose m captured steps all ran, in order.
  std::vector<int64_t> boundaries;
  for (int64_t b = 0; b + param.steps - 1 < steps; b += param.interval)
    boundaries.push_back(b);
  ASSERT_GE(boundaries.size(), 2u)
      << "too few steps (" << steps << ") for the test";
  ASSERT_EQ(snapshots.size(), boundaries.size());

  // A fresh full forward over every committed position.
  c10::InferenceMode guard;
  std::vector<int64_t> all(prompt.begin(), prompt.end());
  all.insert(all.end(), result->output_ids.begin(), result->output_ids.end());
  all.pop_back();  // the newest token has no position in the cache yet
  std::vector<LayerKv> kv = model->AllocateKv(static_cast<int64_t>(all.size()));
  torch::Tensor full_states;
  ForwardOptions options;
  options.boundary_states = &full_states;
  torch::Tensor full_logits = model->Forward(torch::tensor(all, torch::kInt64),
                                             0, kv, options);  // [n, vocab]
  torch::Tensor full_argmax = full_logits.argmax(-1);

  for (size_t i = 0; i < snapshots.size(); ++i) {
    const ReferenceStates& s = snapshots[i];
    const int64_t b = boundaries[i];
    SCOPED_TRACE(absl::StrCat("snapshot ", i, " (boundary step ", b, ")"));
    EXPECT_EQ(s.step, b);
    std::vector<int64_t> expected_positions;
    for (int64_t k = b; k < b + param.steps; ++k) {
      for (int64_t r = 0; r < step_rows[k]; ++r)
        expected_positions.push_back(step_first[k] + r);
    }
    EXPECT_EQ(s.positions, expected_positions);
    const int64_t rows = static_cast<int64_t>(s.positions.size());
    ASSERT_GE(rows, param.steps);
    for (int64_t r = 1; r < rows; ++r)
      EXPECT_EQ(s.positions[r], s.positions[r - 1] + 1);
    EXPECT_EQ(s.context_length, s.positions.back() + 1);
    ASSERT_EQ(s.states.dim(), 3);
    EXPECT_EQ(s.states.size(0), 2 * model->num_layers() + 1);
    EXPECT_EQ(s.states.size(1), rows);
    EXPECT_EQ(s.states.size(2), c.hidden_size);
    EXPECT_EQ(s.states.scalar_type(), model->dtype());
    ASSERT_EQ(static_cast<int64_t>(s.target_argmax.size()), rows);

    torch::Tensor index = torch::tensor(s.positions, torch::kInt64);
    torch::Tensor expected = full_states.index_select(1, index);
    EXPECT_TRUE(torch::allclose(s.states, expected, kRtol, kAtol))
        << "states differ by up to "
        << (s.states - expected).abs().max().item<double>();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t p = s.positions[r];
      EXPECT_EQ(s.target_argmax[r], full_argmax[p].item<int64_t>())
          << "position " << p;
      if (param.temperature == 0.0) {
        // Greedy commits the target's argmax: it is the token at p + 1.
        EXPECT_EQ(s.target_argmax[r], result->output_ids[p + 1 - n])
            << "position " << p;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ReferenceStatesTest,
    ::testing::Values(ReferenceCase{"stories260k", "a2,m2,a3", 3, 0.0, 8, 3},
                      ReferenceCase{"stories260k", "m0,a1,m3", 4, 1.0, 8, 3},
                      ReferenceCase{"stories260k", "", 2, 0.0, 5, 1},
                      ReferenceCase{"tiny-qwen3", "a1", 3, 0.0, 8, 3},
                      ReferenceCase{"tiny-llama", "m0", 2, 1.0, 6, 4}),
    [](const ::testing::TestParamInfo<ReferenceCase>& info) {
      std::string name = absl::StrCat(info.param.model, "_", info.index);
      std::replace(name.begin(), name.end(), '-', '_');
      return name;
    });

// Without a callback nothing is captured, and the output is the same.
TEST(ReferenceStatesGenerateTest, NoCallbackNoCaptureSameOutput) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = GetModel("stories260k");
  ASSERT_NE(model, nullptr);
  GenerationRequest request;
  request.prompt_ids = {1, 410, 469, 347};
  request.max_new_tokens = 40;
  request.speculation.mode = SpeculationMode::kStatic;
  request.speculation.skip = "a2,m2,a3";
  request.speculation.plan_interval = 4;
  request.speculation.reference_steps = 2;
  auto plain = Generate(*model, *GetTokenizer(), request);
  int snapshots = 0;
  auto captured = Generate(*model, *GetTokenizer(), request, nullptr,
                           [&](ReferenceStates&&) { ++snapshots; });
  ASSERT_TRUE(plain.ok() && captured.ok());
  EXPECT_EQ(plain->output_ids, captured->output_ids);
  EXPECT_GT(snapshots, 0);
}

// reference_steps > plan_interval must not silently starve the planner:
// either the request is refused naming the field, or snapshots arrive. (It
// once returned OK and never delivered: the collector dropped its pieces at
// every boundary.) Generate() now refuses it.
TEST(ReferenceStatesGenerateTest,
     MoreReferenceStepsThanTheIntervalIsRefusedOrDelivers) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  const LlamaModel* model = GetModel("stories260k");
  ASSERT_NE(model, nullptr);
  GenerationRequest request;
  request.prompt_ids = {1, 410, 469, 347};
  request.max_new_tokens = 40;
  request.speculation.mode = SpeculationMode::kStatic;
  request.speculation.skip = "a2";
  request.speculation.plan_interval = 2;
  request.speculation.reference_steps = 5;
  int snapshots = 0;
  auto result = Generate(*model, *GetTokenizer(), request, nullptr,
                         [&](ReferenceStates&&) { ++snapshots; });
  if (!result.ok()) {
    EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(result.status().message().find("reference_steps"),
              std::string::npos)
        << result.status();
  } else {
    ASSERT_GE(result->stats.steps, 6);
    EXPECT_GT(snapshots, 0)
        << "Generate() accepted reference_steps 5 > plan_interval 2 and "
           "delivered no reference states in "
        << result->stats.steps << " steps";
  }
}

}  // namespace
}  // namespace knapserve

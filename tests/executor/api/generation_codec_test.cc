// Tests of the Generation wire codec (executor/api/generation_codec.h): every
// speculation mode of the table round-trips through its wire value, bad
// values are InvalidArgument naming the field, requests decode with defaults
// and validation, results encode field by field.
#include "executor/api/generation_codec.h"

#include <gtest/gtest.h>

#include <set>

#include "absl/strings/ascii.h"
#include "executor/api/planning_json.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using testing::CachedModel;
using testing::StoriesTokenizer;

TEST(GenerationCodecTest, EveryModeRoundTripsThroughItsWireValue) {
  std::set<int> wire_values;
  for (const SpeculationModeInfo& info : AllSpeculationModes()) {
    const v1::SpeculationMode wire = ToWireMode(info.mode);
    EXPECT_NE(wire, v1::SPECULATION_MODE_UNSPECIFIED)
        << info.name << " has no wire value";
    EXPECT_EQ(v1::SpeculationMode_Name(wire),
              "SPECULATION_MODE_" + absl::AsciiStrToUpper(info.name));
    EXPECT_TRUE(wire_values.insert(wire).second) << info.name;
    absl::StatusOr<SpeculationMode> back =
        FromWireMode(wire, SpeculationMode::kOff);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, info.mode);
  }
  // And every wire value but UNSPECIFIED names a mode.
  for (int value = v1::SpeculationMode_MIN; value <= v1::SpeculationMode_MAX;
       ++value) {
    if (!v1::SpeculationMode_IsValid(value) ||
        value == v1::SPECULATION_MODE_UNSPECIFIED)
      continue;
    EXPECT_TRUE(FromWireMode(static_cast<v1::SpeculationMode>(value),
                             SpeculationMode::kOff)
                    .ok())
        << v1::SpeculationMode_Name(static_cast<v1::SpeculationMode>(value));
  }
}

TEST(GenerationCodecTest, UnspecifiedModeIsTheDefaultAndBadValuesNameTheField) {
  EXPECT_EQ(
      *FromWireMode(v1::SPECULATION_MODE_UNSPECIFIED, SpeculationMode::kStatic),
      SpeculationMode::kStatic);
  for (int bad : {42, -1, 1000}) {
    absl::StatusOr<SpeculationMode> mode = FromWireMode(
        static_cast<v1::SpeculationMode>(bad), SpeculationMode::kOff);
    EXPECT_EQ(mode.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(mode.status().message().find("speculation.mode"),
              std::string::npos)
        << mode.status();
  }
}

TEST(GenerationCodecTest, FinishReasonsMapToTheirNamedWireValues) {
  std::set<int> values;
  for (FinishReason reason :
       {FinishReason::kEos, FinishReason::kLength, FinishReason::kStopSequence,
        FinishReason::kAborted}) {
    const v1::FinishReason wire = ToWireFinishReason(reason);
    EXPECT_NE(wire, v1::FINISH_REASON_UNSPECIFIED);
    EXPECT_TRUE(values.insert(wire).second);
    EXPECT_EQ(
        v1::FinishReason_Name(wire),
        "FINISH_REASON_" + absl::AsciiStrToUpper(FinishReasonName(reason)));
  }
}

TEST(GenerationCodecTest, StatusesKeepTheirCodeAndMessage) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  const grpc::Status internal =
      ToGrpcStatus(absl::InternalError("decode step 3: boom"));
  EXPECT_EQ(internal.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_EQ(internal.error_message(), "decode step 3: boom");
  EXPECT_EQ(ToGrpcStatus(absl::InvalidArgumentError("x")).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError("x")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
}

class DecodeGenerateRequestTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
    model_ = CachedModel("stories260k");
    ASSERT_NE(model_, nullptr);
    defaults_.max_new_tokens = 33;
    defaults_.speculation.mode = SpeculationMode::kStatic;
    defaults_.speculation.skip = "a1";
    defaults_.speculation.max_draft = 4;
  }

  absl::StatusOr<GenerationRequest> Decode(
      const v1::GenerateRequest& wire) const {
    return DecodeGenerateRequest(wire, defaults_, *model_, *StoriesTokenizer());
  }

  const LlamaModel* model_ = nullptr;
  GenerateRequestDefaults defaults_;
};

TEST_F(DecodeGenerateRequestTest, FieldsMapAndUnsetOnesTakeTheDefaults) {
  v1::GenerateRequest wire;
  wire.set_text("Zoo");
  absl::StatusOr<GenerationRequest> plain = Decode(wire);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->prompt_ids, (std::vector<int32_t>{1, 410, 469, 347}));
  EXPECT_EQ(plain->max_new_tokens, 33);
  EXPECT_EQ(plain->speculation.mode, SpeculationMode::kStatic);
  EXPECT_EQ(plain->speculation.skip, "a1");
  EXPECT_EQ(plain->speculation.max_draft, 4);
  EXPECT_FALSE(plain->ignore_eos);

  wire.mutable_token_ids()->add_ids(1);
  wire.mutable_token_ids()->add_ids(410);
  wire.set_max_new_tokens(7);
  wire.set_temperature(0.5);
  wire.set_top_k(3);
  wire.set_top_p(0.9);
  wire.set_seed(99);
  wire.set_ignore_eos(true);
  wire.add_stop("The end");
  wire.add_stop_token_ids(2);
  wire.set_logprobs(true);
  wire.set_top_logprobs(4);
  v1::SpeculationOptions* spec = wire.mutable_speculation();
  spec->set_mode(v1::SPECULATION_MODE_OFF);
  spec->set_max_draft_tokens(6);
  spec->set_static_mask("m2");
  spec->set_exit_threshold(0.25);
  absl::StatusOr<GenerationRequest> full = Decode(wire);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->prompt_ids, (std::vector<int32_t>{1, 410}));
  EXPECT_EQ(full->max_new_tokens, 7);
  EXPECT_FLOAT_EQ(full->sampling.temperature, 0.5);
  EXPECT_EQ(full->sampling.top_k, 3);
  EXPECT_FLOAT_EQ(full->sampling.top_p, 0.9);
  ASSERT_TRUE(full->sampling.seed.has_value());
  EXPECT_EQ(*full->sampling.seed, 99u);
  EXPECT_TRUE(full->ignore_eos);
  EXPECT_EQ(full->stop_strings, std::vector<std::string>{"The end"});
  EXPECT_EQ(full->stop_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(full->speculation.mode, SpeculationMode::kOff);
  EXPECT_EQ(full->speculation.max_draft, 6);
  EXPECT_EQ(full->speculation.skip, "m2");
  EXPECT_DOUBLE_EQ(full->speculation.exit_threshold, 0.25);
  EXPECT_TRUE(full->logprobs);
  EXPECT_EQ(full->top_logprobs, 4);
  wire.set_top_logprobs(21);
  EXPECT_NE(Decode(wire).status().message().find("top_logprobs"),
            std::string::npos);
}

TEST_F(DecodeGenerateRequestTest, BadRequestsNameTheField) {
  struct Case {
    std::string field;
    absl::StatusCode code;
    std::function<void(v1::GenerateRequest&)> edit;
  };
  const std::vector<Case> cases = {
      {"prompt: set text or token_ids", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { r.clear_prompt(); }},
      {"prompt.text: empty", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { r.set_text(""); }},
      {"prompt.token_ids: empty", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { r.mutable_token_ids(); }},
      {"prompt: token id 9999", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { r.mutable_token_ids()->add_ids(9999); }},
      {"speculation.mode: unknown value 42", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) {
         r.mutable_speculation()->set_mode(
             static_cast<v1::SpeculationMode>(42));
       }},
      {"speculation.mode: knapspec needs a planner",
       absl::StatusCode::kFailedPrecondition,
       [](v1::GenerateRequest& r) {
         r.mutable_speculation()->set_mode(v1::SPECULATION_MODE_KNAPSPEC);
       }},
      {"speculation.mode: clasp needs a planner",
       absl::StatusCode::kFailedPrecondition,
       [](v1::GenerateRequest& r) {
         r.mutable_speculation()->set_mode(v1::SPECULATION_MODE_CLASP);
       }},
      {"max_new_tokens", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { r.set_max_new_tokens(0); }},
      {"max_draft", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) {
         r.mutable_speculation()->set_max_draft_tokens(16);
       }},
      {"temperature: must be", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { r.set_temperature(-1); }},
      {"top_p: must be", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { r.set_top_p(0); }},
      {"top_k: must be", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { r.set_top_k(-2); }},
      {"min_p: must be", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { r.set_min_p(1.5); }},
      {"repetition_penalty: must be", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { r.set_repetition_penalty(0); }},
      {"presence_penalty: must be", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { r.set_presence_penalty(2.5); }},
      {"frequency_penalty: must be", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { r.set_frequency_penalty(-3); }},
      {"logit_bias: token id 9999 outside", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { (*r.mutable_logit_bias())[9999] = 1; }},
      {"logit_bias: the bias of token id 5", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { (*r.mutable_logit_bias())[5] = 101; }},
      {"min_tokens: must be >= 0", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { r.set_min_tokens(-1); }},
      {"min_tokens: must be <= max_new_tokens",
       absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) {
         r.set_max_new_tokens(4);
         r.set_min_tokens(5);
       }},
      {"bad_words: sequence 1 has 0", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) {
         r.add_bad_words()->add_ids(3);
         r.add_bad_words();
       }},
      {"bad_words: token id 512 outside", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) { r.add_bad_words()->add_ids(512); }},
      {"specbound.lambda", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) {
         r.mutable_speculation()->set_mode(v1::SPECULATION_MODE_SPECBOUND);
         r.mutable_speculation()->set_specbound_lambda(2);
       }},
      {"specbound.depth_bound", absl::StatusCode::kInvalidArgument,
       [](v1::GenerateRequest& r) {
         r.mutable_speculation()->set_mode(v1::SPECULATION_MODE_SPECBOUND);
         r.mutable_speculation()->set_specbound_depth_bound(99);
       }},
      // The server loaded no trained heads.
      {"specbound.trained_heads", absl::StatusCode::kFailedPrecondition,
       [](v1::GenerateRequest& r) {
         r.mutable_speculation()->set_mode(v1::SPECULATION_MODE_SPECBOUND);
         r.mutable_speculation()->set_specbound_trained_heads(true);
       }},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest wire;
    wire.set_text("Hello");
    c.edit(wire);
    absl::StatusOr<GenerationRequest> request = Decode(wire);
    EXPECT_EQ(request.status().code(), c.code)
        << c.field << ": " << request.status();
    EXPECT_NE(request.status().message().find(c.field), std::string::npos)
        << c.field << ": " << request.status();
  }
  // With a planner the planned modes decode.
  defaults_.have_planner = true;
  v1::GenerateRequest planned;
  planned.set_text("Hello");
  planned.mutable_speculation()->set_mode(v1::SPECULATION_MODE_KNAPSPEC);
  absl::StatusOr<GenerationRequest> request = Decode(planned);
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(request->speculation.mode, SpeculationMode::kKnapSpec);
}

TEST_F(DecodeGenerateRequestTest, LogitsProcessorsMapAndDefaultToOff) {
  v1::GenerateRequest wire;
  wire.set_text("Hello");
  absl::StatusOr<GenerationRequest> bare = Decode(wire);
  ASSERT_TRUE(bare.ok()) << bare.status();
  const SamplingParams off;
  EXPECT_EQ(bare->sampling.repetition_penalty, off.repetition_penalty);
  EXPECT_EQ(bare->sampling.presence_penalty, 0.0);
  EXPECT_EQ(bare->sampling.frequency_penalty, 0.0);
  EXPECT_EQ(bare->sampling.min_p, 0.0);
  EXPECT_EQ(bare->sampling.min_tokens, 0);
  EXPECT_TRUE(bare->sampling.logit_bias.empty());
  EXPECT_TRUE(bare->sampling.bad_words.empty());
  wire.set_repetition_penalty(1.2);
  wire.set_presence_penalty(-0.5);
  wire.set_frequency_penalty(0.75);
  wire.set_min_p(0.1);
  wire.set_min_tokens(3);
  (*wire.mutable_logit_bias())[7] = -100;
  (*wire.mutable_logit_bias())[11] = 2.5;
  wire.add_bad_words()->add_ids(9);
  v1::TokenIds* pair = wire.add_bad_words();
  pair->add_ids(4);
  pair->add_ids(5);
  absl::StatusOr<GenerationRequest> full = Decode(wire);
  ASSERT_TRUE(full.ok()) << full.status();
  const SamplingParams& s = full->sampling;
  EXPECT_DOUBLE_EQ(s.repetition_penalty, 1.2);
  EXPECT_DOUBLE_EQ(s.presence_penalty, -0.5);
  EXPECT_DOUBLE_EQ(s.frequency_penalty, 0.75);
  EXPECT_DOUBLE_EQ(s.min_p, 0.1);
  EXPECT_EQ(s.min_tokens, 3);
  EXPECT_EQ(s.logit_bias, (std::map<int32_t, double>{{7, -100}, {11, 2.5}}));
  EXPECT_EQ(s.bad_words, (std::vector<std::vector<int32_t>>{{9}, {4, 5}}));
}

TEST_F(DecodeGenerateRequestTest, SpecBoundSettingsMapAndDefault) {
  defaults_.speculation.specbound.lambda = 0.75;
  v1::GenerateRequest wire;
  wire.set_text("Hello");
  v1::SpeculationOptions* spec = wire.mutable_speculation();
  spec->set_mode(v1::SPECULATION_MODE_SPECBOUND);
  spec->set_specbound_t0(2.5);
  spec->set_specbound_depth_bound(3);
  spec->set_specbound_check_every(2);
  absl::StatusOr<GenerationRequest> request = Decode(wire);
  ASSERT_TRUE(request.ok()) << request.status();
  const SpecBoundConfig& sb = request->speculation.specbound;
  EXPECT_EQ(request->speculation.mode, SpeculationMode::kSpecBound);
  EXPECT_DOUBLE_EQ(sb.lambda, 0.75);  // unset: the server's
  EXPECT_DOUBLE_EQ(sb.t0, 2.5);
  EXPECT_EQ(sb.depth_bound, 3);
  EXPECT_EQ(sb.check_every, 2);
  EXPECT_FALSE(sb.trained_heads);
}

TEST_F(DecodeGenerateRequestTest, LimitsRefuseOversizeFieldsNamingTheFlag) {
  defaults_.limits.max_prompt_tokens = 4;
  defaults_.limits.max_new_tokens = 50;
  defaults_.limits.max_stop_strings = 2;
  defaults_.limits.max_stop_bytes = 5;
  defaults_.limits.max_stop_token_ids = 1;
  struct Case {
    std::string says;
    std::function<void(v1::GenerateRequest&)> edit;
  };
  const std::vector<Case> cases = {
      {"prompt.token_ids: 5 tokens, more than this server's limit of 4 "
       "(--max-prompt-tokens)",
       [](v1::GenerateRequest& r) {
         for (int i = 0; i < 5; ++i) r.mutable_token_ids()->add_ids(7);
       }},
      {"(--max-prompt-tokens)",
       [](v1::GenerateRequest& r) {
         r.set_text("Once upon a time there was a big dog");
       }},
      {"max_new_tokens: 51, more than this server's limit of 50",
       [](v1::GenerateRequest& r) { r.set_max_new_tokens(51); }},
      {"stop: 3 strings, more than this server's limit of 2",
       [](v1::GenerateRequest& r) {
         for (const char* s : {"a", "b", "c"}) r.add_stop(s);
       }},
      {"stop[1]: 6 bytes, more than this server's limit of 5",
       [](v1::GenerateRequest& r) {
         r.add_stop("ok");
         r.add_stop("sixsix");
       }},
      {"stop_token_ids: 2 ids, more than this server's limit of 1",
       [](v1::GenerateRequest& r) {
         r.add_stop_token_ids(1);
         r.add_stop_token_ids(2);
       }},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest wire;
    wire.set_text("Hi");
    wire.set_max_new_tokens(10);
    c.edit(wire);
    absl::StatusOr<GenerationRequest> request = Decode(wire);
    EXPECT_EQ(request.status().code(), absl::StatusCode::kInvalidArgument)
        << c.says << ": " << request.status();
    EXPECT_NE(request.status().message().find(c.says), std::string::npos)
        << c.says << ": " << request.status();
  }
  // At the limits a request decodes.
  v1::GenerateRequest wire;
  for (int i = 0; i < 4; ++i) wire.mutable_token_ids()->add_ids(7);
  wire.set_max_new_tokens(50);
  wire.add_stop("five5");
  wire.add_stop("x");
  wire.add_stop_token_ids(3);
  EXPECT_TRUE(Decode(wire).ok()) << Decode(wire).status();
}

TEST(GenerationCodecTest, EncodesChunksAndFinalResults) {
  const std::vector<int32_t> ids = {5, 6};
  v1::GenerateResponse chunk = EncodeChunk("req-1", ids, "hi");
  ASSERT_TRUE(chunk.has_chunk());
  EXPECT_EQ(chunk.chunk().request_id(), "req-1");
  EXPECT_EQ(chunk.chunk().text(), "hi");
  EXPECT_EQ(std::vector<int32_t>(chunk.chunk().token_ids().begin(),
                                 chunk.chunk().token_ids().end()),
            ids);
  EXPECT_EQ(chunk.chunk().logprobs_size(), 0);
  EXPECT_EQ(chunk.chunk().top_logprobs_size(), 0);
  // Log-probabilities: one per id, and with top_logprobs the alternatives.
  const std::vector<float> chosen = {-0.5f, -1.0f};
  const std::vector<std::vector<TokenLogprob>> top = {
      {{5, -0.5f}, {9, -2.0f}}, {{7, -0.25f}, {6, -1.0f}}};
  const v1::GenerateResponse with_top =
      EncodeChunk("req-1", ids, "hi", StepLogprobs{chosen, top});
  ASSERT_EQ(with_top.chunk().logprobs_size(), 2);
  EXPECT_FLOAT_EQ(with_top.chunk().logprobs(1), -1.0f);
  ASSERT_EQ(with_top.chunk().top_logprobs_size(), 2);
  EXPECT_EQ(with_top.chunk().top_logprobs(1).token_ids(0), 7);
  EXPECT_FLOAT_EQ(with_top.chunk().top_logprobs(1).logprobs(1), -1.0f);

  GenerationResult r;
  r.finish_reason = FinishReason::kStopSequence;
  r.matched_stop = "The end";
  r.seed = 7;
  r.stats.prompt_tokens = 4;
  r.stats.completion_tokens = 11;
  r.stats.decode_seconds = 2.0;
  r.stats.prefill_seconds = 0.5;
  r.speculation.drafts = 3;
  r.speculation.draft_tokens = 9;
  r.speculation.accepted_tokens = 6;
  r.speculation.accepted_per_position = {3, 2, 1};
  AppliedPlan plan;
  plan.applied_step = 12;
  plan.mask = "a1";
  plan.gamma = 3;
  plan.age_steps = 2;
  r.plans.push_back(plan);
  v1::GenerateResponse final = EncodeFinal(
      "req-2", r, SpeculationMode::kKnapSpec, ServiceTimings{0.1, 0.2, 3.0});
  ASSERT_TRUE(final.has_final());
  const v1::FinalResult& f = final.final();
  EXPECT_EQ(f.request_id(), "req-2");
  EXPECT_EQ(f.finish_reason(), v1::FINISH_REASON_STOP_SEQUENCE);
  EXPECT_EQ(f.stop_sequence(), "The end");
  EXPECT_EQ(f.seed(), 7u);
  EXPECT_EQ(f.usage().prompt_tokens(), 4);
  EXPECT_EQ(f.usage().completion_tokens(), 11);
  EXPECT_DOUBLE_EQ(f.timings().queue_seconds(), 0.1);
  EXPECT_DOUBLE_EQ(f.timings().time_to_first_token_seconds(), 0.2);
  EXPECT_DOUBLE_EQ(f.timings().total_seconds(), 3.0);
  EXPECT_DOUBLE_EQ(f.timings().mean_inter_token_latency_seconds(), 0.2);
  EXPECT_EQ(f.speculation_stats().mode(), v1::SPECULATION_MODE_KNAPSPEC);
  EXPECT_EQ(f.speculation_stats().drafts(), 3);
  EXPECT_EQ(f.speculation_stats().accepted_per_position_size(), 3);
  ASSERT_EQ(f.speculation_stats().plans_size(), 1);
  EXPECT_EQ(f.speculation_stats().plans(0).step(), 12u);
  EXPECT_EQ(f.speculation_stats().plans(0).mask(), "a1");
  EXPECT_EQ(f.speculation_stats().plans(0).age_steps(), 2u);
}

// The final message carries the planning statistics, and a client decodes
// them back into the same values `generate --json` prints in-process
// (executor/api/planning_json.h): the same JSON either way.
TEST(GenerationCodecTest, FinalCarriesPlanningStatisticsThatDecodeBack) {
  GenerationResult r;
  r.stats.completion_tokens = 20;
  r.stats.decode_seconds = 2.0;
  r.stats.plan_requests = 3;
  r.stats.plan_failures = 1;
  r.last_plan_error = "INTERNAL: boom";
  PlanningStats& p = r.planning;
  p.cache_hits = 2;
  p.cache_misses = 1;
  p.triggers_no_plan = 1;
  p.triggers_new_bucket = 4;
  p.triggers_drift = 5;
  p.triggers_recheck = 2;
  p.budget_deferrals = 6;
  p.solve_seconds = 0.5;
  p.process_planner_cpu_share = 0.04;
  p.guard_checks = 7;
  p.guard_fallbacks = 8;
  p.guard_probe_steps = 9;
  p.guard_plain_steps = 10;
  p.guard_last_spec_tps = 123.5;
  p.guard_last_plain_tps = 100.25;
  p.guard_inherited_steps = 6;
  p.guard_carried_steps = 4;
  p.guard_settle_steps = 8;
  p.guard_confirmations = 5;
  p.guard_cleared_losses = 3;
  p.profile_pending = true;
  p.profile_pending_steps = 11;
  AppliedPlan plan;
  plan.applied_step = 12;
  plan.plan_step = 9;
  plan.age_steps = 3;
  plan.mask = "a1,m2";
  plan.gamma = 3;
  plan.alpha_hat = 0.75;
  plan.alpha_smoothed = 0.7;
  plan.predicted_tokens_per_step = 2.25;
  plan.predicted_drafts_per_step = 1.75;
  plan.predicted_tpt = 210;
  plan.baseline_tpt = 180;
  plan.num_candidates = 14;
  plan.solve_seconds = 0.125;
  plan.queue_seconds = 0.0625;
  plan.context_length = 40;
  plan.source = "solve";
  plan.measured_steps = 15;
  plan.measured_tokens = 33;
  plan.measured_seconds = 0.1875;
  plan.measured_drafted = 45;
  plan.measured_accepted = 18;
  plan.measured_plain_tpt = 150;
  plan.draft_cost_ratio = 1.25;  // drafting ran 25% above the profile's cost
  plan.measured_tokens_sq =
      75;  // 12 steps of 2 tokens in 11.5 ms, 3 of 3 in 16.5
  plan.measured_token_seconds = 0.4245;
  plan.measured_seconds_sq = 0.00240375;
  plan.beside_solve_steps = 4;
  plan.beside_solve_tokens = 7;
  plan.beside_solve_seconds = 0.0625;
  plan.unsteady_steps = 8;  // right after the prefill
  plan.unsteady_tokens = 17;
  plan.unsteady_seconds = 0.125;
  r.plans.push_back(plan);
  const v1::FinalResult f =
      EncodeFinal("req-3", r, SpeculationMode::kKnapSpec, ServiceTimings{})
          .final();
  EXPECT_DOUBLE_EQ(f.timings().decode_seconds(), 2.0);
  EXPECT_EQ(f.planning().plan_requests(), 3);
  EXPECT_EQ(f.planning().plan_failures(), 1);
  EXPECT_EQ(f.planning().last_plan_error(), "INTERNAL: boom");
  EXPECT_DOUBLE_EQ(f.planning().planner_cpu_share(), 0.25);
  EXPECT_TRUE(f.planning().profile_pending());
  EXPECT_EQ(f.planning().profile_pending_steps(), 11);

  const PlanningStats back = DecodePlanningStats(f.planning());
  EXPECT_EQ(PlanningJson(back, f.timings().decode_seconds()),
            PlanningJson(p, r.stats.decode_seconds));
  ASSERT_EQ(f.speculation_stats().plans_size(), 1);
  const AppliedPlan plan_back =
      DecodeAppliedPlan(f.speculation_stats().plans(0));
  EXPECT_EQ(AppliedPlansJson({plan_back}), AppliedPlansJson(r.plans));
  EXPECT_EQ(AppliedPlansJson(r.plans)[0]["measured_tpt"], 176.0);
  EXPECT_EQ(plan_back.unsteady_steps, 8);
  EXPECT_EQ(plan_back.unsteady_tokens, 17);
  EXPECT_DOUBLE_EQ(plan_back.unsteady_seconds, 0.125);
  // 210 promised against a profile's plain 180; plain measured 150 now:
  // 175, the calibrated prediction. Recent drafting steps cost 1.25x their
  // predicted time: 168 by them, reported beside it.
  EXPECT_EQ(AppliedPlansJson({plan_back})[0]["measured_plain_tpt"], 150.0);
  EXPECT_EQ(AppliedPlansJson({plan_back})[0]["calibrated_tpt"], 175.0);
  EXPECT_EQ(AppliedPlansJson({plan_back})[0]["draft_cost_ratio"], 1.25);
  EXPECT_EQ(AppliedPlansJson({plan_back})[0]["draft_calibrated_tpt"], 168.0);
  // A plain plan has no drafting calibration; the plain one stays.
  AppliedPlan plain_back = plan_back;
  plain_back.gamma = 0;
  EXPECT_EQ(plain_back.calibrated_tpt(), 175.0);
  EXPECT_EQ(plain_back.draft_calibrated_tpt(), 0);
  plain_back.gamma = 3;
  plain_back.draft_cost_ratio = 0;  // too few drafting steps
  EXPECT_EQ(plain_back.calibrated_tpt(), 175.0);
  EXPECT_EQ(plain_back.draft_calibrated_tpt(), 0);
  plain_back.measured_plain_tpt = 0;  // no plain rate: no calibration
  EXPECT_EQ(plain_back.calibrated_tpt(), 0);
  EXPECT_EQ(AppliedPlansJson({plan_back})[0]["beside_solve_tokens"], 7);
  EXPECT_EQ(plan_back.measured_tokens_sq, 75);
  EXPECT_EQ(plan_back.measured_token_seconds, 0.4245);
  EXPECT_EQ(plan_back.measured_seconds_sq, 0.00240375);
  // sqrt(sum (t_i - R s_i)^2 * 15 / 14) / 0.1875 over those 15 steps.
  EXPECT_NEAR(plan_back.measured_tpt_standard_error(), 1.02628, 1e-4);
  EXPECT_EQ(AppliedPlansJson({plan_back})[0]["measured_tpt_standard_error"],
            plan_back.measured_tpt_standard_error());
  EXPECT_EQ(AppliedPlansJson({plan_back})[0]["predicted_drafts_per_step"],
            1.75);
  EXPECT_EQ(PlanningJson(back, 2.0)["planner_cpu_share"], 0.25);
  EXPECT_EQ(PlanningJson(back, 2.0)["profile_pending_steps"], 11);
  EXPECT_EQ(PlanningJson(back, 2.0)["guard"]["inherited_steps"], 6);
  EXPECT_EQ(PlanningJson(back, 2.0)["guard"]["carried_steps"], 4);
  EXPECT_EQ(PlanningJson(back, 2.0)["guard"]["settle_steps"], 8);
  EXPECT_EQ(PlanningJson(back, 2.0)["guard"]["confirmations"], 5);
  EXPECT_EQ(PlanningJson(back, 2.0)["guard"]["cleared_losses"], 3);
}

}  // namespace
}  // namespace knapserve

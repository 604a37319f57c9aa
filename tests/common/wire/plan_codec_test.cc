// Tests of the plan codec (common/wire/plan_codec.h): requests and responses
// survive the wire, the K/V window holds exactly the positions it names, and
// every malformed field is refused by name.
#include "common/wire/plan_codec.h"

#include <c10/core/InferenceMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

namespace knapserve {
namespace {

constexpr int kLayers = 3;

// A request with random states [2L+1, r, 8] and K/V [2, capacity, 4].
PlanRequest MakeRequest(int64_t first_position, int64_t r) {
  c10::InferenceMode guard;
  torch::manual_seed(7);
  PlanRequest request;
  request.sequence_id = 42;
  request.step = 128;
  request.context_length = first_position + r;
  request.plan_lifetime_tokens = 64;
  request.exit_threshold = 0.625;
  request.policy = PlanPolicy::kClasp;
  request.clasp_layers = 1;
  request.max_draft = 6;
  request.model_fingerprint = "llama-test";
  request.states = torch::randn({2 * kLayers + 1, r, 8}).to(torch::kBFloat16);
  request.first_position = first_position;
  for (int64_t i = 0; i < r; ++i)
    request.target_argmax.push_back(static_cast<int32_t>(10 + i));
  for (int l = 0; l < kLayers; ++l) {
    request.kv.push_back({torch::randn({2, first_position + r + 5, 4}),
                          torch::randn({2, first_position + r + 5, 4})});
  }
  request.kv_length = first_position + r;
  return request;
}

TEST(PlanCodecTest, RequestRoundTripsWithAWindowOfThePrefix) {
  c10::InferenceMode guard;
  const PlanRequest request = MakeRequest(/*first_position=*/50, /*r=*/6);
  v1::PlanRequest wire;
  ASSERT_TRUE(
      EncodePlanRequest(request, {/*leading=*/4, /*window=*/10}, &wire).ok());
  EXPECT_EQ(wire.sequence_id(), "42");
  // 4 leading + 10 before the first reference position (40..49), then
  // the committed reference positions before the last one (50..54).
  EXPECT_EQ(wire.kv_context().window().positions_size(), 14 + 5);
  EXPECT_EQ(wire.kv_context().window().positions(4), 40);
  EXPECT_EQ(wire.kv_context().window().positions(14), 50);
  EXPECT_EQ(wire.kv_context().window().reference_positions_with_kv(), 5);
  auto back = DecodePlanRequest(wire, kLayers, 10);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->sequence_id, 42u);
  EXPECT_EQ(back->step, 128);
  EXPECT_EQ(back->context_length, 56);
  EXPECT_EQ(back->plan_lifetime_tokens, 64);
  EXPECT_EQ(back->exit_threshold, 0.625);
  EXPECT_EQ(back->policy, PlanPolicy::kClasp);
  EXPECT_EQ(back->clasp_layers, 1);
  EXPECT_EQ(back->max_draft, 6);
  EXPECT_EQ(back->first_position, 50);
  EXPECT_EQ(back->target_argmax, request.target_argmax);
  EXPECT_TRUE(torch::equal(back->states, request.states));
  ASSERT_EQ(back->kv.size(), static_cast<size_t>(kLayers));
  EXPECT_EQ(back->kv_length, 19);
  torch::Tensor positions = torch::cat(
      {torch::arange(0, 4), torch::arange(40, 50), torch::arange(50, 55)});
  std::vector<int64_t> want(positions.data_ptr<int64_t>(),
                            positions.data_ptr<int64_t>() + 19);
  EXPECT_EQ(back->kv_positions, want);
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_TRUE(torch::equal(back->kv[l].k,
                             request.kv[l].k.index_select(1, positions)));
    EXPECT_TRUE(torch::equal(back->kv[l].v,
                             request.kv[l].v.index_select(1, positions)));
  }
}

TEST(PlanCodecTest, ALargeWindowCarriesTheWholePrefixOnce) {
  c10::InferenceMode guard;
  const PlanRequest request = MakeRequest(/*first_position=*/12, /*r=*/3);
  v1::PlanRequest wire;
  ASSERT_TRUE(EncodePlanRequest(request, {4, 1024}, &wire).ok());
  auto back = DecodePlanRequest(wire, kLayers, 10);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->kv_length, 12 + 2);  // and reference positions 12, 13
  EXPECT_TRUE(torch::equal(back->kv[0].k, request.kv[0].k.narrow(1, 0, 14)));
  // Only the committed ones: a cache that ends at the first reference
  // position sends none of them.
  PlanRequest prefix_only = request;
  prefix_only.kv_length = 12;
  ASSERT_TRUE(EncodePlanRequest(prefix_only, {4, 1024}, &wire).ok());
  EXPECT_EQ(wire.kv_context().window().reference_positions_with_kv(), 0);
  EXPECT_EQ(wire.kv_context().window().positions_size(), 12);
}

TEST(PlanCodecTest, ResponsesRoundTripAndErrorsKeepTheirKind) {
  DraftPlan plan;
  ASSERT_TRUE(LayerMask::Parse("a1,m1", kLayers).ok());
  plan.mask = *LayerMask::Parse("a1,m1", kLayers);
  plan.gamma = 4;
  plan.predicted_tpt = 123.5;
  plan.alpha_hat = 0.75;
  plan.num_candidates = 9;
  plan.num_evaluated = 4;
  plan.alpha_smoothed = 0.7;
  plan.predicted_tokens_per_step = 2.5;
  plan.predicted_drafts_per_step = 2.25;
  plan.solve_seconds = 0.25;
  plan.queue_seconds = 0.01;
  const v1::PlanResponse wire = EncodePlanResponse(42, 128, plan);
  auto back = DecodePlanResponse(wire, kLayers, /*max_gamma=*/10);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->mask, plan.mask);
  EXPECT_EQ(back->gamma, 4);
  EXPECT_EQ(back->step, 128);
  EXPECT_DOUBLE_EQ(back->predicted_tpt, 123.5);
  EXPECT_DOUBLE_EQ(back->alpha_hat, 0.75);
  EXPECT_DOUBLE_EQ(back->alpha_smoothed, 0.7);
  EXPECT_DOUBLE_EQ(back->predicted_tokens_per_step, 2.5);
  EXPECT_DOUBLE_EQ(back->predicted_drafts_per_step, 2.25);
  EXPECT_EQ(back->num_candidates, 9);
  EXPECT_EQ(back->num_evaluated, 4);
  for (const absl::Status& error :
       {absl::FailedPreconditionError("other model"),
        absl::InvalidArgumentError("states: bad"),
        absl::CancelledError("superseded"),
        absl::ResourceExhaustedError("queue full"),
        absl::InternalError("boom")}) {
    auto decoded =
        DecodePlanResponse(EncodePlanResponse(1, 2, error), kLayers, 10);
    EXPECT_EQ(decoded.status().code(), error.code()) << error;
    EXPECT_EQ(decoded.status().message(), error.message());
  }
}

TEST(PlanCodecTest, RefusesMalformedRequestsNamingTheField) {
  c10::InferenceMode guard;
  v1::PlanRequest good;
  ASSERT_TRUE(EncodePlanRequest(MakeRequest(20, 4), {4, 8}, &good).ok());
  ASSERT_TRUE(DecodePlanRequest(good, kLayers, 10).ok());
  struct Case {
    std::string expected;
    std::function<void(v1::PlanRequest&)> corrupt;
  };
  const std::vector<Case> cases = {
      {"sequence_id", [](v1::PlanRequest& r) { r.set_sequence_id("seq-a"); }},
      {"context_length", [](v1::PlanRequest& r) { r.set_context_length(0); }},
      {"plan_lifetime_tokens",
       [](v1::PlanRequest& r) { r.set_plan_lifetime_tokens(-5); }},
      {"exit_threshold", [](v1::PlanRequest& r) { r.set_exit_threshold(1.5); }},
      {"exit_threshold", [](v1::PlanRequest& r) { r.set_exit_threshold(NAN); }},
      {"model_fingerprint",
       [](v1::PlanRequest& r) { r.clear_model_fingerprint(); }},
      {"reference_states: required",
       [](v1::PlanRequest& r) { r.clear_reference_states(); }},
      {"reference_states.data",
       [](v1::PlanRequest& r) {
         r.mutable_reference_states()->mutable_data()->resize(3);
       }},
      {"reference_positions",
       [](v1::PlanRequest& r) { r.set_reference_positions(2, 99); }},
      {"reference_token_ids",
       [](v1::PlanRequest& r) { r.add_reference_token_ids(5); }},
      {"kv_context.all_in_memory",
       [](v1::PlanRequest& r) {
         r.mutable_kv_context()->set_all_in_memory(true);
       }},
      {"kv_context.window.positions[1]",
       [](v1::PlanRequest& r) {
         r.mutable_kv_context()->mutable_window()->set_positions(1, 0);
       }},
      {"kv_context.window.reference_positions_with_kv",
       [](v1::PlanRequest& r) {
         r.mutable_kv_context()
             ->mutable_window()
             ->set_reference_positions_with_kv(4);  // r - 1 = 3 at most
       }},
      {"kv_context.window.positions[14]",  // the third reference position
       [](v1::PlanRequest& r) {
         r.mutable_kv_context()->mutable_window()->set_positions(14, 23);
       }},
      {"kv_context.window.layers: 2",
       [](v1::PlanRequest& r) {
         r.mutable_kv_context()
             ->mutable_window()
             ->mutable_layers()
             ->RemoveLast();
       }},
      {"kv_context.window.layers[0]",
       [](v1::PlanRequest& r) {
         r.mutable_kv_context()
             ->mutable_window()
             ->mutable_layers(0)
             ->mutable_v()
             ->set_shape(1, 3);
         r.mutable_kv_context()
             ->mutable_window()
             ->mutable_layers(0)
             ->mutable_v()
             ->mutable_data()
             ->resize(2 * 3 * 4 * 4);
       }},
      {"policy",
       [](v1::PlanRequest& r) {
         r.set_policy(static_cast<v1::PlannerPolicy>(99));
       }},
  };
  for (const Case& c : cases) {
    v1::PlanRequest bad = good;
    c.corrupt(bad);
    auto decoded = DecodePlanRequest(bad, kLayers, 10);
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument)
        << c.expected;
    EXPECT_NE(decoded.status().message().find(c.expected), std::string::npos)
        << c.expected << ": " << decoded.status();
  }
}

// NaN or Inf in the reference states or the K/V window would make every
// cosine of the planner's DP NaN (a CLaSp solve then failed with Internal;
// found by tests/fuzz/fuzz_plan_codec): the decoder refuses them by field.
TEST(PlanCodecTest, NonFiniteStatesOrKvAreRefusedByField) {
  c10::InferenceMode guard;
  for (const char* field :
       {"reference_states", "kv_context.window.layers[1].v"}) {
    for (const float bad : {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity()}) {
      PlanRequest request = MakeRequest(/*first_position=*/12, /*r=*/3);
      if (std::string(field) == "reference_states") {
        request.states = request.states.to(torch::kFloat32);
        request.states[2][1][3] = bad;
      } else {
        request.kv[1].v[0][5][2] = bad;
      }
      v1::PlanRequest wire;
      ASSERT_TRUE(EncodePlanRequest(request, {4, 1024}, &wire).ok());
      auto back = DecodePlanRequest(wire, kLayers, 10);
      ASSERT_FALSE(back.ok()) << field;
      EXPECT_EQ(back.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(back.status().message()),
                  ::testing::HasSubstr(field));
      EXPECT_THAT(std::string(back.status().message()),
                  ::testing::HasSubstr("NaN or infinite"));
    }
  }
}

// A plan may not ask for longer drafts than the request offered; a gamma
// past INT_MAX once wrapped to a negative int (found by fuzz_plan_codec).
TEST(PlanCodecTest, AGammaAboveTheRequestedMaxDraftIsRefused) {
  DraftPlan plan;
  plan.mask = *LayerMask::Parse("a1", kLayers);
  plan.gamma = 4;
  v1::PlanResponse wire = EncodePlanResponse(1, 2, plan);
  EXPECT_TRUE(DecodePlanResponse(wire, kLayers, 4).ok());
  auto refused = DecodePlanResponse(wire, kLayers, 3);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("gamma: 4 exceeds"));
  wire.set_gamma(4227330007u);
  EXPECT_FALSE(DecodePlanResponse(wire, kLayers, 10).ok());
}

// The basis the executor refines a plan from (executor/planning/
// plan_refinement.h) crosses the wire whole, and a broken one is refused by
// field: the remote planner's plans refine like the in-process planner's.
TEST(PlanCodecTest, ThePlansBasisRoundTripsAndABadOneIsRefused) {
  DraftPlan plan;
  plan.mask = *LayerMask::Parse("a1,m1", kLayers);
  plan.gamma = 3;
  plan.alpha_hat = 0.6;
  PlanBasis& basis = plan.basis;
  basis.verify_seconds = {1e-3, 1.1e-3, 1.2e-3, 1.3e-3, 1.4e-3};
  basis.draft_seconds = 2e-4;
  basis.reference_tokens = 16;
  basis.accept_share = 0.6;
  basis.prior = AlphaPrior{1, 2};
  basis.confidence_stop = true;
  basis.go_on_share = 0.75;
  basis.accept_and_go_on_share = 0.5;
  basis.gamma_fixed = true;
  basis.later_accept_trials = 7.5;
  basis.later_accept_share = 0.8;
  basis.later_accept_and_go_on_share = 0.6;
  basis.later_go_on_trials = 9.5;
  basis.later_go_on_share = 0.7;
  const v1::PlanResponse wire = EncodePlanResponse(1, 2, plan);
  ASSERT_TRUE(wire.has_basis());
  auto back = DecodePlanResponse(wire, kLayers, /*max_gamma=*/4);
  ASSERT_TRUE(back.ok()) << back.status();
  const PlanBasis& got = back->basis;
  EXPECT_EQ(got.verify_seconds, basis.verify_seconds);
  EXPECT_DOUBLE_EQ(got.draft_seconds, 2e-4);
  EXPECT_EQ(got.reference_tokens, 16);
  EXPECT_DOUBLE_EQ(got.accept_share, 0.6);
  EXPECT_DOUBLE_EQ(got.prior.hits, 1);
  EXPECT_DOUBLE_EQ(got.prior.misses, 2);
  EXPECT_TRUE(got.confidence_stop);
  EXPECT_DOUBLE_EQ(got.go_on_share, 0.75);
  EXPECT_DOUBLE_EQ(got.accept_and_go_on_share, 0.5);
  EXPECT_TRUE(got.gamma_fixed);
  EXPECT_DOUBLE_EQ(got.later_accept_trials, 7.5);
  EXPECT_DOUBLE_EQ(got.later_accept_share, 0.8);
  EXPECT_DOUBLE_EQ(got.later_accept_and_go_on_share, 0.6);
  EXPECT_DOUBLE_EQ(got.later_go_on_trials, 9.5);
  EXPECT_DOUBLE_EQ(got.later_go_on_share, 0.7);
  // Without later trials (an older planner) the later shares are not read.
  {
    v1::PlanResponse old_planner = wire;
    old_planner.mutable_basis()->set_later_accept_trials(0);
    old_planner.mutable_basis()->set_later_go_on_share(0);
    auto decoded = DecodePlanResponse(old_planner, kLayers, 4);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    EXPECT_EQ(decoded->basis.later_accept_trials, 0);
    EXPECT_EQ(decoded->basis.later_go_on_share, 1);
  }

  // A plain plan carries none.
  DraftPlan plain = plan;
  plain.gamma = 0;
  EXPECT_FALSE(EncodePlanResponse(1, 2, plain).has_basis());

  auto refused = [&](auto&& edit, const std::string& field) {
    v1::PlanResponse bad = wire;
    edit(*bad.mutable_basis());
    auto decoded = DecodePlanResponse(bad, kLayers, 4);
    ASSERT_FALSE(decoded.ok()) << field;
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(decoded.status().message()),
                ::testing::HasSubstr(field));
  };
  // More prices than max_draft_tokens + 1, fewer than gamma + 1.
  refused([](v1::PlanBasis& b) { b.add_verify_seconds(1.5e-3); },
          "basis.verify_seconds: 6 entries");
  refused([](v1::PlanBasis& b) { b.mutable_verify_seconds()->Truncate(3); },
          "basis.verify_seconds: 3 entries");
  refused([](v1::PlanBasis& b) { b.set_verify_seconds(2, -1); },
          "basis.verify_seconds must be finite");
  refused(
      [](v1::PlanBasis& b) {
        b.set_verify_seconds(0, std::numeric_limits<double>::infinity());
      },
      "basis.verify_seconds must be finite");
  refused([](v1::PlanBasis& b) { b.set_draft_seconds(0); },
          "basis.draft_seconds");
  refused([](v1::PlanBasis& b) { b.set_reference_tokens(-1); },
          "basis.reference_tokens");
  refused([](v1::PlanBasis& b) { b.set_prior_misses(-1); },
          "alpha_prior.misses");
  refused([](v1::PlanBasis& b) { b.set_accept_share(1.5); },
          "basis.accept_share");
  refused([](v1::PlanBasis& b) { b.set_go_on_share(-0.1); },
          "basis.go_on_share");
  refused([](v1::PlanBasis& b) { b.set_accept_and_go_on_share(std::nan("")); },
          "basis.accept_and_go_on_share");
  refused([](v1::PlanBasis& b) { b.set_later_accept_trials(-1); },
          "basis.later_accept_trials");
  refused([](v1::PlanBasis& b) { b.set_later_go_on_trials(std::nan("")); },
          "basis.later_go_on_trials");
  // More pairs than the 16 reference tokens hold (15).
  refused([](v1::PlanBasis& b) { b.set_later_go_on_trials(15.5); },
          "basis.later_go_on_trials");
  refused([](v1::PlanBasis& b) { b.set_later_accept_trials(1e300); },
          "basis.later_accept_trials");
  refused([](v1::PlanBasis& b) { b.set_later_accept_share(1.1); },
          "basis.later_accept_share");
  refused([](v1::PlanBasis& b) { b.set_later_go_on_share(-1); },
          "basis.later_go_on_share");
  refused([](v1::PlanBasis& b) { b.set_later_accept_and_go_on_share(2); },
          "basis.later_accept_and_go_on_share");
}

// A plan error without a message still says what happened (found by
// fuzz_plan_codec: a CANCELLED with an empty message).
TEST(PlanCodecTest, AnErrorWithoutAMessageIsNamedByItsCode) {
  v1::PlanResponse wire;
  wire.mutable_error()->set_code(v1::PLAN_ERROR_CODE_SUPERSEDED);
  auto decoded = DecodePlanResponse(wire, kLayers, 10);
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(
      std::string(decoded.status().message()),
      ::testing::HasSubstr("PLAN_ERROR_CODE_SUPERSEDED without a message"));
}

// "Profile pending" crosses the wire as its own code and is recognized on
// the executor's side (no failure there); a plain Unavailable is not it.
TEST(PlanCodecTest, ProfilePendingRoundTripsAsItsOwnCode) {
  const v1::PlanResponse wire = EncodePlanResponse(
      7, 12, ProfilePendingError("profile pending: still measuring"));
  EXPECT_EQ(wire.error().code(), v1::PLAN_ERROR_CODE_PROFILE_PENDING);
  auto decoded = DecodePlanResponse(wire, kLayers, 10);
  EXPECT_TRUE(IsProfilePending(decoded.status())) << decoded.status();
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(decoded.status().message(), "profile pending: still measuring");

  const v1::PlanResponse gone =
      EncodePlanResponse(7, 12, absl::UnavailableError("profile pending"));
  EXPECT_EQ(gone.error().code(), v1::PLAN_ERROR_CODE_INTERNAL);
  EXPECT_FALSE(
      IsProfilePending(DecodePlanResponse(gone, kLayers, 10).status()));
}

}  // namespace
}  // namespace knapserve

// Fuzz target: plan requests and plans from arbitrary protobuf bytes
// (common/wire/plan_codec.h), as the planner service and the executor's
// remote planner client decode them. The first byte picks the message: even
// is a knapserve.v1.PlanRequest for the shared stories260k model, odd a
// knapserve.v1.PlanResponse; the rest is its bytes.
//
// A request the codec accepts goes on to the real solver (InProcessPlanner::
// Solve with a latency profile measured at start-up), as it would in the
// planner service. The solver may refuse it (wrong hidden size, a fingerprint
// that is not the model's) but must never fail with Internal: that would mean
// a malformed request got past validation into a LibTorch check.
#include <c10/core/InferenceMode.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "common/wire/plan_codec.h"
#include "planner/inprocess_planner.h"
#include "planner/latency_profile.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

constexpr int kDefaultMaxDraft = 4;
std::unique_ptr<knapserve::InProcessPlanner> g_planner;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  using namespace knapserve;
  fuzz::SilenceProtobufLogs();
  fuzz::UseOneTorchThread();
  c10::InferenceMode guard;
  const LlamaModel& model = fuzz::Stories260k();
  ProfileOptions options;
  options.contexts = {16, 64};
  options.repeats = 1;
  options.warmup = 0;
  options.max_draft = kDefaultMaxDraft;
  auto profile = ProfileModel(model, options);
  auto planner = profile.ok() ? InProcessPlanner::Create(model, *profile, {})
                              : profile.status();
  if (!planner.ok()) {
    std::fprintf(stderr, "fuzz_plan_codec: %s\n",
                 planner.status().ToString().c_str());
    std::exit(2);
  }
  g_planner = std::move(*planner);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace knapserve;
  using namespace knapserve::fuzz;
  if (size == 0) return 0;
  c10::InferenceMode guard;
  const int num_layers = Stories260k().num_layers();
  if (data[0] % 2 == 0) {
    v1::PlanRequest wire;
    if (!wire.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
    auto request = DecodePlanRequest(wire, num_layers, kDefaultMaxDraft);
    if (!request.ok()) {
      CheckRefusal(request.status());
      return 0;
    }
    FUZZ_CHECK(request->states.dim() == 3);
    FUZZ_CHECK(request->states.size(0) == 2 * num_layers + 1);
    FUZZ_CHECK(request->kv.empty() ||
               request->kv.size() == static_cast<size_t>(num_layers));
    FUZZ_CHECK(request->max_draft >= 1);
    auto plan = g_planner->Solve(*request);
    FUZZ_CHECK_MSG(
        plan.ok() || plan.status().code() != absl::StatusCode::kInternal,
        plan.status().ToString());
    if (!plan.ok()) CheckRefusal(plan.status());
    return 0;
  }
  v1::PlanResponse wire;
  if (!wire.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
  auto plan = DecodePlanResponse(wire, num_layers, kDefaultMaxDraft);
  if (!plan.ok()) {
    CheckRefusal(plan.status());
    return 0;
  }
  FUZZ_CHECK(plan->mask.num_layers() == num_layers);
  FUZZ_CHECK(plan->gamma >= 0 && plan->gamma <= kDefaultMaxDraft);
  return 0;
}

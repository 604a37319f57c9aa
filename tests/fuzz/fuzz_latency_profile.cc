// Fuzz target: the latency-profile loader (planner/latency_profile.h). The
// input is the profile's JSON text. An accepted profile must write back to
// JSON that loads to the same text again, and every latency it answers for
// (attention, verify, draft at contexts from 0 to far past the table) must be
// finite and non-negative.
#include <cmath>
#include <cstdint>
#include <string>

#include "common/model/layer_mask.h"
#include "planner/latency_profile.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace knapserve;
  using namespace knapserve::fuzz;
  auto profile =
      LatencyProfile::FromJson(std::string(AsText(data, size)), "profile");
  if (!profile.ok()) {
    CheckRefusal(profile.status());
    return 0;
  }
  const absl::Status valid = profile->Validate();
  FUZZ_CHECK_MSG(valid.ok(), valid.ToString());
  const std::string json = profile->ToJson();
  auto again = LatencyProfile::FromJson(json, "round trip");
  FUZZ_CHECK_MSG(again.ok(), again.status().ToString() + "\n" + json);
  FUZZ_CHECK(again->ToJson() == json);

  const int layers = 4;
  LayerMask mask(layers);
  mask.set_skipped(2 * 1, true);      // layer 1's attention
  mask.set_skipped(2 * 2 + 1, true);  // layer 2's MLP
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{100}, int64_t{1} << 20}) {
    for (int tokens :
         {0, 1, 2, profile->max_draft + 1, profile->max_draft + 5}) {
      const double verify = profile->VerifySeconds(n, tokens);
      FUZZ_CHECK_MSG(std::isfinite(verify) && verify >= 0, json);
    }
    const double attention = profile->AttentionSeconds(n);
    FUZZ_CHECK_MSG(std::isfinite(attention) && attention >= 0, json);
    const double draft = profile->DraftSeconds(mask, n);
    FUZZ_CHECK_MSG(std::isfinite(draft) && draft >= 0, json);
  }
  return 0;
}

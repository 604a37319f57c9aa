// Fuzz target: GenerateRequest validation (executor/api/generation_codec.h)
// from arbitrary protobuf bytes, against the shared stories260k model with the
// default request limits, as the Generation service decodes every request.
// A request that is accepted then runs (at most 3 new tokens) through the
// real generator: it must not fail with Internal, which would mean that a
// request validation let through broke something inside.
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstdint>

#include "executor/api/generation_codec.h"
#include "executor/engine/generator.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  knapserve::fuzz::SilenceProtobufLogs();
  knapserve::fuzz::UseOneTorchThread();
  knapserve::fuzz::Stories260k();
  knapserve::fuzz::Stories260kTokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace knapserve;
  using namespace knapserve::fuzz;
  v1::GenerateRequest wire;
  if (!wire.ParseFromArray(data, static_cast<int>(size))) return 0;
  const LlamaModel& model = Stories260k();
  const GenerateRequestDefaults defaults;
  auto request =
      DecodeGenerateRequest(wire, defaults, model, Stories260kTokenizer());
  if (!request.ok()) {
    CheckRefusal(request.status());
    return 0;
  }
  FUZZ_CHECK(!request->prompt_ids.empty());
  for (int32_t id : request->prompt_ids) {
    FUZZ_CHECK(id >= 0 && id < model.config().vocab_size);
  }
  FUZZ_CHECK(request->max_new_tokens >= 1);
  FUZZ_CHECK(static_cast<int64_t>(request->prompt_ids.size()) <
             model.max_context());
  FUZZ_CHECK(static_cast<int64_t>(request->stop_strings.size()) <=
             defaults.limits.max_stop_strings);

  c10::InferenceMode guard;
  GenerationRequest capped = *request;
  capped.max_new_tokens = std::min<int64_t>(capped.max_new_tokens, 3);
  // min_tokens was checked against the uncapped max_new_tokens.
  capped.sampling.min_tokens =
      std::min<int64_t>(capped.sampling.min_tokens, capped.max_new_tokens);
  auto result = Generate(model, Stories260kTokenizer(), capped);
  FUZZ_CHECK_MSG(result.ok(), result.status().ToString());
  FUZZ_CHECK(static_cast<int64_t>(result->output_ids.size()) <= 3);
  return 0;
}

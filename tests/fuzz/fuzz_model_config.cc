// Fuzz target: config.json and generation_config.json
// (common/checkpoint/model_config.h). The first byte picks the file: even is
// config.json, odd is generation_config.json applied to a small Llama config;
// the rest is its text. An accepted config.json must survive
// ModelConfigToJson and ParseModelConfig with the same fingerprint and
// context; a refused generation_config.json must leave the config unchanged.
#include <cstdint>
#include <string>
#include <string_view>

#include "common/checkpoint/model_config.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace knapserve;
  using namespace knapserve::fuzz;
  if (size == 0) return 0;
  const std::string_view text = AsText(data + 1, size - 1);
  if (data[0] % 2 == 0) {
    auto config = ParseModelConfig(text, "config.json");
    if (!config.ok()) {
      CheckRefusal(config.status());
      return 0;
    }
    FUZZ_CHECK(config->max_context() > 0);
    const std::string json = ModelConfigToJson(*config);
    auto again = ParseModelConfig(json, "round trip");
    FUZZ_CHECK_MSG(again.ok(), again.status().ToString() + "\n" + json);
    FUZZ_CHECK_MSG(again->Fingerprint() == config->Fingerprint(), json);
    FUZZ_CHECK(again->max_context() == config->max_context());
    FUZZ_CHECK(again->eos_token_ids == config->eos_token_ids);
    FUZZ_CHECK(again->bos_token_id == config->bos_token_id);
    return 0;
  }
  ModelConfig config;
  config.model_type = "llama";
  config.eos_token_ids = {2};
  config.bos_token_id = 1;
  absl::Status status =
      ApplyGenerationConfig(text, "generation_config.json", config);
  if (!status.ok()) {
    CheckRefusal(status);
    FUZZ_CHECK(config.eos_token_ids == std::vector<int32_t>{2});
    FUZZ_CHECK(config.bos_token_id == 1);
    return 0;
  }
  for (int32_t id : config.eos_token_ids) FUZZ_CHECK(id >= 0);
  FUZZ_CHECK(!config.bos_token_id.has_value() || *config.bos_token_id >= 0);
  return 0;
}

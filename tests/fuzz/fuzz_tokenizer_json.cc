// Fuzz target: loading a tokenizer.json (common/text/tokenizer.h). The input
// is the file's text. A tokenizer that loads must encode and decode a fixed
// sample, with and without special tokens, and decode the first ids of its
// vocabulary, without error.
#include <cstdint>
#include <numeric>
#include <vector>

#include "common/text/tokenizer.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace knapserve;
  using namespace knapserve::fuzz;
  auto tokenizer = Tokenizer::FromJson(AsText(data, size), "tokenizer.json");
  if (!tokenizer.ok()) {
    CheckRefusal(tokenizer.status());
    return 0;
  }
  for (bool special : {false, true}) {
    auto ids = (*tokenizer)
                   ->Encode("Once upon a time, Lily said: \"héllo\"!", special);
    FUZZ_CHECK_MSG(ids.ok(), ids.status().ToString());
    auto text = (*tokenizer)->Decode(*ids, /*skip_special_tokens=*/special);
    FUZZ_CHECK_MSG(text.ok(), text.status().ToString());
  }
  std::vector<int32_t> first(std::min<int32_t>(64, (*tokenizer)->vocab_size()));
  std::iota(first.begin(), first.end(), 0);
  auto text = (*tokenizer)->Decode(first);
  FUZZ_CHECK_MSG(text.ok(), text.status().ToString());
  return 0;
}

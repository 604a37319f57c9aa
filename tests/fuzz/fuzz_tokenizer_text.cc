// Fuzz target: encode and decode on arbitrary bytes with the real tokenizers
// of the shared data (stories260k's SentencePiece-style BPE and SmolLM's
// byte-level BPE). The first byte picks the tokenizer (bit 0) and the
// special-token flags (bits 1, 2); the rest is both the text to encode and,
// read as little-endian int32s, ids to decode. Properties:
//   - Encode accepts exactly the valid UTF-8 texts, and gives ids in the
//     vocabulary;
//   - Decode of any non-negative ids is valid UTF-8; a negative id is
//     OutOfRange;
//   - the IncrementalDecoder's pieces, concatenated, equal Decode of all ids.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/text/tokenizer.h"
#include "common/text/unicode_util.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

const knapserve::Tokenizer* g_tokenizers[2];

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  using knapserve::fuzz::SharedTokenizer;
  g_tokenizers[0] = &SharedTokenizer("models/stories260k/tokenizer.json");
  g_tokenizers[1] = &SharedTokenizer("tokenizers/smollm/tokenizer.json");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace knapserve;
  using namespace knapserve::fuzz;
  if (size == 0) return 0;
  const Tokenizer& tokenizer = *g_tokenizers[data[0] & 1];
  const bool add_special = (data[0] & 2) != 0;
  const bool skip_special = (data[0] & 4) != 0;
  const std::string_view text = AsText(data + 1, size - 1);

  auto encoded = tokenizer.Encode(text, add_special);
  FUZZ_CHECK(encoded.ok() == IsValidUtf8(text));
  if (encoded.ok()) {
    for (int32_t id : *encoded) {
      FUZZ_CHECK(id >= 0 && id < tokenizer.vocab_size());
    }
    auto decoded = tokenizer.Decode(*encoded, skip_special);
    FUZZ_CHECK_MSG(decoded.ok(), decoded.status().ToString());
    FUZZ_CHECK(IsValidUtf8(*decoded));
  } else {
    CheckRefusal(encoded.status());
  }

  // The same bytes as ids, mostly near the vocabulary (a few far outside it,
  // some negative).
  std::vector<int32_t> ids;
  for (size_t i = 0; i + 4 <= text.size(); i += 4) {
    int32_t raw;
    std::memcpy(&raw, text.data() + i, 4);
    ids.push_back(raw % (2 * tokenizer.vocab_size() + 1));
  }
  auto decoded = tokenizer.Decode(ids, skip_special);
  bool any_negative = false;
  for (int32_t id : ids) any_negative |= id < 0;
  if (any_negative) {
    FUZZ_CHECK(!decoded.ok());
    FUZZ_CHECK(decoded.status().code() == absl::StatusCode::kOutOfRange);
  } else {
    FUZZ_CHECK_MSG(decoded.ok(), decoded.status().ToString());
    FUZZ_CHECK(IsValidUtf8(*decoded));
  }
  IncrementalDecoder stream(tokenizer, skip_special);
  std::string streamed;
  std::vector<int32_t> accepted;
  for (int32_t id : ids) {
    auto piece = stream.Push(id);
    if (id < 0) {
      FUZZ_CHECK(!piece.ok());
      continue;
    }
    FUZZ_CHECK_MSG(piece.ok(), piece.status().ToString());
    streamed += *piece;
    accepted.push_back(id);
  }
  streamed += stream.Flush();
  auto whole = tokenizer.Decode(accepted, skip_special);
  FUZZ_CHECK(whole.ok());
  FUZZ_CHECK_MSG(streamed == *whole,
                 "streamed \"" + streamed + "\" != decoded \"" + *whole + "\"");
  return 0;
}

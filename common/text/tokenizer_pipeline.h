// The pieces of a Hugging Face tokenizer.json pipeline other than the model:
// normalizers, pre-tokenizers, decoders and post-processors, plus a PCRE2
// regex wrapper they share. Internal to common/text/tokenizer.cc; use
// Tokenizer.
//
// Each Parse* function reads one component object of tokenizer.json and
// returns it, nullptr for a JSON null (component absent), InvalidArgument for
// a malformed object and Unimplemented for a type knapserve does not support.
// Messages name the file and the component's path in it (the JsonReader's
// style): `tokenizer.json: field "pre_tokenizer.pretokenizers[1]": unsupported
// pre_tokenizer type 'X'`. The semantics follow the Rust `tokenizers` crate.
//
// All components are immutable after parsing and their const methods are
// thread-safe. Text arguments are valid UTF-8 unless a comment says otherwise.
#ifndef KNAPSERVE_COMMON_TEXT_TOKENIZER_PIPELINE_H_
#define KNAPSERVE_COMMON_TEXT_TOKENIZER_PIPELINE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/base/json_fields.h"

struct pcre2_real_code_8;

namespace knapserve {
namespace tokenizer_internal {

// A compiled PCRE2 pattern (UTF + UCP, so \p{L}, \s, \w are Unicode-aware).
// Matching allocates its own match data, so one Regex serves many threads.
class Regex {
 public:
  // InvalidArgument with PCRE2's message if `pattern` does not compile.
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(
      std::string_view pattern);
  // A pattern that matches `text` literally.
  static absl::StatusOr<std::unique_ptr<Regex>> Literal(std::string_view text);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // The non-overlapping matches in `subject` (valid UTF-8), left to right, as
  // [begin, end) byte offsets. After an empty match the search resumes one
  // character later.
  std::vector<std::pair<size_t, size_t>> FindAll(
      std::string_view subject) const;

 private:
  explicit Regex(pcre2_real_code_8* code) : code_(code) {}
  pcre2_real_code_8* code_;  // Owned.
};

// A tokenizer.json pattern object: {"String": "..."} or {"Regex": "..."}.
absl::StatusOr<std::unique_ptr<Regex>> ParsePattern(const JsonReader& pattern);

// The 256 printable characters GPT-2's byte-level BPE uses for bytes
// (bytes_to_unicode): ByteLevelChar(b) is the UTF-8 of the character for byte
// b.
std::string_view ByteLevelChar(uint8_t b);
// The byte a byte-level character stands for, or -1 if `cp` is not one.
int ByteLevelByte(char32_t cp);

// Debian's Abseil has its own string_view type; this converts for absl calls.
inline absl::string_view AbslView(std::string_view s) {
  return {s.data(), s.size()};
}

// --- Normalizers --------------------------------------------------------

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual std::string Normalize(std::string_view text) const = 0;
};

// Supports NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Strip, Sequence.
absl::StatusOr<std::unique_ptr<Normalizer>> ParseNormalizer(
    const JsonReader& json);

// --- Pre-tokenizers -----------------------------------------------------

// One piece of text on its way to the model. `at_start` is true for the piece
// that begins at offset 0 of the input (Metaspace's prepend_scheme "first").
struct PreToken {
  std::string text;
  bool at_start = false;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces `pieces` by their split (and possibly rewritten) parts, in order.
  // Empty parts are dropped.
  virtual void PreTokenize(std::vector<PreToken>* pieces) const = 0;
};

// Supports ByteLevel, Split, Digits, Metaspace, Whitespace, WhitespaceSplit,
// Sequence.
absl::StatusOr<std::unique_ptr<PreTokenizer>> ParsePreTokenizer(
    const JsonReader& json);

// --- Decoders -----------------------------------------------------------

class Decoder {
 public:
  virtual ~Decoder() = default;
  // Rewrites the token strings in place (the `decode_chain` of the crate).
  // Joining the result gives the text; it may not be valid UTF-8 only if the
  // input tokens were not.
  virtual void DecodeChain(std::vector<std::string>* tokens) const = 0;
};

// Supports ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace,
// BPEDecoder, Sequence.
absl::StatusOr<std::unique_ptr<Decoder>> ParseDecoder(const JsonReader& json);

// --- Post-processors ----------------------------------------------------

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // Adds the special tokens of a single sequence around `ids`.
  virtual void Process(std::vector<int32_t>* ids) const = 0;
  // The id this processor puts first, if it puts a special token first.
  virtual std::optional<int32_t> LeadingSpecialId() const = 0;
};

// Supports TemplateProcessing, ByteLevel (adds nothing), RobertaProcessing,
// BertProcessing, Sequence.
absl::StatusOr<std::unique_ptr<PostProcessor>> ParsePostProcessor(
    const JsonReader& json);

}  // namespace tokenizer_internal
}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_TEXT_TOKENIZER_PIPELINE_H_

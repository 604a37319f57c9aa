#include "common/text/tokenizer_pipeline.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/base/status.h"
#include "common/text/unicode_util.h"

namespace knapserve {
namespace tokenizer_internal {

namespace {

// Unimplemented "unsupported <what> type '<type>'", naming the component.
absl::Status Unsupported(const JsonReader& component, absl::string_view what,
                         absl::string_view type) {
  return component.Annotate(absl::UnimplementedError(
      absl::StrCat("unsupported ", what, " type '", type, "'")));
}

// The component's "type": it must be an object with a string "type".
absl::StatusOr<std::string> ComponentType(const JsonReader& component) {
  RETURN_IF_ERROR(component.ExpectObject());
  return component.RequiredString("type");
}

// The single character of a one-character string field (Metaspace's
// replacement, Strip's content).
absl::StatusOr<std::string> SingleChar(const JsonReader& obj,
                                       std::string_view key,
                                       std::string_view fallback) {
  ASSIGN_OR_RETURN(std::string s, obj.OptionalString(key, fallback));
  size_t pos = 0;
  if (s.empty() || !IsValidUtf8(s) ||
      (NextCodePoint(s, &pos), pos != s.size())) {
    return obj.FieldError(key, "must be a single character");
  }
  return s;
}

// Replaces every match of `pattern` in `text` by `content`.
std::string ReplaceAll(const Regex& pattern, std::string_view text,
                       std::string_view content) {
  std::vector<std::pair<size_t, size_t>> matches = pattern.FindAll(text);
  if (matches.empty()) return std::string(text);
  std::string out;
  out.reserve(text.size() + matches.size() * content.size());
  size_t prev = 0;
  for (const auto& [begin, end] : matches) {
    out.append(text.substr(prev, begin - prev));
    out.append(content);
    prev = end;
  }
  out.append(text.substr(prev));
  return out;
}

}  // namespace

// --- Regex ----------------------------------------------------------------

namespace {

absl::StatusOr<pcre2_code*> CompilePcre2(std::string_view pattern,
                                         uint32_t options) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()),
                                   pattern.size(), PCRE2_UTF | options,
                                   &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    return absl::InvalidArgumentError(absl::StrCat(
        "bad regex '", AbslView(pattern), "' at offset ", error_offset, ": ",
        reinterpret_cast<const char*>(message)));
  }
  // JIT is an optimization only; the interpreter is used if it is unavailable.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return code;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Regex>> Regex::Compile(
    std::string_view pattern) {
  ASSIGN_OR_RETURN(pcre2_code * code, CompilePcre2(pattern, PCRE2_UCP));
  return std::unique_ptr<Regex>(new Regex(code));
}

absl::StatusOr<std::unique_ptr<Regex>> Regex::Literal(std::string_view text) {
  ASSIGN_OR_RETURN(pcre2_code * code, CompilePcre2(text, PCRE2_LITERAL));
  return std::unique_ptr<Regex>(new Regex(code));
}

Regex::~Regex() { pcre2_code_free(code_); }

std::vector<std::pair<size_t, size_t>> Regex::FindAll(
    std::string_view subject) const {
  std::vector<std::pair<size_t, size_t>> matches;
  static constexpr char kEmpty[] = "";
  const auto* data =
      reinterpret_cast<PCRE2_SPTR>(subject.empty() ? kEmpty : subject.data());
  pcre2_match_data* match_data =
      pcre2_match_data_create_from_pattern(code_, nullptr);
  size_t start = 0;
  while (start <= subject.size()) {
    const int rc = pcre2_match(code_, data, subject.size(), start,
                               PCRE2_NO_UTF_CHECK, match_data, nullptr);
    if (rc < 0)
      break;  // No match (or a resource limit, which these patterns do not
              // reach).
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match_data);
    const size_t begin = ovector[0], end = ovector[1];
    matches.emplace_back(begin, end);
    if (end > begin) {
      start = end;
    } else {
      if (end >= subject.size()) break;
      size_t next = end;
      NextCodePoint(subject, &next);
      start = next;
    }
  }
  pcre2_match_data_free(match_data);
  return matches;
}

absl::StatusOr<std::unique_ptr<Regex>> ParsePattern(const JsonReader& pattern) {
  // A "String" that is not a string falls through to "Regex", as it always did.
  const JsonReader literal = pattern.Field("String");
  if (literal.value().is_string()) {
    ASSIGN_OR_RETURN(const std::string text, literal.AsString());
    absl::StatusOr<std::unique_ptr<Regex>> regex = Regex::Literal(text);
    if (!regex.ok()) return literal.Annotate(regex.status());
    return regex;
  }
  if (pattern.Has("Regex")) {
    const JsonReader expression = pattern.Field("Regex");
    ASSIGN_OR_RETURN(const std::string text, expression.AsString());
    absl::StatusOr<std::unique_ptr<Regex>> regex = Regex::Compile(text);
    if (!regex.ok()) return expression.Annotate(regex.status());
    return regex;
  }
  if (pattern.Has("String")) return literal.TypeError("a string");
  return pattern.TypeError("a pattern {\"String\": ...} or {\"Regex\": ...}");
}

// --- Byte-level alphabet --------------------------------------------------

namespace {

struct ByteLevelTables {
  std::array<std::string, 256> byte_to_char;
  std::array<int16_t, 512>
      char_to_byte;  // All byte-level code points are < 512.

  ByteLevelTables() {
    char_to_byte.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      const char32_t cp = printable ? static_cast<char32_t>(b)
                                    : static_cast<char32_t>(256 + n++);
      AppendUtf8(cp, &byte_to_char[b]);
      char_to_byte[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelTables& GetByteLevelTables() {
  static const ByteLevelTables* tables = new ByteLevelTables();
  return *tables;
}

}  // namespace

std::string_view ByteLevelChar(uint8_t b) {
  return GetByteLevelTables().byte_to_char[b];
}

int ByteLevelByte(char32_t cp) {
  return cp < 512 ? GetByteLevelTables().char_to_byte[cp] : -1;
}

// --- Normalizers ----------------------------------------------------------

namespace {

class UnicodeFormNormalizer : public Normalizer {
 public:
  explicit UnicodeFormNormalizer(NormalizationForm form) : form_(form) {}
  std::string Normalize(std::string_view text) const override {
    return NormalizeUnicode(text, form_);
  }

 private:
  NormalizationForm form_;
};

class LowercaseNormalizer : public Normalizer {
 public:
  std::string Normalize(std::string_view text) const override {
    return ToLowerUnicode(text);
  }
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prepend)
      : prepend_(std::move(prepend)) {}
  std::string Normalize(std::string_view text) const override {
    if (text.empty()) return std::string();
    return absl::StrCat(prepend_, AbslView(text));
  }

 private:
  std::string prepend_;
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(std::unique_ptr<Regex> pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  std::string Normalize(std::string_view text) const override {
    return ReplaceAll(*pattern_, text, content_);
  }

 private:
  std::unique_ptr<Regex> pattern_;
  std::string content_;
};

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  std::string Normalize(std::string_view text) const override {
    size_t begin = 0, end = text.size();
    if (left_) {
      while (begin < end) {
        size_t next = begin;
        if (!IsUnicodeWhitespace(NextCodePoint(text, &next))) break;
        begin = next;
      }
    }
    if (right_) {
      while (end > begin) {
        size_t prev = end;
        if (!IsUnicodeWhitespace(PrevCodePoint(text, &prev))) break;
        end = prev;
      }
    }
    return std::string(text.substr(begin, end - begin));
  }

 private:
  bool left_, right_;
};

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(
      std::vector<std::unique_ptr<Normalizer>> normalizers)
      : normalizers_(std::move(normalizers)) {}
  std::string Normalize(std::string_view text) const override {
    std::string current(text);
    for (const auto& normalizer : normalizers_)
      current = normalizer->Normalize(current);
    return current;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> normalizers_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Normalizer>> ParseNormalizer(
    const JsonReader& json) {
  if (json.is_null()) return nullptr;
  ASSIGN_OR_RETURN(const std::string type, ComponentType(json));
  if (type == "NFC")
    return std::make_unique<UnicodeFormNormalizer>(NormalizationForm::kNfc);
  if (type == "NFD")
    return std::make_unique<UnicodeFormNormalizer>(NormalizationForm::kNfd);
  if (type == "NFKC")
    return std::make_unique<UnicodeFormNormalizer>(NormalizationForm::kNfkc);
  if (type == "NFKD")
    return std::make_unique<UnicodeFormNormalizer>(NormalizationForm::kNfkd);
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "Prepend") {
    ASSIGN_OR_RETURN(std::string prepend, json.RequiredString("prepend"));
    return std::make_unique<PrependNormalizer>(std::move(prepend));
  }
  if (type == "Replace") {
    ASSIGN_OR_RETURN(std::unique_ptr<Regex> pattern,
                     ParsePattern(json.Field("pattern")));
    ASSIGN_OR_RETURN(std::string content, json.RequiredString("content"));
    return std::make_unique<ReplaceNormalizer>(std::move(pattern),
                                               std::move(content));
  }
  if (type == "Strip") {
    ASSIGN_OR_RETURN(bool left, json.OptionalBool("strip_left", true));
    ASSIGN_OR_RETURN(bool right, json.OptionalBool("strip_right", true));
    return std::make_unique<StripNormalizer>(left, right);
  }
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const std::vector<JsonReader> items,
                     json.RequiredArray("normalizers"));
    std::vector<std::unique_ptr<Normalizer>> normalizers;
    for (const JsonReader& item : items) {
      ASSIGN_OR_RETURN(std::unique_ptr<Normalizer> normalizer,
                       ParseNormalizer(item));
      if (normalizer != nullptr) normalizers.push_back(std::move(normalizer));
    }
    return std::make_unique<SequenceNormalizer>(std::move(normalizers));
  }
  return Unsupported(json, "normalizer", type);
}

// --- Pre-tokenizers -------------------------------------------------------

namespace {

enum class SplitBehavior {
  kRemoved,
  kIsolated,
  kMergedWithPrevious,
  kMergedWithNext,
  kContiguous
};

absl::StatusOr<SplitBehavior> ParseBehavior(const JsonReader& obj) {
  ASSIGN_OR_RETURN(const std::string name,
                   obj.OptionalString("behavior", "Isolated"));
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  return obj.FieldError("behavior",
                        absl::StrCat("unknown behavior '", name, "'"));
}

struct Span {
  size_t begin, end;
  bool is_match;
};

// The crate's NormalizedString::split: `matches` are the pattern's matches in
// a text of `length` bytes. Returns the [begin, end) ranges to keep, non-empty.
std::vector<std::pair<size_t, size_t>> SplitRanges(
    size_t length, const std::vector<std::pair<size_t, size_t>>& matches,
    bool invert, SplitBehavior behavior) {
  std::vector<Span> spans;
  if (length == 0) {
    spans.push_back({0, 0, false});
  } else {
    size_t prev = 0;
    for (const auto& [begin, end] : matches) {
      if (prev != begin) spans.push_back({prev, begin, false});
      spans.push_back({begin, end, true});
      prev = end;
    }
    if (prev != length) spans.push_back({prev, length, false});
  }
  if (invert) {
    for (Span& span : spans) span.is_match = !span.is_match;
  }
  std::vector<Span> merged;
  switch (behavior) {
    case SplitBehavior::kRemoved:
      merged = std::move(spans);
      break;
    case SplitBehavior::kIsolated:
      merged = std::move(spans);
      for (Span& span : merged) span.is_match = false;
      break;
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const Span& span : spans) {
        if (span.is_match == previous_match && !merged.empty()) {
          merged.back().end = span.end;
        } else {
          merged.push_back({span.begin, span.end, false});
        }
        previous_match = span.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Span& span : spans) {
        if (span.is_match && !previous_match && !merged.empty()) {
          merged.back().end = span.end;
        } else {
          merged.push_back({span.begin, span.end, false});
        }
        previous_match = span.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous_match && !merged.empty()) {
          merged.back().begin = it->begin;
        } else {
          merged.push_back({it->begin, it->end, false});
        }
        previous_match = it->is_match;
      }
      std::reverse(merged.begin(), merged.end());
      break;
    }
  }
  std::vector<std::pair<size_t, size_t>> ranges;
  ranges.reserve(merged.size());
  for (const Span& span : merged) {
    if (!span.is_match && span.end > span.begin)
      ranges.emplace_back(span.begin, span.end);
  }
  return ranges;
}

// Splits every piece by `pattern`, keeping the parts SplitRanges keeps.
void SplitPieces(const Regex& pattern, bool invert, SplitBehavior behavior,
                 std::vector<PreToken>* pieces) {
  std::vector<PreToken> out;
  out.reserve(pieces->size());
  for (PreToken& piece : *pieces) {
    const auto ranges = SplitRanges(
        piece.text.size(), pattern.FindAll(piece.text), invert, behavior);
    if (ranges.size() == 1 && ranges[0].first == 0 &&
        ranges[0].second == piece.text.size()) {
      out.push_back(std::move(piece));
      continue;
    }
    for (const auto& [begin, end] : ranges) {
      out.push_back({piece.text.substr(begin, end - begin),
                     piece.at_start && begin == 0});
    }
  }
  *pieces = std::move(out);
}

class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(std::unique_ptr<Regex> pattern, SplitBehavior behavior,
                    bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void PreTokenize(std::vector<PreToken>* pieces) const override {
    SplitPieces(*pattern_, invert_, behavior_, pieces);
  }

 private:
  std::unique_ptr<Regex> pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

// GPT-2's pre-tokenization regex, which ByteLevel uses when use_regex is set.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::unique_ptr<Regex> regex)
      : add_prefix_space_(add_prefix_space), regex_(std::move(regex)) {}
  void PreTokenize(std::vector<PreToken>* pieces) const override {
    if (add_prefix_space_) {
      for (PreToken& piece : *pieces) {
        if (piece.text.empty() || piece.text[0] != ' ')
          piece.text.insert(0, 1, ' ');
      }
    }
    if (regex_ != nullptr)
      SplitPieces(*regex_, false, SplitBehavior::kIsolated, pieces);
    for (PreToken& piece : *pieces) {
      std::string mapped;
      mapped.reserve(piece.text.size() * 2);
      for (char c : piece.text)
        mapped.append(ByteLevelChar(static_cast<uint8_t>(c)));
      piece.text = std::move(mapped);
    }
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Regex> regex_;  // Null when use_regex is false.
};

class DigitsPreTokenizer : public PreTokenizer {
 public:
  DigitsPreTokenizer(std::unique_ptr<Regex> digit, bool individual)
      : digit_(std::move(digit)), individual_(individual) {}
  void PreTokenize(std::vector<PreToken>* pieces) const override {
    SplitPieces(
        *digit_, false,
        individual_ ? SplitBehavior::kIsolated : SplitBehavior::kContiguous,
        pieces);
  }

 private:
  std::unique_ptr<Regex> digit_;  // One numeric character.
  bool individual_;
};

enum class PrependScheme { kAlways, kFirst, kNever };

absl::StatusOr<PrependScheme> ParsePrependScheme(const JsonReader& obj) {
  if (obj.Has("prepend_scheme")) {
    ASSIGN_OR_RETURN(const std::string name,
                     obj.RequiredString("prepend_scheme"));
    if (name == "always") return PrependScheme::kAlways;
    if (name == "first") return PrependScheme::kFirst;
    if (name == "never") return PrependScheme::kNever;
    return obj.FieldError("prepend_scheme",
                          absl::StrCat("unknown prepend_scheme '", name, "'"));
  }
  // The older form.
  ASSIGN_OR_RETURN(bool add_prefix_space,
                   obj.OptionalBool("add_prefix_space", true));
  return add_prefix_space ? PrependScheme::kAlways : PrependScheme::kNever;
}

class MetaspacePreTokenizer : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme,
                        std::unique_ptr<Regex> space,
                        std::unique_ptr<Regex> replacement_regex)
      : replacement_(std::move(replacement)),
        scheme_(scheme),
        space_(std::move(space)),
        replacement_regex_(std::move(replacement_regex)) {}
  void PreTokenize(std::vector<PreToken>* pieces) const override {
    for (PreToken& piece : *pieces) {
      piece.text = ReplaceAll(*space_, piece.text, replacement_);
      const bool prepend =
          (scheme_ == PrependScheme::kAlways ||
           (scheme_ == PrependScheme::kFirst && piece.at_start)) &&
          piece.text.compare(0, replacement_.size(), replacement_) != 0;
      if (prepend) piece.text.insert(0, replacement_);
    }
    if (replacement_regex_ != nullptr) {
      SplitPieces(*replacement_regex_, false, SplitBehavior::kMergedWithNext,
                  pieces);
    }
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  std::unique_ptr<Regex> space_;  // Literal " ".
  std::unique_ptr<Regex>
      replacement_regex_;  // Literal replacement; null if split is false.
};

class SequencePreTokenizer : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(
      std::vector<std::unique_ptr<PreTokenizer>> pre_tokenizers)
      : pre_tokenizers_(std::move(pre_tokenizers)) {}
  void PreTokenize(std::vector<PreToken>* pieces) const override {
    for (const auto& pre_tokenizer : pre_tokenizers_)
      pre_tokenizer->PreTokenize(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> pre_tokenizers_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PreTokenizer>> ParsePreTokenizer(
    const JsonReader& json) {
  if (json.is_null()) return nullptr;
  ASSIGN_OR_RETURN(const std::string type, ComponentType(json));
  if (type == "ByteLevel") {
    ASSIGN_OR_RETURN(bool add_prefix_space,
                     json.OptionalBool("add_prefix_space", true));
    ASSIGN_OR_RETURN(bool use_regex, json.OptionalBool("use_regex", true));
    std::unique_ptr<Regex> regex;
    if (use_regex) {
      ASSIGN_OR_RETURN(regex, Regex::Compile(kGpt2Pattern));
    }
    return std::make_unique<ByteLevelPreTokenizer>(add_prefix_space,
                                                   std::move(regex));
  }
  if (type == "Split") {
    ASSIGN_OR_RETURN(std::unique_ptr<Regex> pattern,
                     ParsePattern(json.Field("pattern")));
    ASSIGN_OR_RETURN(SplitBehavior behavior, ParseBehavior(json));
    ASSIGN_OR_RETURN(bool invert, json.OptionalBool("invert", false));
    return std::make_unique<SplitPreTokenizer>(std::move(pattern), behavior,
                                               invert);
  }
  if (type == "Digits") {
    ASSIGN_OR_RETURN(bool individual,
                     json.OptionalBool("individual_digits", false));
    ASSIGN_OR_RETURN(std::unique_ptr<Regex> digit, Regex::Compile(R"(\p{N})"));
    return std::make_unique<DigitsPreTokenizer>(std::move(digit), individual);
  }
  if (type == "Metaspace") {
    ASSIGN_OR_RETURN(std::string replacement,
                     SingleChar(json, "replacement", "\xE2\x96\x81"));
    ASSIGN_OR_RETURN(PrependScheme scheme, ParsePrependScheme(json));
    ASSIGN_OR_RETURN(bool split, json.OptionalBool("split", true));
    ASSIGN_OR_RETURN(std::unique_ptr<Regex> space, Regex::Literal(" "));
    std::unique_ptr<Regex> replacement_regex;
    if (split) {
      ASSIGN_OR_RETURN(replacement_regex, Regex::Literal(replacement));
    }
    return std::make_unique<MetaspacePreTokenizer>(
        std::move(replacement), scheme, std::move(space),
        std::move(replacement_regex));
  }
  if (type == "Whitespace") {
    ASSIGN_OR_RETURN(std::unique_ptr<Regex> words,
                     Regex::Compile(R"(\w+|[^\w\s]+)"));
    return std::make_unique<SplitPreTokenizer>(std::move(words),
                                               SplitBehavior::kRemoved,
                                               /*invert=*/true);
  }
  if (type == "WhitespaceSplit") {
    ASSIGN_OR_RETURN(std::unique_ptr<Regex> spaces, Regex::Compile(R"(\s+)"));
    return std::make_unique<SplitPreTokenizer>(std::move(spaces),
                                               SplitBehavior::kRemoved,
                                               /*invert=*/false);
  }
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const std::vector<JsonReader> items,
                     json.RequiredArray("pretokenizers"));
    std::vector<std::unique_ptr<PreTokenizer>> pre_tokenizers;
    for (const JsonReader& item : items) {
      ASSIGN_OR_RETURN(std::unique_ptr<PreTokenizer> pre_tokenizer,
                       ParsePreTokenizer(item));
      if (pre_tokenizer != nullptr)
        pre_tokenizers.push_back(std::move(pre_tokenizer));
    }
    return std::make_unique<SequencePreTokenizer>(std::move(pre_tokenizers));
  }
  return Unsupported(json, "pre_tokenizer", type);
}

// --- Decoders -------------------------------------------------------------

namespace {

class ByteLevelDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::string bytes;
    for (const std::string& token : *tokens) {
      const size_t mark = bytes.size();
      bool mapped = IsValidUtf8(token);
      size_t pos = 0;
      while (mapped && pos < token.size()) {
        const int b = ByteLevelByte(NextCodePoint(token, &pos));
        if (b < 0) {
          mapped = false;
        } else {
          bytes.push_back(static_cast<char>(b));
        }
      }
      if (!mapped) {
        // Not a byte-level token (e.g. an added token with other characters):
        // its own bytes, as the crate does.
        bytes.resize(mark);
        bytes.append(token);
      }
    }
    tokens->assign(1, Utf8Lossy(bytes));
  }
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(std::unique_ptr<Regex> pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& token : *tokens)
      token = ReplaceAll(*pattern_, token, content_);
  }

 private:
  std::unique_ptr<Regex> pattern_;
  std::string content_;
};

// The byte of a "<0xNN>" token, or -1.
int ByteFallbackByte(std::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>')
    return -1;
  int value = 0;
  for (size_t i = 3; i < 5; ++i) {
    const char c = token[i];
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      digit = c - 'A' + 10;
    } else {
      return -1;
    }
    value = value * 16 + digit;
  }
  return value;
}

class ByteFallbackDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens->size());
    std::string pending;  // Bytes of consecutive <0xNN> tokens.
    // The Rust crate turns a whole run that is not valid UTF-8 into one
    // U+FFFD per byte; we replace only the ill-formed parts, as Tokenizers.js
    // (TextDecoder) does. Valid runs decode the same either way, and this way
    // later bytes never change the text of earlier ones, which streaming needs.
    const auto flush = [&] {
      if (pending.empty()) return;
      out.push_back(Utf8Lossy(pending));
      pending.clear();
    };
    for (std::string& token : *tokens) {
      const int b = ByteFallbackByte(token);
      if (b >= 0) {
        pending.push_back(static_cast<char>(b));
      } else {
        flush();
        out.push_back(std::move(token));
      }
    }
    flush();
    *tokens = std::move(out);
  }
};

class FuseDecoder : public Decoder {
 public:
  void DecodeChain(std::vector<std::string>* tokens) const override {
    std::string joined;
    for (const std::string& token : *tokens) joined.append(token);
    tokens->assign(1, std::move(joined));
  }
};

class StripDecoder : public Decoder {
 public:
  StripDecoder(std::string content, size_t start, size_t stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (std::string& token : *tokens) {
      const std::string_view view(token);
      size_t begin = 0, end = view.size();
      for (size_t i = 0; i < start_ && begin < end; ++i) {
        if (view.substr(begin, content_.size()) != content_) break;
        begin += content_.size();
      }
      for (size_t i = 0; i < stop_ && end >= begin + content_.size(); ++i) {
        if (view.substr(end - content_.size(), content_.size()) != content_)
          break;
        end -= content_.size();
      }
      token = std::string(view.substr(begin, end - begin));
    }
  }

 private:
  std::string content_;  // One character.
  size_t start_, stop_;
};

class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, PrependScheme scheme)
      : replacement_(std::move(replacement)), scheme_(scheme) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (size_t i = 0; i < tokens->size(); ++i) {
      std::string& token = (*tokens)[i];
      const std::string_view with =
          (i == 0 && scheme_ != PrependScheme::kNever) ? "" : " ";
      std::string out;
      out.reserve(token.size());
      size_t pos = 0;
      while (pos < token.size()) {
        const size_t at = token.find(replacement_, pos);
        if (at == std::string::npos) {
          out.append(token, pos, std::string::npos);
          break;
        }
        out.append(token, pos, at - pos);
        out.append(with);
        pos = at + replacement_.size();
      }
      token = std::move(out);
    }
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
};

class BpeSuffixDecoder : public Decoder {
 public:
  explicit BpeSuffixDecoder(std::string suffix) : suffix_(std::move(suffix)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    if (suffix_.empty()) return;
    for (size_t i = 0; i < tokens->size(); ++i) {
      std::string& token = (*tokens)[i];
      const std::string_view with = i + 1 == tokens->size() ? "" : " ";
      std::string out;
      size_t pos = 0;
      while (pos < token.size()) {
        const size_t at = token.find(suffix_, pos);
        if (at == std::string::npos) {
          out.append(token, pos, std::string::npos);
          break;
        }
        out.append(token, pos, at - pos);
        out.append(with);
        pos = at + suffix_.size();
      }
      token = std::move(out);
    }
  }

 private:
  std::string suffix_;
};

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> decoders)
      : decoders_(std::move(decoders)) {}
  void DecodeChain(std::vector<std::string>* tokens) const override {
    for (const auto& decoder : decoders_) decoder->DecodeChain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> decoders_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Decoder>> ParseDecoder(const JsonReader& json) {
  if (json.is_null()) return nullptr;
  ASSIGN_OR_RETURN(const std::string type, ComponentType(json));
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Replace") {
    ASSIGN_OR_RETURN(std::unique_ptr<Regex> pattern,
                     ParsePattern(json.Field("pattern")));
    ASSIGN_OR_RETURN(std::string content, json.RequiredString("content"));
    return std::make_unique<ReplaceDecoder>(std::move(pattern),
                                            std::move(content));
  }
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    ASSIGN_OR_RETURN(std::string content, SingleChar(json, "content", " "));
    ASSIGN_OR_RETURN(int64_t start, json.OptionalInt64("start", 0));
    ASSIGN_OR_RETURN(int64_t stop, json.OptionalInt64("stop", 0));
    if (start < 0)
      return json.FieldError("start",
                             absl::StrCat("must be >= 0, got ", start));
    if (stop < 0)
      return json.FieldError("stop", absl::StrCat("must be >= 0, got ", stop));
    return std::make_unique<StripDecoder>(std::move(content),
                                          static_cast<size_t>(start),
                                          static_cast<size_t>(stop));
  }
  if (type == "Metaspace") {
    ASSIGN_OR_RETURN(std::string replacement,
                     SingleChar(json, "replacement", "\xE2\x96\x81"));
    ASSIGN_OR_RETURN(PrependScheme scheme, ParsePrependScheme(json));
    return std::make_unique<MetaspaceDecoder>(std::move(replacement), scheme);
  }
  if (type == "BPEDecoder") {
    ASSIGN_OR_RETURN(std::string suffix, json.OptionalString("suffix", "</w>"));
    return std::make_unique<BpeSuffixDecoder>(std::move(suffix));
  }
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const std::vector<JsonReader> items,
                     json.RequiredArray("decoders"));
    std::vector<std::unique_ptr<Decoder>> decoders;
    for (const JsonReader& item : items) {
      ASSIGN_OR_RETURN(std::unique_ptr<Decoder> decoder, ParseDecoder(item));
      if (decoder != nullptr) decoders.push_back(std::move(decoder));
    }
    return std::make_unique<SequenceDecoder>(std::move(decoders));
  }
  return Unsupported(json, "decoder", type);
}

// --- Post-processors ------------------------------------------------------

namespace {

// Special ids before and after the sequence.
class WrapProcessor : public PostProcessor {
 public:
  WrapProcessor(std::vector<int32_t> before, std::vector<int32_t> after)
      : before_(std::move(before)), after_(std::move(after)) {}
  void Process(std::vector<int32_t>* ids) const override {
    ids->insert(ids->begin(), before_.begin(), before_.end());
    ids->insert(ids->end(), after_.begin(), after_.end());
  }
  std::optional<int32_t> LeadingSpecialId() const override {
    if (before_.empty()) return std::nullopt;
    return before_.front();
  }

 private:
  std::vector<int32_t> before_, after_;
};

class SequenceProcessor : public PostProcessor {
 public:
  explicit SequenceProcessor(
      std::vector<std::unique_ptr<PostProcessor>> processors)
      : processors_(std::move(processors)) {}
  void Process(std::vector<int32_t>* ids) const override {
    for (const auto& processor : processors_) processor->Process(ids);
  }
  std::optional<int32_t> LeadingSpecialId() const override {
    std::optional<int32_t> leading;
    for (const auto& processor : processors_) {
      if (auto id = processor->LeadingSpecialId(); id.has_value()) leading = id;
    }
    return leading;
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> processors_;
};

absl::StatusOr<std::unique_ptr<PostProcessor>> ParseTemplate(
    const JsonReader& json) {
  // Special token name -> ids. A "special_tokens" that is not an object is
  // ignored, as it always was (a template naming a token then fails below).
  std::map<std::string, std::vector<int32_t>> special;
  const JsonReader specials = json.Field("special_tokens");
  if (specials.value().is_object()) {
    ASSIGN_OR_RETURN(const auto members, specials.AsMembers());
    for (const auto& [name, entry] : members) {
      RETURN_IF_ERROR(entry.ExpectObject());
      ASSIGN_OR_RETURN(const std::vector<JsonReader> ids,
                       entry.RequiredArray("ids"));
      std::vector<int32_t>& out = special[name];
      for (const JsonReader& id : ids) {
        ASSIGN_OR_RETURN(int value, id.AsInt());
        out.push_back(value);
      }
    }
  }
  // The template's pieces as (is_sequence, special name).
  std::vector<std::pair<bool, std::string>> pieces;
  if (!json.value().contains("single"))
    return json.FieldError("single", "required but missing");
  const JsonReader single = json.Field("single");
  if (single.value().is_string()) {
    ASSIGN_OR_RETURN(const std::string text, single.AsString());
    // The string form: "<s> $A" / "[CLS]:0 $A:0 [SEP]:0".
    for (absl::string_view piece :
         absl::StrSplit(text, ' ', absl::SkipEmpty())) {
      std::string_view word(piece.data(), piece.size());
      // Drop a ":<type id>" suffix.
      const size_t colon = word.rfind(':');
      if (colon != std::string_view::npos && colon > 0 &&
          colon + 1 < word.size() &&
          word.find_first_not_of("0123456789", colon + 1) ==
              std::string_view::npos) {
        word = word.substr(0, colon);
      }
      if (!word.empty() && word[0] == '$') {
        pieces.emplace_back(true, "");
      } else {
        pieces.emplace_back(false, std::string(word));
      }
    }
  } else if (single.value().is_array()) {
    ASSIGN_OR_RETURN(const std::vector<JsonReader> items, single.AsArray());
    for (const JsonReader& item : items) {
      if (item.value().is_object() && item.value().contains("Sequence")) {
        pieces.emplace_back(true, "");
      } else if (item.value().is_object() &&
                 item.value().contains("SpecialToken")) {
        ASSIGN_OR_RETURN(const JsonReader special_token,
                         item.Child("SpecialToken"));
        ASSIGN_OR_RETURN(std::string name, special_token.RequiredString("id"));
        pieces.emplace_back(false, std::move(name));
      } else {
        return item.TypeError(
            "a template piece {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
  } else {
    return single.TypeError("a template string or list");
  }
  std::vector<int32_t> before, after;
  bool seen_sequence = false;
  for (const auto& [is_sequence, name] : pieces) {
    if (is_sequence) {
      if (seen_sequence) {
        return single.Annotate(absl::UnimplementedError(
            "a single template with two sequences is not supported"));
      }
      seen_sequence = true;
      continue;
    }
    auto it = special.find(name);
    if (it == special.end()) {
      return single.Error(
          absl::StrCat("template names unknown special token '", name, "'"));
    }
    std::vector<int32_t>& target = seen_sequence ? after : before;
    target.insert(target.end(), it->second.begin(), it->second.end());
  }
  return std::make_unique<WrapProcessor>(std::move(before), std::move(after));
}

// RobertaProcessing / BertProcessing: {"cls": ["<s>", 0], "sep": ["</s>", 2]}.
absl::StatusOr<std::unique_ptr<PostProcessor>> ParseClsSep(
    const JsonReader& json) {
  std::vector<int32_t> ids;
  for (const char* key : {"cls", "sep"}) {
    ASSIGN_OR_RETURN(const std::vector<JsonReader> pair,
                     json.RequiredArray(key));
    if (pair.size() != 2) return json.Field(key).TypeError("[token, id]");
    ASSIGN_OR_RETURN(int id, pair[1].AsInt());
    ids.push_back(id);
  }
  return std::make_unique<WrapProcessor>(std::vector<int32_t>{ids[0]},
                                         std::vector<int32_t>{ids[1]});
}

}  // namespace

absl::StatusOr<std::unique_ptr<PostProcessor>> ParsePostProcessor(
    const JsonReader& json) {
  if (json.is_null()) return nullptr;
  ASSIGN_OR_RETURN(const std::string type, ComponentType(json));
  if (type == "TemplateProcessing") return ParseTemplate(json);
  if (type == "ByteLevel") {
    return std::make_unique<WrapProcessor>(std::vector<int32_t>{},
                                           std::vector<int32_t>{});
  }
  if (type == "RobertaProcessing" || type == "BertProcessing")
    return ParseClsSep(json);
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const std::vector<JsonReader> items,
                     json.RequiredArray("processors"));
    std::vector<std::unique_ptr<PostProcessor>> processors;
    for (const JsonReader& item : items) {
      ASSIGN_OR_RETURN(std::unique_ptr<PostProcessor> processor,
                       ParsePostProcessor(item));
      if (processor != nullptr) processors.push_back(std::move(processor));
    }
    return std::make_unique<SequenceProcessor>(std::move(processors));
  }
  return Unsupported(json, "post_processor", type);
}

}  // namespace tokenizer_internal
}  // namespace knapserve

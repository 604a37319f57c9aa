// Tokenizer and IncrementalDecoder.
//
// Build dependencies (Debian packages): libpcre2-dev (regexes),
// libutf8proc-dev (Unicode normalization and classes), nlohmann-json3-dev.
#include "common/text/tokenizer.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/file_util.h"
#include "common/base/json_fields.h"
#include "common/base/status.h"
#include "common/text/tokenizer_bpe.h"
#include "common/text/tokenizer_pipeline.h"
#include "common/text/unicode_util.h"
#include "nlohmann/json.hpp"

namespace knapserve {
namespace tokenizer_internal {

// Leftmost-longest exact matching of the added tokens' strings (what the crate
// does with Aho-Corasick), as a byte trie. Immutable once built.
class AddedTokenMatcher {
 public:
  AddedTokenMatcher() : terminal_(1, -1) {}

  // Adds `pattern` (non-empty) for the added token with index `index`. The
  // first index added for a pattern wins.
  void Add(std::string_view pattern, int32_t index) {
    int32_t node = 0;
    for (char c : pattern) {
      const uint64_t key = ChildKey(node, c);
      auto it = children_.find(key);
      if (it == children_.end()) {
        const int32_t child = static_cast<int32_t>(terminal_.size());
        terminal_.push_back(-1);
        children_.emplace(key, child);
        node = child;
      } else {
        node = it->second;
      }
    }
    if (terminal_[node] < 0) terminal_[node] = index;
    first_byte_[static_cast<uint8_t>(pattern[0])] = true;
  }

  bool empty() const { return terminal_.size() == 1; }

  // The leftmost match starting at or after `from`, longest among those.
  bool FindNext(std::string_view text, size_t from, size_t* begin, size_t* end,
                int32_t* index) const {
    for (size_t start = from; start < text.size(); ++start) {
      if (!first_byte_[static_cast<uint8_t>(text[start])]) continue;
      int32_t node = 0;
      int32_t best = -1;
      size_t best_end = 0;
      for (size_t pos = start; pos < text.size(); ++pos) {
        auto it = children_.find(ChildKey(node, text[pos]));
        if (it == children_.end()) break;
        node = it->second;
        if (terminal_[node] >= 0) {
          best = terminal_[node];
          best_end = pos + 1;
        }
      }
      if (best >= 0) {
        *begin = start;
        *end = best_end;
        *index = best;
        return true;
      }
    }
    return false;
  }

 private:
  static uint64_t ChildKey(int32_t node, char c) {
    return (static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(c);
  }

  std::vector<int32_t> terminal_;  // Per node: added token index, or -1.
  absl::flat_hash_map<uint64_t, int32_t> children_;
  std::array<bool, 256> first_byte_{};
};

}  // namespace tokenizer_internal

namespace {

using tokenizer_internal::AddedTokenMatcher;

// Rust's regex \w, approximately: alphanumeric or '_'.
bool IsWordChar(char32_t cp) { return cp == '_' || IsUnicodeAlphanumeric(cp); }

// Start of the run of whitespace at the end of text[0:end].
size_t TrailingSpaceStart(std::string_view text, size_t end) {
  while (end > 0) {
    size_t prev = end;
    if (!IsUnicodeWhitespace(PrevCodePoint(text, &prev))) break;
    end = prev;
  }
  return end;
}

// End of the run of whitespace at the start of text[begin:].
size_t LeadingSpaceEnd(std::string_view text, size_t begin) {
  while (begin < text.size()) {
    size_t next = begin;
    if (!IsUnicodeWhitespace(NextCodePoint(text, &next))) break;
    begin = next;
  }
  return begin;
}

}  // namespace

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(
    const std::string& tokenizer_json_path) {
  ASSIGN_OR_RETURN(std::string contents, ReadFileToString(tokenizer_json_path));
  return FromJson(contents, tokenizer_json_path);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(
    std::string_view text, std::string_view source_name) {
  ASSIGN_OR_RETURN(const nlohmann::json json, ParseJsonText(text, source_name));
  const JsonReader root(json, std::string(source_name));
  RETURN_IF_ERROR(root.ExpectObject());

  // Every field is read through JsonReader, which names the file and the
  // field in its errors and lets no JSON exception escape.
  std::unique_ptr<Tokenizer> tokenizer(new Tokenizer());
  ASSIGN_OR_RETURN(tokenizer->normalizer_, tokenizer_internal::ParseNormalizer(
                                               root.Field("normalizer")));
  ASSIGN_OR_RETURN(
      tokenizer->pre_tokenizer_,
      tokenizer_internal::ParsePreTokenizer(root.Field("pre_tokenizer")));
  ASSIGN_OR_RETURN(const JsonReader model, root.Child("model"));
  ASSIGN_OR_RETURN(tokenizer->model_,
                   tokenizer_internal::BpeModel::FromJson(model));
  ASSIGN_OR_RETURN(
      tokenizer->post_processor_,
      tokenizer_internal::ParsePostProcessor(root.Field("post_processor")));
  ASSIGN_OR_RETURN(tokenizer->decoder_,
                   tokenizer_internal::ParseDecoder(root.Field("decoder")));

  ASSIGN_OR_RETURN(const std::vector<JsonReader> added,
                   root.OptionalArray("added_tokens"));
  int32_t vocab_size = tokenizer->model_->id_limit();
  for (const JsonReader& entry : added) {
    RETURN_IF_ERROR(entry.ExpectObject());
    AddedToken token;
    ASSIGN_OR_RETURN(token.content, entry.RequiredString("content"));
    ASSIGN_OR_RETURN(int64_t id, entry.RequiredInt64("id"));
    if (id < 0 || id >= (int64_t{1} << 24)) {
      return entry.FieldError("id",
                              absl::StrCat("must be in [0, 2^24), got ", id));
    }
    if (token.content.empty() || !IsValidUtf8(token.content)) {
      return entry.FieldError("content", "must be non-empty UTF-8");
    }
    token.id = static_cast<int32_t>(id);
    ASSIGN_OR_RETURN(token.special, entry.OptionalBool("special", false));
    ASSIGN_OR_RETURN(token.lstrip, entry.OptionalBool("lstrip", false));
    ASSIGN_OR_RETURN(token.rstrip, entry.OptionalBool("rstrip", false));
    ASSIGN_OR_RETURN(token.single_word,
                     entry.OptionalBool("single_word", false));
    ASSIGN_OR_RETURN(token.normalized,
                     entry.OptionalBool("normalized", !token.special));
    vocab_size = std::max(vocab_size, token.id + 1);
    const size_t index = tokenizer->added_tokens_.size();
    tokenizer->added_by_content_[token.content] = index;
    tokenizer->added_by_id_[token.id] = index;
    tokenizer->added_tokens_.push_back(std::move(token));
  }
  tokenizer->vocab_size_ = vocab_size;

  tokenizer->raw_matcher_ = std::make_unique<AddedTokenMatcher>();
  tokenizer->normalized_matcher_ = std::make_unique<AddedTokenMatcher>();
  for (size_t i = 0; i < tokenizer->added_tokens_.size(); ++i) {
    const AddedToken& token = tokenizer->added_tokens_[i];
    if (!token.normalized) {
      tokenizer->raw_matcher_->Add(token.content, static_cast<int32_t>(i));
      continue;
    }
    // As in the crate, normalized tokens are matched in normalized text by
    // their normalized form.
    const std::string pattern =
        tokenizer->normalizer_ != nullptr
            ? tokenizer->normalizer_->Normalize(token.content)
            : token.content;
    if (!pattern.empty())
      tokenizer->normalized_matcher_->Add(pattern, static_cast<int32_t>(i));
  }

  if (tokenizer->post_processor_ != nullptr) {
    tokenizer->bos_id_ = tokenizer->post_processor_->LeadingSpecialId();
  }
  if (!tokenizer->bos_id_.has_value()) {
    for (const char* name : {"<s>", "<|begin_of_text|>", "<bos>"}) {
      auto it = tokenizer->added_by_content_.find(name);
      if (it != tokenizer->added_by_content_.end() &&
          tokenizer->added_tokens_[it->second].special) {
        tokenizer->bos_id_ = tokenizer->added_tokens_[it->second].id;
        break;
      }
    }
  }
  return tokenizer;
}

std::vector<Tokenizer::Segment> Tokenizer::SplitOnAddedTokens(
    std::string_view text, const AddedTokenMatcher& matcher) const {
  std::vector<Segment> segments;
  if (text.empty()) return segments;
  if (matcher.empty()) {
    segments.push_back({0, text.size(), -1});
    return segments;
  }
  size_t start_offset = 0;  // End of the last emitted segment.
  size_t search = 0;
  size_t begin = 0, end = 0;
  int32_t index = -1;
  while (matcher.FindNext(text, search, &begin, &end, &index)) {
    search = end;
    const AddedToken& token = added_tokens_[index];
    if (token.single_word) {
      bool start_ok = true, stop_ok = true;
      if (begin > 0) {
        size_t prev = begin;
        start_ok = !IsWordChar(PrevCodePoint(text, &prev));
      }
      if (end < text.size()) {
        size_t next = end;
        stop_ok = !IsWordChar(NextCodePoint(text, &next));
      }
      if (!start_ok || !stop_ok) continue;
    }
    if (token.lstrip)
      begin = std::max(TrailingSpaceStart(text, begin), start_offset);
    if (token.rstrip) end = LeadingSpaceEnd(text, end);
    if (start_offset < begin) segments.push_back({start_offset, begin, -1});
    segments.push_back({begin, end, index});
    start_offset = end;
    search = std::max(search, end);
  }
  if (start_offset < text.size())
    segments.push_back({start_offset, text.size(), -1});
  return segments;
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(
    std::string_view text, bool add_special_tokens) const {
  const size_t bad = FirstInvalidUtf8Offset(text);
  if (bad != text.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Encode: text is not valid UTF-8 (at byte ", bad, ")"));
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  std::vector<tokenizer_internal::PreToken> pieces;
  for (const Segment& raw : SplitOnAddedTokens(text, *raw_matcher_)) {
    if (raw.added >= 0) {
      ids.push_back(added_tokens_[raw.added].id);
      continue;
    }
    const std::string_view raw_text =
        text.substr(raw.begin, raw.end - raw.begin);
    const std::string normalized = normalizer_ != nullptr
                                       ? normalizer_->Normalize(raw_text)
                                       : std::string(raw_text);
    for (const Segment& segment :
         SplitOnAddedTokens(normalized, *normalized_matcher_)) {
      if (segment.added >= 0) {
        ids.push_back(added_tokens_[segment.added].id);
        continue;
      }
      pieces.clear();
      pieces.push_back(
          {normalized.substr(segment.begin, segment.end - segment.begin),
           raw.begin == 0 && segment.begin == 0});
      if (pre_tokenizer_ != nullptr) pre_tokenizer_->PreTokenize(&pieces);
      for (const tokenizer_internal::PreToken& piece : pieces)
        model_->Tokenize(piece.text, &ids);
    }
  }
  if (add_special_tokens && post_processor_ != nullptr)
    post_processor_->Process(&ids);
  return ids;
}

const std::string* Tokenizer::TokenOf(int32_t id) const {
  if (auto it = added_by_id_.find(id); it != added_by_id_.end()) {
    return &added_tokens_[it->second].content;
  }
  return model_->IdToToken(id);
}

absl::StatusOr<std::string> Tokenizer::Decode(absl::Span<const int32_t> ids,
                                              bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0) {
      return absl::OutOfRangeError(
          absl::StrCat("Decode: negative token id ", id));
    }
    if (skip_special_tokens && IsSpecial(id)) continue;
    if (const std::string* token = TokenOf(id); token != nullptr)
      tokens.push_back(*token);
  }
  std::string text;
  if (decoder_ != nullptr) {
    decoder_->DecodeChain(&tokens);
    for (const std::string& token : tokens) text.append(token);
  } else {
    text = absl::StrJoin(tokens, " ");
  }
  if (!IsValidUtf8(text)) text = Utf8Lossy(text);
  return text;
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  if (auto it = added_by_content_.find(tokenizer_internal::AbslView(token));
      it != added_by_content_.end()) {
    return added_tokens_[it->second].id;
  }
  return model_->TokenToId(token);
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  const std::string* token = TokenOf(id);
  if (token == nullptr) return std::nullopt;
  return *token;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  auto it = added_by_id_.find(id);
  return it != added_by_id_.end() && added_tokens_[it->second].special;
}

// --- IncrementalDecoder ------------------------------------------------------

namespace {

// Prompt ids kept as context: enough for a multi-byte character split over
// byte tokens plus the token before it.
constexpr size_t kPromptContext = 6;
// Ids before the decode window are dropped once there are this many.
constexpr size_t kTrimThreshold = 1024;

}  // namespace

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer,
                                       bool skip_special_tokens,
                                       std::vector<int32_t> prompt_ids)
    : tokenizer_(&tokenizer), skip_special_tokens_(skip_special_tokens) {
  const size_t keep = std::min(prompt_ids.size(), kPromptContext);
  for (size_t i = prompt_ids.size() - keep; i < prompt_ids.size(); ++i) {
    const int32_t id = prompt_ids[i];
    if (id >= 0 && id < tokenizer.vocab_size()) ids_.push_back(id);
  }
  prefix_offset_ = 0;
  read_offset_ = ids_.size();
  prefix_text_ = DecodeRange(prefix_offset_, read_offset_);
}

std::string IncrementalDecoder::DecodeRange(size_t begin, size_t end) const {
  auto text =
      tokenizer_->Decode(absl::MakeConstSpan(ids_).subspan(begin, end - begin),
                         skip_special_tokens_);
  return text.ok() ? std::move(text).value()
                   : std::string();  // Ids were checked.
}

absl::StatusOr<std::string> IncrementalDecoder::Push(int32_t id) {
  if (id < 0) {
    return absl::OutOfRangeError(
        absl::StrCat("IncrementalDecoder: negative token id ", id));
  }
  // An id the tokenizer does not know (models pad their embedding past the
  // tokenizer, e.g. Qwen2) decodes to nothing, as in the crate.
  if (id >= tokenizer_->vocab_size()) return std::string();
  ids_.push_back(id);
  std::string new_text = DecodeRange(prefix_offset_, ids_.size());
  // Hold back text that has not grown or ends in an incomplete character.
  if (new_text.size() <= prefix_text_.size() ||
      new_text.ends_with(kReplacementChar)) {
    return std::string();
  }
  return Emit(new_text);
}

std::string IncrementalDecoder::Flush() {
  if (read_offset_ == ids_.size()) return std::string();
  std::string new_text = DecodeRange(prefix_offset_, ids_.size());
  if (new_text.size() <= prefix_text_.size()) return std::string();
  return Emit(new_text);
}

std::string IncrementalDecoder::Emit(const std::string& new_text) {
  // Normally new_text starts with prefix_text_. It does not only when the
  // window starts inside a character (a prompt that ends mid-character); then
  // emit from the last common character boundary.
  size_t common = 0;
  const size_t limit = std::min(new_text.size(), prefix_text_.size());
  while (common < limit && new_text[common] == prefix_text_[common]) ++common;
  while (common > 0 && common < new_text.size() &&
         (static_cast<uint8_t>(new_text[common]) & 0xC0) == 0x80) {
    --common;
  }
  std::string out = new_text.substr(common);
  prefix_offset_ = read_offset_;
  read_offset_ = ids_.size();
  if (prefix_offset_ >= kTrimThreshold) {
    ids_.erase(ids_.begin(),
               ids_.begin() + static_cast<std::ptrdiff_t>(prefix_offset_));
    read_offset_ -= prefix_offset_;
    prefix_offset_ = 0;
  }
  prefix_text_ = DecodeRange(prefix_offset_, read_offset_);
  return out;
}

}  // namespace knapserve

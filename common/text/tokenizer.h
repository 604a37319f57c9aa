// Text <-> token ids for Llama-family models, loaded from a Hugging Face
// tokenizer.json.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
//                    Tokenizer::FromFile(model_dir + "/tokenizer.json"));
//   ASSIGN_OR_RETURN(std::vector<int32_t> ids, tokenizer->Encode(prompt,
//   true)); IncrementalDecoder stream(*tokenizer, /*skip_special_tokens=*/true,
//   ids); for (int32_t id : generated) { ASSIGN_OR_RETURN(std::string piece,
//   stream.Push(id)); ... } std::string tail = stream.Flush();
//
// Supported, with the semantics of the Rust `tokenizers` crate (the goldens in
// ../shared/tokenizers were made with Hugging Face's Tokenizers.js):
//   model:          BPE (vocab + merges as "a b" or ["a", "b"], byte_fallback,
//                   unk/fuse_unk, ignore_merges, continuing/end-of-word
//                   affixes)
//   normalizer:     NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Strip,
//   Sequence pre_tokenizer:  ByteLevel, Split (String/Regex, all behaviors,
//   invert), Digits,
//                   Metaspace (prepend_scheme first/always/never, split),
//                   Whitespace, WhitespaceSplit, Sequence
//   post_processor: TemplateProcessing, ByteLevel, RobertaProcessing,
//   BertProcessing,
//                   Sequence (single sequences only)
//   decoder:        ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace,
//                   BPEDecoder, Sequence
//   added_tokens:   special and normal, with
//   lstrip/rstrip/single_word/normalized.
// This covers GPT-2 / Llama-3 / Qwen2 / SmolLM byte-level BPE and Llama-2 /
// Mistral SentencePiece-style BPE. Other component types (WordPiece, Unigram,
// BertNormalizer, Precompiled, ...) fail to load with Unimplemented naming the
// file and the component. truncation, padding and BPE dropout are ignored.
// Regexes run on PCRE2 in Unicode mode, which agrees with the crate's
// Oniguruma on the patterns these models use.
//
// One deliberate difference: when a run of <0xNN> byte tokens is not valid
// UTF-8, the ByteFallback decoder replaces only its ill-formed parts with
// U+FFFD (as Tokenizers.js does), where the crate replaces every byte of the
// run. Valid text decodes identically; this keeps streaming exact.
#ifndef KNAPSERVE_COMMON_TEXT_TOKENIZER_H_
#define KNAPSERVE_COMMON_TEXT_TOKENIZER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace knapserve {

namespace tokenizer_internal {
class AddedTokenMatcher;
class BpeModel;
class Decoder;
class Normalizer;
class PostProcessor;
class PreTokenizer;
}  // namespace tokenizer_internal

// A loaded tokenizer.json. Immutable after construction (apart from an
// internal, locked cache), so all const methods are thread-safe and one
// instance serves every request.
class Tokenizer {
 public:
  // Reads and parses the file. NotFound if it cannot be opened,
  // InvalidArgument for malformed JSON or a malformed component, Unimplemented
  // for an unsupported component type; messages start with the path.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(
      const std::string& tokenizer_json_path);
  // The same from the file's text; `source_name` names it in error messages.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(
      std::string_view json, std::string_view source_name);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // The ids of `text`. Added tokens (special or not) that appear literally in
  // the text are matched as their ids, longest first, before normalization.
  // add_special_tokens applies the post_processor (e.g. Llama-2's BOS; the
  // ByteLevel post-processor adds nothing). InvalidArgument if `text` is not
  // valid UTF-8.
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              bool add_special_tokens) const;

  // The text of `ids` through the decoder pipeline; special tokens are dropped
  // if skip_special_tokens. Always valid UTF-8 (ill-formed byte sequences
  // become U+FFFD). OutOfRange for an id < 0; ids that name no token (>=
  // vocab_size(), as models often pad their embedding past the tokenizer, or
  // holes in the vocab) are skipped, as in the crate.
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids,
                                     bool skip_special_tokens = false) const;

  // Largest id of the model vocab and the added tokens, plus one.
  int32_t vocab_size() const { return vocab_size_; }
  // Added tokens first, then the model vocab.
  std::optional<int32_t> TokenToId(std::string_view token) const;
  std::optional<std::string> IdToToken(int32_t id) const;
  // True for added tokens marked "special".
  bool IsSpecial(int32_t id) const;
  // The token the post_processor puts first (e.g. <s>, <|begin_of_text|>), else
  // a special added token named <s>, <|begin_of_text|> or <bos>, else none.
  std::optional<int32_t> bos_id() const { return bos_id_; }

 private:
  struct AddedToken {
    std::string content;
    int32_t id = 0;
    bool special = false;
    bool lstrip = false;
    bool rstrip = false;
    bool single_word = false;
    bool normalized = false;
  };
  // A piece of text [begin, end) or, if added >= 0, the added token
  // added_tokens_[added] spanning it.
  struct Segment {
    size_t begin;
    size_t end;
    int32_t added;
  };

  Tokenizer();
  // The HF AddedVocabulary split: added-token matches and the text between.
  std::vector<Segment> SplitOnAddedTokens(
      std::string_view text,
      const tokenizer_internal::AddedTokenMatcher& matcher) const;
  // The token string of `id` (added first), or nullptr.
  const std::string* TokenOf(int32_t id) const;

  std::unique_ptr<tokenizer_internal::Normalizer> normalizer_;  // May be null.
  std::unique_ptr<tokenizer_internal::PreTokenizer>
      pre_tokenizer_;  // May be null.
  std::unique_ptr<tokenizer_internal::BpeModel> model_;
  std::unique_ptr<tokenizer_internal::PostProcessor>
      post_processor_;                                    // May be null.
  std::unique_ptr<tokenizer_internal::Decoder> decoder_;  // May be null.
  std::vector<AddedToken> added_tokens_;
  absl::flat_hash_map<std::string, size_t>
      added_by_content_;  // -> index in added_tokens_.
  absl::flat_hash_map<int32_t, size_t>
      added_by_id_;  // -> index in added_tokens_.
  // Added tokens matched in the raw text (normalized == false) and in the
  // normalized text (normalized == true, patterns normalized too).
  std::unique_ptr<tokenizer_internal::AddedTokenMatcher> raw_matcher_;
  std::unique_ptr<tokenizer_internal::AddedTokenMatcher> normalized_matcher_;
  int32_t vocab_size_ = 0;
  std::optional<int32_t> bos_id_;
};

// Streaming detokenizer for one sequence: feed generated ids one at a time and
// get back only text that is complete, valid UTF-8 and will not change when
// more tokens arrive (byte-fallback <0xNN> tokens and byte-level pieces that
// split a character are held back until the character completes; the
// SentencePiece leading-space strip applies only at the very start).
//
// With empty prompt_ids, the concatenation of every Push() result and Flush()
// equals tokenizer.Decode(all ids, skip_special_tokens). prompt_ids is
// context: the first generated piece is decoded as in the middle of a
// sequence (after a prompt, SentencePiece "▁Hello" gives " Hello"). Only the
// last few prompt ids are kept; ids outside the vocab are ignored.
//
// Works like vLLM's / TGI's detokenizer: decode ids[prefix:] and
// ids[prefix:read] and emit the difference once it does not end in U+FFFD.
// Each Push decodes a few tokens. Not thread-safe; holds a reference to the
// tokenizer, which must outlive it.
class IncrementalDecoder {
 public:
  IncrementalDecoder(const Tokenizer& tokenizer,
                     bool skip_special_tokens = false,
                     std::vector<int32_t> prompt_ids = {});

  // The new stable text after `id` (often empty). An id the tokenizer does
  // not know adds no text; OutOfRange for a negative id (the decoder is then
  // unchanged).
  absl::StatusOr<std::string> Push(int32_t id);
  // Whatever is still held back, ill-formed bytes as U+FFFD. Pushing may go on
  // afterwards.
  std::string Flush();

 private:
  // Decode of ids_[begin:end]; the ids are known to be in range.
  std::string DecodeRange(size_t begin, size_t end) const;
  // Emits the text of ids_[prefix_offset_:] beyond prefix_text_ and advances.
  std::string Emit(const std::string& new_text);

  const Tokenizer* tokenizer_;  // Not owned.
  bool skip_special_tokens_;
  std::vector<int32_t>
      ids_;  // Context and generated ids; the front is trimmed.
  size_t prefix_offset_ = 0;  // Start of the decode window.
  size_t read_offset_ = 0;    // End of the ids whose text was emitted.
  std::string prefix_text_;   // DecodeRange(prefix_offset_, read_offset_).
};

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_TEXT_TOKENIZER_H_

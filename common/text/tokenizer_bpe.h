// The byte-pair-encoding model of a Hugging Face tokenizer.json ("model":
// {"type": "BPE", ...}). Internal to common/text/tokenizer.cc; use Tokenizer.
//
// BpeModel turns one pre-token into ids the way the Rust `tokenizers` crate
// does: each character becomes its vocab id (or, with byte_fallback, its
// <0xNN> byte tokens, or unk), then the lowest-ranked merge is applied
// repeatedly (leftmost first on ties) until none applies. Merges come as
// "a b" strings or ["a", "b"] pairs. ignore_merges, continuing_subword_prefix,
// end_of_word_suffix and fuse_unk are honoured; dropout is ignored (it is a
// training-time option).
//
// Immutable after construction except for an internal cache of tokenized
// words (bounded, guarded by an absl::Mutex: shared for lookups, exclusive for
// inserts), so all const methods are thread-safe.
#ifndef KNAPSERVE_COMMON_TEXT_TOKENIZER_BPE_H_
#define KNAPSERVE_COMMON_TEXT_TOKENIZER_BPE_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/base/json_fields.h"

namespace knapserve {
namespace tokenizer_internal {

class BpeModel {
 public:
  // Parses the "model" object. InvalidArgument for a malformed object (bad
  // vocab, a merge whose parts or result are not in the vocab), Unimplemented
  // for a model type other than BPE; messages name the file and the field.
  static absl::StatusOr<std::unique_ptr<BpeModel>> FromJson(
      const JsonReader& model);

  // Appends the ids of `word`, one pre-token (valid UTF-8), to *ids.
  void Tokenize(std::string_view word, std::vector<int32_t>* ids) const
      ABSL_LOCKS_EXCLUDED(cache_mutex_);

  std::optional<int32_t> TokenToId(std::string_view token) const;
  // The token of `id`, or nullptr if the vocab has no such id.
  const std::string* IdToToken(int32_t id) const;
  // Largest id in the vocab plus one (0 for an empty vocab).
  int32_t id_limit() const { return static_cast<int32_t>(id_to_token_.size()); }

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  // One symbol of a word being merged; a doubly linked list over a vector.
  struct Symbol {
    int32_t id;
    int32_t prev;  // -1 at the start.
    int32_t next;  // -1 at the end.
    bool alive;
  };

  BpeModel() = default;
  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }
  // The uncached tokenization of `word`.
  void TokenizeUncached(std::string_view word, std::vector<int32_t>* ids) const;

  absl::flat_hash_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> has_id_;
  absl::flat_hash_map<uint64_t, Merge> merges_;
  std::optional<int32_t> unk_id_;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  std::array<int32_t, 256> byte_ids_{};  // Id of <0xNN>, or -1.

  // Words up to kMaxCachedWordBytes long -> ids. Cleared when it gets full.
  static constexpr size_t kMaxCachedWordBytes = 256;
  static constexpr size_t kMaxCacheEntries = 65536;
  mutable absl::Mutex cache_mutex_;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache_
      ABSL_GUARDED_BY(cache_mutex_);
};

}  // namespace tokenizer_internal
}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_TEXT_TOKENIZER_BPE_H_

#include "common/text/tokenizer_bpe.h"

#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/status.h"
#include "common/text/tokenizer_pipeline.h"
#include "common/text/unicode_util.h"

namespace knapserve {
namespace tokenizer_internal {

namespace {

// Ids above this are rejected as malformed rather than allocated for.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// One entry of "merges": "a b" or ["a", "b"].
absl::StatusOr<std::pair<std::string, std::string>> ParseMerge(
    const JsonReader& merge) {
  constexpr std::string_view kExpected = "a merge \"a b\" or [\"a\", \"b\"]";
  if (!merge.value().is_string() && !merge.value().is_array())
    return merge.TypeError(kExpected);
  ASSIGN_OR_RETURN(std::vector<std::string> parts, merge.AsStringOrList());
  if (merge.value().is_string()) {
    const std::string line = parts[0];
    const size_t space = line.find(' ');
    if (space == std::string::npos ||
        line.find(' ', space + 1) != std::string::npos) {
      return merge.TypeError(kExpected);
    }
    parts = {line.substr(0, space), line.substr(space + 1)};
  }
  if (parts.size() != 2) return merge.TypeError(kExpected);
  return std::make_pair(std::move(parts[0]), std::move(parts[1]));
}

}  // namespace

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::FromJson(
    const JsonReader& model) {
  RETURN_IF_ERROR(model.ExpectObject());
  std::string type = "BPE";
  if (model.value().contains("type") || !model.value().contains("merges")) {
    ASSIGN_OR_RETURN(type, model.RequiredString("type"));
  }
  if (type != "BPE") {
    return model.Annotate(absl::UnimplementedError(
        absl::StrCat("unsupported model type '", type, "'")));
  }
  std::unique_ptr<BpeModel> bpe(new BpeModel());

  ASSIGN_OR_RETURN(const JsonReader vocab, model.Child("vocab"));
  ASSIGN_OR_RETURN(const auto members, vocab.AsMembers());
  int64_t max_id = -1;
  bpe->vocab_.reserve(members.size());
  for (const auto& [token, id_reader] : members) {
    ASSIGN_OR_RETURN(const int64_t id, id_reader.AsInt64());
    if (id < 0 || id > kMaxTokenId) {
      return id_reader.Error(absl::StrCat("expected a token id in [0, ",
                                          kMaxTokenId, "], got ", id));
    }
    bpe->vocab_[token] = static_cast<int32_t>(id);
    max_id = std::max(max_id, id);
  }
  bpe->id_to_token_.resize(static_cast<size_t>(max_id + 1));
  bpe->has_id_.resize(static_cast<size_t>(max_id + 1));
  for (const auto& [token, id] : bpe->vocab_) {
    bpe->id_to_token_[id] = token;
    bpe->has_id_[id] = true;
  }

  ASSIGN_OR_RETURN(bpe->continuing_subword_prefix_,
                   model.OptionalString("continuing_subword_prefix", ""));
  ASSIGN_OR_RETURN(bpe->end_of_word_suffix_,
                   model.OptionalString("end_of_word_suffix", ""));
  ASSIGN_OR_RETURN(bpe->byte_fallback_,
                   model.OptionalBool("byte_fallback", false));
  ASSIGN_OR_RETURN(bpe->fuse_unk_, model.OptionalBool("fuse_unk", false));
  ASSIGN_OR_RETURN(bpe->ignore_merges_,
                   model.OptionalBool("ignore_merges", false));
  ASSIGN_OR_RETURN(const std::string unk,
                   model.OptionalString("unk_token", ""));
  if (!unk.empty()) {
    // The crate fails at encode time if unk is needed but missing; we treat a
    // missing unk token as none.
    if (auto it = bpe->vocab_.find(unk); it != bpe->vocab_.end())
      bpe->unk_id_ = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = bpe->vocab_.find(absl::StrFormat("<0x%02X>", b));
    bpe->byte_ids_[b] = it == bpe->vocab_.end() ? -1 : it->second;
  }

  ASSIGN_OR_RETURN(const std::vector<JsonReader> merges,
                   model.OptionalArray("merges"));
  bpe->merges_.reserve(merges.size());
  const size_t prefix_len = bpe->continuing_subword_prefix_.size();
  for (size_t i = 0; i < merges.size(); ++i) {
    ASSIGN_OR_RETURN(auto pair, ParseMerge(merges[i]));
    const auto& [left, right] = pair;
    auto left_it = bpe->vocab_.find(left);
    auto right_it = bpe->vocab_.find(right);
    // As in the crate, the merged token drops the right part's
    // continuing-subword prefix.
    const std::string merged =
        left +
        (prefix_len > 0 && right.compare(0, prefix_len,
                                         bpe->continuing_subword_prefix_) == 0
             ? right.substr(prefix_len)
             : right);
    auto merged_it = bpe->vocab_.find(merged);
    if (left_it == bpe->vocab_.end() || right_it == bpe->vocab_.end() ||
        merged_it == bpe->vocab_.end()) {
      return merges[i].Error(absl::StrCat("merge '", left, " ", right,
                                          "' uses a token not in the vocab"));
    }
    // A repeated pair keeps its last rank, as the crate's map does.
    bpe->merges_[PairKey(left_it->second, right_it->second)] =
        Merge{static_cast<int32_t>(i), merged_it->second};
  }
  return bpe;
}

std::optional<int32_t> BpeModel::TokenToId(std::string_view token) const {
  auto it = vocab_.find(AbslView(token));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::IdToToken(int32_t id) const {
  if (id < 0 || id >= id_limit() || !has_id_[id]) return nullptr;
  return &id_to_token_[id];
}

void BpeModel::Tokenize(std::string_view word,
                        std::vector<int32_t>* ids) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto it = vocab_.find(AbslView(word)); it != vocab_.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() < kMaxCachedWordBytes;
  if (cacheable) {
    absl::ReaderMutexLock lock(&cache_mutex_);
    if (auto it = cache_.find(AbslView(word)); it != cache_.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = ids->size();
  TokenizeUncached(word, ids);
  if (cacheable) {
    absl::WriterMutexLock lock(&cache_mutex_);
    if (cache_.size() >= kMaxCacheEntries) cache_.clear();
    cache_.emplace(std::string(word),
                   std::vector<int32_t>(ids->begin() + start, ids->end()));
  }
}

void BpeModel::TokenizeUncached(std::string_view word,
                                std::vector<int32_t>* ids) const {
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  const auto add = [&symbols](int32_t id) {
    const int32_t index = static_cast<int32_t>(symbols.size());
    symbols.push_back(Symbol{id, index - 1, -1, true});
    if (index > 0) symbols[index - 1].next = index;
  };

  // The crate's merge_word: one symbol per character.
  int32_t pending_unk =
      -1;  // An unk symbol not added yet (fuse_unk may extend it).
  std::string decorated;
  size_t pos = 0;
  while (pos < word.size()) {
    const size_t begin = pos;
    NextCodePoint(word, &pos);
    std::string_view piece = word.substr(begin, pos - begin);
    const bool add_prefix = begin > 0 && !continuing_subword_prefix_.empty();
    const bool add_suffix = pos == word.size() && !end_of_word_suffix_.empty();
    if (add_prefix || add_suffix) {
      decorated.clear();
      if (add_prefix) decorated.append(continuing_subword_prefix_);
      decorated.append(piece);
      if (add_suffix) decorated.append(end_of_word_suffix_);
      piece = decorated;
    }
    if (auto it = vocab_.find(AbslView(piece)); it != vocab_.end()) {
      if (pending_unk >= 0) {
        add(pending_unk);
        pending_unk = -1;
      }
      add(it->second);
      continue;
    }
    if (byte_fallback_) {
      bool all_bytes = true;
      for (char c : piece)
        all_bytes = all_bytes && byte_ids_[static_cast<uint8_t>(c)] >= 0;
      if (all_bytes) {
        for (char c : piece) add(byte_ids_[static_cast<uint8_t>(c)]);
        continue;
      }
    }
    if (unk_id_.has_value()) {
      if (!(pending_unk >= 0 && fuse_unk_)) {
        if (pending_unk >= 0) add(pending_unk);
        pending_unk = *unk_id_;
      }
    }
  }
  if (pending_unk >= 0) add(pending_unk);
  if (symbols.empty()) return;

  // The crate's merge_all: lowest rank first, leftmost on ties.
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
  };
  const auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> queue(
      later);
  const auto push_pair = [&](int32_t left_pos) {
    const Symbol& left = symbols[left_pos];
    auto it = merges_.find(PairKey(left.id, symbols[left.next].id));
    if (it != merges_.end())
      queue.push(Candidate{it->second.rank, left_pos, it->second.new_id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i)
    push_pair(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& symbol = symbols[top.pos];
    if (!symbol.alive || symbol.next < 0) continue;
    auto it = merges_.find(PairKey(symbol.id, symbols[symbol.next].id));
    if (it == merges_.end() || it->second.new_id != top.new_id)
      continue;  // Stale.
    Symbol& right = symbols[symbol.next];
    right.alive = false;
    symbol.id = top.new_id;
    symbol.next = right.next;
    if (symbol.next >= 0) symbols[symbol.next].prev = top.pos;
    if (symbol.prev >= 0) push_pair(symbol.prev);
    if (symbol.next >= 0) push_pair(top.pos);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next)
    ids->push_back(symbols[i].id);
}

}  // namespace tokenizer_internal
}  // namespace knapserve

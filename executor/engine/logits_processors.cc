#include "executor/engine/logits_processors.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace knapserve {
namespace {

absl::Status TokenIdInVocab(const char* field, int32_t id, int64_t vocab) {
  if (id >= 0 && id < vocab) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": token id ", id, " outside the vocabulary [0, ", vocab, ")"));
}

}  // namespace

const char* DraftAcceptanceName(DraftAcceptance acceptance) {
  switch (acceptance) {
    case DraftAcceptance::kAuto:
      return "auto";
    case DraftAcceptance::kRejection:
      return "rejection";
    case DraftAcceptance::kCoupled:
      return "coupled";
  }
  return "auto";
}

absl::StatusOr<DraftAcceptance> ParseDraftAcceptance(std::string_view name) {
  for (DraftAcceptance a : {DraftAcceptance::kAuto, DraftAcceptance::kRejection,
                            DraftAcceptance::kCoupled}) {
    if (name == DraftAcceptanceName(a)) return a;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("draft acceptance '", std::string(name),
                   "' is not one of auto, rejection, coupled"));
}

absl::Status ValidateSamplingParams(const SamplingParams& params,
                                    int64_t vocab_size) {
  if (!(params.temperature >= 0.0) || !std::isfinite(params.temperature)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "temperature: must be a finite number >= 0 (below ", kGreedyTemperature,
        " it is greedy), got ", params.temperature));
  }
  if (params.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k: must be >= 0 (0 = off), got ", params.top_k));
  }
  if (!(params.top_p > 0.0 && params.top_p <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_p: must be in (0, 1], got ", params.top_p));
  }
  if (!(params.min_p >= 0.0 && params.min_p <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_p: must be in [0, 1], got ", params.min_p));
  }
  if (!(params.repetition_penalty > 0.0) ||
      !std::isfinite(params.repetition_penalty)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty: must be a finite number > 0 (1 = "
                     "off), got ",
                     params.repetition_penalty));
  }
  for (const auto& [field, value] :
       {std::pair<const char*, double>{"presence_penalty",
                                       params.presence_penalty},
        std::pair<const char*, double>{"frequency_penalty",
                                       params.frequency_penalty}}) {
    if (!(value >= -2.0 && value <= 2.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": must be in [-2, 2], got ", value));
    }
  }
  for (const auto& [id, bias] : params.logit_bias) {
    if (absl::Status s = TokenIdInVocab("logit_bias", id, vocab_size); !s.ok())
      return s;
    if (!(bias >= -100.0 && bias <= 100.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_bias: the bias of token id ", id,
                       " must be in [-100, 100], got ", bias));
    }
  }
  if (params.min_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_tokens: must be >= 0, got ", params.min_tokens));
  }
  const int64_t words = static_cast<int64_t>(params.bad_words.size());
  if (words > kMaxBadWords) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad_words: at most ", kMaxBadWords, " sequences, got ", words));
  }
  for (int64_t i = 0; i < words; ++i) {
    const std::vector<int32_t>& word = params.bad_words[i];
    if (word.empty() || static_cast<int64_t>(word.size()) > kMaxBadWordTokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad_words: sequence ", i, " has ", word.size(),
                       " token ids; each needs 1 to ", kMaxBadWordTokens));
    }
    for (int32_t id : word) {
      if (absl::Status s = TokenIdInVocab("bad_words", id, vocab_size); !s.ok())
        return s;
    }
  }
  return absl::OkStatus();
}

LogitsProcessors::LogitsProcessors(const SamplingParams& params,
                                   absl::Span<const int32_t> prompt_ids,
                                   absl::Span<const int32_t> end_ids)
    : bad_words_(params.bad_words),
      min_tokens_(params.min_tokens),
      repetition_(static_cast<float>(params.repetition_penalty)),
      presence_(params.presence_penalty),
      frequency_(params.frequency_penalty) {
  for (const auto& [id, bias] : params.logit_bias) {
    if (bias != 0.0) bias_.emplace_back(id, static_cast<float>(bias));
  }
  if (min_tokens_ > 0) {
    end_ids_.assign(end_ids.begin(), end_ids.end());
    std::sort(end_ids_.begin(), end_ids_.end());
    end_ids_.erase(std::unique(end_ids_.begin(), end_ids_.end()),
                   end_ids_.end());
  }
  penalties_ = repetition_ != 1.0f || presence_ != 0.0 || frequency_ != 0.0;
  if (repetition_ != 1.0f) {
    for (int32_t id : prompt_ids) {
      if (prompt_set_.insert(id).second) prompt_ids_.push_back(id);
    }
  }
  active_ =
      !bias_.empty() || !bad_words_.empty() || !end_ids_.empty() || penalties_;
}

void LogitsProcessors::Commit(absl::Span<const int32_t> ids) {
  if (!active_) return;
  for (int32_t id : ids) {
    generated_.push_back(id);
    ++counts_[id];
  }
}

void LogitsProcessors::Ban(absl::Span<float> logits,
                           absl::Span<const int32_t> pending) const {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  const int64_t n_pending = static_cast<int64_t>(pending.size());
  const int64_t total = generated() + n_pending;
  // The history's k-th token from its end (k = 1 is the newest).
  auto from_end = [&](int64_t k) {
    return k <= n_pending ? pending[n_pending - k]
                          : generated_[generated_.size() - (k - n_pending)];
  };
  std::vector<int32_t> banned;
  for (const std::vector<int32_t>& word : bad_words_) {
    const int64_t prefix = static_cast<int64_t>(word.size()) - 1;
    if (prefix > total) continue;
    bool match = true;
    for (int64_t i = 0; i < prefix && match; ++i) {
      match = word[i] == from_end(prefix - i);
    }
    if (match) banned.push_back(word.back());
  }
  if (total < min_tokens_) {
    banned.insert(banned.end(), end_ids_.begin(), end_ids_.end());
  }
  if (banned.empty()) return;
  std::sort(banned.begin(), banned.end());
  banned.erase(std::unique(banned.begin(), banned.end()), banned.end());
  int64_t in_vocab = 0;
  for (int32_t id : banned) in_vocab += id >= 0 && id < vocab;
  if (in_vocab >= vocab) return;  // bans never leave no token
  for (int32_t id : banned) {
    if (id >= 0 && id < vocab)
      logits[id] = -std::numeric_limits<float>::infinity();
  }
}

void LogitsProcessors::Penalize(absl::Span<float> logits,
                                absl::Span<const int32_t> pending) const {
  const int64_t vocab = static_cast<int64_t>(logits.size());
  const bool repetition = repetition_ != 1.0f;
  // The pending tokens' counts (a step drafts a handful at most).
  std::vector<std::pair<int32_t, int64_t>> pending_counts;
  for (int32_t id : pending) {
    auto it = std::find_if(pending_counts.begin(), pending_counts.end(),
                           [id](const auto& e) { return e.first == id; });
    if (it == pending_counts.end()) {
      pending_counts.emplace_back(id, 1);
    } else {
      ++it->second;
    }
  }
  auto pending_count = [&](int32_t id) -> int64_t {
    for (const auto& [p, c] : pending_counts)
      if (p == id) return c;
    return 0;
  };
  auto committed_count = [&](int32_t id) -> int64_t {
    auto it = counts_.find(id);
    return it == counts_.end() ? 0 : it->second;
  };
  // Steps 4 and 5 on one id seen `count` times in the generated tokens
  // (and, for the repetition penalty, maybe only in the prompt).
  auto penalize = [&](int32_t id, int64_t count) {
    if (id < 0 || id >= vocab) return;
    float l = logits[id];
    if (repetition) l = l > 0 ? l / repetition_ : l * repetition_;
    if (count > 0) {
      l -= static_cast<float>(frequency_ * static_cast<double>(count) +
                              presence_);
    }
    logits[id] = l;
  };
  // Every id of prompt (with the repetition penalty on) and generated
  // tokens exactly once.
  if (repetition) {
    for (int32_t id : prompt_ids_)
      penalize(id, committed_count(id) + pending_count(id));
  }
  for (const auto& [id, count] : counts_) {
    if (repetition && prompt_set_.contains(id)) continue;
    penalize(id, count + pending_count(id));
  }
  for (const auto& [id, count] : pending_counts) {
    if (repetition && prompt_set_.contains(id)) continue;
    if (counts_.contains(id)) continue;
    penalize(id, count);
  }
}

void LogitsProcessors::ApplyInPlace(absl::Span<float> logits,
                                    absl::Span<const int32_t> pending) const {
  if (!active_) return;
  const int64_t vocab = static_cast<int64_t>(logits.size());
  for (const auto& [id, bias] : bias_) {
    if (id < vocab) logits[id] += bias;
  }
  if (!bad_words_.empty() || !end_ids_.empty()) Ban(logits, pending);
  if (penalties_) Penalize(logits, pending);
}

torch::Tensor LogitsProcessors::Apply(const torch::Tensor& logits,
                                      absl::Span<const int32_t> pending) const {
  if (!active_) return logits;
  c10::InferenceMode guard;
  torch::Tensor out = logits
                          .to(torch::kCPU, torch::kFloat32,
                              /*non_blocking=*/false, /*copy=*/true)
                          .reshape({-1})
                          .contiguous();
  ApplyInPlace(absl::MakeSpan(out.data_ptr<float>(), out.numel()), pending);
  return out;
}

torch::Tensor LogitsProcessors::ApplyRows(
    const torch::Tensor& logits, absl::Span<const int32_t> drafts) const {
  if (!active_) return logits;
  c10::InferenceMode guard;
  torch::Tensor out = logits
                          .to(torch::kCPU, torch::kFloat32,
                              /*non_blocking=*/false, /*copy=*/true)
                          .contiguous();
  const int64_t rows = out.size(0);
  const int64_t vocab = out.size(1);
  float* data = out.data_ptr<float>();
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t before =
        std::min<int64_t>(j, static_cast<int64_t>(drafts.size()));
    ApplyInPlace(absl::MakeSpan(data + j * vocab, vocab),
                 drafts.subspan(0, before));
  }
  return out;
}

}  // namespace knapserve

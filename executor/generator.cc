#include "executor/generator.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "executor/kv_cache.h"

namespace knapserve {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

std::string FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStopSequence:
      return "stop_sequence";
    case FinishReason::kAborted:
      return "aborted";
  }
  return "unknown";
}

double GenerationStats::prefill_tokens_per_second() const {
  return prefill_seconds > 0 ? static_cast<double>(prompt_tokens) / prefill_seconds : 0.0;
}

double GenerationStats::decode_tokens_per_second() const {
  return decode_seconds > 0 && completion_tokens > 1
             ? static_cast<double>(completion_tokens - 1) / decode_seconds
             : 0.0;
}

absl::Status ValidateGenerationRequest(const GenerationRequest& request, const LlamaModel& model) {
  const int64_t n = static_cast<int64_t>(request.prompt_ids.size());
  if (n == 0) return absl::InvalidArgumentError("prompt: empty (it needs at least one token)");
  if (n >= model.max_context()) {
    return absl::InvalidArgumentError(absl::StrCat("prompt: ", n,
                                                   " tokens do not fit the model's context of ",
                                                   model.max_context(), " tokens"));
  }
  const int64_t vocab = model.config().vocab_size;
  for (int32_t id : request.prompt_ids) {
    if (id < 0 || id >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt: token id ", id, " outside the vocabulary [0, ", vocab, ")"));
    }
  }
  if (request.max_new_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens: must be >= 1, got ", request.max_new_tokens));
  }
  if (request.prefill_chunk < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_chunk: must be >= 1, got ", request.prefill_chunk));
  }
  for (const std::string& stop : request.stop_strings) {
    if (stop.empty()) return absl::InvalidArgumentError("stop: empty stop string");
  }
  return Annotate(ValidateSamplingParams(request.sampling), "sampling");
}

TextStream::TextStream(const Tokenizer& tokenizer, std::vector<int32_t> prompt_ids,
                       std::vector<std::string> stop_strings)
    : decoder_(tokenizer, /*skip_special_tokens=*/true, std::move(prompt_ids)),
      stop_strings_(std::move(stop_strings)) {}

std::string TextStream::TakeSafeText(bool final) {
  if (matched_stop_.has_value()) return "";
  // Look for a completed stop string. None can start in already-emitted text:
  // anything that could begin one was held back.
  size_t best = std::string::npos;
  for (const std::string& stop : stop_strings_) {
    size_t at = text_.find(stop, emitted_);
    if (at != std::string::npos && (best == std::string::npos || at < best)) {
      best = at;
      matched_stop_ = stop;
    }
  }
  size_t safe_end = text_.size();
  if (best != std::string::npos) {
    safe_end = best;
  } else if (!final) {
    // Hold back the longest suffix that is a proper prefix of a stop string.
    for (const std::string& stop : stop_strings_) {
      const size_t max_len = std::min(stop.size() - 1, text_.size() - emitted_);
      for (size_t len = max_len; len > 0; --len) {
        if (text_.compare(text_.size() - len, len, stop, 0, len) == 0) {
          safe_end = std::min(safe_end, text_.size() - len);
          break;
        }
      }
    }
  }
  std::string out = text_.substr(emitted_, safe_end - emitted_);
  emitted_ = safe_end;
  emitted_text_ += out;
  return out;
}

absl::StatusOr<std::string> TextStream::Push(int32_t id) {
  if (matched_stop_.has_value()) return std::string();
  ASSIGN_OR_RETURN(std::string piece, decoder_.Push(id));
  text_ += piece;
  return TakeSafeText(/*final=*/false);
}

std::string TextStream::Finish() {
  if (matched_stop_.has_value()) return "";
  text_ += decoder_.Flush();
  return TakeSafeText(/*final=*/true);
}

absl::StatusOr<GenerationResult> Generate(const LlamaModel& model, const Tokenizer& tokenizer,
                                          const GenerationRequest& request,
                                          const StreamCallback& on_tokens) {
  RETURN_IF_ERROR(ValidateGenerationRequest(request, model));
  c10::InferenceMode inference_mode;
  const auto start = std::chrono::steady_clock::now();

  const int64_t prompt_len = static_cast<int64_t>(request.prompt_ids.size());
  // The sequence may grow to the context limit; the KV cache never needs more.
  const int64_t capacity = std::min(model.max_context(), prompt_len + request.max_new_tokens);
  KvCache cache(model, capacity);
  Sampler sampler(request.sampling);
  TextStream stream(tokenizer, request.prompt_ids, request.stop_strings);

  GenerationResult result;
  result.seed = sampler.seed();
  result.stats.prompt_tokens = prompt_len;

  const std::vector<int32_t>& eos = model.config().eos_token_ids;
  auto is_end_id = [&](int32_t id, FinishReason* reason) {
    if (!request.ignore_eos && std::find(eos.begin(), eos.end(), id) != eos.end()) {
      *reason = FinishReason::kEos;
      return true;
    }
    if (std::find(request.stop_token_ids.begin(), request.stop_token_ids.end(), id) !=
        request.stop_token_ids.end()) {
      *reason = FinishReason::kStopSequence;
      return true;
    }
    return false;
  };

  torch::Tensor prompt = torch::tensor(
      std::vector<int64_t>(request.prompt_ids.begin(), request.prompt_ids.end()), torch::kInt64);
  torch::Tensor logits =
      model.Prefill(prompt, /*start_pos=*/0, cache.layers(), request.prefill_chunk);
  cache.Commit(prompt_len);

  std::chrono::steady_clock::time_point decode_start;
  while (true) {
    const int32_t next = sampler.Sample(logits);
    if (result.output_ids.empty()) {
      result.stats.prefill_seconds = SecondsSince(start);
      decode_start = std::chrono::steady_clock::now();
    }
    result.output_ids.push_back(next);
    ASSIGN_OR_RETURN(std::string text, stream.Push(next));
    FinishReason reason = FinishReason::kLength;
    bool done = is_end_id(next, &reason);
    if (stream.stopped()) {
      done = true;
      reason = FinishReason::kStopSequence;
    }
    if (!done && (static_cast<int64_t>(result.output_ids.size()) >= request.max_new_tokens ||
                  prompt_len + static_cast<int64_t>(result.output_ids.size()) >=
                      model.max_context())) {
      done = true;
      reason = FinishReason::kLength;
    }
    if (done) text += stream.Finish();
    if (on_tokens && !on_tokens(absl::MakeConstSpan(&result.output_ids.back(), 1), text)) {
      done = true;
      reason = FinishReason::kAborted;
    }
    if (done) {
      result.finish_reason = reason;
      break;
    }
    torch::Tensor input = torch::tensor({static_cast<int64_t>(next)}, torch::kInt64);
    logits = model.Forward(input, cache.length(), cache.layers(), /*num_logits=*/1)[0];
    cache.Commit(cache.length() + 1);
  }
  result.text = stream.emitted();
  if (stream.matched_stop().has_value()) result.matched_stop = *stream.matched_stop();
  result.stats.completion_tokens = static_cast<int64_t>(result.output_ids.size());
  result.stats.decode_seconds = SecondsSince(decode_start);
  result.stats.total_seconds = SecondsSince(start);
  return result;
}

}  // namespace knapserve

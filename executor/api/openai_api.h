// The OpenAI-compatible wire format of the HTTP front door
// (executor/api/http_front_door.h): request bodies of POST /v1/completions and
// POST /v1/chat/completions parsed and validated into the same
// v1::GenerateRequest a gRPC client sends (so both paths share
// DecodeGenerateRequest's checks and limits), and the JSON a client gets
// back: whole responses, SSE stream chunks, and OpenAI's error shape.
//
// Fields honoured (anything else a client sends is ignored, as OpenAI's own
// server ignores unknown fields, except those listed as refused):
//   model                 must name the served model (404 otherwise)
//   prompt                completions: a string, a list of one string, a
//                         list of token ids, or a list of one such list
//   messages              chat: [{role, content}], content a string or a
//                         list of {type: "text", text} parts; rendered with
//                         the model's chat template (executor-side Jinja)
//   max_tokens, max_completion_tokens, temperature, top_p, seed, stop (a
//   string or a list), stream, stream_options.include_usage,
//   n                     choices, decoded side by side sharing the prompt's
//                         K/V; each streamed event carries its choice's index
//   best_of               completions: candidates, the n with the highest
//                         cumulative log-probability returned (not with
//                         stream unless equal to n)
//   logprobs              completions: an integer N in [0, 20], the chosen
//                         token's log-probability and N alternatives;
//                         chat: a boolean, with top_logprobs N in [0, 20]
//                         (the full model's log_softmax, the same in every
//                         speculation mode)
//   presence_penalty, frequency_penalty, logit_bias ({"token id": bias})
//                         OpenAI's logits processors
//   top_k, ignore_eos, stop_token_ids, repetition_penalty, min_p,
//   min_tokens            vLLM's extensions, same meaning
//   bad_words             vLLM's, but as lists of token ids ([[12], [34,
//                         56]]); a list of strings is refused
//   knapserve: {spec, max_draft, static_mask, exit_threshold, specbound}
//                         speculation for this request; the response's
//                         `knapserve` field carries its acceptance stats
// The sampling fields mean what executor/engine/logits_processors.h defines
// (the same pipeline as gRPC); out of range they are a 400 naming the field.
//   echo                  completions: the prompt before the completion
//                         (streamed: in a first event of its own), with
//                         its tokens' log-probabilities under `logprobs`
//                         (the first token's null)
// Refused with a 400 naming the field: best_of on chat or streamed above n,
// echo on chat, suffix, top_logprobs on completions (its count is `logprobs`),
// tools / functions (no tool calling), stream_options without stream.
//
// Stateless functions and a per-request encoder; thread safety: any thread,
// one OpenAiEncoder per request.
#ifndef KNAPSERVE_EXECUTOR_API_OPENAI_API_H_
#define KNAPSERVE_EXECUTOR_API_OPENAI_API_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"
#include "executor/api/generation_codec.h"
#include "executor/engine/generator.h"
#include "knapserve/v1/generation.pb.h"
#include "nlohmann/json.hpp"

namespace knapserve {

enum class OpenAiEndpoint { kCompletions, kChat };

// A model's chat template and the token strings it refers to.
struct ChatPromptFormat {
  ChatTemplate chat_template;
  std::string bos_token;
  std::string eos_token;
};

// What the front door knows about the model it serves.
struct OpenAiModel {
  std::string name;                        // what `model` must say
  const Tokenizer* tokenizer = nullptr;    // borrowed
  const ChatPromptFormat* chat = nullptr;  // borrowed; null: no template
};

struct OpenAiRequest {
  OpenAiEndpoint endpoint = OpenAiEndpoint::kCompletions;
  // The equivalent gRPC request: prompt (text, or token ids for a token
  // prompt and for chat, whose rendered text is tokenized without adding
  // special tokens: the template writes them), sampling, stops, speculation.
  v1::GenerateRequest wire;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool logprobs = false;
  bool echo = false;  // completions: the prompt before the completion
};

// Parses and checks a request body. InvalidArgument naming the field
// ("messages[1].content: expected a string or a list of text parts"), NotFound
// for a `model` other than `model.name`, InvalidArgument "messages: this model
// has no chat template ..." for chat without a template. Sampling ranges and
// limits are checked later by DecodeGenerateRequest.
absl::StatusOr<OpenAiRequest> ParseOpenAiRequest(std::string_view body,
                                                 OpenAiEndpoint endpoint,
                                                 const OpenAiModel& model);

// OpenAI's error object: {"error": {"message", "type", "param", "code"}}.
// `param` is the field a message starts with ("max_tokens: ..."), if any.
nlohmann::json OpenAiErrorJson(const absl::Status& status);
// The HTTP status for an error: 400 InvalidArgument / OutOfRange /
// FailedPrecondition, 404 NotFound, 429 ResourceExhausted, 503 Unavailable,
// 504 DeadlineExceeded, 499 Cancelled, 500 otherwise.
int HttpStatusFor(absl::StatusCode code);

// "stop" (EOS, a stop string or stop token), "length", "abort".
std::string OpenAiFinishReason(FinishReason reason);

// Builds one request's responses: the whole JSON body, or the SSE events of
// a stream. Thread safety: one thread at a time (the request's).
class OpenAiEncoder {
 public:
  OpenAiEncoder(const OpenAiRequest& request, std::string id,
                std::string model_name, int64_t created,
                const Tokenizer& tokenizer);

  // The SSE events ("data: {...}\n\n") for one decode step's output of
  // choice `index`. A choice's first chat event also carries the assistant
  // role.
  std::string StreamTokens(int index, absl::Span<const int32_t> ids,
                           std::string_view text, const StepLogprobs& logprobs);
  // The closing events: each choice's finish reason (results in index
  // order, each with its GenerationResult::index), the usage chunk when
  // asked, and "data: [DONE]".
  std::string StreamEnd(absl::Span<const GenerationResult* const> results,
                        SpeculationMode mode, const ServiceTimings& timings);
  // An error after the stream began: an error event, then [DONE].
  static std::string StreamError(const absl::Status& status);

  // The prompt as tokenized (and its text as given), for `echo`.
  void SetPrompt(std::vector<int32_t> ids, std::string text);

  // The non-streamed response: one choice per result, in index order.
  nlohmann::json Response(absl::Span<const GenerationResult* const> results,
                          SpeculationMode mode,
                          const ServiceTimings& timings) const;

 private:
  // A stream's progress for one choice.
  struct ChoiceState {
    bool sent_role = false;   // chat: the first delta carries the role
    bool sent_echo = false;   // completions: the prompt went first
    int64_t text_offset = 0;  // completions logprobs' text_offset
  };
  ChoiceState& State(int index);

  nlohmann::json Envelope() const;  // id, object, created, model
  // The prompt once, every choice's completion tokens.
  nlohmann::json Usage(absl::Span<const GenerationResult* const> results) const;
  // The logprobs object of a choice for these tokens (OpenAI's legacy
  // completions shape or chat's content list); `text_offset` advances.
  nlohmann::json Logprobs(absl::Span<const int32_t> ids,
                          const StepLogprobs& logprobs,
                          int64_t& text_offset) const;
  static std::string Event(const nlohmann::json& data);
  // One token's text ("" when it decodes to nothing).
  std::string TokenText(int32_t id) const;
  // The legacy logprobs object of the echoed prompt (its first token null);
  // `text_offset` advances.
  nlohmann::json PromptLogprobs(const StepLogprobs& logprobs,
                                int64_t& text_offset) const;

  const OpenAiEndpoint endpoint_;
  const bool include_usage_;
  const bool logprobs_;
  const bool echo_;
  std::vector<int32_t> prompt_ids_;  // SetPrompt
  std::string prompt_text_;
  const std::string id_;
  const std::string model_name_;
  const int64_t created_;
  const Tokenizer& tokenizer_;
  std::vector<ChoiceState> choices_;  // streams: by choice index
};

// The `knapserve` extension object of a finished response: speculation mode,
// mask, acceptance stats, plans applied and timings (clients ignore it); for
// the planned modes also `planning` (executor/api/planning_json.h, with
// profile_pending), plan_requests and plan_failures.
nlohmann::json KnapserveExtension(const GenerationResult& result,
                                  SpeculationMode mode,
                                  const ServiceTimings& timings);

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_API_OPENAI_API_H_

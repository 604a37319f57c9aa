#include "executor/api/openai_api.h"

#include <cctype>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "executor/api/planning_json.h"
#include "executor/engine/speculation_mode.h"

namespace knapserve {
namespace {

using Json = nlohmann::json;

std::string TypeName(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return "a boolean";
    case Json::value_t::string:
      return "a string";
    case Json::value_t::array:
      return "a list";
    case Json::value_t::object:
      return "an object";
    default:
      return "a number";
  }
}

absl::Status FieldError(const std::string& field, const std::string& what,
                        const Json& got) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": expected ", what, ", got ", TypeName(got)));
}

// The body's field `name`, or nullptr when absent or null (OpenAI's clients
// send null for "not set").
const Json* Field(const Json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::StatusOr<std::optional<int64_t>> OptionalInt(const Json& body,
                                                   const char* name) {
  const Json* v = Field(body, name);
  if (v == nullptr) return std::optional<int64_t>();
  if (v->is_number_integer()) return std::optional<int64_t>(v->get<int64_t>());
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (d == static_cast<double>(static_cast<int64_t>(d)))
      return std::optional<int64_t>(static_cast<int64_t>(d));
  }
  return FieldError(name, "an integer", *v);
}

absl::StatusOr<std::optional<double>> OptionalNumber(const Json& body,
                                                     const char* name) {
  const Json* v = Field(body, name);
  if (v == nullptr) return std::optional<double>();
  if (!v->is_number()) return FieldError(name, "a number", *v);
  return std::optional<double>(v->get<double>());
}

absl::StatusOr<bool> OptionalBool(const Json& body, const char* name,
                                  bool fallback) {
  const Json* v = Field(body, name);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) return FieldError(name, "true or false", *v);
  return v->get<bool>();
}

// A prompt given as token ids: every element an integer in int32.
absl::StatusOr<std::vector<int32_t>> TokenList(const Json& list,
                                               const std::string& field) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < list.size(); ++i) {
    const Json& v = list[i];
    if (!v.is_number_integer() || v.get<int64_t>() < INT32_MIN ||
        v.get<int64_t>() > INT32_MAX) {
      return FieldError(absl::StrCat(field, "[", i, "]"), "a token id", v);
    }
    ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
  }
  return ids;
}

absl::Status ParsePrompt(const Json& body, v1::GenerateRequest& wire) {
  const Json* prompt = Field(body, "prompt");
  if (prompt == nullptr) {
    return absl::InvalidArgumentError("prompt: required but missing");
  }
  const Json* p = prompt;
  // A list of one prompt is that prompt (several would need several
  // choices: a batch this server does not take in one request).
  if (p->is_array() && !p->empty() &&
      (p->front().is_string() || p->front().is_array())) {
    if (p->size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt: one prompt per request, got a list of ", p->size()));
    }
    p = &p->front();
  }
  if (p->is_string()) {
    wire.set_text(p->get<std::string>());
    return absl::OkStatus();
  }
  if (p->is_array()) {
    ASSIGN_OR_RETURN(std::vector<int32_t> ids, TokenList(*p, "prompt"));
    wire.mutable_token_ids()->mutable_ids()->Add(ids.begin(), ids.end());
    return absl::OkStatus();
  }
  return FieldError("prompt", "a string or a list of token ids", *prompt);
}

// A message's content: a string, or a list of {type: "text", text} parts
// (joined with nothing between, as the text parts of one message).
absl::StatusOr<std::string> MessageContent(const Json& content,
                                           const std::string& field) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) {
    return FieldError(field, "a string or a list of text parts", content);
  }
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const Json& part = content[i];
    const std::string where = absl::StrCat(field, "[", i, "]");
    if (!part.is_object()) return FieldError(where, "an object", part);
    const Json* type = Field(part, "type");
    if (type == nullptr || !type->is_string() ||
        type->get<std::string>() != "text") {
      return absl::InvalidArgumentError(
          absl::StrCat(where,
                       ".type: only \"text\" parts are supported (this server "
                       "takes no images or audio)"));
    }
    const Json* t = Field(part, "text");
    if (t == nullptr || !t->is_string()) {
      return FieldError(absl::StrCat(where, ".text"), "a string",
                        t == nullptr ? Json() : *t);
    }
    text += t->get<std::string>();
  }
  return text;
}

absl::Status ParseMessages(const Json& body, const OpenAiModel& model,
                           v1::GenerateRequest& wire) {
  const Json* messages = Field(body, "messages");
  if (messages == nullptr) {
    return absl::InvalidArgumentError("messages: required but missing");
  }
  if (!messages->is_array() || messages->empty()) {
    return FieldError("messages", "a non-empty list of messages", *messages);
  }
  Json list = Json::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    const Json& m = (*messages)[i];
    const std::string where = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return FieldError(where, "an object", m);
    const Json* role = Field(m, "role");
    if (role == nullptr || !role->is_string()) {
      return FieldError(where + ".role", "a string",
                        role == nullptr ? Json() : *role);
    }
    const std::string r = role->get<std::string>();
    if (r != "system" && r != "user" && r != "assistant" && r != "developer") {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".role: expected system, developer, user or assistant, got '",
          r, "'"));
    }
    Json out = Json::object();
    // The templates know "system"; OpenAI's newer name for it is
    // "developer".
    out["role"] = r == "developer" ? "system" : r;
    const Json* content = Field(m, "content");
    if (content == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".content: required but missing"));
    }
    ASSIGN_OR_RETURN(out["content"],
                     MessageContent(*content, where + ".content"));
    list.push_back(std::move(out));
  }
  if (model.chat == nullptr) {
    return absl::InvalidArgumentError(
        "messages: this model has no chat template (no chat_template in its "
        "tokenizer_config.json); use /v1/completions, or start the server "
        "with --chat-template FILE");
  }
  Json context = Json::object();
  context["messages"] = std::move(list);
  context["tools"] = nullptr;  // as transformers passes it without tools
  context["add_generation_prompt"] = true;
  context["bos_token"] = model.chat->bos_token;
  context["eos_token"] = model.chat->eos_token;
  absl::StatusOr<std::string> prompt =
      model.chat->chat_template.Render(context);
  if (!prompt.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("messages: ", prompt.status().message()));
  }
  // The template writes the special tokens (BOS and the turn markers), so
  // the tokenizer must not add its own.
  absl::StatusOr<std::vector<int32_t>> ids =
      model.tokenizer->Encode(*prompt, /*add_special_tokens=*/false);
  if (!ids.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("messages: ", ids.status().message()));
  }
  wire.mutable_token_ids()->mutable_ids()->Add(ids->begin(), ids->end());
  return absl::OkStatus();
}

absl::Status ParseStop(const Json& body, v1::GenerateRequest& wire) {
  const Json* stop = Field(body, "stop");
  if (stop == nullptr) return absl::OkStatus();
  if (stop->is_string()) {
    wire.add_stop(stop->get<std::string>());
    return absl::OkStatus();
  }
  if (!stop->is_array()) {
    return FieldError("stop", "a string or a list of strings", *stop);
  }
  for (size_t i = 0; i < stop->size(); ++i) {
    if (!(*stop)[i].is_string()) {
      return FieldError(absl::StrCat("stop[", i, "]"), "a string", (*stop)[i]);
    }
    wire.add_stop((*stop)[i].get<std::string>());
  }
  return absl::OkStatus();
}

// knapserve.specbound: {"lambda", "t0", "depth_bound", "check_every",
// "trained_heads"}, each optional (the range checks are the service's).
absl::Status ParseSpecBound(const Json& sb, v1::SpeculationOptions& spec) {
  if (!sb.is_object())
    return FieldError("knapserve.specbound", "an object", sb);
  for (auto it = sb.begin(); it != sb.end(); ++it) {
    const std::string& key = it.key();
    if (key != "lambda" && key != "t0" && key != "depth_bound" &&
        key != "check_every" && key != "trained_heads") {
      return absl::InvalidArgumentError(absl::StrCat(
          "knapserve.specbound.", key,
          ": unknown field (expected lambda, t0, depth_bound, check_every or "
          "trained_heads)"));
    }
  }
  ASSIGN_OR_RETURN(std::optional<double> lambda, OptionalNumber(sb, "lambda"));
  if (lambda.has_value()) spec.set_specbound_lambda(*lambda);
  ASSIGN_OR_RETURN(std::optional<double> t0, OptionalNumber(sb, "t0"));
  if (t0.has_value()) spec.set_specbound_t0(*t0);
  for (const char* name : {"depth_bound", "check_every"}) {
    ASSIGN_OR_RETURN(std::optional<int64_t> n, OptionalInt(sb, name));
    if (!n.has_value()) continue;
    if (*n < 0 || *n > 1 << 20) {
      return absl::InvalidArgumentError(absl::StrCat(
          "knapserve.specbound.", name, ": must be in [0, 2^20], got ", *n));
    }
    if (std::string(name) == "depth_bound") {
      spec.set_specbound_depth_bound(static_cast<uint32_t>(*n));
    } else {
      spec.set_specbound_check_every(static_cast<uint32_t>(*n));
    }
  }
  if (Field(sb, "trained_heads") != nullptr) {
    ASSIGN_OR_RETURN(bool trained, OptionalBool(sb, "trained_heads", false));
    spec.set_specbound_trained_heads(trained);
  }
  return absl::OkStatus();
}

// The `knapserve` extension object: speculation for this request.
absl::Status ParseExtension(const Json& body, v1::GenerateRequest& wire) {
  const Json* ext = Field(body, "knapserve");
  if (ext == nullptr) return absl::OkStatus();
  if (!ext->is_object()) return FieldError("knapserve", "an object", *ext);
  for (auto it = ext->begin(); it != ext->end(); ++it) {
    const std::string& key = it.key();
    if (key != "spec" && key != "max_draft" && key != "static_mask" &&
        key != "exit_threshold" && key != "specbound") {
      return absl::InvalidArgumentError(absl::StrCat(
          "knapserve.", key,
          ": unknown field (expected spec, max_draft, static_mask, "
          "exit_threshold or specbound)"));
    }
  }
  v1::SpeculationOptions* spec = wire.mutable_speculation();
  if (const Json* mode = Field(*ext, "spec"); mode != nullptr) {
    if (!mode->is_string())
      return FieldError("knapserve.spec", "a mode name", *mode);
    absl::StatusOr<SpeculationMode> parsed =
        ParseSpeculationMode(mode->get<std::string>());
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("knapserve.spec: ", parsed.status().message()));
    }
    spec->set_mode(ToWireMode(*parsed));
  }
  ASSIGN_OR_RETURN(std::optional<int64_t> max_draft,
                   OptionalInt(*ext, "max_draft"));
  if (max_draft.has_value()) {
    if (*max_draft < 0 || *max_draft > 64) {
      return absl::InvalidArgumentError(absl::StrCat(
          "knapserve.max_draft: must be in [0, 64], got ", *max_draft));
    }
    spec->set_max_draft_tokens(static_cast<uint32_t>(*max_draft));
  }
  if (const Json* mask = Field(*ext, "static_mask"); mask != nullptr) {
    if (!mask->is_string())
      return FieldError("knapserve.static_mask", "a string", *mask);
    spec->set_static_mask(mask->get<std::string>());
  }
  ASSIGN_OR_RETURN(std::optional<double> threshold,
                   OptionalNumber(*ext, "exit_threshold"));
  if (threshold.has_value()) spec->set_exit_threshold(*threshold);
  if (const Json* sb = Field(*ext, "specbound"); sb != nullptr) {
    RETURN_IF_ERROR(ParseSpecBound(*sb, *spec));
  }
  return absl::OkStatus();
}

// The logits processors (executor/engine/logits_processors.h): OpenAI's
// presence_penalty, frequency_penalty and logit_bias ({"token id": bias}),
// vLLM's repetition_penalty, min_p, min_tokens and bad_words (here as lists
// of token ids; words as strings are refused). Their ranges are checked by
// DecodeGenerateRequest, with the same messages as for gRPC.
absl::Status ParseLogitsProcessors(const Json& body,
                                   v1::GenerateRequest& wire) {
  ASSIGN_OR_RETURN(std::optional<double> presence,
                   OptionalNumber(body, "presence_penalty"));
  if (presence.has_value()) wire.set_presence_penalty(*presence);
  ASSIGN_OR_RETURN(std::optional<double> frequency,
                   OptionalNumber(body, "frequency_penalty"));
  if (frequency.has_value()) wire.set_frequency_penalty(*frequency);
  ASSIGN_OR_RETURN(std::optional<double> repetition,
                   OptionalNumber(body, "repetition_penalty"));
  if (repetition.has_value()) wire.set_repetition_penalty(*repetition);
  ASSIGN_OR_RETURN(std::optional<double> min_p, OptionalNumber(body, "min_p"));
  if (min_p.has_value()) wire.set_min_p(*min_p);
  ASSIGN_OR_RETURN(std::optional<int64_t> min_tokens,
                   OptionalInt(body, "min_tokens"));
  if (min_tokens.has_value()) {
    if (*min_tokens < 0 || *min_tokens > INT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("min_tokens: must be >= 0, got ", *min_tokens));
    }
    wire.set_min_tokens(static_cast<int32_t>(*min_tokens));
  }
  if (const Json* bias = Field(body, "logit_bias"); bias != nullptr) {
    if (!bias->is_object()) {
      return FieldError("logit_bias", "an object of token id: bias", *bias);
    }
    for (auto it = bias->begin(); it != bias->end(); ++it) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(it.key(), &id)) {
        return absl::InvalidArgumentError(
            absl::StrCat("logit_bias: key '", it.key(), "' is not a token id"));
      }
      if (!it->is_number()) {
        return absl::InvalidArgumentError(
            absl::StrCat("logit_bias: the bias of token id ", id,
                         ": expected a number, got ", TypeName(*it)));
      }
      (*wire.mutable_logit_bias())[id] = it->get<double>();
    }
  }
  if (const Json* words = Field(body, "bad_words"); words != nullptr) {
    if (!words->is_array()) {
      return FieldError("bad_words", "a list of token-id lists", *words);
    }
    for (size_t i = 0; i < words->size(); ++i) {
      const Json& word = (*words)[i];
      if (word.is_string()) {
        return absl::InvalidArgumentError(
            "bad_words: only lists of token ids are supported (e.g. [[1234], "
            "[56, 78]]), not strings; tokenize the words with the model's "
            "tokenizer (knapserve tokenize --text ...) first");
      }
      if (!word.is_array()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "bad_words: sequence ", i, ": expected a list of token ids, got ",
            TypeName(word)));
      }
      v1::TokenIds* ids = wire.add_bad_words();
      for (const Json& id : word) {
        if (!id.is_number_integer() || id.get<int64_t>() < INT32_MIN ||
            id.get<int64_t>() > INT32_MAX) {
          return absl::InvalidArgumentError(
              absl::StrCat("bad_words: sequence ", i,
                           ": expected token ids, got ", TypeName(id)));
        }
        ids->add_ids(static_cast<int32_t>(id.get<int64_t>()));
      }
    }
  }
  return absl::OkStatus();
}

// Fields a client may send that this server cannot honour: refused, never
// silently ignored.
absl::Status RefuseUnsupported(const Json& body, OpenAiEndpoint endpoint) {
  if (endpoint == OpenAiEndpoint::kChat && Field(body, "best_of") != nullptr) {
    return absl::InvalidArgumentError(
        "best_of: a completions field (chat has n only)");
  }
  if (endpoint == OpenAiEndpoint::kChat) {
    ASSIGN_OR_RETURN(bool echo, OptionalBool(body, "echo", false));
    if (echo) {
      return absl::InvalidArgumentError(
          "echo: a completions field (chat responses hold the new message "
          "only)");
    }
  }
  if (const Json* suffix = Field(body, "suffix");
      suffix != nullptr && !(suffix->is_string() && suffix->empty())) {
    return absl::InvalidArgumentError("suffix: not supported");
  }
  for (const char* tools : {"tools", "functions"}) {
    if (const Json* t = Field(body, tools); t != nullptr && !t->empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(tools, ": tool calling is not supported"));
    }
  }
  if (const Json* tool_choice = Field(body, "tool_choice");
      tool_choice != nullptr && *tool_choice != "none") {
    return absl::InvalidArgumentError(
        "tool_choice: tool calling is not supported (only \"none\")");
  }
  if (const Json* format = Field(body, "response_format");
      format != nullptr &&
      !(format->is_object() && format->contains("type") &&
        (*format)["type"].is_string() && (*format)["type"] == "text")) {
    return absl::InvalidArgumentError(
        "response_format: only {\"type\": \"text\"}; JSON mode and JSON "
        "schemas need constrained decoding, which this server does not do");
  }
  if (const Json* audio = Field(body, "audio"); audio != nullptr) {
    return absl::InvalidArgumentError("audio: text models only");
  }
  if (endpoint == OpenAiEndpoint::kCompletions &&
      Field(body, "top_logprobs") != nullptr) {
    return absl::InvalidArgumentError(
        "top_logprobs: a chat field; completions take the count as "
        "logprobs");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<OpenAiRequest> ParseOpenAiRequest(std::string_view body_text,
                                                 OpenAiEndpoint endpoint,
                                                 const OpenAiModel& model) {
  Json body = Json::parse(body_text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) {
    return absl::InvalidArgumentError("body: not valid JSON");
  }
  if (!body.is_object()) return FieldError("body", "a JSON object", body);
  OpenAiRequest request;
  request.endpoint = endpoint;
  const Json* name = Field(body, "model");
  if (name == nullptr) {
    return absl::InvalidArgumentError("model: required but missing");
  }
  if (!name->is_string()) return FieldError("model", "a string", *name);
  if (name->get<std::string>() != model.name) {
    return absl::NotFoundError(absl::StrCat("model: '",
                                            name->get<std::string>(),
                                            "' does not exist; this server "
                                            "serves '",
                                            model.name, "'"));
  }
  RETURN_IF_ERROR(RefuseUnsupported(body, endpoint));
  v1::GenerateRequest& wire = request.wire;
  if (endpoint == OpenAiEndpoint::kCompletions) {
    RETURN_IF_ERROR(ParsePrompt(body, wire));
    // logprobs: N, the chosen token's logprob and N alternatives.
    ASSIGN_OR_RETURN(std::optional<int64_t> lp, OptionalInt(body, "logprobs"));
    if (lp.has_value()) {
      if (*lp < 0 || *lp > kMaxTopLogprobs) {
        return absl::InvalidArgumentError(absl::StrCat(
            "logprobs: must be in [0, ", kMaxTopLogprobs, "], got ", *lp));
      }
      request.logprobs = true;
      wire.set_top_logprobs(static_cast<int32_t>(*lp));
    }
    // echo: the prompt before the completion, with its tokens'
    // log-probabilities when logprobs is set.
    ASSIGN_OR_RETURN(request.echo, OptionalBool(body, "echo", false));
    wire.set_prompt_logprobs(request.echo && request.logprobs);
  } else {
    RETURN_IF_ERROR(ParseMessages(body, model, wire));
    ASSIGN_OR_RETURN(request.logprobs, OptionalBool(body, "logprobs", false));
    ASSIGN_OR_RETURN(std::optional<int64_t> top,
                     OptionalInt(body, "top_logprobs"));
    if (top.has_value()) {
      if (*top < 0 || *top > kMaxTopLogprobs) {
        return absl::InvalidArgumentError(absl::StrCat(
            "top_logprobs: must be in [0, ", kMaxTopLogprobs, "], got ", *top));
      }
      if (*top > 0 && !request.logprobs) {
        return absl::InvalidArgumentError(
            "top_logprobs: needs \"logprobs\": true");
      }
      wire.set_top_logprobs(static_cast<int32_t>(*top));
    }
  }
  wire.set_logprobs(request.logprobs);
  // max_completion_tokens is chat's newer name; either is honoured.
  ASSIGN_OR_RETURN(std::optional<int64_t> max_tokens,
                   OptionalInt(body, "max_completion_tokens"));
  const char* max_field = "max_completion_tokens";
  if (!max_tokens.has_value()) {
    ASSIGN_OR_RETURN(max_tokens, OptionalInt(body, "max_tokens"));
    max_field = "max_tokens";
  }
  if (max_tokens.has_value()) {
    if (*max_tokens < 1 || *max_tokens > INT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat(max_field, ": must be >= 1, got ", *max_tokens));
    }
    wire.set_max_new_tokens(static_cast<int32_t>(*max_tokens));
  }
  ASSIGN_OR_RETURN(std::optional<double> temperature,
                   OptionalNumber(body, "temperature"));
  // OpenAI's default temperature is 1; an unset one samples.
  wire.set_temperature(temperature.value_or(1.0));
  if (temperature.has_value() && *temperature < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature: must be >= 0, got ", *temperature));
  }
  ASSIGN_OR_RETURN(std::optional<double> top_p, OptionalNumber(body, "top_p"));
  if (top_p.has_value()) {
    if (!(*top_p > 0 && *top_p <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("top_p: must be in (0, 1], got ", *top_p));
    }
    wire.set_top_p(*top_p);
  }
  ASSIGN_OR_RETURN(std::optional<int64_t> top_k, OptionalInt(body, "top_k"));
  if (top_k.has_value()) {
    // vLLM's -1 means "no filter", as our 0 does.
    if (*top_k < -1 || *top_k > INT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("top_k: must be >= -1, got ", *top_k));
    }
    wire.set_top_k(static_cast<int32_t>(std::max<int64_t>(0, *top_k)));
  }
  ASSIGN_OR_RETURN(std::optional<int64_t> seed, OptionalInt(body, "seed"));
  if (seed.has_value()) wire.set_seed(static_cast<uint64_t>(*seed));
  ASSIGN_OR_RETURN(bool ignore_eos, OptionalBool(body, "ignore_eos", false));
  if (ignore_eos) wire.set_ignore_eos(true);
  RETURN_IF_ERROR(ParseStop(body, wire));
  if (const Json* ids = Field(body, "stop_token_ids"); ids != nullptr) {
    if (!ids->is_array()) {
      return FieldError("stop_token_ids", "a list of token ids", *ids);
    }
    ASSIGN_OR_RETURN(std::vector<int32_t> stops,
                     TokenList(*ids, "stop_token_ids"));
    wire.mutable_stop_token_ids()->Add(stops.begin(), stops.end());
  }
  RETURN_IF_ERROR(ParseLogitsProcessors(body, wire));
  RETURN_IF_ERROR(ParseExtension(body, wire));
  ASSIGN_OR_RETURN(request.stream, OptionalBool(body, "stream", false));
  // n and best_of: ranges are the request's checks (DecodeGenerateRequest).
  ASSIGN_OR_RETURN(std::optional<int64_t> n, OptionalInt(body, "n"));
  if (n.has_value()) {
    wire.set_n(static_cast<int32_t>(std::clamp<int64_t>(*n, -1, 1 << 20)));
  }
  ASSIGN_OR_RETURN(std::optional<int64_t> best_of,
                   OptionalInt(body, "best_of"));
  if (best_of.has_value()) {
    wire.set_best_of(
        static_cast<int32_t>(std::clamp<int64_t>(*best_of, -1, 1 << 20)));
    if (request.stream && *best_of > n.value_or(1)) {
      return absl::InvalidArgumentError(
          "best_of: cannot stream (the best choices are known only at the "
          "end); send stream: false or best_of equal to n");
    }
  }
  if (const Json* options = Field(body, "stream_options"); options != nullptr) {
    if (!request.stream) {
      return absl::InvalidArgumentError(
          "stream_options: only allowed when stream is true");
    }
    if (!options->is_object()) {
      return FieldError("stream_options", "an object", *options);
    }
    absl::StatusOr<bool> usage = OptionalBool(*options, "include_usage", false);
    if (!usage.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("stream_options.", usage.status().message()));
    }
    request.include_usage = *usage;
  }
  return request;
}

int HttpStatusFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      return 400;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    case absl::StatusCode::kCancelled:
      return 499;
    default:
      return 500;
  }
}

Json OpenAiErrorJson(const absl::Status& status) {
  const std::string message(status.message());
  // Our messages name the field first: "max_tokens: must be >= 1".
  Json param = nullptr;
  const size_t colon = message.find(": ");
  if (colon != std::string::npos && colon > 0) {
    const std::string head = message.substr(0, colon);
    bool is_field = true;
    for (char c : head) {
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' ||
            c == '.' || c == '[' || c == ']')) {
        is_field = false;
      }
    }
    if (is_field) param = head;
  }
  const int http = HttpStatusFor(status.code());
  std::string type = "server_error";
  if (http == 400 || http == 404) type = "invalid_request_error";
  if (http == 429) type = "rate_limit_exceeded";
  if (http == 503) type = "service_unavailable";
  Json error = {
      {"message",
       message.empty() ? absl::StatusCodeToString(status.code()) : message},
      {"type", type},
      {"param", param},
      {"code", absl::StatusCodeToString(status.code())}};
  return Json{{"error", std::move(error)}};
}

std::string OpenAiFinishReason(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAborted:
      return "abort";
    default:
      return "stop";
  }
}

Json KnapserveExtension(const GenerationResult& r, SpeculationMode mode,
                        const ServiceTimings& timings) {
  const SpeculationStats& s = r.speculation;
  Json ext = {
      {"spec", SpeculationModeName(mode)},
      {"mask", r.mask},
      {"seed", r.seed},
      {"finish_reason", FinishReasonName(r.finish_reason)},
      {"output_token_ids", r.output_ids},
      {"drafts", s.drafts},
      {"draft_tokens", s.draft_tokens},
      {"accepted_tokens", s.accepted_tokens},
      {"accepted_per_position", s.accepted_per_position},
      {"acceptance_rate", s.acceptance_rate()},
      {"mean_accepted_length", s.mean_acceptance_length()},
      {"plans_applied", r.plans.size()},
      {"mean_exit_depth", s.mean_exit_depth()},
      {"depth_bound_stops", s.depth_bound_stops},
      {"width_bound_stops", s.width_bound_stops},
      {"timings",
       {{"queue_seconds", timings.queue_seconds},
        {"first_token_seconds", timings.first_token_seconds},
        {"total_seconds", timings.total_seconds},
        {"prefill_seconds", r.stats.prefill_seconds},
        {"decode_seconds", r.stats.decode_seconds},
        {"decode_tokens_per_second", r.stats.decode_tokens_per_second()}}}};
  if (!r.matched_stop.empty()) ext["stop_sequence"] = r.matched_stop;
  if (!r.routed_domain.empty()) {
    ext["routed_domain"] = r.routed_domain;
    ext["routing_similarity"] = r.routing_similarity;
    ext["timings"]["routing_seconds"] = r.stats.routing_seconds;
  }
  if (IsPlanned(mode)) {
    // What planning did, as `knapserve generate --json` prints it
    // (profile_pending: the server was still measuring its latency profile,
    // so the request decoded plainly for want of a plan).
    ext["planning"] = PlanningJson(r.planning, r.stats.decode_seconds);
    ext["plan_requests"] = r.stats.plan_requests;
    ext["plan_failures"] = r.stats.plan_failures;
  } else if (Drafts(mode)) {
    // The guard of the unplanned drafting modes (static, knn, specbound).
    ext["guard"] = PlanningJson(r.planning, r.stats.decode_seconds)["guard"];
  }
  return ext;
}

OpenAiEncoder::OpenAiEncoder(const OpenAiRequest& request, std::string id,
                             std::string model_name, int64_t created,
                             const Tokenizer& tokenizer)
    : endpoint_(request.endpoint),
      include_usage_(request.include_usage),
      logprobs_(request.logprobs),
      echo_(request.echo),
      id_(std::move(id)),
      model_name_(std::move(model_name)),
      created_(created),
      tokenizer_(tokenizer) {}

Json OpenAiEncoder::Envelope() const {
  return Json{
      {"id", id_},
      {"object", endpoint_ == OpenAiEndpoint::kChat ? "chat.completion"
                                                    : "text_completion"},
      {"created", created_},
      {"model", model_name_}};
}

Json OpenAiEncoder::Usage(
    absl::Span<const GenerationResult* const> results) const {
  // The prompt counts once (its K/V is shared); every choice's tokens count.
  const int64_t prompt = results.empty() ? 0 : results[0]->stats.prompt_tokens;
  int64_t completion = 0;
  for (const GenerationResult* result : results) {
    completion += result->stats.completion_tokens;
  }
  return Json{{"prompt_tokens", prompt},
              {"completion_tokens", completion},
              {"total_tokens", prompt + completion}};
}

std::string OpenAiEncoder::TokenText(int32_t id) const {
  const int32_t single[] = {id};
  absl::StatusOr<std::string> piece = tokenizer_.Decode(single, false);
  return piece.ok() ? *piece : "";
}

Json OpenAiEncoder::Logprobs(absl::Span<const int32_t> ids,
                             const StepLogprobs& logprobs,
                             int64_t& text_offset) const {
  if (!logprobs_) return nullptr;
  Json tokens = Json::array(), values = Json::array(), offsets = Json::array();
  Json content = Json::array(), tops = Json::array();
  auto bytes_of = [](const std::string& token) {
    Json bytes = Json::array();
    for (unsigned char c : token) bytes.push_back(static_cast<int>(c));
    return bytes;
  };
  for (size_t i = 0; i < ids.size() && i < logprobs.chosen.size(); ++i) {
    const std::string token = TokenText(ids[i]);
    const double lp = logprobs.chosen[i];
    const absl::Span<const TokenLogprob> top =
        i < logprobs.top.size() ? absl::MakeConstSpan(logprobs.top[i])
                                : absl::Span<const TokenLogprob>();
    if (endpoint_ == OpenAiEndpoint::kChat) {
      Json alternatives = Json::array();
      for (const TokenLogprob& alt : top) {
        const std::string text = TokenText(alt.id);
        alternatives.push_back(Json{{"token", text},
                                    {"logprob", alt.logprob},
                                    {"bytes", bytes_of(text)}});
      }
      content.push_back(Json{{"token", token},
                             {"logprob", lp},
                             {"bytes", bytes_of(token)},
                             {"top_logprobs", std::move(alternatives)}});
    } else {
      tokens.push_back(token);
      values.push_back(lp);
      offsets.push_back(text_offset);
      text_offset += static_cast<int64_t>(token.size());
      // OpenAI's legacy shape: {token text: logprob}; ids that decode to
      // the same text keep the likelier one (the first).
      Json alternatives = Json::object();
      for (const TokenLogprob& alt : top) {
        const std::string text = TokenText(alt.id);
        if (!alternatives.contains(text)) alternatives[text] = alt.logprob;
      }
      tops.push_back(std::move(alternatives));
    }
  }
  if (endpoint_ == OpenAiEndpoint::kChat) {
    return Json{{"content", std::move(content)}};
  }
  return Json{
      {"tokens", std::move(tokens)},
      {"token_logprobs", std::move(values)},
      {"top_logprobs", logprobs.top.empty() ? Json(nullptr) : std::move(tops)},
      {"text_offset", std::move(offsets)}};
}

void OpenAiEncoder::SetPrompt(std::vector<int32_t> ids, std::string text) {
  prompt_ids_ = std::move(ids);
  prompt_text_ = std::move(text);
}

Json OpenAiEncoder::PromptLogprobs(const StepLogprobs& logprobs,
                                   int64_t& text_offset) const {
  Json tokens = Json::array(), values = Json::array(), offsets = Json::array();
  Json tops = Json::array();
  for (size_t i = 0; i < prompt_ids_.size(); ++i) {
    const std::string token = TokenText(prompt_ids_[i]);
    tokens.push_back(token);
    offsets.push_back(text_offset);
    text_offset += static_cast<int64_t>(token.size());
    // The first token has no position before it: null, as OpenAI's.
    values.push_back(i > 0 && i - 1 < logprobs.prompt.size()
                         ? Json(logprobs.prompt[i - 1])
                         : Json(nullptr));
    if (i == 0 || i - 1 >= logprobs.prompt_top.size()) {
      tops.push_back(nullptr);
      continue;
    }
    Json alternatives = Json::object();
    for (const TokenLogprob& alt : logprobs.prompt_top[i - 1]) {
      const std::string text = TokenText(alt.id);
      if (!alternatives.contains(text)) alternatives[text] = alt.logprob;
    }
    tops.push_back(std::move(alternatives));
  }
  return Json{{"tokens", std::move(tokens)},
              {"token_logprobs", std::move(values)},
              {"top_logprobs",
               logprobs.prompt_top.empty() ? Json(nullptr) : std::move(tops)},
              {"text_offset", std::move(offsets)}};
}

namespace {

// Appends the legacy logprobs object `more` to `into` (the echoed prompt's,
// then the completion's).
void AppendLegacyLogprobs(Json& into, const Json& more) {
  for (const char* key : {"tokens", "token_logprobs", "text_offset"}) {
    for (const Json& v : more[key]) into[key].push_back(v);
  }
  if (into["top_logprobs"].is_null() && more["top_logprobs"].is_null()) return;
  Json tops =
      into["top_logprobs"].is_array() ? into["top_logprobs"] : Json::array();
  if (into["top_logprobs"].is_null()) {
    for (size_t i = 0; i < into["tokens"].size() - more["tokens"].size(); ++i)
      tops.push_back(nullptr);
  }
  if (more["top_logprobs"].is_array()) {
    for (const Json& v : more["top_logprobs"]) tops.push_back(v);
  } else {
    for (size_t i = 0; i < more["tokens"].size(); ++i) tops.push_back(nullptr);
  }
  into["top_logprobs"] = std::move(tops);
}

}  // namespace

std::string OpenAiEncoder::Event(const Json& data) {
  return absl::StrCat(
      "data: ", data.dump(-1, ' ', false, Json::error_handler_t::replace),
      "\n\n");
}

OpenAiEncoder::ChoiceState& OpenAiEncoder::State(int index) {
  if (static_cast<int>(choices_.size()) <= index) choices_.resize(index + 1);
  return choices_[index];
}

std::string OpenAiEncoder::StreamTokens(int index,
                                        absl::Span<const int32_t> ids,
                                        std::string_view text,
                                        const StepLogprobs& logprobs) {
  ChoiceState& state = State(index);
  std::string echoed;
  if (echo_ && !state.sent_echo && endpoint_ == OpenAiEndpoint::kCompletions) {
    // The prompt first, in an event of its own.
    state.sent_echo = true;
    Json chunk = Envelope();
    chunk["choices"] = Json::array({Json{
        {"index", index},
        {"text", prompt_text_},
        {"logprobs", logprobs_ ? PromptLogprobs(logprobs, state.text_offset)
                               : Json(nullptr)},
        {"finish_reason", nullptr}}});
    if (include_usage_) chunk["usage"] = nullptr;
    echoed = Event(chunk);
  }
  Json chunk = Envelope();
  Json choice = {{"index", index},
                 {"logprobs", Logprobs(ids, logprobs, state.text_offset)},
                 {"finish_reason", nullptr}};
  if (endpoint_ == OpenAiEndpoint::kChat) {
    chunk["object"] = "chat.completion.chunk";
    Json delta = {{"content", std::string(text)}};
    if (!state.sent_role) delta["role"] = "assistant";
    state.sent_role = true;
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = std::string(text);
  }
  chunk["choices"] = Json::array({std::move(choice)});
  chunk["knapserve"] =
      Json{{"token_ids", std::vector<int32_t>(ids.begin(), ids.end())}};
  if (include_usage_) chunk["usage"] = nullptr;
  return echoed + Event(chunk);
}

std::string OpenAiEncoder::StreamEnd(
    absl::Span<const GenerationResult* const> results, SpeculationMode mode,
    const ServiceTimings& timings) {
  std::string out;
  for (const GenerationResult* result : results) {
    ChoiceState& state = State(result->index);
    Json chunk = Envelope();
    Json choice = {
        {"index", result->index},
        {"logprobs", nullptr},
        {"finish_reason", OpenAiFinishReason(result->finish_reason)}};
    if (endpoint_ == OpenAiEndpoint::kChat) {
      chunk["object"] = "chat.completion.chunk";
      Json delta = Json::object();
      if (!state.sent_role) delta["role"] = "assistant";
      choice["delta"] = std::move(delta);
    } else {
      choice["text"] = "";
    }
    chunk["choices"] = Json::array({std::move(choice)});
    chunk["knapserve"] = KnapserveExtension(*result, mode, timings);
    if (include_usage_) chunk["usage"] = nullptr;
    out += Event(chunk);
  }
  if (include_usage_) {
    Json usage = Envelope();
    if (endpoint_ == OpenAiEndpoint::kChat)
      usage["object"] = "chat.completion.chunk";
    usage["choices"] = Json::array();
    usage["usage"] = Usage(results);
    out += Event(usage);
  }
  return out + "data: [DONE]\n\n";
}

std::string OpenAiEncoder::StreamError(const absl::Status& status) {
  return Event(OpenAiErrorJson(status)) + "data: [DONE]\n\n";
}

Json OpenAiEncoder::Response(absl::Span<const GenerationResult* const> results,
                             SpeculationMode mode,
                             const ServiceTimings& timings) const {
  Json response = Envelope();
  const bool echo = echo_ && endpoint_ == OpenAiEndpoint::kCompletions;
  Json choices = Json::array();
  for (const GenerationResult* result : results) {
    int64_t offset = 0;
    const StepLogprobs all{result->output_logprobs, result->output_top_logprobs,
                           result->prompt_logprobs,
                           result->prompt_top_logprobs};
    Json logprobs = nullptr;
    if (logprobs_ && echo) {
      logprobs = PromptLogprobs(all, offset);
      AppendLegacyLogprobs(logprobs, Logprobs(result->output_ids, all, offset));
    } else {
      logprobs = Logprobs(result->output_ids, all, offset);
    }
    Json choice = {
        {"index", result->index},
        {"logprobs", std::move(logprobs)},
        {"finish_reason", OpenAiFinishReason(result->finish_reason)}};
    if (endpoint_ == OpenAiEndpoint::kChat) {
      choice["message"] = {{"role", "assistant"}, {"content", result->text}};
    } else {
      choice["text"] = echo ? prompt_text_ + result->text : result->text;
    }
    // Each choice's own speculation statistics when there are several.
    if (results.size() > 1) {
      choice["knapserve"] = KnapserveExtension(*result, mode, timings);
    }
    choices.push_back(std::move(choice));
  }
  response["choices"] = std::move(choices);
  response["usage"] = Usage(results);
  if (!results.empty()) {
    response["knapserve"] = KnapserveExtension(*results[0], mode, timings);
  }
  return response;
}

}  // namespace knapserve

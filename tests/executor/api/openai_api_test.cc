// Tests of the OpenAI wire format (executor/api/openai_api.h): request bodies
// parsed into the gRPC request they mean, every refusal naming its field,
// and the response, stream and error shapes clients read.
#include "executor/api/openai_api.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using Json = nlohmann::json;

OpenAiModel Model(const ChatPromptFormat* chat = nullptr) {
  OpenAiModel model;
  model.name = "stories";
  model.tokenizer = testing::StoriesTokenizer();
  model.chat = chat;
  return model;
}

absl::StatusOr<OpenAiRequest> Parse(
    const Json& body, OpenAiEndpoint endpoint = OpenAiEndpoint::kCompletions,
    const ChatPromptFormat* chat = nullptr) {
  return ParseOpenAiRequest(body.dump(), endpoint, Model(chat));
}

TEST(OpenAiApiTest, CompletionFieldsBecomeTheGrpcRequest) {
  if (testing::StoriesTokenizer() == nullptr) GTEST_SKIP() << "no tokenizer";
  absl::StatusOr<OpenAiRequest> r = Parse(
      Json{{"model", "stories"},
           {"prompt", "Once upon a time"},
           {"max_tokens", 12},
           {"temperature", 0.5},
           {"top_p", 0.9},
           {"top_k", -1},
           {"seed", 7},
           {"stop", Json::array({"\n", "The end"})},
           {"stop_token_ids", Json::array({2})},
           {"ignore_eos", true},
           {"logprobs", 0},
           {"stream", true},
           {"stream_options", {{"include_usage", true}}},
           {"user", "ignored"},
           {"knapserve",
            {{"spec", "static"}, {"max_draft", 3}, {"static_mask", "0-3"}}}});
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::GenerateRequest& w = r->wire;
  EXPECT_EQ(w.text(), "Once upon a time");
  EXPECT_EQ(w.max_new_tokens(), 12);
  EXPECT_DOUBLE_EQ(w.temperature(), 0.5);
  EXPECT_DOUBLE_EQ(w.top_p(), 0.9);
  EXPECT_EQ(w.top_k(), 0);
  EXPECT_EQ(w.seed(), 7u);
  ASSERT_EQ(w.stop_size(), 2);
  EXPECT_EQ(w.stop(1), "The end");
  ASSERT_EQ(w.stop_token_ids_size(), 1);
  EXPECT_TRUE(w.ignore_eos());
  EXPECT_TRUE(w.logprobs());
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  EXPECT_EQ(w.speculation().mode(), v1::SPECULATION_MODE_STATIC);
  EXPECT_EQ(w.speculation().max_draft_tokens(), 3u);
  EXPECT_EQ(w.speculation().static_mask(), "0-3");
}

TEST(OpenAiApiTest, SpecBoundSettingsMapToTheWire) {
  if (testing::StoriesTokenizer() == nullptr) GTEST_SKIP() << "no tokenizer";
  absl::StatusOr<OpenAiRequest> r =
      Parse(Json{{"model", "stories"},
                 {"prompt", "Once"},
                 {"knapserve",
                  {{"spec", "specbound"},
                   {"max_draft", 8},
                   {"specbound",
                    {{"lambda", 0.6},
                     {"t0", 1.5},
                     {"depth_bound", 12},
                     {"check_every", 2},
                     {"trained_heads", true}}}}}});
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::SpeculationOptions& s = r->wire.speculation();
  EXPECT_EQ(s.mode(), v1::SPECULATION_MODE_SPECBOUND);
  EXPECT_EQ(s.max_draft_tokens(), 8u);
  EXPECT_DOUBLE_EQ(s.specbound_lambda(), 0.6);
  EXPECT_DOUBLE_EQ(s.specbound_t0(), 1.5);
  EXPECT_EQ(s.specbound_depth_bound(), 12u);
  EXPECT_EQ(s.specbound_check_every(), 2u);
  EXPECT_TRUE(s.has_specbound_trained_heads());
  EXPECT_TRUE(s.specbound_trained_heads());
  // Unset fields stay unset (the server's defaults).
  absl::StatusOr<OpenAiRequest> bare = Parse(Json{
      {"model", "stories"},
      {"prompt", "Once"},
      {"knapserve", {{"spec", "specbound"}, {"specbound", Json::object()}}}});
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_FALSE(bare->wire.speculation().has_specbound_lambda());
  EXPECT_FALSE(bare->wire.speculation().has_specbound_trained_heads());
}

// OpenAI's penalties and logit_bias (token ids as strings, as OpenAI sends
// them) and vLLM's repetition_penalty, min_p, min_tokens and bad_words (as
// token-id lists) reach the gRPC request; unset ones stay unset.
TEST(OpenAiApiTest, LogitsProcessorFieldsBecomeTheGrpcRequest) {
  if (testing::StoriesTokenizer() == nullptr) GTEST_SKIP() << "no tokenizer";
  absl::StatusOr<OpenAiRequest> r =
      Parse(Json{{"model", "stories"},
                 {"prompt", "Once"},
                 {"presence_penalty", 0.5},
                 {"frequency_penalty", -1.25},
                 {"repetition_penalty", 1.1},
                 {"min_p", 0.05},
                 {"min_tokens", 7},
                 {"logit_bias", {{"12", 5}, {"300", -100}}},
                 {"bad_words", {{4}, {5, 6}}}});
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::GenerateRequest& w = r->wire;
  EXPECT_DOUBLE_EQ(w.presence_penalty(), 0.5);
  EXPECT_DOUBLE_EQ(w.frequency_penalty(), -1.25);
  EXPECT_DOUBLE_EQ(w.repetition_penalty(), 1.1);
  EXPECT_DOUBLE_EQ(w.min_p(), 0.05);
  EXPECT_EQ(w.min_tokens(), 7);
  ASSERT_EQ(w.logit_bias_size(), 2);
  EXPECT_DOUBLE_EQ(w.logit_bias().at(12), 5.0);
  EXPECT_DOUBLE_EQ(w.logit_bias().at(300), -100.0);
  ASSERT_EQ(w.bad_words_size(), 2);
  EXPECT_EQ(w.bad_words(0).ids_size(), 1);
  EXPECT_EQ(w.bad_words(1).ids(1), 6);
  absl::StatusOr<OpenAiRequest> bare =
      Parse(Json{{"model", "stories"},
                 {"prompt", "Once"},
                 {"logit_bias", nullptr},
                 {"presence_penalty", nullptr}});
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_FALSE(bare->wire.has_presence_penalty());
  EXPECT_FALSE(bare->wire.has_repetition_penalty());
  EXPECT_FALSE(bare->wire.has_min_tokens());
  EXPECT_EQ(bare->wire.logit_bias_size(), 0);
  // Words as strings are refused, saying what is taken instead.
  auto words = Parse(Json{
      {"model", "stories"}, {"prompt", "Once"}, {"bad_words", {"dragon"}}});
  EXPECT_NE(words.status().message().find("only lists of token ids"),
            std::string::npos)
      << words.status();
}

TEST(OpenAiApiTest, PromptsComeAsTextTokensOrAListOfOne) {
  if (testing::StoriesTokenizer() == nullptr) GTEST_SKIP() << "no tokenizer";
  auto ids = Parse(Json{{"model", "stories"}, {"prompt", {1, 403, 9}}});
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(ids->wire.token_ids().ids_size(), 3);
  auto nested = Parse(Json{{"model", "stories"}, {"prompt", {{1, 403}}}});
  ASSERT_TRUE(nested.ok()) << nested.status();
  EXPECT_EQ(nested->wire.token_ids().ids_size(), 2);
  auto one = Parse(Json{{"model", "stories"}, {"prompt", {"Hi"}}});
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->wire.text(), "Hi");
  // OpenAI's default temperature is 1 (sampling).
  EXPECT_DOUBLE_EQ(one->wire.temperature(), 1.0);
  auto two = Parse(Json{{"model", "stories"}, {"prompt", {"a", "b"}}});
  EXPECT_EQ(two.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(two.status().message().find("one prompt per request"),
            std::string::npos);
}

// Each refusal is InvalidArgument (NotFound for the model) and starts with
// the field it is about, which becomes the error's `param`.
TEST(OpenAiApiTest, RefusalsNameTheirField) {
  if (testing::StoriesTokenizer() == nullptr) GTEST_SKIP() << "no tokenizer";
  const Json base = {{"model", "stories"}, {"prompt", "Once"}};
  struct Case {
    Json patch;
    std::string field;
  };
  const std::vector<Case> cases = {
      {{{"max_tokens", "ten"}}, "max_tokens"},
      {{{"max_tokens", 0}}, "max_tokens"},
      {{{"max_completion_tokens", -3}}, "max_completion_tokens"},
      {{{"temperature", -1}}, "temperature"},
      {{{"top_p", 0}}, "top_p"},
      {{{"n", "two"}}, "n"},
      {{{"best_of", 3}, {"stream", true}}, "best_of"},
      {{{"echo", "yes"}}, "echo"},
      {{{"presence_penalty", "high"}}, "presence_penalty"},
      {{{"frequency_penalty", true}}, "frequency_penalty"},
      {{{"repetition_penalty", "x"}}, "repetition_penalty"},
      {{{"min_p", Json::array()}}, "min_p"},
      {{{"min_tokens", -1}}, "min_tokens"},
      {{{"min_tokens", 1.5}}, "min_tokens"},
      {{{"logit_bias", 5}}, "logit_bias"},
      {{{"logit_bias", {{"twelve", 5}}}}, "logit_bias"},
      {{{"logit_bias", {{"12", "up"}}}}, "logit_bias"},
      {{{"bad_words", {"word"}}}, "bad_words"},
      {{{"bad_words", 3}}, "bad_words"},
      {{{"bad_words", {{1, "x"}}}}, "bad_words"},
      {{{"top_logprobs", 2}}, "top_logprobs"},
      {{{"suffix", "x"}}, "suffix"},
      {{{"response_format", {{"type", "json_object"}}}}, "response_format"},
      {{{"tool_choice", "auto"}}, "tool_choice"},
      {{{"audio", {{"voice", "alloy"}}}}, "audio"},
      {{{"logprobs", 21}}, "logprobs"},
      {{{"logprobs", -1}}, "logprobs"},
      {{{"stop", 5}}, "stop"},
      {{{"stop", {"a", 1}}}, "stop[1]"},
      {{{"stream_options", {{"include_usage", true}}}}, "stream_options"},
      {{{"knapserve", {{"spec", "warp"}}}}, "knapserve.spec"},
      {{{"knapserve", {{"max_draft", 99}}}}, "knapserve.max_draft"},
      {{{"knapserve", {{"gamma", 2}}}}, "knapserve.gamma"},
      {{{"knapserve", {{"specbound", 3}}}}, "knapserve.specbound"},
      {{{"knapserve", {{"specbound", {{"depth", 3}}}}}},
       "knapserve.specbound.depth"},
      {{{"knapserve", {{"specbound", {{"depth_bound", -1}}}}}},
       "knapserve.specbound.depth_bound"},
      {{{"prompt", {1, "x"}}}, "prompt[1]"},
      {{{"prompt", 3}}, "prompt"},
      {{{"model", 3}}, "model"},
  };
  for (const Case& c : cases) {
    Json body = base;
    body.update(c.patch);
    absl::StatusOr<OpenAiRequest> r = Parse(body);
    ASSERT_FALSE(r.ok()) << body.dump();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument)
        << body.dump();
    EXPECT_EQ(OpenAiErrorJson(r.status())["error"]["param"], c.field)
        << r.status();
  }
  // What these refusals leave alone: plain text output, no tools, n and
  // best_of in range (their ranges are DecodeGenerateRequest's).
  Json fine = base;
  fine.update(Json{{"response_format", {{"type", "text"}}},
                   {"tool_choice", "none"},
                   {"n", 2},
                   {"best_of", 3}});
  absl::StatusOr<OpenAiRequest> accepted = Parse(fine);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_EQ(accepted->wire.n(), 2);
  EXPECT_EQ(accepted->wire.best_of(), 3);
  auto missing = Parse(Json{{"model", "stories"}});
  EXPECT_EQ(OpenAiErrorJson(missing.status())["error"]["param"], "prompt");
  auto other = Parse(Json{{"model", "gpt-4"}, {"prompt", "x"}});
  EXPECT_EQ(other.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(HttpStatusFor(other.status().code()), 404);
  auto not_json =
      ParseOpenAiRequest("{\"model\": ", OpenAiEndpoint::kChat, Model());
  EXPECT_EQ(not_json.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(OpenAiApiTest, ChatRendersTheTemplateOrSaysThereIsNone) {
  if (testing::StoriesTokenizer() == nullptr) GTEST_SKIP() << "no tokenizer";
  const Json body = {{"model", "stories"},
                     {"messages",
                      {{{"role", "system"}, {"content", "Be kind."}},
                       {{"role", "user"},
                        {"content",
                         {{{"type", "text"}, {"text", "Once upon "}},
                          {{"type", "text"}, {"text", "a time"}}}}}}},
                     {"logprobs", true},
                     {"top_logprobs", 0}};
  auto none = Parse(body, OpenAiEndpoint::kChat);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("no chat template"),
            std::string::npos);
  EXPECT_EQ(HttpStatusFor(none.status().code()), 400);

  absl::StatusOr<ChatTemplate> tmpl = ChatTemplate::Parse(
      "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}"
      "{{ m.content }}{% endif %}{% endfor %}");
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();
  ChatPromptFormat chat{*tmpl, "<s>", "</s>"};
  auto r = Parse(body, OpenAiEndpoint::kChat, &chat);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->logprobs);
  // "<s>" is written by the template and matched as the BOS token; the
  // tokenizer adds nothing of its own: the same ids as the text prompt
  // with the tokenizer's special tokens.
  absl::StatusOr<std::vector<int32_t>> expected =
      testing::StoriesTokenizer()->Encode("Once upon a time", true);
  ASSERT_TRUE(expected.ok());
  EXPECT_EQ(std::vector<int32_t>(r->wire.token_ids().ids().begin(),
                                 r->wire.token_ids().ids().end()),
            *expected);

  Json bad = body;
  bad["messages"][1]["content"] = {{{"type", "image_url"}}};
  EXPECT_EQ(
      OpenAiErrorJson(
          Parse(bad, OpenAiEndpoint::kChat, &chat).status())["error"]["param"],
      "messages[1].content[0].type");
  bad = body;
  bad["messages"][0]["role"] = "wizard";
  EXPECT_EQ(
      OpenAiErrorJson(
          Parse(bad, OpenAiEndpoint::kChat, &chat).status())["error"]["param"],
      "messages[0].role");
  bad = body;
  bad["top_logprobs"] = 21;
  EXPECT_EQ(
      OpenAiErrorJson(
          Parse(bad, OpenAiEndpoint::kChat, &chat).status())["error"]["param"],
      "top_logprobs");
  bad["top_logprobs"] = 2;
  bad["logprobs"] = false;
  EXPECT_EQ(
      OpenAiErrorJson(
          Parse(bad, OpenAiEndpoint::kChat, &chat).status())["error"]["param"],
      "top_logprobs");
  bad = body;
  bad["echo"] = true;
  EXPECT_EQ(
      OpenAiErrorJson(
          Parse(bad, OpenAiEndpoint::kChat, &chat).status())["error"]["param"],
      "echo");
  Json top = body;
  top["top_logprobs"] = 20;
  auto with_top = Parse(top, OpenAiEndpoint::kChat, &chat);
  ASSERT_TRUE(with_top.ok()) << with_top.status();
  EXPECT_TRUE(with_top->wire.logprobs());
  EXPECT_EQ(with_top->wire.top_logprobs(), 20);
}

// Alternatives at each position in both of OpenAI's shapes: chat's
// content[i].top_logprobs list of {token, logprob, bytes}, and the legacy
// completions' top_logprobs list of {token text: logprob} (logprobs: N).
TEST(OpenAiApiTest, TopLogprobsUseEachEndpointsShape) {
  if (testing::StoriesTokenizer() == nullptr) GTEST_SKIP() << "no tokenizer";
  const Json completion = {
      {"model", "stories"}, {"prompt", "Once"}, {"logprobs", 2}};
  auto parsed = Parse(completion, OpenAiEndpoint::kCompletions);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->logprobs);
  EXPECT_EQ(parsed->wire.top_logprobs(), 2);
  EXPECT_FALSE(parsed->echo);
  EXPECT_FALSE(parsed->wire.prompt_logprobs());
  // echo asks for the prompt's log-probabilities only with logprobs.
  Json echo = completion;
  echo["echo"] = true;
  auto echoed = Parse(echo, OpenAiEndpoint::kCompletions);
  ASSERT_TRUE(echoed.ok()) << echoed.status();
  EXPECT_TRUE(echoed->echo);
  EXPECT_TRUE(echoed->wire.prompt_logprobs());
  echo.erase("logprobs");
  echoed = Parse(echo, OpenAiEndpoint::kCompletions);
  ASSERT_TRUE(echoed.ok()) << echoed.status();
  EXPECT_TRUE(echoed->echo);
  EXPECT_FALSE(echoed->wire.prompt_logprobs());

  const std::vector<int32_t> ids = {403};
  const std::vector<float> chosen = {-0.25f};
  const std::vector<std::vector<TokenLogprob>> top = {
      {{403, -0.25f}, {261, -1.5f}}};
  OpenAiRequest request;
  request.endpoint = OpenAiEndpoint::kCompletions;
  request.stream = true;
  request.logprobs = true;
  OpenAiEncoder legacy(request, "cmpl-1", "stories", 1700000000,
                       *testing::StoriesTokenizer());
  const Json event = Json::parse(
      legacy.StreamTokens(0, ids, " Once", StepLogprobs{chosen, top})
          .substr(6));
  const Json& lp = event["choices"][0]["logprobs"];
  ASSERT_EQ(lp["top_logprobs"].size(), 1u);
  const Json& alternatives = lp["top_logprobs"][0];
  ASSERT_EQ(alternatives.size(), 2u) << alternatives.dump();
  // {token text: logprob} (a JSON object: no order of its own).
  std::vector<double> values;
  for (const auto& [text, value] : alternatives.items()) {
    values.push_back(value.get<double>());
  }
  std::sort(values.begin(), values.end(), std::greater<double>());
  EXPECT_EQ(values, (std::vector<double>{-0.25, -1.5}));
  EXPECT_DOUBLE_EQ(lp["token_logprobs"][0].get<double>(), -0.25);

  request.endpoint = OpenAiEndpoint::kChat;
  OpenAiEncoder chat(request, "chatcmpl-1", "stories", 1700000000,
                     *testing::StoriesTokenizer());
  const Json chunk = Json::parse(
      chat.StreamTokens(0, ids, " Once", StepLogprobs{chosen, top}).substr(6));
  const Json& content = chunk["choices"][0]["logprobs"]["content"][0];
  ASSERT_EQ(content["top_logprobs"].size(), 2u);
  EXPECT_DOUBLE_EQ(content["top_logprobs"][1]["logprob"].get<double>(), -1.5);
  EXPECT_TRUE(content["top_logprobs"][1]["bytes"].is_array());
  // Without alternatives the legacy shape keeps top_logprobs null.
  OpenAiRequest plain = request;
  plain.endpoint = OpenAiEndpoint::kCompletions;
  OpenAiEncoder no_top(plain, "cmpl-2", "stories", 1700000000,
                       *testing::StoriesTokenizer());
  EXPECT_TRUE(
      Json::parse(no_top.StreamTokens(0, ids, " Once", StepLogprobs{chosen})
                      .substr(6))["choices"][0]["logprobs"]["top_logprobs"]
          .is_null());
}

TEST(OpenAiApiTest, ErrorsUseOpenAisShapeAndCodes) {
  const Json e =
      OpenAiErrorJson(absl::InvalidArgumentError("max_tokens: must be >= 1"));
  EXPECT_EQ(e["error"]["message"], "max_tokens: must be >= 1");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["param"], "max_tokens");
  EXPECT_TRUE(OpenAiErrorJson(absl::InternalError(
      "generation failed: x y"))["error"]["param"]
                  .is_null());
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kResourceExhausted), 429);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kUnavailable), 503);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kInternal), 500);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kFailedPrecondition), 400);
}

TEST(OpenAiApiTest, StreamEventsEndWithUsageAndDone) {
  if (testing::StoriesTokenizer() == nullptr) GTEST_SKIP() << "no tokenizer";
  OpenAiRequest request;
  request.endpoint = OpenAiEndpoint::kChat;
  request.stream = true;
  request.include_usage = true;
  request.logprobs = true;
  OpenAiEncoder encoder(request, "chatcmpl-1", "stories", 1700000000,
                        *testing::StoriesTokenizer());
  const std::vector<int32_t> ids = {403};
  const std::vector<float> lps = {-0.25f};
  const std::string first =
      encoder.StreamTokens(0, ids, " Once", StepLogprobs{lps});
  ASSERT_EQ(first.rfind("data: ", 0), 0u);
  ASSERT_EQ(first.substr(first.size() - 2), "\n\n");
  const Json chunk = Json::parse(first.substr(6));
  EXPECT_EQ(chunk["object"], "chat.completion.chunk");
  EXPECT_EQ(chunk["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(chunk["choices"][0]["delta"]["content"], " Once");
  EXPECT_DOUBLE_EQ(
      chunk["choices"][0]["logprobs"]["content"][0]["logprob"].get<double>(),
      -0.25);
  EXPECT_TRUE(chunk["usage"].is_null());
  const Json second = Json::parse(
      encoder.StreamTokens(0, ids, "x", StepLogprobs{lps}).substr(6));
  EXPECT_FALSE(second["choices"][0]["delta"].contains("role"));

  GenerationResult result;
  result.output_ids = {403, 403};
  result.stats.prompt_tokens = 5;
  result.stats.completion_tokens = 2;
  result.finish_reason = FinishReason::kLength;
  const std::string end =
      encoder.StreamEnd({&result}, SpeculationMode::kOff, ServiceTimings{});
  std::vector<std::string> events;
  for (size_t at = 0; at < end.size();) {
    const size_t next = end.find("\n\n", at);
    ASSERT_NE(next, std::string::npos);
    events.push_back(end.substr(at + 6, next - at - 6));
    at = next + 2;
  }
  ASSERT_EQ(events.size(), 3u) << end;
  EXPECT_EQ(Json::parse(events[0])["choices"][0]["finish_reason"], "length");
  const Json usage = Json::parse(events[1]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["total_tokens"], 7);
  EXPECT_EQ(events[2], "[DONE]");
}

}  // namespace
}  // namespace knapserve

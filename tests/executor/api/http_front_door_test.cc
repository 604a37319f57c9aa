// Tests of the OpenAI-compatible HTTP front door
// (executor/api/http_front_door.h) over real loopback HTTP with cpp-httplib's
// client, on the same executor as gRPC: greedy output equal to local generation
// (whole and streamed), chat through a template, logprobs, OpenAI's error shape
// and codes (400, 404, 413, 429, 503), the info endpoints, a client that
// disconnects (streamed or not) stopping its sequence and freeing its K/V, and
// request ids no gRPC client can guess or abort.
#include "executor/api/http_front_door.h"

#include <arpa/inet.h>
#include <c10/util/Exception.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "executor/api/executor_server.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

using Json = nlohmann::json;
using testing::CachedModel;
using testing::StoriesTokenizer;

constexpr char kTemplate[] =
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}"
    "{{ m.content }}{% endif %}{% endfor %}";

struct Server {
  const LlamaModel* model = nullptr;
  std::unique_ptr<ExecutorServer> server;
  std::unique_ptr<httplib::Client> http;
};

Server StartServer(GenerationServiceOptions options, bool with_template,
                   MetricsRegistry* metrics = nullptr,
                   int64_t max_body_bytes = 4 << 20) {
  Server s;
  s.model = CachedModel("stories260k");
  if (s.model == nullptr) return s;
  options.model_path = testing::Stories260kDir();
  options.metrics = metrics;
  auto server = ExecutorServer::Start(*s.model, *StoriesTokenizer(), options,
                                      "127.0.0.1:0");
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return s;
  HttpFrontDoorOptions http;
  http.model_name = "stories260k";
  http.metrics = metrics;
  http.max_body_bytes = max_body_bytes;
  if (with_template) {
    absl::StatusOr<ChatTemplate> parsed = ChatTemplate::Parse(kTemplate);
    EXPECT_TRUE(parsed.ok()) << parsed.status();
    http.chat = ChatPromptFormat{*parsed, "<s>", "</s>"};
  }
  absl::Status started = (*server)->StartHttp("127.0.0.1:0", std::move(http));
  EXPECT_TRUE(started.ok()) << started;
  s.server = std::move(*server);
  s.http =
      std::make_unique<httplib::Client>("127.0.0.1", s.server->http_port());
  s.http->set_read_timeout(60, 0);
  return s;
}

Server StartServer(int max_running = 4, int max_queue = 16,
                   bool with_template = true) {
  GenerationServiceOptions options;
  options.scheduler.max_running = max_running;
  options.scheduler.max_queue = max_queue;
  return StartServer(options, with_template);
}

struct Reply {
  int status = 0;
  Json body;
};

Reply Post(httplib::Client& http, const std::string& path, const Json& body) {
  httplib::Result res = http.Post(path, body.dump(), "application/json");
  Reply reply;
  if (!res) return reply;
  reply.status = res->status;
  reply.body = Json::parse(res->body, nullptr, false);
  return reply;
}

// A streamed response's events: the JSON ones, and whether [DONE] closed it.
struct Events {
  int status = 0;
  std::vector<Json> events;
  bool done = false;
  std::string text;  // concatenated choices' text / delta content
  std::vector<int32_t> ids;
};

// Streams `body` to `path`. `keep_reading` sees each event and may return
// false to drop the connection there.
Events Stream(httplib::Client& http, const std::string& path, const Json& body,
              const std::function<bool(const Json&)>& keep_reading = nullptr) {
  Events out;
  std::string buffer;
  httplib::Request req;
  req.method = "POST";
  req.path = path;
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.response_handler = [&](const httplib::Response& res) {
    out.status = res.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t size, uint64_t,
                             uint64_t) {
    buffer.append(data, size);
    for (size_t end; (end = buffer.find("\n\n")) != std::string::npos;) {
      const std::string event = buffer.substr(0, end);
      buffer.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      const std::string data_text = event.substr(6);
      if (data_text == "[DONE]") {
        out.done = true;
        continue;
      }
      Json json = Json::parse(data_text, nullptr, false);
      if (json.contains("choices") && !json["choices"].empty()) {
        const Json& choice = json["choices"][0];
        if (choice.contains("text")) out.text += choice["text"];
        if (choice.contains("delta") && choice["delta"].contains("content"))
          out.text += choice["delta"]["content"];
      }
      if (json.contains("knapserve") &&
          json["knapserve"].contains("token_ids")) {
        for (int32_t id : json["knapserve"]["token_ids"]) out.ids.push_back(id);
      }
      out.events.push_back(json);
      if (keep_reading && !keep_reading(out.events.back())) return false;
    }
    return true;
  };
  http.send(req);
  return out;
}

GenerationResult LocalGreedy(const LlamaModel& model, const std::string& prompt,
                             int64_t max_new_tokens, bool logprobs = false,
                             int top_logprobs = 0) {
  GenerationRequest request;
  absl::StatusOr<std::vector<int32_t>> ids =
      StoriesTokenizer()->Encode(prompt, true);
  EXPECT_TRUE(ids.ok());
  request.prompt_ids = *ids;
  request.max_new_tokens = max_new_tokens;
  request.top_logprobs = top_logprobs;
  request.ignore_eos = true;
  request.logprobs = logprobs;
  absl::StatusOr<GenerationResult> result =
      Generate(model, *StoriesTokenizer(), request);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *result : GenerationResult();
}

Json Completion(const std::string& prompt, int max_tokens) {
  return Json{{"model", "stories260k"},
              {"prompt", prompt},
              {"max_tokens", max_tokens},
              {"temperature", 0},
              {"ignore_eos", true}};
}

TEST(HttpFrontDoorTest, GreedyCompletionsWholeAndStreamedEqualLocalOutput) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Server s = StartServer();
  ASSERT_NE(s.server, nullptr);
  const GenerationResult local = LocalGreedy(*s.model, "Once upon a time", 40);

  const Reply whole =
      Post(*s.http, "/v1/completions", Completion("Once upon a time", 40));
  ASSERT_EQ(whole.status, 200) << whole.body.dump();
  EXPECT_EQ(whole.body["object"], "text_completion");
  EXPECT_EQ(whole.body["model"], "stories260k");
  EXPECT_EQ(whole.body["choices"][0]["text"], local.text);
  EXPECT_EQ(whole.body["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(whole.body["usage"]["completion_tokens"], 40);
  EXPECT_EQ(whole.body["usage"]["prompt_tokens"],
            static_cast<int64_t>(local.stats.prompt_tokens));
  EXPECT_EQ(whole.body["usage"]["total_tokens"],
            local.stats.prompt_tokens + 40);
  EXPECT_EQ(
      whole.body["knapserve"]["output_token_ids"].get<std::vector<int32_t>>(),
      local.output_ids);

  Json streamed_body = Completion("Once upon a time", 40);
  streamed_body["stream"] = true;
  streamed_body["stream_options"] = {{"include_usage", true}};
  streamed_body["knapserve"] = {
      {"spec", "static"}, {"static_mask", "a2,m2,a3"}, {"max_draft", 3}};
  const Events streamed = Stream(*s.http, "/v1/completions", streamed_body);
  EXPECT_EQ(streamed.status, 200);
  EXPECT_TRUE(streamed.done);
  EXPECT_EQ(streamed.text, local.text);
  EXPECT_EQ(streamed.ids, local.output_ids);  // speculation is lossless
  ASSERT_GE(streamed.events.size(), 3u);
  const Json& last_choice = streamed.events[streamed.events.size() - 2];
  EXPECT_EQ(last_choice["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(last_choice["knapserve"]["spec"], "static");
  EXPECT_GT(last_choice["knapserve"]["drafts"].get<int>(), 0);
  const Json& usage = streamed.events.back();
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 40);
}

// n choices through the OpenAI API: whole, each choice at its index with
// its own text and the prompt counted once in the usage; streamed, every
// event at its choice's index, each choice's text the same as whole (a
// seed means the same text); best_of returns the candidate with the
// highest cumulative log-probability; chat takes n but not best_of.
TEST(HttpFrontDoorTest, NChoicesComeAtTheirIndexAndBestOfPicksTheLikeliest) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Server s = StartServer();
  ASSERT_NE(s.server, nullptr);
  Json body = Completion("Once upon a time", 12);
  body["temperature"] = 1.0;
  body["seed"] = 5;
  body["n"] = 3;
  body["logprobs"] = 0;
  const Reply whole = Post(*s.http, "/v1/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.body.dump();
  const Json& choices = whole.body["choices"];
  ASSERT_EQ(choices.size(), 3u);
  std::vector<std::string> texts;
  std::vector<double> likelihood;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(choices[i]["index"], i);
    EXPECT_EQ(choices[i]["finish_reason"], "length");
    texts.push_back(choices[i]["text"]);
    double sum = 0;
    for (double lp : choices[i]["logprobs"]["token_logprobs"]) sum += lp;
    likelihood.push_back(sum);
  }
  EXPECT_NE(texts[0], texts[1]);
  EXPECT_EQ(whole.body["usage"]["completion_tokens"], 36);
  const int64_t prompt = whole.body["usage"]["prompt_tokens"];
  EXPECT_EQ(whole.body["usage"]["total_tokens"], prompt + 36);
  Json alone = body;
  alone["n"] = 1;
  EXPECT_EQ(Post(*s.http, "/v1/completions", alone).body["choices"][0]["text"],
            texts[0])
      << "choice 0 samples with the request's own seed";

  Json streamed_body = body;
  streamed_body["stream"] = true;
  const Events streamed = Stream(*s.http, "/v1/completions", streamed_body);
  ASSERT_EQ(streamed.status, 200);
  EXPECT_TRUE(streamed.done);
  std::map<int, std::string> by_index;
  int finished = 0;
  for (const Json& event : streamed.events) {
    const Json& choice = event["choices"][0];
    by_index[choice["index"].get<int>()] += choice["text"].get<std::string>();
    finished += !choice["finish_reason"].is_null();
  }
  EXPECT_EQ(finished, 3);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(by_index[i], texts[i]) << i;

  Json best = body;
  best["n"] = 1;
  best["best_of"] = 3;
  const Reply picked = Post(*s.http, "/v1/completions", best);
  ASSERT_EQ(picked.status, 200) << picked.body.dump();
  ASSERT_EQ(picked.body["choices"].size(), 1u);
  const size_t likeliest =
      std::max_element(likelihood.begin(), likelihood.end()) -
      likelihood.begin();
  EXPECT_EQ(picked.body["choices"][0]["text"], texts[likeliest]);
  EXPECT_EQ(picked.body["usage"]["completion_tokens"], 12);

  best["stream"] = true;
  EXPECT_EQ(Post(*s.http, "/v1/completions", best).body["error"]["param"],
            "best_of");
  Json chat = {{"model", "stories260k"},
               {"messages", {{{"role", "user"}, {"content", "Hi"}}}},
               {"max_tokens", 4},
               {"n", 2},
               {"best_of", 2}};
  EXPECT_EQ(Post(*s.http, "/v1/chat/completions", chat).body["error"]["param"],
            "best_of");
}

TEST(HttpFrontDoorTest, ChatGoesThroughTheTemplateAndLogprobsAreTheModels) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Server s = StartServer();
  ASSERT_NE(s.server, nullptr);
  const GenerationResult local = LocalGreedy(
      *s.model, "Once upon a time", 24, /*logprobs=*/true, /*top_logprobs=*/3);
  ASSERT_EQ(local.output_logprobs.size(), 24u);
  ASSERT_EQ(local.output_top_logprobs.size(), 24u);
  const Json chat = {
      {"model", "stories260k"},
      {"messages",
       {{{"role", "system"}, {"content", "ignored by this template"}},
        {{"role", "user"}, {"content", "Once upon a time"}}}},
      {"max_completion_tokens", 24},
      {"temperature", 0},
      {"ignore_eos", true},
      {"logprobs", true},
      {"top_logprobs", 3}};
  const Reply whole = Post(*s.http, "/v1/chat/completions", chat);
  ASSERT_EQ(whole.status, 200) << whole.body.dump();
  EXPECT_EQ(whole.body["object"], "chat.completion");
  EXPECT_EQ(whole.body["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(whole.body["choices"][0]["message"]["content"], local.text);
  const Json& content = whole.body["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 24u);
  for (size_t i = 0; i < content.size(); ++i) {
    EXPECT_NEAR(content[i]["logprob"].get<double>(), local.output_logprobs[i],
                1e-4);
    EXPECT_LE(content[i]["logprob"].get<double>(), 0.0);
    const Json& top = content[i]["top_logprobs"];
    ASSERT_EQ(top.size(), 3u) << i;
    for (size_t k = 0; k < 3; ++k) {
      EXPECT_NEAR(top[k]["logprob"].get<double>(),
                  local.output_top_logprobs[i][k].logprob, 1e-4);
    }
  }

  // Streamed with speculation: the same text, and the logprobs (from the
  // verification pass's logits) the same up to float rounding.
  Json streamed_body = chat;
  streamed_body["stream"] = true;
  streamed_body["knapserve"] = {{"spec", "static"},
                                {"static_mask", "a2,m2,a3"}};
  const Events streamed =
      Stream(*s.http, "/v1/chat/completions", streamed_body);
  EXPECT_TRUE(streamed.done);
  EXPECT_EQ(streamed.text, local.text);
  ASSERT_FALSE(streamed.events.empty());
  EXPECT_EQ(streamed.events[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(streamed.events[0]["choices"][0]["delta"]["role"], "assistant");
  std::vector<double> lps, firsts;
  for (const Json& e : streamed.events) {
    const Json& lp = e["choices"][0]["logprobs"];
    if (lp.is_object()) {
      for (const Json& t : lp["content"]) {
        lps.push_back(t["logprob"]);
        firsts.push_back(t["top_logprobs"][0]["logprob"]);
      }
    }
  }
  ASSERT_EQ(lps.size(), 24u);
  ASSERT_EQ(firsts.size(), 24u);
  for (size_t i = 0; i < lps.size(); ++i) {
    EXPECT_NEAR(lps[i], local.output_logprobs[i], 1e-4) << i;
    EXPECT_NEAR(firsts[i], local.output_top_logprobs[i][0].logprob, 1e-4) << i;
  }

  // Completions take the count as `logprobs` (OpenAI's legacy shape).
  Json completion = Completion("Once upon a time", 8);
  completion["logprobs"] = 2;
  const Reply legacy = Post(*s.http, "/v1/completions", completion);
  ASSERT_EQ(legacy.status, 200) << legacy.body.dump();
  const Json& legacy_top =
      legacy.body["choices"][0]["logprobs"]["top_logprobs"];
  ASSERT_EQ(legacy_top.size(), 8u);
  EXPECT_GE(legacy_top[0].size(), 1u);
  EXPECT_LE(legacy_top[0].size(), 2u);
}

// echo (issue 28, item 4): the prompt before the completion, whole and
// streamed (in a first event of its own), with its tokens'
// log-probabilities (the first null) equal to local generation's
// prompt_logprobs, and the completion's as without echo.
TEST(HttpFrontDoorTest, EchoReturnsThePromptAndItsLogprobs) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Server s = StartServer();
  ASSERT_NE(s.server, nullptr);
  const std::string prompt = "Once upon a time, there was a cat";
  GenerationRequest local_request;
  absl::StatusOr<std::vector<int32_t>> ids =
      StoriesTokenizer()->Encode(prompt, true);
  ASSERT_TRUE(ids.ok());
  local_request.prompt_ids = *ids;
  local_request.max_new_tokens = 6;
  local_request.ignore_eos = true;
  local_request.logprobs = true;
  local_request.top_logprobs = 1;
  local_request.prompt_logprobs = true;
  absl::StatusOr<GenerationResult> local =
      Generate(*s.model, *StoriesTokenizer(), local_request);
  ASSERT_TRUE(local.ok()) << local.status();
  const size_t n = ids->size();
  ASSERT_EQ(local->prompt_logprobs.size(), n - 1);

  Json body = Completion(prompt, 6);
  body["echo"] = true;
  body["logprobs"] = 1;
  const Reply whole = Post(*s.http, "/v1/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.body.dump();
  const Json& choice = whole.body["choices"][0];
  EXPECT_EQ(choice["text"], prompt + local->text);
  const Json& lp = choice["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), n + 6);
  ASSERT_EQ(lp["token_logprobs"].size(), n + 6);
  ASSERT_EQ(lp["top_logprobs"].size(), n + 6);
  ASSERT_EQ(lp["text_offset"].size(), n + 6);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  for (size_t i = 1; i < n; ++i) {
    EXPECT_NEAR(lp["token_logprobs"][i].get<double>(),
                local->prompt_logprobs[i - 1], 1e-4)
        << i;
  }
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_NEAR(lp["token_logprobs"][n + i].get<double>(),
                local->output_logprobs[i], 1e-4)
        << i;
  }

  body["stream"] = true;
  const Events streamed = Stream(*s.http, "/v1/completions", body);
  EXPECT_TRUE(streamed.done);
  EXPECT_EQ(streamed.text, prompt + local->text);
  ASSERT_FALSE(streamed.events.empty());
  const Json& first = streamed.events[0]["choices"][0];
  EXPECT_EQ(first["text"], prompt);
  ASSERT_EQ(first["logprobs"]["token_logprobs"].size(), n);
  EXPECT_NEAR(first["logprobs"]["token_logprobs"][n - 1].get<double>(),
              local->prompt_logprobs[n - 2], 1e-4);
}

TEST(HttpFrontDoorTest, ErrorsUseOpenAisShapeAndHttpCodes) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  GenerationServiceOptions options;
  options.limits.max_prompt_tokens = 64;
  Server s = StartServer(options, /*with_template=*/false, nullptr,
                         /*max_body_bytes=*/4096);
  ASSERT_NE(s.server, nullptr);
  Json bad = Completion("Once", 8);
  bad["max_tokens"] = "eight";
  Reply r = Post(*s.http, "/v1/completions", bad);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(r.body["error"]["param"], "max_tokens");
  EXPECT_EQ(r.body["error"]["type"], "invalid_request_error");

  bad = Completion("Once", 8);
  bad["n"] = 17;  // over kMaxChoices
  EXPECT_EQ(Post(*s.http, "/v1/completions", bad).body["error"]["param"], "n");

  bad = Completion("Once", 8);
  bad["prompt"] = std::vector<int>(100, 5);  // over --max-prompt-tokens
  r = Post(*s.http, "/v1/completions", bad);
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body["error"]["message"].get<std::string>().find("64"),
            std::string::npos);

  // Sampling fields out of range: 400 naming the field (the same checks as
  // gRPC's).
  for (const auto& [field, value] : std::vector<std::pair<std::string, Json>>{
           {"presence_penalty", 3},
           {"frequency_penalty", -2.5},
           {"repetition_penalty", 0},
           {"min_p", 1.5},
           {"temperature", -0.5},
           {"logit_bias", {{"600", 1}}},
           {"logit_bias", {{"5", -101}}},
           {"min_tokens", 9},
           {"bad_words", Json::array({Json::array()})}}) {
    bad = Completion("Once", 8);
    bad[field] = value;
    r = Post(*s.http, "/v1/completions", bad);
    EXPECT_EQ(r.status, 400) << field << " " << value.dump();
    EXPECT_EQ(r.body["error"]["param"], field) << r.body.dump();
  }
  // In range they are served: a +100 bias makes the greedy output one token.
  Json biased = Completion("Once", 8);
  biased["logit_bias"] = {{"300", 100}};
  biased["presence_penalty"] = 0.5;
  r = Post(*s.http, "/v1/completions", biased);
  ASSERT_EQ(r.status, 200) << r.body.dump();
  EXPECT_EQ(r.body["knapserve"]["output_token_ids"],
            Json(std::vector<int>(8, 300)));

  bad = Completion("Once", 8);
  bad["model"] = "gpt-4o";
  r = Post(*s.http, "/v1/completions", bad);
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(r.body["error"]["param"], "model");

  r = Post(*s.http, "/v1/chat/completions",
           Json{{"model", "stories260k"},
                {"messages", {{{"role", "user"}, {"content", "hi"}}}}});
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(
      r.body["error"]["message"].get<std::string>().find("no chat template"),
      std::string::npos);

  httplib::Result raw =
      s.http->Post("/v1/completions", "{not json", "application/json");
  ASSERT_TRUE(raw);
  EXPECT_EQ(raw->status, 400);
  raw = s.http->Post("/v1/completions", std::string(8192, ' '),
                     "application/json");
  ASSERT_TRUE(raw);
  EXPECT_EQ(raw->status, 413);
  EXPECT_TRUE(Json::parse(raw->body, nullptr, false).contains("error"));
  raw = s.http->Get("/v1/engines");
  ASSERT_TRUE(raw);
  EXPECT_EQ(raw->status, 404);
  EXPECT_TRUE(Json::parse(raw->body, nullptr, false).contains("error"));

  // The server serves on after every refusal.
  EXPECT_EQ(Post(*s.http, "/v1/completions", Completion("Once", 4)).status,
            200);
}

TEST(HttpFrontDoorTest, ModelsHealthAndMetrics) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  MetricsRegistry metrics;
  Server s = StartServer(GenerationServiceOptions(), true, &metrics);
  ASSERT_NE(s.server, nullptr);
  httplib::Result models = s.http->Get("/v1/models");
  ASSERT_TRUE(models);
  const Json list = Json::parse(models->body);
  EXPECT_EQ(list["data"][0]["id"], "stories260k");
  EXPECT_EQ(s.http->Get("/v1/models/stories260k")->status, 200);
  EXPECT_EQ(s.http->Get("/v1/models/other")->status, 404);
  EXPECT_EQ(s.http->Get("/health")->status, 200);
  ASSERT_EQ(Post(*s.http, "/v1/completions", Completion("Once", 5)).status,
            200);
  Json bad = Completion("Once", 5);
  bad["n"] = 0;
  ASSERT_EQ(Post(*s.http, "/v1/completions", bad).status, 400);
  const std::string text = s.http->Get("/metrics")->body;
  // The same registry as gRPC: the request and its refusal are counted.
  EXPECT_NE(text.find("knapserve_requests_total{code=\"OK\"} 1"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("knapserve_requests_total{code=\"INVALID_ARGUMENT\"} 1"),
            std::string::npos)
      << text;
}

TEST(HttpFrontDoorTest, AFullQueueIs429AndDrainingIs503) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  Server s = StartServer(/*max_running=*/1, /*max_queue=*/0);
  ASSERT_NE(s.server, nullptr);
  httplib::Client second("127.0.0.1", s.server->http_port());
  Reply refused;
  Json longer = Completion("Once", 400);
  longer["stream"] = true;
  std::thread drainer;
  Reply draining;
  int health_while_draining = 0;
  const Events first =
      Stream(*s.http, "/v1/completions", longer, [&](const Json&) {
        if (refused.status == 0) {
          refused = Post(second, "/v1/completions", Completion("Zoo", 4));
          drainer = std::thread(
              [&] { EXPECT_TRUE(s.server->Drain(std::chrono::seconds(60))); });
          while (!s.server->service().scheduler().draining())
            std::this_thread::yield();
          draining = Post(second, "/v1/completions", Completion("Zoo", 4));
          health_while_draining = second.Get("/health")->status;
        }
        return true;
      });
  drainer.join();
  EXPECT_EQ(refused.status, 429) << refused.body.dump();
  EXPECT_EQ(refused.body["error"]["type"], "rate_limit_exceeded");
  EXPECT_EQ(draining.status, 503) << draining.body.dump();
  EXPECT_EQ(health_while_draining, 503);
  // The running stream finished during the drain.
  EXPECT_TRUE(first.done);
  EXPECT_EQ(
      first.events[first.events.size() - 1]["choices"][0]["finish_reason"],
      "length");
}

// A LibTorch error in a request's forward pass (the fault hook throws where
// the step's passes run) is a 500 in OpenAI's shape for a whole response,
// and an error event then [DONE] for a stream that already began; the
// server serves on.
TEST(HttpFrontDoorTest, AnInternalErrorIs500OrAnErrorEvent) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  std::atomic<bool> fail{true};
  GenerationServiceOptions options;
  options.before_step_for_tests = [&](std::string_view, int64_t step) {
    TORCH_CHECK(!(fail.load() && step == 3), "injected fault");
  };
  Server s = StartServer(options, true);
  ASSERT_NE(s.server, nullptr);
  const Reply whole =
      Post(*s.http, "/v1/completions", Completion("Once upon a time", 16));
  EXPECT_EQ(whole.status, 500) << whole.body.dump();
  EXPECT_EQ(whole.body["error"]["type"], "server_error");
  EXPECT_NE(
      whole.body["error"]["message"].get<std::string>().find("injected fault"),
      std::string::npos);
  Json body = Completion("Once upon a time", 16);
  body["stream"] = true;
  const Events streamed = Stream(*s.http, "/v1/completions", body);
  EXPECT_EQ(streamed.status, 200);  // the headers went out with the first
  EXPECT_TRUE(streamed.done);
  ASSERT_FALSE(streamed.events.empty());
  EXPECT_TRUE(streamed.events.back().contains("error"));
  EXPECT_GE(streamed.ids.size(), 1u);  // the tokens before the fault
  fail = false;
  EXPECT_EQ(Post(*s.http, "/v1/completions", Completion("Once", 4)).status,
            200);
}

// Records the last decode step, and makes every step last `step_ms` (as a
// real model's: a long generation takes seconds, so a disconnect lands in
// its middle). Must outlive the server whose options it made.
class SlowSteps {
 public:
  explicit SlowSteps(int step_ms) : step_ms_(step_ms) {}
  GenerationServiceOptions Options() {
    GenerationServiceOptions options;
    options.before_step_for_tests = [this](std::string_view, int64_t step) {
      {
        absl::MutexLock lock(&mu_);
        last_step_ = step;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(step_ms_));
    };
    return options;
  }
  int64_t last_step() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return last_step_;
  }

 private:
  const int step_ms_;
  mutable absl::Mutex mu_;
  int64_t last_step_ ABSL_GUARDED_BY(mu_) = -1;
};

// The client drops the connection after a few events: its sequence stops
// within a few steps (the first write after the close may still succeed),
// long before its 480 tokens, and its K/V blocks go back to the pool.
TEST(HttpFrontDoorTest, AClientThatDisconnectsStopsItsSequenceAndFreesKv) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  SlowSteps steps(3);
  Server s = StartServer(steps.Options(), true);
  ASSERT_NE(s.server, nullptr);
  Json longer = Completion("Once", 480);
  longer["stream"] = true;
  int events = 0;
  int64_t step_at_close = 0;
  Stream(*s.http, "/v1/completions", longer, [&](const Json&) {
    if (++events < 5) return true;
    step_at_close = steps.last_step();
    return false;
  });
  const KvPool& pool = s.server->service().engine().pool();
  for (int i = 0; i < 500 && pool.used_blocks() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(pool.used_blocks(), 0);
  const int64_t last_step = steps.last_step();
  EXPECT_LT(last_step, 470);
  EXPECT_LE(last_step - step_at_close, 3)
      << "steps after the disconnect: " << last_step - step_at_close;
}

// Issue 28, item 7: a non-streamed request, which writes nothing before
// its end, also stops within a few steps of its client closing the
// connection (the front door watches the socket), and frees its K/V.
TEST(HttpFrontDoorTest, ANonStreamedClientThatDisconnectsStopsItsSequence) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  SlowSteps steps(3);
  Server s = StartServer(steps.Options(), true);
  ASSERT_NE(s.server, nullptr);
  const std::string body = Completion("Once", 480).dump();
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(s.server->http_port()));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)),
            0);
  const std::string request = absl::StrCat(
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
      "Content-Type: application/json\r\nContent-Length: ",
      body.size(), "\r\n\r\n", body);
  ASSERT_EQ(send(fd, request.data(), request.size(), 0),
            static_cast<ssize_t>(request.size()));
  auto step = [&] { return steps.last_step(); };
  for (int i = 0; i < 1000 && step() < 10; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const int64_t step_at_close = step();
  ASSERT_GE(step_at_close, 10);
  close(fd);
  const KvPool& pool = s.server->service().engine().pool();
  for (int i = 0; i < 500 && pool.used_blocks() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(pool.used_blocks(), 0);
  EXPECT_LT(step(), 470);
  EXPECT_LE(step() - step_at_close, 30)
      << "steps after the disconnect: " << step() - step_at_close;
}

// Issue 28, item 7: HTTP request ids are unguessable ("cmpl-" and 32 hex
// digits), and a gRPC client that learns one cannot abort that request: it
// belongs to the HTTP front door, and finishes in full.
TEST(HttpFrontDoorTest, IdsAreUnguessableAndNoGrpcClientCanAbortThem) {
  if (!testing::HaveStories260k()) GTEST_SKIP() << "no stories260k";
  GenerationServiceOptions options;
  options.before_step_for_tests = [](std::string_view, int64_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  };
  Server s = StartServer(options, true);
  ASSERT_NE(s.server, nullptr);
  auto stub = v1::Generation::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", s.server->port()),
                          grpc::InsecureChannelCredentials()));
  Json longer = Completion("Once", 120);
  longer["stream"] = true;
  std::string id;
  bool found = true;
  const Events streamed =
      Stream(*s.http, "/v1/completions", longer, [&](const Json& event) {
        if (id.empty()) {
          id = event.value("id", "");
          grpc::ClientContext context;
          v1::AbortRequest abort;
          abort.set_request_id(id);
          v1::AbortResponse response;
          EXPECT_TRUE(stub->Abort(&context, abort, &response).ok());
          found = response.found();
        }
        return true;
      });
  EXPECT_TRUE(std::regex_match(id, std::regex("cmpl-[0-9a-f]{32}"))) << id;
  EXPECT_FALSE(found) << "a gRPC client aborted an HTTP request";
  EXPECT_TRUE(streamed.done);
  EXPECT_EQ(streamed.ids.size(), 120u);
  const Reply whole = Post(*s.http, "/v1/completions", Completion("Zoo", 3));
  EXPECT_TRUE(std::regex_match(whole.body.value("id", ""),
                               std::regex("cmpl-[0-9a-f]{32}")))
      << whole.body.dump();
  EXPECT_NE(whole.body.value("id", ""), id);
}

}  // namespace
}  // namespace knapserve

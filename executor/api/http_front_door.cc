#include "executor/api/http_front_door.h"

#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <deque>
#include <filesystem>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/base/random_id.h"
#include "common/base/status.h"
#include "common/model/exception_status.h"

namespace knapserve {

using Json = nlohmann::json;

// One POST's generation. The engine's step thread (OnTokens) and a
// scheduler worker (OnFinished) produce; the connection's pool thread
// consumes: the SSE events of a stream, or the outcome of a whole response.
class HttpFrontDoor::Request final : public LocalGenerationSink {
 public:
  Request(std::string id, const OpenAiRequest& parsed, SpeculationMode mode,
          std::string model_name, const Tokenizer& tokenizer,
          const std::vector<int32_t>& prompt_ids)
      : id_(std::move(id)),
        stream_(parsed.stream),
        mode_(mode),
        encoder_(parsed, id_, std::move(model_name),
                 absl::ToUnixSeconds(absl::Now()), tokenizer) {
    if (parsed.echo) {
      // The prompt as given; a prompt of token ids as their text.
      absl::StatusOr<std::string> text =
          parsed.wire.has_text()
              ? absl::StatusOr<std::string>(parsed.wire.text())
              : tokenizer.Decode(prompt_ids, false);
      encoder_.SetPrompt(prompt_ids, text.ok() ? *text : "");
    }
  }

  const std::string& request_id() const override { return id_; }
  const std::string& owner() const override {
    static const std::string* http = new std::string("http");
    return *http;
  }
  bool ShouldStop() const override { return cancelled_.load() || aborted(); }
  absl::Status StopStatus() const override {
    return absl::CancelledError("the HTTP client went away");
  }
  void OnTokens(int index, absl::Span<const int32_t> ids, std::string_view text,
                const StepLogprobs& logprobs) override
      ABSL_LOCKS_EXCLUDED(mu_) {
    if (!stream_) return;  // the whole response is built from the result
    absl::MutexLock lock(&mu_);
    pending_ += encoder_.StreamTokens(index, ids, text, logprobs);
  }
  void OnFinished(GenerationOutcome outcome) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (stream_) {
      pending_ +=
          outcome.status.ok()
              ? encoder_.StreamEnd(Choices(outcome), mode_, outcome.timings)
              : OpenAiEncoder::StreamError(outcome.status);
    }
    outcome_ = std::move(outcome);
  }

  // The client is gone (or the server is shutting down): the sequence stops
  // at its next step.
  void Cancel() { cancelled_ = true; }

  // Stream: waits up to `timeout` for events; moves them to `out` and says
  // whether the stream is complete (every event handed out).
  bool NextEvents(std::string& out, absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !pending_.empty() || outcome_.has_value();
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    out = std::move(pending_);
    pending_.clear();
    return outcome_.has_value();
  }

  // Whole response: waits up to `timeout` for the outcome; nullopt if it
  // has not come yet.
  std::optional<GenerationOutcome> TakeOutcome(absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return outcome_.has_value();
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&done), timeout)) {
      return std::nullopt;
    }
    return std::move(*outcome_);
  }

  Json Response(const GenerationOutcome& outcome) const
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return encoder_.Response(Choices(outcome), mode_, outcome.timings);
  }

 private:
  // Every choice of a successful outcome, in index order.
  static std::vector<const GenerationResult*> Choices(
      const GenerationOutcome& outcome) {
    std::vector<const GenerationResult*> all = {&*outcome.result};
    for (const GenerationResult& choice : outcome.other_choices) {
      all.push_back(&choice);
    }
    return all;
  }

  const std::string id_;
  const bool stream_;
  const SpeculationMode mode_;
  std::atomic<bool> cancelled_{false};
  mutable absl::Mutex mu_;
  OpenAiEncoder encoder_ ABSL_GUARDED_BY(mu_);
  std::string pending_ ABSL_GUARDED_BY(mu_);  // SSE events not yet written
  std::optional<GenerationOutcome> outcome_ ABSL_GUARDED_BY(mu_);
};

struct HttpFrontDoor::Impl {
  httplib::Server server;
};

namespace {

void ReplyJson(httplib::Response& res, int status, const Json& body) {
  res.status = status;
  res.set_content(
      body.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n",
      "application/json");
}

void ReplyError(httplib::Response& res, const absl::Status& status) {
  ReplyJson(res, HttpStatusFor(status.code()), OpenAiErrorJson(status));
}

// The numeric host and port of a socket address, as cpp-httplib writes
// them into Request::remote_addr / local_addr.
bool HostAndPort(const sockaddr_storage& address, socklen_t length,
                 std::string& host, int& port) {
  char name[NI_MAXHOST];
  char service[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&address), length, name,
                  sizeof(name), service, sizeof(service),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return false;
  }
  host = name;
  return absl::SimpleAtoi(service, &port);
}

// The socket of the connection `req` arrived on, or -1. cpp-httplib 0.11
// does not hand it to the handler, so this looks for the descriptor of
// this process whose two ends are the request's. The descriptor stays
// valid while the handler runs: cpp-httplib closes it only afterwards.
int ConnectionSocket(const httplib::Request& req) {
  // Error codes, not exceptions: nothing may throw into the handler.
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end;
       !ec && it != end; it.increment(ec)) {
    int fd = -1;
    if (!absl::SimpleAtoi(it->path().filename().string(), &fd)) continue;
    sockaddr_storage peer{};
    socklen_t peer_length = sizeof(peer);
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_length) !=
        0) {
      continue;  // not a connected socket
    }
    sockaddr_storage local{};
    socklen_t local_length = sizeof(local);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_length) !=
        0) {
      continue;
    }
    std::string peer_host, local_host;
    int peer_port = -1, local_port = -1;
    if (HostAndPort(peer, peer_length, peer_host, peer_port) &&
        HostAndPort(local, local_length, local_host, local_port) &&
        peer_port == req.remote_port && local_port == req.local_port &&
        peer_host == req.remote_addr && local_host == req.local_addr) {
      return fd;
    }
  }
  return -1;
}

// Whether the peer of connected socket `fd` hung up (closed or shut down
// its side). Data it sent (a pipelined request) is not a hang-up and is
// left unread.
bool PeerHungUp(int fd) {
  pollfd watched{fd, POLLRDHUP, 0};
  if (poll(&watched, 1, 0) <= 0) return false;
  return (watched.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

}  // namespace

HttpFrontDoor::HttpFrontDoor(GenerationService& service,
                             HttpFrontDoorOptions options)
    : service_(service), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<HttpFrontDoor>> HttpFrontDoor::Start(
    GenerationService& service, const std::string& listen,
    HttpFrontDoorOptions options) {
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http-listen: expected HOST:PORT, got '", listen, "'"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host.empty()) host = "0.0.0.0";
  if (options.max_connections < 2) {
    return absl::InvalidArgumentError("max_connections: must be >= 2");
  }
  std::unique_ptr<HttpFrontDoor> door(
      new HttpFrontDoor(service, std::move(options)));
  door->impl_ = std::make_unique<Impl>();
  HttpFrontDoor* self = door.get();
  httplib::Server& server = door->impl_->server;
  const int threads = door->options_.max_connections;
  server.new_task_queue = [threads] {
    return new httplib::ThreadPool(threads);
  };
  // A larger body is answered 413 by cpp-httplib before it is read whole.
  server.set_payload_max_length(
      static_cast<size_t>(std::max<int64_t>(1, door->options_.max_body_bytes)));
  server.set_tcp_nodelay(true);

  auto completions = [self](const httplib::Request& req,
                            httplib::Response& res) {
    self->HandleGenerate(req, res, OpenAiEndpoint::kCompletions);
  };
  auto chat = [self](const httplib::Request& req, httplib::Response& res) {
    self->HandleGenerate(req, res, OpenAiEndpoint::kChat);
  };
  server.Post("/v1/completions", completions);
  server.Post("/v1/chat/completions", chat);
  auto model_json = [self]() {
    return Json{{"id", self->options_.model_name},
                {"object", "model"},
                {"created", 0},
                {"owned_by", "knapserve"},
                {"max_model_len", self->service_.model().max_context()}};
  };
  server.Get("/v1/models", [model_json](const httplib::Request&,
                                        httplib::Response& res) {
    ReplyJson(res, 200,
              Json{{"object", "list"}, {"data", Json::array({model_json()})}});
  });
  server.Get(
      R"(/v1/models/(.+))",
      [self, model_json](const httplib::Request& req, httplib::Response& res) {
        const std::string name = req.matches[1];
        if (name != self->options_.model_name) {
          ReplyError(res, absl::NotFoundError(
                              absl::StrCat("model: '", name,
                                           "' does not exist; this server "
                                           "serves '",
                                           self->options_.model_name, "'")));
          return;
        }
        ReplyJson(res, 200, model_json());
      });
  server.Get("/health",
             [self](const httplib::Request&, httplib::Response& res) {
               if (self->draining_.load()) {
                 ReplyJson(res, 503, Json{{"status", "draining"}});
               } else {
                 ReplyJson(res, 200, Json{{"status", "ok"}});
               }
             });
  server.Get("/metrics",
             [self](const httplib::Request&, httplib::Response& res) {
               if (self->options_.metrics == nullptr) {
                 ReplyError(res, absl::NotFoundError("metrics: not enabled"));
                 return;
               }
               res.set_content(self->options_.metrics->Render(),
                               "text/plain; version=0.0.4");
             });
  // cpp-httplib's own refusals (unknown path, 413, a malformed request)
  // come with an empty body: give them OpenAI's error shape.
  server.set_error_handler(
      [](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return;
        absl::Status status;
        if (res.status == 404) {
          status = absl::NotFoundError(
              absl::StrCat("path: no route for ", req.method, " ", req.path));
        } else if (res.status == 413) {
          status = absl::InvalidArgumentError(
              "body: larger than the server's --max-request-bytes");
        } else {
          status = absl::InvalidArgumentError(
              absl::StrCat("request: refused with HTTP ", res.status));
        }
        const int code = res.status;
        ReplyJson(res, code, OpenAiErrorJson(status));
      });
  // No exception may escape into cpp-httplib's threads.
  server.set_exception_handler([](const httplib::Request&,
                                  httplib::Response& res,
                                  std::exception_ptr error) {
    absl::Status status = absl::InternalError("request failed");
    try {
      std::rethrow_exception(error);
    } catch (...) {
      status = CurrentExceptionAsInternal("request failed");
    }
    ReplyError(res, status);
  });

  door->port_ = port == 0 ? server.bind_to_any_port(host)
                          : (server.bind_to_port(host, port) ? port : -1);
  if (door->port_ <= 0) {
    return absl::UnavailableError(
        absl::StrCat("--http-listen: cannot listen on ", listen));
  }
  door->listener_ =
      std::thread([self] { self->impl_->server.listen_after_bind(); });
  return door;
}

void HttpFrontDoor::HandleGenerate(const httplib::Request& req,
                                   httplib::Response& res,
                                   OpenAiEndpoint endpoint) {
  OpenAiModel model;
  model.name = options_.model_name;
  model.tokenizer = &service_.tokenizer();
  model.chat = options_.chat.has_value() ? &*options_.chat : nullptr;
  absl::StatusOr<OpenAiRequest> parsed =
      ParseOpenAiRequest(req.body, endpoint, model);
  absl::StatusOr<GenerationRequest> decoded =
      parsed.ok()
          ? DecodeGenerateRequest(parsed->wire, service_.request_defaults(),
                                  service_.model(), service_.tokenizer())
          : absl::StatusOr<GenerationRequest>(parsed.status());
  const std::string traceparent = req.get_header_value("traceparent");
  const char* operation =
      endpoint == OpenAiEndpoint::kChat ? "chat" : "text_completion";
  if (!decoded.ok()) {
    service_.RecordRefused(decoded.status());
    RequestTrace refused;
    refused.Start(traceparent, "", "http", operation, options_.model_name);
    refused.Finish(decoded.status(), nullptr);
    ReplyError(res, decoded.status());
    return;
  }
  const std::string id =
      UnguessableId(endpoint == OpenAiEndpoint::kChat ? "chatcmpl-" : "cmpl-");
  auto request = std::make_shared<Request>(
      id, *parsed, decoded->speculation.mode, options_.model_name,
      service_.tokenizer(), decoded->prompt_ids);
  request->trace().Start(traceparent, id, "http", operation,
                         options_.model_name);
  if (!Track(request)) {
    const absl::Status closing =
        absl::UnavailableError("the server is shutting down");
    request->trace().Finish(closing, nullptr);
    ReplyError(res, closing);
    return;
  }
  if (absl::Status admitted = service_.Submit(std::move(*decoded), request);
      !admitted.ok()) {
    Untrack(request.get());
    ReplyError(res, admitted);
    return;
  }
  if (!parsed->stream) {
    // Nothing is written before the outcome, so the connection itself is
    // watched for a client that leaves (see the header).
    const int socket = ConnectionSocket(req);
    std::optional<GenerationOutcome> finished;
    while (!(finished = request->TakeOutcome(absl::Milliseconds(20)))) {
      if (socket >= 0 && PeerHungUp(socket)) request->Cancel();
    }
    const GenerationOutcome outcome = std::move(*finished);
    Untrack(request.get());
    if (!outcome.status.ok()) {
      ReplyError(res, outcome.status);
      return;
    }
    ReplyJson(res, 200, request->Response(outcome));
    return;
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [request](size_t, httplib::DataSink& sink) {
        std::string events;
        const bool complete =
            request->NextEvents(events, absl::Milliseconds(100));
        if (!events.empty() && !sink.write(events.data(), events.size())) {
          request->Cancel();  // the client is gone
          return false;
        }
        if (complete) sink.done();
        return true;
      },
      [this, request](bool success) {
        if (!success) request->Cancel();
        Untrack(request.get());
      });
}

bool HttpFrontDoor::Track(const std::shared_ptr<Request>& request) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return false;
  live_.emplace(request.get(), request);
  return true;
}

void HttpFrontDoor::Untrack(const Request* request) {
  absl::MutexLock lock(&mu_);
  live_.erase(request);
}

void HttpFrontDoor::Shutdown() {
  std::vector<std::shared_ptr<Request>> live;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    for (const auto& [key, request] : live_) live.push_back(request);
  }
  for (const std::shared_ptr<Request>& request : live) request->Cancel();
  impl_->server.stop();
  if (listener_.joinable()) listener_.join();
}

HttpFrontDoor::~HttpFrontDoor() { Shutdown(); }

}  // namespace knapserve

// OtlpHttpExporter against a cpp-httplib OTLP/HTTP receiver on loopback:
// a Tracer's spans arrive as JSON POSTs on /v1/traces; a receiver that
// answers an error, or none at all, fails the export without hanging.
#include "common/trace/otlp_http_exporter.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace knapserve::trace {
namespace {

// Collects what is POSTed to /v1/traces; answers `status`.
class Receiver {
 public:
  explicit Receiver(int status = 200) : status_(status) {
    server_.Post("/v1/traces", [this](const httplib::Request& req,
                                      httplib::Response& res) {
      absl::MutexLock lock(&mu_);
      bodies_.push_back(req.body);
      content_types_.push_back(req.get_header_value("Content-Type"));
      res.status = status_;
      res.set_content("{}", "application/json");
    });
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    for (int i = 0; i < 5000 && !server_.is_running(); ++i) usleep(1000);
  }
  ~Receiver() {
    server_.stop();
    thread_.join();
  }
  std::string url() const {
    return absl::StrCat("http://127.0.0.1:", port_, "/v1/traces");
  }
  std::vector<std::string> bodies() {
    absl::MutexLock lock(&mu_);
    return bodies_;
  }
  std::vector<std::string> content_types() {
    absl::MutexLock lock(&mu_);
    return content_types_;
  }

 private:
  const int status_;
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  absl::Mutex mu_;
  std::vector<std::string> bodies_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> content_types_ ABSL_GUARDED_BY(mu_);
};

TEST(OtlpHttpExporterTest, PostsJsonToTheReceiver) {
  Receiver receiver;
  absl::StatusOr<std::unique_ptr<OtlpHttpExporter>> exporter =
      OtlpHttpExporter::Create(receiver.url());
  ASSERT_TRUE(exporter.ok()) << exporter.status();
  TracerOptions options;
  options.service_name = "exporter-test";
  Tracer tracer(options, std::move(*exporter));
  {
    Span root = tracer.StartSpan("root", {}, SpanKind::kServer);
    root.SetAttribute("answer", int64_t{42});
    Span child = tracer.StartSpan("child", root.context());
  }
  tracer.Shutdown(absl::Seconds(10));
  EXPECT_EQ(tracer.exported(), 2);
  EXPECT_EQ(tracer.failed(), 0);
  std::vector<std::string> names;
  for (const std::string& body : receiver.bodies()) {
    const nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << body;
    EXPECT_EQ(j["resourceSpans"][0]["resource"]["attributes"][0]["value"]
               ["stringValue"],
              "exporter-test");
    for (const nlohmann::json& s :
         j["resourceSpans"][0]["scopeSpans"][0]["spans"]) {
      names.push_back(s["name"]);
    }
  }
  EXPECT_EQ(names.size(), 2u);
  for (const std::string& type : receiver.content_types()) {
    EXPECT_EQ(type, "application/json");
  }
}

TEST(OtlpHttpExporterTest, ErrorsAndUnreachableReceiversFailTheExport) {
  Receiver refusing(503);
  absl::StatusOr<std::unique_ptr<OtlpHttpExporter>> exporter =
      OtlpHttpExporter::Create(refusing.url());
  ASSERT_TRUE(exporter.ok());
  absl::Status status =
      (*exporter)->Export("{}", absl::Now() + absl::Seconds(5));
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("503"), absl::string_view::npos) << status;

  // Nobody listens on this port any more: the export fails fast.
  std::string gone_url;
  {
    Receiver gone;
    gone_url = gone.url();
  }
  exporter = OtlpHttpExporter::Create(gone_url);
  ASSERT_TRUE(exporter.ok());
  const absl::Time start = absl::Now();
  status = (*exporter)->Export("{}", absl::Now() + absl::Seconds(2));
  EXPECT_FALSE(status.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));

  EXPECT_FALSE(OtlpHttpExporter::Create("collector:4318").ok());
}

}  // namespace
}  // namespace knapserve::trace

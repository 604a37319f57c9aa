// Tests of the Prometheus metrics (common/metrics/metrics.h): the text format
// and serving it over HTTP.
#include "common/metrics/metrics.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

namespace knapserve {
namespace {

TEST(MetricsTest, RendersCountersGaugesAndHistograms) {
  MetricsRegistry registry;
  registry
      .AddCounter("knapserve_requests_total", "Calls by code.",
                  {{"code", "OK"}})
      .Add(3);
  registry
      .AddCounter("knapserve_requests_total", "Calls by code.",
                  {{"code", "CANCELLED"}})
      .Add();
  registry
      .AddCounter("knapserve_requests_total", "Calls by code.",
                  {{"code", "OK"}})
      .Add();
  registry.AddGauge("knapserve_running_requests", "Running.",
                    [] { return 2.0; });
  Histogram& h =
      registry.AddHistogram("knapserve_ttft_seconds", "TTFT.", {0.1, 1});
  h.Observe(0.05);
  h.Observe(0.5);
  h.Observe(7);
  const std::string text = registry.Render();
  // prometheus-cpp's text format: series of a family sorted by labels,
  // histograms as count, sum, then cumulative buckets.
  EXPECT_NE(text.find("# HELP knapserve_requests_total Calls by code.\n"
                      "# TYPE knapserve_requests_total counter\n"
                      "knapserve_requests_total{code=\"CANCELLED\"} 1\n"
                      "knapserve_requests_total{code=\"OK\"} 4\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("# TYPE knapserve_running_requests "
                      "gauge\nknapserve_running_requests 2\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("knapserve_ttft_seconds_count 3\n"
                      "knapserve_ttft_seconds_sum 7.55\n"
                      "knapserve_ttft_seconds_bucket{le=\"0.1\"} 1\n"
                      "knapserve_ttft_seconds_bucket{le=\"1\"} 2\n"
                      "knapserve_ttft_seconds_bucket{le=\"+Inf\"} 3\n"),
            std::string::npos)
      << text;
  // The same name and labels give the same counter.
  EXPECT_EQ(&registry.AddCounter("knapserve_requests_total", "Calls by code.",
                                 {{"code", "OK"}}),
            &registry.AddCounter("knapserve_requests_total", "Calls by code.",
                                 {{"code", "OK"}}));
}

TEST(MetricsTest, GaugesAreReadAtEachRender) {
  MetricsRegistry registry;
  double running = 1;
  registry.AddGauge("knapserve_running_requests", "Running.",
                    [&] { return running; });
  EXPECT_NE(registry.Render().find("knapserve_running_requests 1\n"),
            std::string::npos);
  running = 5;
  EXPECT_NE(registry.Render().find("knapserve_running_requests 5\n"),
            std::string::npos);
}

// A bare HTTP/1.0 GET over a socket (no client library).
std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string request =
      "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  if (write(fd, request.data(), request.size()) < 0) {
    close(fd);
    return "";
  }
  std::string response;
  char buffer[4096];
  for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;)
    response.append(buffer, n);
  close(fd);
  return response;
}

TEST(MetricsTest, ServesTheTextOverHttp) {
  MetricsRegistry registry;
  registry.AddCounter("knapserve_generation_tokens_total", "Tokens.").Add(42);
  auto server = MetricsHttpServer::Start(&registry, "127.0.0.1", 0);
  ASSERT_NE(server, nullptr);
  ASSERT_GT(server->bound_port(), 0);
  std::string response;
  for (int i = 0; i < 50 && response.empty(); ++i) {
    response = HttpGet(server->bound_port(), "/metrics");
    if (response.empty()) usleep(20 * 1000);
  }
  EXPECT_NE(response.find("200 OK"), std::string::npos) << response;
  EXPECT_NE(response.find("text/plain; version=0.0.4"), std::string::npos)
      << response;
  EXPECT_NE(response.find("knapserve_generation_tokens_total 42"),
            std::string::npos)
      << response;
  EXPECT_NE(HttpGet(server->bound_port(), "/nothing").find("404"),
            std::string::npos);
}

}  // namespace
}  // namespace knapserve

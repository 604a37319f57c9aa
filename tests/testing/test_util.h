// Small helpers the test files share: status messages as std::string, whole
// files in and out, running a child process, loading a model or tokenizer with
// a test failure instead of a status, and a scoped torch thread count. All are
// free functions, safe from any thread; the loaded objects belong to the
// caller.
#ifndef KNAPSERVE_TESTS_TESTING_TEST_UTIL_H_
#define KNAPSERVE_TESTS_TESTING_TEST_UTIL_H_

#include <c10/core/ScalarType.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace knapserve {
class LlamaModel;
class Tokenizer;
}  // namespace knapserve

namespace knapserve::testing {

// status.message() as a std::string (for gMock matchers such as HasSubstr).
std::string Message(const absl::Status& status);

// The bytes of the file at `path`; "" if it cannot be read.
std::string ReadFile(const std::string& path);

// Replaces the file at `path` by `contents` (bytes); a test failure if the
// write fails.
void WriteFile(const std::string& path, std::string_view contents);

// What a child process did: its exit status (-1 if it did not exit
// normally) and everything it wrote to stdout and stderr.
struct ProcessOutcome {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// This process's environment as "NAME=VALUE" entries, with `changes`
// applied: "NAME=VALUE" sets, "NAME" removes.
std::vector<std::string> EnvironmentWith(
    const std::vector<std::string>& changes);

// Runs argv[0] (a path) with `argv`, stdout and stderr captured in files (no
// pipe deadlocks, no shell quoting), in this process's environment with
// `env_changes` applied ("NAME=VALUE" sets, "NAME" removes). A test failure
// if it cannot be started. Not for concurrent use from several threads.
ProcessOutcome RunProcess(std::vector<std::string> argv,
                          const std::vector<std::string>& env_changes = {});

// A loopback TCP port nothing listens on right now (the kernel's choice for
// port 0), for flags that take a fixed port such as --metrics-port. Another
// process may take it before the caller binds it; 0 on failure.
int FreeLoopbackPort();

// A server process (knapserve-planner, knapserve-executor, knapserve serve,
// or another binary) started with `argv` in this process's environment with
// `env_changes` applied, its stderr captured. Knapserve servers are started
// with --listen 127.0.0.1:0 and port() is what they say they bound (waiting
// at most 120 s; empty if they never did). For another server, `ready` is the
// line its stderr prints once it serves, and port() is then "ready". The
// destructor stops a server still running (SIGTERM, then waits). Not for
// concurrent use from several threads.
class ServerProcess {
 public:
  explicit ServerProcess(std::vector<std::string> argv,
                         const std::string& ready = "",
                         const std::vector<std::string>& env_changes = {});
  ~ServerProcess();
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;

  const std::string& port() const { return port_; }
  // "127.0.0.1:PORT", or "" when no port is known.
  std::string address() const;
  int pid() const { return pid_; }
  std::string log() const;
  // SIGTERM, then the exit code (128 + signal if it did not exit normally).
  int Stop() { return Signal(15); }
  // SIGKILL: the process dies without any clean-up.
  void Kill() { Signal(9); }
  // SIGTERM without waiting; Wait() then reaps it.
  void SendSigterm();
  int Wait() { return Signal(0); }

 private:
  int Signal(int signal);

  std::string dir_;
  int pid_ = 0;
  std::string err_path_;
  std::string port_;
  int exit_code_ = -1;
};

// LlamaModel::Load(dir) in `dtype`; nullptr and a test failure on error.
std::unique_ptr<LlamaModel> LoadModelOrFail(
    const std::string& dir, c10::ScalarType dtype = c10::ScalarType::Float);

// Tokenizer::FromFile(path); nullptr and a test failure on error.
std::unique_ptr<Tokenizer> LoadTokenizerOrFail(const std::string& path);

// Sets torch's intra-op thread count (at::set_num_threads) for a scope and
// restores the previous count when it ends.
class ScopedThreadCount {
 public:
  explicit ScopedThreadCount(int n);
  ~ScopedThreadCount();
  ScopedThreadCount(const ScopedThreadCount&) = delete;
  ScopedThreadCount& operator=(const ScopedThreadCount&) = delete;

 private:
  int saved_;
};

}  // namespace knapserve::testing

#endif  // KNAPSERVE_TESTS_TESTING_TEST_UTIL_H_

#include "tests/testing/test_util.h"

#include <ATen/Parallel.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <iterator>

#include "common/model/llama.h"
#include "common/text/tokenizer.h"
#include "tests/testing/temp_dir.h"

namespace knapserve::testing {

std::string Message(const absl::Status& status) {
  return std::string(status.message());
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in),
                     std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, std::string_view contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  out.close();
  EXPECT_TRUE(out.good()) << "cannot write " << path;
}

std::unique_ptr<LlamaModel> LoadModelOrFail(const std::string& dir,
                                            c10::ScalarType dtype) {
  ModelOptions options;
  options.dtype = dtype;
  auto model = LlamaModel::Load(dir, options);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? std::move(*model) : nullptr;
}

std::unique_ptr<Tokenizer> LoadTokenizerOrFail(const std::string& path) {
  auto tokenizer = Tokenizer::FromFile(path);
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? std::move(tokenizer).value() : nullptr;
}

ScopedThreadCount::ScopedThreadCount(int n) : saved_(at::get_num_threads()) {
  at::set_num_threads(n);
}

ScopedThreadCount::~ScopedThreadCount() { at::set_num_threads(saved_); }

std::vector<std::string> EnvironmentWith(
    const std::vector<std::string>& changes) {
  std::vector<std::string> env;
  auto name_of = [](const std::string& entry) {
    return entry.substr(0, entry.find('='));
  };
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    bool changed = false;
    for (const std::string& change : changes)
      changed |= name_of(change) == name_of(entry);
    if (!changed) env.push_back(entry);
  }
  for (const std::string& change : changes) {
    if (change.find('=') != std::string::npos) env.push_back(change);
  }
  return env;
}

ProcessOutcome RunProcess(std::vector<std::string> argv_strings,
                          const std::vector<std::string>& env_changes) {
  static const std::string dir = MakeTempDir("process");
  const std::string out_path = dir + "/stdout";
  const std::string err_path = dir + "/stderr";
  std::vector<char*> argv;
  for (std::string& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<std::string> env_strings = EnvironmentWith(env_changes);
  std::vector<char*> env;
  for (std::string& s : env_strings) env.push_back(s.data());
  env.push_back(nullptr);
  ProcessOutcome outcome;
  pid_t pid = 0;
  const int spawned =
      posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) {
    ADD_FAILURE() << "cannot start " << argv[0] << ": error " << spawned;
    return outcome;
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) {
    ADD_FAILURE() << "waitpid failed";
    return outcome;
  }
  if (WIFEXITED(status)) outcome.exit_code = WEXITSTATUS(status);
  outcome.out = ReadFile(out_path);
  outcome.err = ReadFile(err_path);
  return outcome;
}

int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  close(fd);
  return port;
}

ServerProcess::ServerProcess(std::vector<std::string> argv_strings,
                             const std::string& ready,
                             const std::vector<std::string>& env_changes)
    : dir_(MakeTempDir("server")) {
  err_path_ = dir_ + "/stderr";
  std::vector<char*> argv;
  for (std::string& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_strings = EnvironmentWith(env_changes);
  std::vector<char*> env;
  for (std::string& s : env_strings) env.push_back(s.data());
  env.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path_.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = 0;
  if (posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), env.data()) ==
      0) {
    pid_ = pid;
  }
  posix_spawn_file_actions_destroy(&actions);
  for (int i = 0; i < 1200 && pid_ != 0 && port_.empty(); ++i) {
    // A server that exited will never be ready: stop waiting for it.
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
      break;
    }
    const std::string err = ReadFile(err_path_);
    if (!ready.empty()) {
      if (err.find(ready) != std::string::npos) {
        port_ = "ready";
      } else {
        usleep(100 * 1000);
      }
      continue;
    }
    const size_t at = err.find("on port ");
    if (at != std::string::npos && err.find('\n', at) != std::string::npos) {
      port_ = err.substr(at + 8, err.find('\n', at) - at - 8);
    } else {
      usleep(100 * 1000);
    }
  }
}

ServerProcess::~ServerProcess() {
  if (pid_ != 0 && exit_code_ < 0) Stop();
}

std::string ServerProcess::address() const {
  return port_.empty() ? "" : "127.0.0.1:" + port_;
}

std::string ServerProcess::log() const { return ReadFile(err_path_); }

void ServerProcess::SendSigterm() { kill(pid_, SIGTERM); }

int ServerProcess::Signal(int signal) {
  if (exit_code_ >= 0)
    return exit_code_;  // already reaped: never signal a reused pid
  if (signal != 0) kill(pid_, signal);
  int status = 0;
  if (waitpid(pid_, &status, 0) == pid_) {
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + signal;
  }
  return exit_code_;
}

}  // namespace knapserve::testing

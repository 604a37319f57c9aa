// knapserve: the command line. `knapserve <subcommand> [flags]`; see --help.
#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "tools/commands.h"

namespace {

constexpr char kUsage[] =
    "knapserve <subcommand> [flags]\n"
    "\n"
    "Subcommands:\n"
    "  generate    generate text from --prompt with a local model (--spec off|static|\n"
    "              knapspec|clasp)\n"
    "  profile     measure the planner's latency model (--model, --out FILE)\n"
    "  tokenize    print the token ids of --text as a JSON array\n"
    "  make-model  write a random-weight checkpoint of a real layout (--shape, --out)\n"
    "  bench ar    measure prefill and decode speed against memory bandwidth\n"
    "  bench spec  --spec off vs --spec static --skip MASK on the same prompts: decode tok/s,\n"
    "              speedup, acceptance, draft/verify time share; checks greedy losslessness\n"
    "              (exit 1 on a mismatch). --search-masks first finds a mask by greedy\n"
    "              forward selection on measured tok/s (--search-prompts, --search-tokens,\n"
    "              --search-whole-layers, --search-max-steps)\n"
    "  bench step-cost\n"
    "              draft step with k of 2L sublayers kept vs a full step (and k/2L), and\n"
    "              verifying gamma+1 tokens vs gamma+1 steps (gamma 1..10), at\n"
    "              --context-length positions (--step-repeats runs, median)\n"
    "\n"
    "Run `knapserve --helpfull` for every flag.";

// Flags are documented with dashes (--max-new-tokens) as users expect; Abseil
// names them with underscores. Rewrites "--a-b[=v]" to "--a_b[=v]" up to "--".
std::vector<std::string> NormalizeFlagNames(int argc, char** argv) {
  std::vector<std::string> out(argv, argv + argc);
  for (size_t i = 1; i < out.size(); ++i) {
    std::string& arg = out[i];
    if (arg == "--") break;
    if (arg.size() < 3 || arg[0] != '-') continue;
    const size_t name_begin = arg[1] == '-' ? 2 : 1;
    const size_t name_end = std::min(arg.find('='), arg.size());
    std::replace(arg.begin() + name_begin, arg.begin() + name_end, '-', '_');
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<std::string> normalized = NormalizeFlagNames(argc, argv);
  std::vector<char*> normalized_argv;
  for (std::string& arg : normalized) normalized_argv.push_back(arg.data());
  std::vector<char*> args =
      absl::ParseCommandLine(static_cast<int>(normalized_argv.size()), normalized_argv.data());
  if (args.size() < 2) {
    std::cerr << kUsage << std::endl;
    return 2;
  }
  const std::string command = args[1];
  std::vector<std::string> rest(args.begin() + 2, args.end());
  if (command == "generate") return knapserve::RunGenerate();
  if (command == "tokenize") return knapserve::RunTokenize();
  if (command == "make-model") return knapserve::RunMakeModel();
  if (command == "profile") return knapserve::RunProfile();
  if (command == "bench") return knapserve::RunBench(rest);
  std::cerr << "unknown subcommand '" << command << "'\n\n" << kUsage << std::endl;
  return 2;
}

// knapserve: the command line. `knapserve <subcommand> [flags]`; see --help.
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/usage.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"

namespace {

constexpr char kUsage[] =
    "knapserve <subcommand> [flags]\n"
    "\n"
    "Subcommands:\n"
    "  generate    generate text from --prompt with a local model (--spec "
    "off|static|\n"
    "              knapspec|clasp|knn|specbound); default model: the "
    "bundled\n"
    "              stories260k\n"
    "  anchors     build KNN-SSD domain anchors (--domains NAME=FILE,..., "
    "--out FILE)\n"
    "              for --spec knn (--anchors FILE)\n"
    "  profile     measure the planner's latency model (--model, --out FILE); "
    "without\n"
    "              --profile, planned modes use the profile cache "
    "(--profile-cache DIR)\n"
    "  planner     run the Planner gRPC service (--listen ADDR, [--profile "
    "FILE]); the same\n"
    "              as the knapserve-planner binary\n"
    "  executor    run the Generation gRPC service (--listen, --planner "
    "ADDR|inproc|none);\n"
    "              the same as the knapserve-executor binary\n"
    "  serve       executor with an in-process planner: the one-process "
    "deployment\n"
    "  tokenize    print the token ids of --text as a JSON array\n"
    "  make-model  write a random-weight checkpoint of a real layout (--shape, "
    "--out)\n"
    "  train-exit-heads\n"
    "              train --spec specbound's exit heads by self-distillation "
    "(--model,\n"
    "              --corpus FILE, --out FILE, --steps, --lr, --seq-len, "
    "--batch, --rank)\n"
    "  bench ar    measure prefill and decode speed against memory bandwidth\n"
    "  bench spec  --spec off vs --spec static --skip MASK on the same "
    "prompts: decode tok/s,\n"
    "              speedup, acceptance, draft/verify time share; checks greedy "
    "losslessness\n"
    "              (exit 1 on a mismatch). --search-masks first finds a mask "
    "by greedy\n"
    "              forward selection on measured tok/s (--search-prompts, "
    "--search-tokens,\n"
    "              --search-whole-layers, --search-max-steps)\n"
    "  bench step-cost\n"
    "              draft step with k of 2L sublayers kept vs a full step (and "
    "k/2L), and\n"
    "              verifying gamma+1 tokens vs gamma+1 steps (gamma 1..10), "
    "at\n"
    "              --context-length positions (--step-repeats runs, median)\n"
    "  bench serve concurrent gRPC streams: tok/s, TTFT, ITL; outputs "
    "checked\n"
    "  bench soak  a long mixed load with cancels, deadlines and Aborts "
    "against --server\n"
    "              (tools/soak.sh); checks outputs, hangs, gauges and "
    "memory\n"
    "\n"
    "Run `knapserve --helpfull` for every flag.";

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  const std::vector<std::string> args =
      knapserve::ParseFlagsWithDashes(argc, argv);
  if (args.size() < 2) {
    std::cerr << kUsage << std::endl;
    return 2;
  }
  const std::string command = args[1];
  std::vector<std::string> rest(args.begin() + 2, args.end());
  if (command == "generate") return knapserve::RunGenerate();
  if (command == "tokenize") return knapserve::RunTokenize();
  if (command == "make-model") return knapserve::RunMakeModel();
  if (command == "train-exit-heads") return knapserve::RunTrainExitHeads();
  if (command == "profile") return knapserve::RunProfile();
  if (command == "anchors") return knapserve::RunAnchors();
  if (command == "planner") return knapserve::RunPlannerServer();
  if (command == "executor") return knapserve::RunExecutorServer();
  if (command == "serve") return knapserve::RunServe();
  if (command == "bench") return knapserve::RunBench(rest);
  std::cerr << "unknown subcommand '" << command << "'\n\n"
            << kUsage << std::endl;
  return 2;
}

// The subcommands of the `knapserve` binary. Each reads the flags it needs
// (tools/cli_flags.h), prints its result to stdout, errors to stderr, and
// returns the process exit code (0 ok, 1 runtime error, 2 bad usage).
#ifndef KNAPSERVE_TOOLS_COMMANDS_H_
#define KNAPSERVE_TOOLS_COMMANDS_H_

#include <string>
#include <vector>

namespace knapserve {

int RunGenerate();
int RunTokenize();
int RunMakeModel();
// args: the positional arguments after "bench" (e.g. {"ar"}).
int RunBench(const std::vector<std::string>& args);

}  // namespace knapserve

#endif  // KNAPSERVE_TOOLS_COMMANDS_H_

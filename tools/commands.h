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
// `knapserve train-exit-heads` (tools/train_exit_heads_command.cc):
// SpecBound's trained exit heads by self-distillation on a corpus.
int RunTrainExitHeads();
// `knapserve profile` (tools/profile_command.cc): the planner's latency model.
int RunProfile();
// `knapserve anchors` (tools/anchors_command.cc): KNN-SSD domain anchors.
int RunAnchors();
// `knapserve planner` / knapserve-planner (tools/planner_command.cc): the
// Planner gRPC service until SIGTERM or SIGINT.
int RunPlannerServer();
// knapserve-executor / `knapserve executor` (tools/executor_command.cc): the
// Generation gRPC service; `knapserve serve`: the same with an in-process
// planner (one-process deployment).
int RunExecutorServer();
int RunServe();
// args: the positional arguments after "bench" (e.g. {"ar"}); dispatches to
// `bench ar` (tools/bench_command.cc), `bench spec` and `bench step-cost`.
int RunBench(const std::vector<std::string>& args);
// `knapserve bench spec` (tools/bench_spec.cc): --spec off against --spec
// static on the same prompts, with the greedy losslessness check and the
// optional --search-masks forward selection.
int RunBenchSpec();
// `knapserve bench step-cost` (tools/bench_step_cost.cc): draft-step and
// verification costs relative to a full decode step.
int RunBenchStepCost();
// `knapserve bench serve` (tools/bench_serve.cc): concurrent gRPC streams
// against a server (one it starts, or --server): tokens/s, TTFT and ITL
// percentiles against single streams, and the greedy outputs checked.
int RunBenchServe();
// `knapserve bench soak` (tools/bench_soak.cc): a long mixed load with
// cancels, deadlines and Aborts against --server, checking outputs, hangs,
// drained gauges and memory growth (tools/soak.sh).
int RunBenchSoak();

}  // namespace knapserve

#endif  // KNAPSERVE_TOOLS_COMMANDS_H_

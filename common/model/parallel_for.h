// ParallelFor: the fork/join of the CPU kernels (packed projections, decode
// attention), on one process-wide pool of worker threads instead of
// OpenMP teams.
//
// Why not at::parallel_for: OpenMP gives every thread that starts a parallel
// region its own team. A server has several such threads (the main thread
// loads and warms the model, the batch engine's step thread decodes, the
// planner thread solves), and once libgomp manages more threads than there
// are cores it stops spinning at barriers and sleeps on a futex at every
// region end. A decode step has about a hundred regions, so on the 2-core
// machines here a served token cost 7.4 ms instead of 1.6 ms. This pool is
// one set of workers for the whole process: workers spin for a short while
// after each job (the next region of a step follows within microseconds),
// then sleep until the next one.
//
// Semantics match at::parallel_for: [begin, end) is cut into at most
// at::get_num_threads() (of the calling thread) contiguous chunks of at
// least `grain` items, chunk t starting at begin + t * ceil(n / chunks); the
// calling thread runs chunk 0 and pool workers the rest. A range of at most
// `grain` items, a call made while another ParallelFor is running (from
// another thread, or nested inside `fn`), and a caller with one thread all
// run `fn(begin, end)` inline on the calling thread. The kernels compute
// every output row with the same instructions for any split, so results are
// bit-identical whichever way a call runs.
//
// Exceptions: an exception thrown by `fn` on any thread is rethrown in the
// caller after every chunk has finished (the first one, if several throw).
//
// Thread safety: ParallelFor may be called from any thread at any time.
// The pool's workers start on first use and live until the process exits.
#ifndef KNAPSERVE_COMMON_MODEL_PARALLEL_FOR_H_
#define KNAPSERVE_COMMON_MODEL_PARALLEL_FOR_H_

#include <cstdint>

#include "absl/functional/function_ref.h"

namespace knapserve {

// `fn` is borrowed for the call only (a non-owning reference: passing a
// lambda allocates nothing, which matters on the per-sublayer hot path).
// `threads` > 0 caps the chunks at that many instead of
// at::get_num_threads() (never above it).
void ParallelFor(int64_t begin, int64_t end, int64_t grain,
                 absl::FunctionRef<void(int64_t, int64_t)> fn, int threads = 0);

// Threads per pass, by phase: a pass over at most kDecodePassRows rows (a
// decode, draft or verification step) uses `decode` threads, a longer one
// (prefill) `prefill` threads, each capped by the calling thread's
// at::get_num_threads(); 0 = at::get_num_threads(). Chosen by measurement
// (planner/thread_choice.h) or by --threads. Process-wide; any thread.
inline constexpr int64_t kDecodePassRows = 16;
void SetPassThreads(int decode, int prefill);
// The threads the kernels use for a pass of `rows` rows (0 = the caller's
// at::get_num_threads()), capped while a ScopedSolveCores lives (below).
int PassThreads(int64_t rows);

// Cores for the planner's solve. On a CPU where the decode's threads and
// the planner's outnumber the cores, a solve at low priority (nice 19) got
// almost no CPU while decoding kept every core busy, yet still cost the
// decode: a 0.4 s knapspec solve took 3.2 s beside a 2-thread decode of
// stories-24l on 2 cores, which ran at 0.90x of plain meanwhile (two
// lockstep threads wait for the one the solve delays). While a
// ScopedSolveCores(n) lives (InProcessPlanner holds one around each solve
// when InProcessPlannerOptions::reserve_cores is n > 0), every pass of the
// kernels here is capped at UsableCores() - n threads (at least 1), so the
// solve has n cores of its own and ends in its CPU time, and the decode
// runs on the others meanwhile (off by default: planner/README.md weighs
// the two); passes are bit-identical for any thread count. Any thread;
// nestable (the counts add).
class ScopedSolveCores {
 public:
  explicit ScopedSolveCores(int cores);
  ~ScopedSolveCores();
  ScopedSolveCores(const ScopedSolveCores&) = delete;
  ScopedSolveCores& operator=(const ScopedSolveCores&) = delete;

 private:
  const int cores_;
};
// The cores this process may run on (its CPU affinity: a container's cpuset
// included), at least 1. Measured once.
int UsableCores();

// While one lives, ATen's parallel ops on the calling thread (at::parallel_for:
// a reduction or a dtype copy of more than 32,768 elements) run inline on it,
// and so does ParallelFor (its chunks follow at::get_num_threads()). For
// small tensor work beside the kernels: ATen hands such an op to an OpenMP
// team, and the team's workers spin on after the region ends, taking a core
// from the next ParallelFor's workers. On a 2-core Zen 4 VM (2 threads):
// - the bf16 LM head's rounding of its float logits (LlamaModel::RowLogits)
//   over smollm2-135m's 49,152-token vocabulary: plain decoding ran at
//   73-80 tok/s, 110-146 without the team;
// - knn's routing of a 1000-token prompt's final states
//   (executor/planning/domain_router.h): the first 8 decode steps took
//   9.1 ms against 7.6 ms for plain decoding's (stories-24l-skip, bf16).
// The batch step runs every sequence's work between passes under one
// (executor/engine/sequence.cc), and LlamaModel its own ATen ops beside the
// kernels (the prompt's token lookup, the K/V's zero fill, the bf16 LM
// head's rounding): no OpenMP region runs in a request after the model
// loads. Nestable; the calling thread only (its OpenMP team size, restored
// at the end).
class ScopedSerialAten {
 public:
  ScopedSerialAten();
  ~ScopedSerialAten();
  ScopedSerialAten(const ScopedSerialAten&) = delete;
  ScopedSerialAten& operator=(const ScopedSerialAten&) = delete;

 private:
  const int threads_;  // the calling thread's team size before
};

// BLAS on the calling thread. LibTorch hands the few products the kernels
// here do not cover (the prefill's attention scores, the planner's branch
// attention and its LM-head checks) to the system BLAS. Debian's OpenBLAS
// (the pthreads build) keeps a pool of its own: workers started at load, at
// normal priority, that spin on sched_yield after every call. A nice-19
// planner's solve woke them and they took a core from decoding: in `bench
// serve` (16 streams), the load phase beside knapspec's first solve decoded
// at 0.84-0.97x of the plain runs around it in 8 of 8 runs, and the solve
// took 1.8x as long (the spinning worker shared its core).
// SingleThreadedBlas() sets OpenBLAS to one thread, so each BLAS call runs on
// the thread that makes it, at that thread's priority (a 2,000-token prefill
// was 2% slower). Loading a model (LlamaModel::FromCheckpoint) calls it;
// idempotent, any thread. A BLAS other than OpenBLAS (found by its symbols at
// run time) is left as it is.
void SingleThreadedBlas();
// The OpenBLAS thread count (1 after SingleThreadedBlas), or -1 where the
// BLAS is not OpenBLAS.
int BlasThreads();

// Calls handled by the pool (more than one chunk) and calls run inline
// because the pool was busy, since the process started; for tests and
// diagnostics.
struct ParallelForCounters {
  int64_t pooled = 0;
  int64_t inline_busy = 0;
};
ParallelForCounters GetParallelForCounters();

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_MODEL_PARALLEL_FOR_H_

#include "common/model/parallel_for.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace knapserve {
namespace {

using Fn = absl::FunctionRef<void(int64_t, int64_t)>;
using Clock = std::chrono::steady_clock;

// How long an idle worker spins before it sleeps. The regions of one decode
// step follow each other within microseconds; between steps and requests
// the workers sleep.
constexpr auto kSpin = std::chrono::microseconds(500);

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// claim_ packs the job's generation (bits 32..63), the next unclaimed part
// (bits 16..31) and the number of parts (bits 0..15). A part is claimed by a
// compare-and-swap on the whole word, so a worker that is late for a job
// cannot claim a part of the next one by mistake.
constexpr uint64_t Pack(uint64_t generation, uint64_t next, uint64_t parts) {
  return (generation << 32) | (next << 16) | parts;
}
constexpr uint64_t NextOf(uint64_t c) { return (c >> 16) & 0xffff; }
constexpr uint64_t PartsOf(uint64_t c) { return c & 0xffff; }
constexpr uint64_t GenerationOf(uint64_t c) { return c >> 32; }

class Pool {
 public:
  static Pool& Get() {
    static Pool* const pool = new Pool();  // never destroyed: workers live
    return *pool;                          // until the process exits
  }

  // Runs the job on this thread and the workers; false (nothing run) when
  // another job holds the pool.
  bool TryRun(int64_t begin, int64_t end, int64_t chunk, int parts, Fn fn) {
    if (busy_.exchange(true, std::memory_order_acquire)) {
      inline_busy_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    pooled_.fetch_add(1, std::memory_order_relaxed);
    EnsureWorkers(parts - 1);
    // The job's fields are written while no part of any job is claimable
    // (the last job's parts are all done), then published by claim_.
    fn_.emplace(fn);
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    {
      absl::MutexLock lock(&error_mu_);
      error_ = nullptr;
    }
    pending_.store(parts, std::memory_order_relaxed);
    ++generation_;
    claim_.store(Pack(generation_, 0, parts), std::memory_order_release);
    wake_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_.notify_all();
    // The caller works too: it takes parts until none is left, so the job
    // finishes even if no worker wakes in time.
    RunClaimableParts();
    for (int spins = 0; pending_.load(std::memory_order_acquire) != 0;
         ++spins) {
      if (spins < 4096) {
        CpuRelax();
      } else {
        std::this_thread::yield();
      }
    }
    std::exception_ptr error;
    {
      absl::MutexLock lock(&error_mu_);
      error = error_;
    }
    busy_.store(false, std::memory_order_release);
    if (error != nullptr) std::rethrow_exception(error);
    return true;
  }

  ParallelForCounters counters() const {
    return {pooled_.load(std::memory_order_relaxed),
            inline_busy_.load(std::memory_order_relaxed)};
  }

 private:
  Pool() = default;

  // Only the pool's owner (the thread that set busy_) calls this.
  void EnsureWorkers(int count) {
    while (static_cast<int>(workers_started_) < count) {
      std::thread([this] { WorkerLoop(); }).detach();
      ++workers_started_;
    }
  }

  // Claims and runs parts of the current job until none is left.
  void RunClaimableParts() {
    uint64_t c = claim_.load(std::memory_order_acquire);
    while (NextOf(c) < PartsOf(c)) {
      if (!claim_.compare_exchange_weak(c, c + (uint64_t{1} << 16),
                                        std::memory_order_acq_rel,
                                        std::memory_order_acquire)) {
        continue;  // c now holds the current value
      }
      // Part NextOf(c) of generation GenerationOf(c) is ours; its job's
      // fields stay as they are until pending_ reaches 0.
      const int64_t part = static_cast<int64_t>(NextOf(c));
      const int64_t b = begin_ + part * chunk_;
      const int64_t e = std::min(end_, b + chunk_);
      try {
        if (b < e) (*fn_)(b, e);
      } catch (...) {
        absl::MutexLock lock(&error_mu_);
        if (error_ == nullptr) error_ = std::current_exception();
      }
      pending_.fetch_sub(1, std::memory_order_acq_rel);
      c = claim_.load(std::memory_order_acquire);
    }
  }

  void WorkerLoop() {
    uint32_t seen = wake_.load(std::memory_order_acquire);
    for (;;) {
      RunClaimableParts();
      // Wait for the next job: spin, then sleep.
      Clock::time_point idle_since = Clock::now();
      for (int spins = 1;; ++spins) {
        const uint32_t now = wake_.load(std::memory_order_acquire);
        if (now != seen) {
          seen = now;
          break;
        }
        CpuRelax();
        if (spins % 256 == 0 && Clock::now() - idle_since > kSpin) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          if (wake_.load(std::memory_order_seq_cst) == seen) {
            wake_.wait(seen, std::memory_order_seq_cst);
          }
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          idle_since = Clock::now();
        }
      }
    }
  }

  std::atomic<bool> busy_{false};  // a job owns the pool
  // Written by the owner only (while busy_), read by the parts it publishes.
  int workers_started_ = 0;
  uint64_t generation_ = 0;
  // The job's function, valid while the job runs (absl::FunctionRef has no
  // empty state, hence optional).
  std::optional<Fn> fn_;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;

  std::atomic<uint64_t> claim_{0};
  std::atomic<int> pending_{0};    // parts not yet finished
  std::atomic<uint32_t> wake_{0};  // bumped for each job (futex word)
  std::atomic<int> sleepers_{0};   // workers in wake_.wait
  absl::Mutex error_mu_;
  std::exception_ptr error_ ABSL_GUARDED_BY(error_mu_);
  std::atomic<int64_t> pooled_{0};
  std::atomic<int64_t> inline_busy_{0};
};

std::atomic<int> decode_pass_threads{0};
std::atomic<int> prefill_pass_threads{0};
std::atomic<int> solve_cores{0};  // reserved by live ScopedSolveCores

}  // namespace

void SetPassThreads(int decode, int prefill) {
  decode_pass_threads.store(std::max(0, decode));
  prefill_pass_threads.store(std::max(0, prefill));
}

int PassThreads(int64_t rows) {
  int pass = rows <= kDecodePassRows ? decode_pass_threads.load()
                                     : prefill_pass_threads.load();
  const int reserved = solve_cores.load(std::memory_order_relaxed);
  if (reserved > 0) {
    const int cores = UsableCores();
    const int wanted = pass > 0 ? pass : std::max(1, at::get_num_threads());
    if (wanted + reserved > cores) pass = std::max(1, cores - reserved);
  }
  return pass;
}

ScopedSolveCores::ScopedSolveCores(int cores) : cores_(std::max(0, cores)) {
  solve_cores.fetch_add(cores_);
}

ScopedSolveCores::~ScopedSolveCores() { solve_cores.fetch_sub(cores_); }

int UsableCores() {
  static const int cores = [] {
    int n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
      n = std::max(1, CPU_COUNT(&set));
    }
    return n;
  }();
  return cores;
}

void ParallelFor(int64_t begin, int64_t end, int64_t grain, Fn fn,
                 int max_threads) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  grain = std::max<int64_t>(grain, 1);
  int64_t threads = std::max(1, at::get_num_threads());
  if (max_threads > 0) threads = std::min<int64_t>(threads, max_threads);
  const int64_t parts =
      std::min<int64_t>({threads, (n + grain - 1) / grain, 0xffff});
  if (parts <= 1) {
    fn(begin, end);
    return;
  }
  const int64_t chunk = (n + parts - 1) / parts;
  const int used = static_cast<int>((n + chunk - 1) / chunk);
  if (!Pool::Get().TryRun(begin, end, chunk, used, fn)) fn(begin, end);
}

ParallelForCounters GetParallelForCounters() { return Pool::Get().counters(); }

// at::get_num_threads() first: ATen's lazy per-thread setup would otherwise
// override the team size set here on its first call.
ScopedSerialAten::ScopedSerialAten() : threads_(at::get_num_threads()) {
  omp_set_num_threads(1);
}

ScopedSerialAten::~ScopedSerialAten() { omp_set_num_threads(threads_); }

void SingleThreadedBlas() {
  // Looked up at run time: the BLAS is whichever library Debian's
  // alternatives put behind libblas.so.3.
  using SetThreads = void (*)(int);
  static const bool done = [] {
    if (auto set = reinterpret_cast<SetThreads>(
            dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
      set(1);
    }
    return true;
  }();
  (void)done;
}

int BlasThreads() {
  using GetThreads = int (*)();
  auto get = reinterpret_cast<GetThreads>(
      dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return get != nullptr ? get() : -1;
}

}  // namespace knapserve

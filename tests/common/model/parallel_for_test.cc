// ParallelFor (common/model/parallel_for.h): every index exactly once in the
// chunks at::parallel_for would make, exceptions reach the caller, busy and
// nested calls run inline, and concurrent callers from many threads all
// finish with correct results; after a model loads, a BLAS product runs on
// the calling thread alone.
#include "common/model/parallel_for.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <time.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "tests/testing/test_models.h"
#include "tests/testing/test_util.h"

namespace knapserve {
namespace {

using ScopedThreads = testing::ScopedThreadCount;

struct Chunk {
  int64_t begin, end;
  bool operator<(const Chunk& o) const { return begin < o.begin; }
};

std::vector<Chunk> ChunksOf(int64_t begin, int64_t end, int64_t grain) {
  absl::Mutex mu;
  std::vector<Chunk> chunks;
  ParallelFor(begin, end, grain, [&](int64_t b, int64_t e) {
    absl::MutexLock lock(&mu);
    chunks.push_back({b, e});
  });
  std::sort(chunks.begin(), chunks.end());
  return chunks;
}

TEST(ParallelForTest, CoversEveryIndexOnceInAtParallelForChunks) {
  for (int threads : {1, 2, 3, 4}) {
    ScopedThreads scoped(threads);
    for (int64_t n : {1, 2, 3, 5, 7, 16, 17, 100, 1001}) {
      for (int64_t grain : {1, 2, 3, 8, 64, 5000}) {
        const int64_t begin = 3;
        const std::vector<Chunk> chunks = ChunksOf(begin, begin + n, grain);
        // The split at::parallel_for makes: min(threads, ceil(n/grain))
        // chunks of ceil(n/chunks), the last one shorter.
        const int64_t parts =
            std::min<int64_t>(threads, (n + grain - 1) / grain);
        const int64_t size = (n + parts - 1) / parts;
        std::vector<Chunk> expected;
        for (int64_t b = begin; b < begin + n; b += size) {
          expected.push_back({b, std::min(begin + n, b + size)});
        }
        ASSERT_EQ(chunks.size(), expected.size())
            << "threads " << threads << " n " << n << " grain " << grain;
        for (size_t i = 0; i < chunks.size(); ++i) {
          EXPECT_EQ(chunks[i].begin, expected[i].begin);
          EXPECT_EQ(chunks[i].end, expected[i].end);
        }
      }
    }
  }
}

TEST(ParallelForTest, AThreadCapLimitsTheChunksNeverRaisesThem) {
  ScopedThreads scoped(3);
  for (int cap : {1, 2, 3, 8}) {
    absl::Mutex mu;
    int calls = 0;
    ParallelFor(
        0, 100, 1,
        [&](int64_t, int64_t) {
          absl::MutexLock lock(&mu);
          ++calls;
        },
        cap);
    EXPECT_EQ(calls, std::min(cap, 3)) << "cap " << cap;
  }
}

TEST(ParallelForTest, PassThreadsFollowTheRowsOfThePass) {
  EXPECT_EQ(PassThreads(1), 0);  // unset: the caller's torch threads
  SetPassThreads(1, 3);
  EXPECT_EQ(PassThreads(1), 1);
  EXPECT_EQ(PassThreads(kDecodePassRows), 1);
  EXPECT_EQ(PassThreads(kDecodePassRows + 1), 3);
  SetPassThreads(0, 0);
  EXPECT_EQ(PassThreads(1000), 0);
}

TEST(ParallelForTest, AnEmptyRangeCallsNothing) {
  int calls = 0;
  ParallelFor(5, 5, 1, [&](int64_t, int64_t) { ++calls; });
  ParallelFor(5, 2, 1, [&](int64_t, int64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

TEST(ParallelForTest, RunsChunksOnOtherThreads) {
  ScopedThreads scoped(2);
  const auto before = GetParallelForCounters();
  absl::Mutex mu;
  std::vector<std::thread::id> ids;
  ParallelFor(0, 2, 1, [&](int64_t, int64_t) {
    absl::MutexLock lock(&mu);
    ids.push_back(std::this_thread::get_id());
  });
  ASSERT_EQ(ids.size(), 2u);
  const auto after = GetParallelForCounters();
  EXPECT_EQ(after.pooled, before.pooled + 1);
  // The caller may run both chunks if no worker claimed one in time; over
  // many calls a worker must take part.
  bool other_thread = ids[0] != ids[1];
  for (int i = 0; i < 2000 && !other_thread; ++i) {
    std::atomic<int> off_caller{0};
    const auto caller = std::this_thread::get_id();
    ParallelFor(0, 2, 1, [&](int64_t, int64_t) {
      if (std::this_thread::get_id() != caller) ++off_caller;
      // Long enough for a worker to wake and claim the other chunk.
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    });
    other_thread = off_caller.load() > 0;
  }
  EXPECT_TRUE(other_thread);
}

TEST(ParallelForTest, AnExceptionInAnyChunkReachesTheCallerAfterAllChunks) {
  ScopedThreads scoped(4);
  for (int64_t failing = 0; failing < 4; ++failing) {
    std::atomic<int> finished{0};
    try {
      ParallelFor(0, 4, 1, [&](int64_t b, int64_t) {
        if (b == failing) throw std::runtime_error("chunk failed");
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        ++finished;
      });
      ADD_FAILURE() << "no exception for failing chunk " << failing;
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "chunk failed");
    }
    EXPECT_EQ(finished.load(), 3) << "failing chunk " << failing;
  }
  // The pool still works afterwards.
  std::atomic<int64_t> sum{0};
  ParallelFor(0, 100, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) sum += i;
  });
  EXPECT_EQ(sum.load(), 4950);
}

TEST(ParallelForTest, ANestedCallRunsInlineAndCompletes) {
  ScopedThreads scoped(2);
  std::atomic<int64_t> sum{0};
  ParallelFor(0, 4, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      ParallelFor(0, 10, 1, [&](int64_t ib, int64_t ie) {
        for (int64_t j = ib; j < ie; ++j) sum += j;
      });
    }
  });
  EXPECT_EQ(sum.load(), 4 * 45);
}

TEST(ParallelForTest, ConcurrentCallersAllGetCorrectResults) {
  // Eight threads share the pool: one at a time uses it, the others run
  // inline; every call must see exactly its own range.
  ScopedThreads restore(at::get_num_threads());  // at::set_num_threads below
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      at::set_num_threads(2 + t % 3);
      for (int call = 0; call < 300; ++call) {
        const int64_t n = 1 + (call * 7 + t) % 97;
        std::vector<std::atomic<int>> hits(n);
        ParallelFor(0, n, 1 + call % 5, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
        });
        for (int64_t i = 0; i < n; ++i) {
          if (hits[i].load() != 1) ++wrong;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

// While a ScopedSerialAten lives, ATen's parallel ops and ParallelFor run on
// the calling thread alone (no OpenMP team whose workers would spin on
// after the region); the team size comes back when it ends, nested too.
TEST(ParallelForTest, ASerialAtenScopeRunsAtenInlineWhileItLives) {
  ScopedThreads restore(at::get_num_threads());
  at::set_num_threads(2);
  // The threads that ran chunks of an at::parallel_for of 2^20 items.
  const auto threads_used = [] {
    absl::Mutex mu;
    std::vector<std::thread::id> ids;
    at::parallel_for(0, int64_t{1} << 20, 1, [&](int64_t, int64_t) {
      absl::MutexLock lock(&mu);
      ids.push_back(std::this_thread::get_id());
    });
    std::sort(ids.begin(), ids.end());
    return std::unique(ids.begin(), ids.end()) - ids.begin();
  };
  EXPECT_EQ(threads_used(), 2) << "without it, ATen's team of two";
  {
    ScopedSerialAten serial;
    EXPECT_EQ(at::get_num_threads(), 1);
    EXPECT_EQ(threads_used(), 1);
    EXPECT_EQ(ChunksOf(0, 100, 1).size(), 1u) << "ParallelFor inline too";
    {
      ScopedSerialAten nested;
      EXPECT_EQ(at::get_num_threads(), 1);
    }
    EXPECT_EQ(at::get_num_threads(), 1);
    // A sum over a prompt's final states, as knn's routing makes: the same
    // value as with the team (a reduction of integers in floats, exact).
    const torch::Tensor rows =
        torch::arange(1000 * 192, torch::kFloat32).reshape({1000, 192});
    EXPECT_EQ(rows.sum(0)[0].item<float>(), 192.0f * 999 * 1000 / 2);
  }
  EXPECT_EQ(at::get_num_threads(), 2);
  EXPECT_EQ(threads_used(), 2);
}

// While a ScopedSolveCores lives, every pass leaves its cores when the
// pass would otherwise use them; the counts add and end with the scopes.
TEST(ParallelForTest, ASolveReservationCapsThePassesWhileItLives) {
  const int cores = UsableCores();
  ASSERT_GE(cores, 1);
  SetPassThreads(cores, 0);
  ScopedThreads threads(cores);  // the prefill's pass: at::get_num_threads()
  EXPECT_EQ(PassThreads(1), cores);
  EXPECT_EQ(PassThreads(kDecodePassRows + 1), 0);
  {
    const ScopedSolveCores solve(1);
    EXPECT_EQ(PassThreads(1), std::max(1, cores - 1));
    EXPECT_EQ(PassThreads(kDecodePassRows + 1), std::max(1, cores - 1));
    {
      const ScopedSolveCores another(1);
      EXPECT_EQ(PassThreads(1), std::max(1, cores - 2));
    }
    EXPECT_EQ(PassThreads(1), std::max(1, cores - 1));
    // A pass that leaves a core anyway is not capped.
    SetPassThreads(std::max(1, cores - 1), 0);
    EXPECT_EQ(PassThreads(1), std::max(1, cores - 1));
  }
  SetPassThreads(cores, 0);
  EXPECT_EQ(PassThreads(1), cores);
  {
    const ScopedSolveCores none(0);
    EXPECT_EQ(PassThreads(1), cores);
  }
  SetPassThreads(0, 0);
}

double ProcessCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(usage.ru_utime.tv_usec +
                                    usage.ru_stime.tv_usec);
}

double ThreadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// OpenBLAS's own workers (normal priority, spinning after each call) took a
// core from decoding whenever the nice-19 planner called BLAS; loading a
// model sets BLAS to the calling thread (SingleThreadedBlas).
TEST(SingleThreadedBlasTest, AfterAModelLoadsABlasProductUsesOnlyItsThread) {
  ASSERT_NE(testing::CachedModel("stories260k"), nullptr);
  if (BlasThreads() == -1) GTEST_SKIP() << "the BLAS is not OpenBLAS";
  EXPECT_EQ(BlasThreads(), 1);
  // Products big enough for OpenBLAS to split them, for about 0.2 s of this
  // thread's time; every other thread of the process idle meanwhile (the
  // kernel pool's workers sleep 0.5 ms after their last job).
  const torch::Tensor a = torch::rand({384, 384});
  const torch::Tensor b = torch::rand({384, 384});
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double process_start = ProcessCpuSeconds();
  const double thread_start = ThreadCpuSeconds();
  double checksum = 0;
  while (ThreadCpuSeconds() - thread_start < 0.2) {
    checksum += torch::mm(a, b).sum().item<double>();
  }
  const double thread = ThreadCpuSeconds() - thread_start;
  const double process = ProcessCpuSeconds() - process_start;
  EXPECT_GT(checksum, 0);
  // Multi-threaded OpenBLAS on two cores: the workers' share (half the
  // product plus their spinning) about doubles the process's time.
  EXPECT_LT(process, 1.3 * thread) << "process CPU " << process << " s for "
                                   << thread << " s on the calling thread";
}

}  // namespace
}  // namespace knapserve

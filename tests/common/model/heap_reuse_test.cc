// Tests of KeepFreedTensorMemory (common/model/heap_reuse.h): after a model
// loads, the short-lived tensors of a solve reuse freed memory instead of
// faulting in fresh pages.
#include "common/model/heap_reuse.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <thread>

#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kGlibcMalloc = false;  // the sanitizer brings its own malloc
#elif defined(__GLIBC__)
constexpr bool kGlibcMalloc = true;
#else
constexpr bool kGlibcMalloc = false;
#endif

// Minor page faults of the calling thread so far.
int64_t ThreadMinorFaults() {
  rusage usage{};
  getrusage(RUSAGE_THREAD, &usage);
  return usage.ru_minflt;
}

TEST(HeapReuseTest, AfterAModelLoadsFreedTensorMemoryIsReused) {
  ASSERT_NE(testing::CachedModel("stories260k"), nullptr);
  if (!kGlibcMalloc) GTEST_SKIP() << "malloc is not glibc's";
  // A fresh thread (its own arena, as the planner's), making and dropping
  // tensors of the DP's sizes: 1-6 MB each, about 40 MB per round.
  int64_t faults = -1;
  std::thread worker([&faults] {
    c10::InferenceMode guard;
    double checksum = 0;
    auto round = [&checksum] {
      for (int64_t kib : {1024, 2048, 4096, 6144, 3072, 1536}) {
        torch::Tensor a = torch::ones({kib * 256});
        torch::Tensor b = a * 2;
        torch::Tensor c = torch::ones({kib * 128});
        checksum += b.sum().item<double>() + c.sum().item<double>();
      }
    };
    round();  // the arena grows
    round();
    const int64_t start = ThreadMinorFaults();
    for (int i = 0; i < 10; ++i) round();
    faults = ThreadMinorFaults() - start;
    EXPECT_GT(checksum, 0);
  });
  worker.join();
  EXPECT_TRUE(KeepFreedTensorMemory());
  // Fresh pages for every tensor would be about 10 x 10,000 faults (4 KiB
  // pages); reused memory faults a few times at most.
  EXPECT_LT(faults, 500) << "minor page faults over 10 rounds";
}

}  // namespace
}  // namespace knapserve

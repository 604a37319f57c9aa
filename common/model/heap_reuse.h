// KeepFreedTensorMemory: keeps the memory of freed tensors in the process for
// the next ones, instead of handing it back to the kernel after every free.
//
// Why: a LibTorch op allocates its output with malloc, and the planner's
// sublayer DP (planner/knapsack.h) makes thousands of short-lived tensors of
// one to a few megabytes: branch attention scores, MLP activations, the
// gathered cell states. glibc serves such sizes with mmap, or from the top of
// an arena that it trims back to the kernel as soon as more than a few
// megabytes lie free there (the thresholds follow the largest freed mmap
// chunk). Each new tensor then faults in fresh zeroed pages: `perf` of a
// knapspec solve on stories-24l (one thread) put 29% of the planner
// thread's time in the kernel's page faults and page clearing, and a
// short-prompt solve took 0.30-0.32 s against 0.21-0.23 s with the memory
// kept (3 runs each; plain decoding, which writes into buffers it keeps,
// unchanged).
//
// KeepFreedTensorMemory() fixes glibc's thresholds: blocks below
// kMmapThresholdBytes come from the arenas, and an arena gives its free top
// back only beyond kTrimThresholdBytes. The cost is memory: each arena that
// did tensor work (the step thread's, the planner's, a prefill worker's) may
// keep up to kTrimThresholdBytes free for reuse. The allocator's own pools
// (the K/V cache, the packed weights) are allocated once and unaffected.
//
// Loading a model (LlamaModel::FromCheckpoint) calls it. Idempotent, any
// thread; a C library other than glibc is left alone.
#ifndef KNAPSERVE_COMMON_MODEL_HEAP_REUSE_H_
#define KNAPSERVE_COMMON_MODEL_HEAP_REUSE_H_

#include <cstdint>

namespace knapserve {

// glibc's largest allowed M_MMAP_THRESHOLD on 64-bit systems.
inline constexpr int64_t kMmapThresholdBytes = int64_t{32} << 20;
inline constexpr int64_t kTrimThresholdBytes = int64_t{64} << 20;

// Returns true when the thresholds are in force (glibc accepted them).
bool KeepFreedTensorMemory();

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_MODEL_HEAP_REUSE_H_

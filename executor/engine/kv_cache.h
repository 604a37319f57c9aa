// KvCache: one sequence's preallocated K/V storage plus its committed length.
//
// Storage for every layer is allocated once, for `capacity` positions, when
// the sequence is admitted; decoding never reallocates or copies it. Rolling
// back rejected positions (speculative decoding) is Truncate(): a length moves,
// nothing is copied, and the next forward overwrites the stale positions.
//
// Ownership: the cache owns its tensors; the model it was made for must
// outlive it only in the sense that shapes must match (it holds no pointer to
// the model). Not thread-safe: one sequence is stepped by one thread at a time.
#ifndef KNAPSERVE_EXECUTOR_ENGINE_KV_CACHE_H_
#define KNAPSERVE_EXECUTOR_ENGINE_KV_CACHE_H_

#include <cstdint>
#include <vector>

#include "common/model/llama.h"

namespace knapserve {

class KvCache {
 public:
  // Allocates `capacity` positions for every layer of `model`.
  KvCache(const LlamaModel& model, int64_t capacity);

  // The per-layer storage, for LlamaModel::Forward / Attention.
  std::vector<LayerKv>& layers() { return layers_; }
  const std::vector<LayerKv>& layers() const { return layers_; }

  // Positions [0, length()) hold committed K/V.
  int64_t length() const { return length_; }
  int64_t capacity() const { return capacity_; }
  int64_t remaining() const { return capacity_ - length_; }

  // Marks positions [length(), new_length) as written and committed.
  void Commit(int64_t new_length);
  // Drops positions >= new_length (new_length <= length()). No copy.
  void Truncate(int64_t new_length);

  // Bytes of K/V the positions [0, length) occupy across all layers.
  int64_t BytesUsed() const;

 private:
  std::vector<LayerKv> layers_;
  int64_t capacity_ = 0;
  int64_t length_ = 0;
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_ENGINE_KV_CACHE_H_

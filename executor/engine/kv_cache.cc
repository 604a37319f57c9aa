#include "executor/engine/kv_cache.h"

namespace knapserve {

KvCache::KvCache(const LlamaModel& model, int64_t capacity)
    : layers_(model.AllocateKv(capacity)), capacity_(capacity) {}

void KvCache::Commit(int64_t new_length) {
  TORCH_CHECK(new_length >= length_ && new_length <= capacity_,
              "KvCache::Commit(", new_length, ") with length ", length_,
              " capacity ", capacity_);
  length_ = new_length;
}

void KvCache::Truncate(int64_t new_length) {
  TORCH_CHECK(new_length >= 0 && new_length <= length_, "KvCache::Truncate(",
              new_length, ") with length ", length_);
  length_ = new_length;
}

int64_t KvCache::BytesUsed() const {
  if (layers_.empty()) return 0;
  const LayerKv& l = layers_.front();
  const int64_t per_position =
      2 * l.k.size(0) * l.k.size(2) * static_cast<int64_t>(l.k.element_size());
  return per_position * length_ * static_cast<int64_t>(layers_.size());
}

}  // namespace knapserve

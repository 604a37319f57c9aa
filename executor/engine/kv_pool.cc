#include "executor/engine/kv_pool.h"

#include <c10/core/InferenceMode.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace knapserve {

absl::StatusOr<int64_t> ParseKvCacheMemory(std::string_view text,
                                           int64_t total_ram_bytes) {
  const std::string original(text);
  std::string s = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(original));
  auto bad = [&](const char* why) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv-cache-memory: '", original, "' ", why,
                     " (bytes such as 536870912, 512MiB or 2GB, or a "
                     "fraction of RAM below 1 such as 0.25)"));
  };
  // Strip a unit: [KMGT](I)?B? or B.
  double scale = 1;
  if (!s.empty() && s.back() == 'B') s.pop_back();
  if (!s.empty() && s.back() == 'I') s.pop_back();
  if (!s.empty() && std::isalpha(static_cast<unsigned char>(s.back()))) {
    const char unit = s.back();
    s.pop_back();
    const bool binary = original.find_first_of("iI") != std::string::npos;
    const double base = binary ? 1024.0 : 1000.0;
    switch (unit) {
      case 'K':
        scale = base;
        break;
      case 'M':
        scale = base * base;
        break;
      case 'G':
        scale = base * base * base;
        break;
      case 'T':
        scale = base * base * base * base;
        break;
      default:
        return bad("has an unknown unit");
    }
  }
  double value = 0;
  if (s.empty() || !absl::SimpleAtod(s, &value) || !std::isfinite(value) ||
      value <= 0) {
    return bad("is not a positive number");
  }
  if (scale == 1 && value < 1) {
    if (total_ram_bytes <= 0)
      return bad("is a fraction, but this machine's RAM is unknown");
    return static_cast<int64_t>(value * static_cast<double>(total_ram_bytes));
  }
  const double bytes = value * scale;
  if (bytes > 9e18) return bad("is too large");
  return static_cast<int64_t>(bytes);
}

int64_t TotalRamBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<int64_t>(pages) * page_size;
}

int64_t DefaultKvCacheBytes(const LlamaModel& model, int max_running) {
  const int64_t rows = 16;
  const int64_t per_sequence =
      (model.max_context() + rows - 1) / rows * model.KvBytesPerBlock(rows);
  int64_t bytes = per_sequence * std::max(1, max_running);
  const int64_t ram = TotalRamBytes();
  if (ram > 0) bytes = std::min(bytes, ram / 4);
  return std::max(bytes, per_sequence);
}

// ---- SequenceKv ----

SequenceKv::SequenceKv(SequenceKv&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      snapshot_(other.snapshot_),
      future_blocks_(std::exchange(other.future_blocks_, 0)),
      blocks_(std::move(other.blocks_)) {
  other.blocks_.clear();
}

SequenceKv& SequenceKv::operator=(SequenceKv&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::exchange(other.pool_, nullptr);
    snapshot_ = other.snapshot_;
    future_blocks_ = std::exchange(other.future_blocks_, 0);
    blocks_ = std::move(other.blocks_);
    other.blocks_.clear();
  }
  return *this;
}

SequenceKv::~SequenceKv() { Release(); }

void SequenceKv::Release() {
  if (pool_ == nullptr) return;
  pool_->Return(blocks_, future_blocks_, /*table=*/!snapshot_);
  blocks_.clear();
  future_blocks_ = 0;
  pool_ = nullptr;
}

absl::Status SequenceKv::EnsureCapacity(int64_t positions) {
  const int64_t needed = pool_->BlocksFor(positions);
  const int64_t missing = needed - static_cast<int64_t>(blocks_.size());
  if (missing > future_blocks_) {
    return absl::FailedPreconditionError(
        absl::StrCat("K/V for ", positions, " positions exceeds the ",
                     reserved_positions(), " this sequence reserved"));
  }
  while (static_cast<int64_t>(blocks_.size()) < needed) {
    blocks_.push_back(pool_->TakeBlock());
    --future_blocks_;
  }
  return absl::OkStatus();
}

absl::Status SequenceKv::SharePrefix(const SequenceKv& source,
                                     int64_t positions) {
  if (source.pool_ != pool_ || !blocks_.empty() || positions < 0 ||
      pool_->BlocksFor(positions) >
          static_cast<int64_t>(source.blocks_.size())) {
    return absl::FailedPreconditionError(
        absl::StrCat("K/V prefix sharing: cannot share ", positions,
                     " positions (the source holds ", source.blocks_.size(),
                     " blocks; this table ", blocks_.size(), ")"));
  }
  const int64_t full = positions / pool_->block_rows();
  const bool partial = positions % pool_->block_rows() != 0;
  if (partial && future_blocks_ < 1) {
    return absl::FailedPreconditionError(
        "K/V prefix sharing: no reserved block for the copied partial block");
  }
  blocks_.assign(source.blocks_.begin(), source.blocks_.begin() + full);
  pool_->Share(blocks_, /*table=*/true);
  if (partial) {
    c10::InferenceMode guard;
    const int32_t from = source.blocks_[full];
    const int32_t to = pool_->TakeBlock();
    --future_blocks_;
    blocks_.push_back(to);  // in the table first: a throwing copy leaks nothing
    for (const LayerKv& layer : pool_->storage().layers) {
      layer.k[to].copy_(layer.k[from]);
      layer.v[to].copy_(layer.v[from]);
    }
  }
  return absl::OkStatus();
}

int64_t SequenceKv::reserved_positions() const {
  return (static_cast<int64_t>(blocks_.size()) + future_blocks_) *
         pool_->block_rows();
}

const PagedKvStorage& SequenceKv::storage() const { return pool_->storage(); }

std::vector<LayerKv> SequenceKv::ContiguousCopy(int64_t length) const {
  c10::InferenceMode guard;
  const PagedKvStorage& storage = pool_->storage();
  const int64_t used = pool_->BlocksFor(length);
  TORCH_CHECK(used <= static_cast<int64_t>(blocks_.size()),
              "ContiguousCopy past the sequence's blocks");
  std::vector<LayerKv> out;
  out.reserve(storage.layers.size());
  if (used == 0) return out;
  torch::Tensor table = torch::tensor(
      std::vector<int64_t>(blocks_.begin(), blocks_.begin() + used),
      torch::TensorOptions().dtype(torch::kInt64));
  table = table.to(storage.layers[0].k.device());
  for (const LayerKv& layer : storage.layers) {
    // [blocks, KV, B, hd] -> [KV, blocks * B, hd] -> first `length`.
    auto gather = [&](const torch::Tensor& pool) {
      const int64_t nkv = pool.size(1);
      const int64_t hd = pool.size(3);
      return pool.index_select(0, table)
          .permute({1, 0, 2, 3})
          .reshape({nkv, used * storage.block_rows, hd})
          .narrow(1, 0, length)
          .contiguous();
    };
    out.push_back({gather(layer.k), gather(layer.v)});
  }
  return out;
}

namespace {

// SequenceKv::Snapshot's holder: a table of shared blocks and no promise.
class PrefixSnapshot : public KvSnapshot {
 public:
  PrefixSnapshot(SequenceKv blocks, int64_t length)
      : blocks_(std::move(blocks)), length_(length) {}
  std::vector<LayerKv> Contiguous() const override {
    c10::InferenceMode guard;
    const PagedKvStorage& storage = blocks_.storage();
    const int64_t rows = storage.block_rows;
    std::vector<LayerKv> out;
    out.reserve(storage.layers.size());
    for (const LayerKv& layer : storage.layers) {
      // Block by block, and only the rows below length_: the sequence may
      // be writing the rest of its last block meanwhile.
      auto gather = [&](const torch::Tensor& pool) {
        std::vector<torch::Tensor> parts;
        for (int64_t b = 0; b * rows < length_; ++b) {
          const int64_t n = std::min(rows, length_ - b * rows);
          parts.push_back(pool[blocks_.blocks()[b]].narrow(1, 0, n));
        }
        return torch::cat(parts, 1);  // [KV, length, hd]
      };
      out.push_back({gather(layer.k), gather(layer.v)});
    }
    return out;
  }

 private:
  const SequenceKv blocks_;
  const int64_t length_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const KvSnapshot>> SequenceKv::Snapshot(
    int64_t length) const {
  const int64_t used = pool_->BlocksFor(length);
  if (length <= 0 || used > static_cast<int64_t>(blocks_.size())) {
    return absl::FailedPreconditionError(
        absl::StrCat("K/V snapshot of ", length, " positions: the table holds ",
                     blocks_.size(), " blocks"));
  }
  std::optional<SequenceKv> held = pool_->TryReserve(0);
  // A reservation of nothing always succeeds.
  held->snapshot_ = true;
  held->blocks_.assign(blocks_.begin(), blocks_.begin() + used);
  pool_->Share(held->blocks_, /*table=*/false);
  return std::shared_ptr<const KvSnapshot>(
      std::make_shared<PrefixSnapshot>(std::move(*held), length));
}

// ---- KvPool ----

absl::StatusOr<std::unique_ptr<KvPool>> KvPool::Create(
    const LlamaModel& model, const KvPoolOptions& options) {
  if (options.block_rows <= 0 || options.block_rows % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv block size: must be a positive multiple of 16, got ",
                     options.block_rows));
  }
  const int64_t per_block = model.KvBytesPerBlock(options.block_rows);
  const int64_t blocks = options.memory_bytes / per_block;
  if (blocks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv-cache-memory: ", options.memory_bytes,
                     " bytes cannot hold one K/V block of ", options.block_rows,
                     " positions (", per_block, " bytes for this model)"));
  }
  if (blocks > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv-cache-memory: ", blocks, " blocks is too many"));
  }
  PagedKvStorage storage;
  try {
    storage = model.AllocatePagedKv(blocks, options.block_rows);
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "kv-cache-memory: could not allocate ", blocks, " K/V blocks (",
        blocks * per_block, " bytes): ", e.what()));
  }
  return std::unique_ptr<KvPool>(new KvPool(std::move(storage), per_block));
}

KvPool::KvPool(PagedKvStorage storage, int64_t bytes_per_block)
    : storage_(std::move(storage)), bytes_per_block_(bytes_per_block) {
  absl::MutexLock lock(&mu_);
  free_list_.reserve(storage_.num_blocks);
  references_.assign(storage_.num_blocks, 0);
  table_references_.assign(storage_.num_blocks, 0);
  // Lowest ids first out (popped from the back).
  for (int64_t b = storage_.num_blocks - 1; b >= 0; --b)
    free_list_.push_back(static_cast<int32_t>(b));
}

KvPool::~KvPool() {
  absl::MutexLock lock(&mu_);
  auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return sequences_ == 0;
  };
  while (!mu_.AwaitWithTimeout(absl::Condition(&none), absl::Seconds(10))) {
    std::fprintf(stderr,
                 "knapserve: the K/V pool waits for %lld sequences or plan "
                 "snapshots to give their blocks back\n",
                 static_cast<long long>(sequences_));
  }
}

int64_t KvPool::BlocksFor(int64_t positions) const {
  return (std::max<int64_t>(positions, 0) + storage_.block_rows - 1) /
         storage_.block_rows;
}

bool KvPool::CanEverFit(int64_t positions) const {
  return BlocksFor(positions) <= storage_.num_blocks;
}

std::optional<SequenceKv> KvPool::TryReserve(int64_t positions,
                                             int64_t shared_prefix_positions) {
  const int64_t shared =
      std::clamp<int64_t>(shared_prefix_positions, 0, positions) /
      storage_.block_rows;
  const int64_t blocks = BlocksFor(positions) - shared;
  absl::MutexLock lock(&mu_);
  if (reserved_ + blocks > storage_.num_blocks) return std::nullopt;
  reserved_ += blocks;
  ++sequences_;
  return SequenceKv(this, blocks);
}

int32_t KvPool::TakeBlock() {
  absl::MutexLock lock(&mu_);
  // A promise guarantees a free block: reserved_ = held + promised <= total.
  // The block moves from promised to held, so reserved_ stays.
  TORCH_CHECK(!free_list_.empty(), "K/V pool: no free block for a reservation");
  const int32_t block = free_list_.back();
  free_list_.pop_back();
  references_[block] = 1;
  table_references_[block] = 1;  // taken for a table
  ++table_blocks_;
  ++blocks_in_tables_;
  return block;
}

void KvPool::Share(absl::Span<const int32_t> blocks, bool table) {
  absl::MutexLock lock(&mu_);
  for (int32_t block : blocks) {
    TORCH_CHECK(references_[block] > 0, "K/V pool: sharing a free block");
    ++references_[block];
    if (table && table_references_[block]++ == 0) ++blocks_in_tables_;
  }
  if (table) table_blocks_ += static_cast<int64_t>(blocks.size());
}

void KvPool::Return(absl::Span<const int32_t> blocks, int64_t future,
                    bool table) {
  absl::MutexLock lock(&mu_);
  for (int32_t block : blocks) {
    if (table && --table_references_[block] == 0) --blocks_in_tables_;
    if (--references_[block] == 0) {
      free_list_.push_back(block);
      --reserved_;
    }
  }
  if (table) table_blocks_ -= static_cast<int64_t>(blocks.size());
  reserved_ -= future;
  --sequences_;
}

int64_t KvPool::used_blocks() const {
  absl::MutexLock lock(&mu_);
  return storage_.num_blocks - static_cast<int64_t>(free_list_.size());
}

int64_t KvPool::table_blocks() const {
  absl::MutexLock lock(&mu_);
  return table_blocks_;
}

int64_t KvPool::shared_saved_blocks() const {
  absl::MutexLock lock(&mu_);
  return table_blocks_ - blocks_in_tables_;
}

int64_t KvPool::reserved_blocks() const {
  absl::MutexLock lock(&mu_);
  return reserved_;
}

int64_t KvPool::free_blocks() const {
  absl::MutexLock lock(&mu_);
  return storage_.num_blocks - reserved_;
}

int64_t KvPool::sequences() const {
  absl::MutexLock lock(&mu_);
  return sequences_;
}

}  // namespace knapserve

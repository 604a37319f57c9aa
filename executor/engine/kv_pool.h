// KvPool: the executor's K/V memory as one managed pool of fixed-size blocks
// (paged attention's layout), shared by every running sequence.
//
// Memory: the pool allocates `memory_bytes` of K/V once, as blocks of
// `block_rows` positions for every layer (LlamaModel::AllocatePagedKv). A
// sequence owns a block table: position p lives in block table[p /
// block_rows]. Blocks are taken as the sequence grows, never one
// max-context buffer per sequence.
//
// Admission: a sequence is admitted with a reservation of the blocks its
// longest possible length needs (prompt + max_new_tokens, capped at the
// context), so a running sequence can never run out of K/V mid-stream and
// nothing is ever preempted. Reserved blocks not yet used stay free in the
// physical sense but cannot be promised twice. A request whose reservation is
// larger than the whole pool can never run (ResourceExhausted at once);
// one that is merely larger than what is free now waits.
//
// Prefix sharing (a request's n > 1 choices, executor/engine/batch_engine.h):
// the choices share the prompt's full blocks. A choice's SequenceKv is
// reserved with the shared prefix left out (TryReserve's
// shared_prefix_positions) and, once the first choice has prefilled, takes
// the prefix over with SharePrefix: the full blocks by reference (each block
// counts its holders), the last partly filled block by copy (the one block
// a choice will write into: copy on write, done when the prefix is shared).
// Positions before the prompt's end are never written again, so a shared
// block is read-only. A block returns to the free list when its last holder
// ends.
//
// Accounting: reserved = blocks held in some table (counted once however
// many tables share them) + blocks promised but not taken yet. A reservation
// therefore stays valid whichever sharer ends first.
//
// Ownership: the pool owns the storage. A SequenceKv owns its reservation
// and one reference to each block of its table, and returns them on
// destruction (finish, cancel, deadline, Abort, error: every path that drops
// the sequence), so blocks cannot leak. A plan snapshot
// (SequenceKv::Snapshot) is a SequenceKv too: it holds its blocks, inside
// the pool's memory budget, until the planner drops it. The pool outlives
// every SequenceKv: its destructor waits for the last.
//
// Thread safety: KvPool's methods may be called from any thread (the engine
// allocates, metrics read the gauges). A SequenceKv is used by one thread at
// a time; the storage it points into is written only by the forward pass of
// the sequence that owns the block.
#ifndef KNAPSERVE_EXECUTOR_ENGINE_KV_POOL_H_
#define KNAPSERVE_EXECUTOR_ENGINE_KV_POOL_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/model/llama.h"
#include "common/plan/planner_client.h"

namespace knapserve {

struct KvPoolOptions {
  int64_t memory_bytes = 0;  // K/V bytes for the pool; > 0
  int64_t block_rows = 16;   // positions per block; a positive multiple of 16
};

// Parses a --kv-cache-memory value: bytes ("536870912", "512MiB", "2GiB",
// "1.5GB"; suffixes K/M/G/T with optional "i" and "B") or a fraction of
// `total_ram_bytes` ("0.25": a plain number below 1). InvalidArgument names
// the value.
absl::StatusOr<int64_t> ParseKvCacheMemory(std::string_view text,
                                           int64_t total_ram_bytes);
// Physical memory of this machine in bytes (0 if unknown).
int64_t TotalRamBytes();
// The default pool size: K/V for `max_running` sequences at the model's full
// context, but at most a quarter of RAM (and at least one full-context
// sequence).
int64_t DefaultKvCacheBytes(const LlamaModel& model, int max_running);

class KvPool;

// One sequence's K/V in the pool: its block table and its reservation.
// Move-only; returns everything to the pool when destroyed.
class SequenceKv {
 public:
  SequenceKv(SequenceKv&& other) noexcept;
  SequenceKv& operator=(SequenceKv&& other) noexcept;
  SequenceKv(const SequenceKv&) = delete;
  SequenceKv& operator=(const SequenceKv&) = delete;
  ~SequenceKv();

  // Makes the table cover positions [0, positions), taking blocks from the
  // reservation. Fails (FailedPrecondition) only past the reservation.
  absl::Status EnsureCapacity(int64_t positions);
  // Starts this (empty) table with positions [0, positions) of `source`'s:
  // the full blocks shared, a last partial block copied into a block of
  // this reservation. FailedPrecondition when this table is not empty, the
  // source does not hold the positions, or they are in another pool.
  absl::Status SharePrefix(const SequenceKv& source, int64_t positions);
  absl::Span<const int32_t> blocks() const { return blocks_; }
  // Positions the table and the rest of the reservation cover.
  int64_t reserved_positions() const;
  const PagedKvStorage& storage() const;
  // A contiguous copy of positions [0, length) for every layer
  // ([kv_heads, length, head_dim] each), for consumers that need plain
  // tensors (a planner's K/V window).
  std::vector<LayerKv> ContiguousCopy(int64_t length) const;
  // Positions [0, length) by reference, for a plan snapshot: one more
  // reference to each block holding them (nothing is copied; a partial last
  // block too, since a sequence writes only positions at or past its
  // committed length, which `length` must be). The blocks stay out of the
  // free list, counted as used, until the snapshot is dropped, also after
  // this sequence ended. Its Contiguous() copies only rows below `length`,
  // on the caller's thread. FailedPrecondition past this table.
  absl::StatusOr<std::shared_ptr<const KvSnapshot>> Snapshot(
      int64_t length) const;

 private:
  friend class KvPool;
  SequenceKv(KvPool* pool, int64_t future_blocks)
      : pool_(pool), future_blocks_(future_blocks) {}
  void Release();

  KvPool* pool_ = nullptr;
  bool snapshot_ = false;        // Snapshot's holder: not a table
  int64_t future_blocks_ = 0;    // promised, not in the table yet
  std::vector<int32_t> blocks_;  // the table: one reference to each
};

class KvPool {
 public:
  // Allocates the storage for `model`. InvalidArgument when the memory
  // cannot hold one block or block_rows is not a positive multiple of 16.
  static absl::StatusOr<std::unique_ptr<KvPool>> Create(
      const LlamaModel& model, const KvPoolOptions& options);

  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;
  // Waits until every SequenceKv is gone: a plan snapshot may still be
  // queued at a planner or being solved when the engine stops (its
  // sequence ended, so the planner drops it soon). Says so on stderr every
  // 10 s while it waits.
  ~KvPool();

  const PagedKvStorage& storage() const { return storage_; }
  int64_t block_rows() const { return storage_.block_rows; }
  int64_t total_blocks() const { return storage_.num_blocks; }
  int64_t bytes_per_block() const { return bytes_per_block_; }
  // Blocks needed for `positions` positions.
  int64_t BlocksFor(int64_t positions) const;
  // Whether a reservation of `positions` could ever be granted (it fits the
  // whole pool).
  bool CanEverFit(int64_t positions) const;

  // Reserves blocks for `positions` positions, or nullopt when not enough
  // unreserved blocks are free now. With shared_prefix_positions, the full
  // blocks of that prefix are left out: the table will take them over from
  // another sequence with SharePrefix.
  std::optional<SequenceKv> TryReserve(int64_t positions,
                                       int64_t shared_prefix_positions = 0)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Gauges.
  int64_t used_blocks() const ABSL_LOCKS_EXCLUDED(mu_);  // in tables, once
  // Table entries over all sequences (plan snapshots' references not
  // counted): minus the blocks those tables hold, what prefix sharing saved.
  int64_t table_blocks() const ABSL_LOCKS_EXCLUDED(mu_);
  // table_blocks minus the distinct blocks in tables, read at once.
  int64_t shared_saved_blocks() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t reserved_blocks() const ABSL_LOCKS_EXCLUDED(mu_);  // promised
  int64_t free_blocks() const ABSL_LOCKS_EXCLUDED(mu_);      // total - reserved
  int64_t sequences() const ABSL_LOCKS_EXCLUDED(mu_);        // live SequenceKvs

 private:
  friend class SequenceKv;
  KvPool(PagedKvStorage storage, int64_t bytes_per_block);
  // A free block with one reference (moved from a reservation's promise).
  int32_t TakeBlock() ABSL_LOCKS_EXCLUDED(mu_);
  // One more reference to each of `blocks`, by a table (counted in
  // table_blocks) or a snapshot.
  void Share(absl::Span<const int32_t> blocks, bool table)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops one reference to each of `blocks` (freeing those that had the
  // last) and the promise of `future` blocks; `table` as for Share.
  void Return(absl::Span<const int32_t> blocks, int64_t future, bool table)
      ABSL_LOCKS_EXCLUDED(mu_);

  const PagedKvStorage storage_;
  const int64_t bytes_per_block_;
  mutable absl::Mutex mu_;
  std::vector<int32_t> free_list_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> references_ ABSL_GUARDED_BY(mu_);        // per block
  std::vector<int32_t> table_references_ ABSL_GUARDED_BY(mu_);  // of those
  int64_t blocks_in_tables_ ABSL_GUARDED_BY(mu_) = 0;           // distinct
  int64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;  // held + promised
  int64_t table_blocks_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t sequences_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_ENGINE_KV_POOL_H_

// Reading and writing checkpoints in the safetensors format.
//
// A .safetensors file is an 8-byte little-endian header length N, N bytes of
// JSON header ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// optional "__metadata__": {string: string}}), then the data section that the
// offsets index. Only the dtypes knapserve computes with are accepted: F32,
// BF16 and F16.
//
//   ASSIGN_OR_RETURN(auto checkpoint, Checkpoint::Open("/models/smollm2"));
//   ASSIGN_OR_RETURN(torch::Tensor w,
//                    checkpoint->Get("model.norm.weight", {hidden_size}));
//
// Tensors returned by View() and Get() alias the memory-mapped file: they are
// CPU tensors that are valid only while the SafetensorsFile / Checkpoint that
// produced them lives, and they must not be written to (the mapping is
// read-only; writing faults). Copy (or .to(device/dtype)) to keep or modify.
//
// Every malformed input (truncated file, bad JSON, bad offsets, unsupported
// dtype, missing shard...) is reported as an absl::Status whose message names
// the file and the problem; nothing here aborts on bad input.
#ifndef KNAPSERVE_COMMON_CHECKPOINT_SAFETENSORS_H_
#define KNAPSERVE_COMMON_CHECKPOINT_SAFETENSORS_H_

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace knapserve {

// One tensor entry of a safetensors header.
struct TensorInfo {
  std::string name;
  std::string dtype;  // "F32", "BF16" or "F16".
  std::vector<int64_t> shape;
  // Byte offsets [begin, end) in the data section (after the header).
  uint64_t begin = 0;
  uint64_t end = 0;
};

// One memory-mapped .safetensors file (mmap, read-only, MAP_PRIVATE).
//
// Open() validates the whole header up front, so later calls only fail on a
// missing name. Immutable after Open(); all methods are thread-safe. The
// mapping is released when the object is destroyed; views must not outlive it.
class SafetensorsFile {
 public:
  // Maps and validates `path`. Errors: NotFound if the file does not exist,
  // InvalidArgument (naming the file and the problem) for a malformed file,
  // Internal for an mmap failure.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::string& path);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // In header order (sorted by data offset).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // nullptr if absent.
  const TensorInfo* Find(std::string_view name) const;
  // The header's "__metadata__" (string values only); empty if absent.
  const std::map<std::string, std::string>& metadata() const {
    return metadata_;
  }

  // A CPU tensor aliasing the mapped bytes (torch::from_blob, no copy), valid
  // while this object lives. Read-only. NotFound if `name` is absent.
  absl::StatusOr<torch::Tensor> View(std::string_view name) const;

 private:
  SafetensorsFile() = default;

  std::string path_;
  void* mapping_ = nullptr;  // Owned; munmap'ed in the destructor.
  size_t mapping_size_ = 0;
  const uint8_t* data_ = nullptr;  // Start of the data section.
  uint64_t data_size_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;  // name -> tensors_ idx.
  std::map<std::string, std::string> metadata_;
};

// A checkpoint folder: either a single model.safetensors, or
// model.safetensors.index.json whose "weight_map" maps each tensor name to a
// shard file in the same folder. Owns its files (and so the memory that Get()
// views alias). Immutable after Open(); thread-safe.
class Checkpoint {
 public:
  // Opens every file and checks that each tensor of the index's weight_map is
  // in its shard. Errors: NotFound if the folder has neither file, or a shard
  // is missing; InvalidArgument for a malformed index or shard.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(
      const std::string& dir);

  const std::string& dir() const { return dir_; }
  bool Has(std::string_view name) const;
  // Every tensor name, sorted.
  std::vector<std::string> TensorNames() const;

  // Aliasing view of tensor `name` (see SafetensorsFile::View). NotFound naming
  // the tensor and folder if missing; InvalidArgument naming the file, tensor,
  // expected and actual shape if the shape differs from `expected_shape`.
  absl::StatusOr<torch::Tensor> Get(std::string_view name,
                                    std::vector<int64_t> expected_shape) const;

  // Aliasing view of tensor `name` with whatever shape the file gives it.
  // NotFound naming the tensor and folder if missing.
  absl::StatusOr<torch::Tensor> View(std::string_view name) const;

  // The header entry of tensor `name` (dtype, shape), or nullptr if absent.
  const TensorInfo* Find(std::string_view name) const;
  // 16 hex digits identifying these weights (not only the architecture, as
  // ModelConfig::Fingerprint does): a 64-bit FNV-1a hash of every tensor's
  // name, dtype, shape and first 4 KiB of data. Two trainings of the same
  // architecture differ; it reads about 4 KiB per tensor.
  std::string WeightsFingerprint() const;

 private:
  Checkpoint() = default;

  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  // name -> (file, info) for every tensor of every file.
  std::map<std::string, std::pair<const SafetensorsFile*, const TensorInfo*>,
           std::less<>>
      index_;
};

// Writes a .safetensors file: header padded with spaces to a multiple of 8
// bytes, tensors contiguous in the given order, dtype from each tensor
// (float32, bfloat16, float16; anything else is InvalidArgument). Tensors may
// live on any device and be non-contiguous; they are copied to CPU one at a
// time. Writes to `path` + ".tmp" and renames, so a failed write leaves no
// partial file at `path`.
absl::Status WriteSafetensors(
    const std::string& path,
    const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata = {});

// Streaming variant for checkpoints too big to hold twice: the header is
// written from `specs` (name, dtype "F32"/"BF16"/"F16", shape), then
// `make_tensor(i)` is called once per spec, in order, and must return a tensor
// of that dtype and shape, which is written and dropped.
struct TensorSpec {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
};
absl::Status WriteSafetensorsStreaming(
    const std::string& path, const std::vector<TensorSpec>& specs,
    const std::function<absl::StatusOr<torch::Tensor>(size_t index)>&
        make_tensor,
    const std::map<std::string, std::string>& metadata = {});

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_CHECKPOINT_SAFETENSORS_H_

#include "common/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/base/file_util.h"
#include "common/base/status.h"
#include "nlohmann/json.hpp"

namespace knapserve {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors is little-endian; big-endian hosts are unsupported");

// The safetensors spec caps the header at 100 MB; so do we, so that a corrupt
// length cannot make us parse garbage for long.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// Element size of a supported dtype, or 0.
int DtypeSize(std::string_view dtype) {
  if (dtype == "F32") return 4;
  if (dtype == "BF16" || dtype == "F16") return 2;
  return 0;
}

absl::StatusOr<torch::ScalarType> DtypeToScalarType(std::string_view dtype) {
  if (dtype == "F32") return torch::kFloat32;
  if (dtype == "BF16") return torch::kBFloat16;
  if (dtype == "F16") return torch::kFloat16;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype '", std::string(dtype), "'"));
}

absl::StatusOr<std::string> ScalarTypeToDtype(torch::ScalarType type) {
  switch (type) {
    case torch::kFloat32:
      return std::string("F32");
    case torch::kBFloat16:
      return std::string("BF16");
    case torch::kFloat16:
      return std::string("F16");
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unsupported tensor dtype ", c10::toString(type),
                       " (supported: float32, bfloat16, float16)"));
  }
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string ErrnoString(int error) { return std::strerror(error); }

// Parses one tensor entry of the header. Errors name the tensor, not the file.
absl::StatusOr<TensorInfo> ParseTensorEntry(const std::string& name,
                                            const nlohmann::json& entry) {
  auto bad = [&](std::string_view problem) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': ", std::string(problem)));
  };
  if (!entry.is_object()) return bad("entry is not a JSON object");
  TensorInfo info;
  info.name = name;

  auto dtype = entry.find("dtype");
  if (dtype == entry.end()) return bad("missing 'dtype'");
  if (!dtype->is_string()) return bad("'dtype' is not a string");
  info.dtype = dtype->get<std::string>();
  const int element_size = DtypeSize(info.dtype);
  if (element_size == 0) {
    return bad(absl::StrCat("unsupported dtype '", info.dtype,
                            "' (supported: F32, BF16, F16)"));
  }

  auto shape = entry.find("shape");
  if (shape == entry.end()) return bad("missing 'shape'");
  if (!shape->is_array()) return bad("'shape' is not an array");
  // Number of elements, checked for overflow against the byte count.
  uint64_t elements = 1;
  bool overflow = false;
  for (const nlohmann::json& dim : *shape) {
    if (!dim.is_number_integer()) return bad("'shape' holds a non-integer");
    if (dim.is_number_unsigned()) {
      const uint64_t value = dim.get<uint64_t>();
      if (value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return bad("'shape' dimension is too large");
      }
      info.shape.push_back(static_cast<int64_t>(value));
    } else {
      const int64_t value = dim.get<int64_t>();
      if (value < 0)
        return bad(absl::StrCat("negative dimension in shape ", shape->dump()));
      info.shape.push_back(value);
    }
    const uint64_t d = static_cast<uint64_t>(info.shape.back());
    if (d != 0 && elements > std::numeric_limits<uint64_t>::max() / d)
      overflow = true;
    elements *= d;
  }
  if (!overflow &&
      elements > std::numeric_limits<uint64_t>::max() / element_size) {
    overflow = true;
  }
  if (std::count(info.shape.begin(), info.shape.end(), 0) > 0) {
    overflow = false;
    elements = 0;
  }

  auto offsets = entry.find("data_offsets");
  if (offsets == entry.end()) return bad("missing 'data_offsets'");
  if (!offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned()) {
    return bad(
        absl::StrCat("'data_offsets' must be two non-negative integers, got ",
                     offsets->dump()));
  }
  info.begin = (*offsets)[0].get<uint64_t>();
  info.end = (*offsets)[1].get<uint64_t>();
  if (info.end < info.begin) {
    return bad(absl::StrCat("data_offsets [", info.begin, ", ", info.end,
                            "] end before they begin"));
  }
  if (overflow || info.end - info.begin != elements * element_size) {
    return bad(absl::StrCat("data_offsets [", info.begin, ", ", info.end,
                            "] span ", info.end - info.begin,
                            " bytes but shape ", ShapeString(info.shape), " x ",
                            info.dtype, " needs ",
                            overflow ? std::string("more than 2^64")
                                     : absl::StrCat(elements * element_size),
                            " bytes"));
  }
  return info;
}

// Closes a file descriptor when it goes out of scope.
class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;

 private:
  int fd_;
};

}  // namespace

// ---------------------------------------------------------------------------
// SafetensorsFile

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    const std::string message =
        absl::StrCat(path, ": cannot open: ", ErrnoString(error));
    if (error == ENOENT) return absl::NotFoundError(message);
    if (error == EACCES) return absl::PermissionDeniedError(message);
    return absl::InvalidArgumentError(message);
  }
  FdCloser closer(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return absl::InternalError(
        absl::StrCat(path, ": fstat failed: ", ErrnoString(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a regular file"));
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": file is ", file_size,
        " bytes, shorter than the 8-byte header length of a safetensors file"));
  }

  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  void* mapping = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (mapping == MAP_FAILED) {
    return absl::InternalError(
        absl::StrCat(path, ": mmap failed: ", ErrnoString(errno)));
  }
  file->mapping_ = mapping;
  file->mapping_size_ = file_size;
  const auto* bytes = static_cast<const uint8_t*>(mapping);

  uint64_t header_size = 0;
  std::memcpy(&header_size, bytes, 8);
  if (header_size > file_size - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header length ", header_size,
                     " runs past the end of the file (", file_size, " bytes)"));
  }
  if (header_size > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": header length ", header_size, " exceeds the 100 MB limit"));
  }
  file->data_ = bytes + 8 + header_size;
  file->data_size_ = file_size - 8 - header_size;

  const auto* header_begin = reinterpret_cast<const char*>(bytes + 8);
  nlohmann::json header =
      nlohmann::json::parse(header_begin, header_begin + header_size,
                            /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header is not valid JSON"));
  }
  if (!header.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": header is not a JSON object (it is a ",
                     header.type_name(), ")"));
  }

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (entry.is_null()) continue;
      if (!entry.is_object()) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": '__metadata__' is not a JSON object"));
      }
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          return absl::InvalidArgumentError(absl::StrCat(
              path, ": '__metadata__' value of '", key, "' is not a string"));
        }
        file->metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    absl::StatusOr<TensorInfo> info = ParseTensorEntry(name, entry);
    if (!info.ok()) return Annotate(info.status(), path);
    if (info->end > file->data_size_) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor '", name, "': data_offsets [", info->begin, ", ",
          info->end, "] are out of the data section (", file->data_size_,
          " bytes)"));
    }
    file->tensors_.push_back(*std::move(info));
  }

  std::sort(file->tensors_.begin(), file->tensors_.end(),
            [](const TensorInfo& a, const TensorInfo& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  // Overlap check on the sorted ranges; empty tensors overlap nothing.
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& info : file->tensors_) {
    if (info.begin == info.end) continue;
    if (previous != nullptr && info.begin < previous->end) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensors '", previous->name, "' [", previous->begin, ", ",
          previous->end, ") and '", info.name, "' [", info.begin, ", ",
          info.end, ") overlap"));
    }
    previous = &info;
  }
  for (size_t i = 0; i < file->tensors_.size(); ++i) {
    file->index_.emplace(file->tensors_[i].name, i);
  }
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<torch::Tensor> SafetensorsFile::View(
    std::string_view name) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(path_, ": no tensor '", std::string(name), "'"));
  }
  ASSIGN_OR_RETURN(torch::ScalarType type, DtypeToScalarType(info->dtype));
  // The mapping is PROT_READ: the const_cast only satisfies from_blob's
  // signature; writing through the tensor faults (documented in the header).
  void* data = const_cast<uint8_t*>(data_ + info->begin);
  return torch::from_blob(data, info->shape,
                          torch::TensorOptions().dtype(type));
}

// ---------------------------------------------------------------------------
// Checkpoint

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(
    const std::string& dir) {
  std::error_code error;
  if (!std::filesystem::is_directory(dir, error)) {
    return absl::NotFoundError(
        absl::StrCat(dir, ": checkpoint folder does not exist"));
  }
  std::unique_ptr<Checkpoint> checkpoint(new Checkpoint());
  checkpoint->dir_ = dir;
  const std::string index_path = dir + "/model.safetensors.index.json";
  const std::string single_path = dir + "/model.safetensors";

  if (std::filesystem::exists(index_path, error)) {
    ASSIGN_OR_RETURN(std::string text, ReadFileToString(index_path));
    nlohmann::json index =
        nlohmann::json::parse(text, /*cb=*/nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": not valid JSON"));
    }
    if (!index.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": not a JSON object"));
    }
    auto weight_map = index.find("weight_map");
    if (weight_map == index.end() || !weight_map->is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": missing 'weight_map' object"));
    }
    std::map<std::string, const SafetensorsFile*> shards;
    for (const auto& [tensor, shard_json] : weight_map->items()) {
      if (!shard_json.is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": weight_map entry of '", tensor,
                         "' is not a file name"));
      }
      const std::string shard = shard_json.get<std::string>();
      if (shard.empty() || shard.find('/') != std::string::npos ||
          shard == "." || shard == "..") {
        return absl::InvalidArgumentError(absl::StrCat(
            index_path, ": weight_map names shard '", shard, "' for tensor '",
            tensor, "', which is not a plain file name in the folder"));
      }
      auto it = shards.find(shard);
      if (it == shards.end()) {
        const std::string shard_path = dir + "/" + shard;
        if (!std::filesystem::exists(shard_path, error)) {
          return absl::NotFoundError(absl::StrCat(
              index_path, ": weight_map names shard '", shard, "' for tensor '",
              tensor, "', but ", shard_path, " does not exist"));
        }
        ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                         SafetensorsFile::Open(shard_path));
        it = shards.emplace(shard, file.get()).first;
        checkpoint->files_.push_back(std::move(file));
      }
      const TensorInfo* info = it->second->Find(tensor);
      if (info == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            index_path, ": weight_map puts tensor '", tensor, "' in ",
            it->second->path(), ", which has no such tensor"));
      }
      checkpoint->index_.emplace(tensor, std::make_pair(it->second, info));
    }
    return checkpoint;
  }

  if (!std::filesystem::exists(single_path, error)) {
    return absl::NotFoundError(
        absl::StrCat(dir,
                     ": no model.safetensors or model.safetensors.index.json "
                     "in the folder"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                   SafetensorsFile::Open(single_path));
  for (const TensorInfo& info : file->tensors()) {
    checkpoint->index_.emplace(info.name, std::make_pair(file.get(), &info));
  }
  checkpoint->files_.push_back(std::move(file));
  return checkpoint;
}

bool Checkpoint::Has(std::string_view name) const {
  return index_.find(name) != index_.end();
}

std::vector<std::string> Checkpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(index_.size());
  for (const auto& [name, unused] : index_) names.push_back(name);
  return names;  // std::map keeps them sorted.
}

std::string Checkpoint::WeightsFingerprint() const {
  // 64-bit FNV-1a over each tensor's name, dtype, shape and first bytes, in
  // name order.
  uint64_t hash = 14695981039346656037ull;
  auto mix = [&hash](const void* data, size_t size) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < size; ++i) {
      hash ^= bytes[i];
      hash *= 1099511628211ull;
    }
  };
  for (const auto& [name, entry] : index_) {
    const TensorInfo& info = *entry.second;
    mix(name.data(), name.size() + 1);
    mix(info.dtype.data(), info.dtype.size() + 1);
    mix(info.shape.data(), info.shape.size() * sizeof(int64_t));
    absl::StatusOr<torch::Tensor> view = entry.first->View(name);
    if (!view.ok()) continue;  // Open() validated every entry
    const size_t size = std::min<uint64_t>(info.end - info.begin, 4096);
    mix(view->data_ptr(), size);
  }
  return absl::StrFormat("%016x", hash);
}

const TensorInfo* Checkpoint::Find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second.second;
}

absl::StatusOr<torch::Tensor> Checkpoint::View(std::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "tensor '", std::string(name), "' not found in checkpoint ", dir_));
  }
  return it->second.first->View(name);
}

absl::StatusOr<torch::Tensor> Checkpoint::Get(
    std::string_view name, std::vector<int64_t> expected_shape) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "tensor '", std::string(name), "' not found in checkpoint ", dir_));
  }
  const auto& [file, info] = it->second;
  if (info->shape != expected_shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        file->path(), ": tensor '", std::string(name), "' has shape ",
        ShapeString(info->shape), ", expected ", ShapeString(expected_shape)));
  }
  return file->View(name);
}

// ---------------------------------------------------------------------------
// Writing

absl::Status WriteSafetensors(
    const std::string& path,
    const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", name, "' is undefined"));
    }
    absl::StatusOr<std::string> dtype = ScalarTypeToDtype(tensor.scalar_type());
    if (!dtype.ok())
      return Annotate(dtype.status(),
                      absl::StrCat(path, ": tensor '", name, "'"));
    specs.push_back({name, *dtype, tensor.sizes().vec()});
  }
  return WriteSafetensorsStreaming(
      path, specs,
      [&](size_t i) -> absl::StatusOr<torch::Tensor> {
        return tensors[i].second;
      },
      metadata);
}

absl::Status WriteSafetensorsStreaming(
    const std::string& path, const std::vector<TensorSpec>& specs,
    const std::function<absl::StatusOr<torch::Tensor>(size_t index)>&
        make_tensor,
    const std::map<std::string, std::string>& metadata) {
  // Header, in the given order, "__metadata__" first.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header["__metadata__"] = std::move(meta);
  }
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const TensorSpec& spec : specs) {
    if (spec.name == "__metadata__" || !seen.insert(spec.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": duplicate or reserved tensor name '", spec.name, "'"));
    }
    const int element_size = DtypeSize(spec.dtype);
    if (element_size == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": tensor '", spec.name, "': unsupported dtype '",
                       spec.dtype, "'"));
    }
    uint64_t bytes = element_size;
    for (int64_t d : spec.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": tensor '", spec.name, "': negative dimension"));
      }
      bytes *= static_cast<uint64_t>(d);
    }
    header[spec.name] = {{"dtype", spec.dtype},
                         {"shape", spec.shape},
                         {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');

  const std::string tmp_path = path + ".tmp";
  std::FILE* out = std::fopen(tmp_path.c_str(), "wb");
  if (out == nullptr) {
    return absl::PermissionDeniedError(
        absl::StrCat(tmp_path, ": cannot create: ", ErrnoString(errno)));
  }
  auto fail = [&](absl::Status status) {
    std::fclose(out);
    std::remove(tmp_path.c_str());
    return status;
  };
  auto write = [&](const void* data, size_t size) {
    return size == 0 || std::fwrite(data, 1, size, out) == size;
  };
  const uint64_t header_size = header_text.size();
  if (!write(&header_size, 8) ||
      !write(header_text.data(), header_text.size())) {
    return fail(absl::DataLossError(
        absl::StrCat(tmp_path, ": write failed: ", ErrnoString(errno))));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& spec = specs[i];
    absl::StatusOr<torch::Tensor> tensor = make_tensor(i);
    if (!tensor.ok())
      return fail(Annotate(tensor.status(),
                           absl::StrCat(path, ": tensor '", spec.name, "'")));
    absl::StatusOr<std::string> dtype =
        tensor->defined() ? ScalarTypeToDtype(tensor->scalar_type())
                          : absl::InvalidArgumentError("tensor is undefined");
    if (!dtype.ok())
      return fail(Annotate(dtype.status(),
                           absl::StrCat(path, ": tensor '", spec.name, "'")));
    if (*dtype != spec.dtype || tensor->sizes().vec() != spec.shape) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor '", spec.name, "' is ", *dtype, " ",
          ShapeString(tensor->sizes().vec()), ", but its spec says ",
          spec.dtype, " ", ShapeString(spec.shape))));
    }
    const torch::Tensor cpu = tensor->to(torch::kCPU).contiguous();
    if (!write(cpu.data_ptr(), cpu.numel() * cpu.element_size())) {
      return fail(absl::DataLossError(
          absl::StrCat(tmp_path, ": write failed: ", ErrnoString(errno))));
    }
  }
  if (std::fclose(out) != 0) {
    std::remove(tmp_path.c_str());
    return absl::DataLossError(
        absl::StrCat(tmp_path, ": close failed: ", ErrnoString(errno)));
  }
  if (std::rename(tmp_path.c_str(), path.c_str()) != 0) {
    const int error = errno;
    std::remove(tmp_path.c_str());
    return absl::PermissionDeniedError(absl::StrCat(
        path, ": cannot rename from ", tmp_path, ": ", ErrnoString(error)));
  }
  return absl::OkStatus();
}

}  // namespace knapserve

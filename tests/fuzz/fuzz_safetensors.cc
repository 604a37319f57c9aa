// Fuzz target: a .safetensors file's header and data offsets
// (common/checkpoint/safetensors.h). The input is the whole file. Accepted
// files must give a view of every tensor that lies inside the file and has
// exactly the bytes its dtype and shape need; every byte is read.
#include <torch/types.h>

#include <cstdint>
#include <string>

#include "common/checkpoint/safetensors.h"
#include "tests/fuzz/fuzz_support.h"

namespace knapserve::fuzz {
namespace {

int64_t BytesPerElement(const std::string& dtype) {
  return dtype == "F32" ? 4 : 2;  // F32, or BF16 / F16.
}

}  // namespace
}  // namespace knapserve::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  knapserve::fuzz::UseOneTorchThread();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace knapserve;
  using namespace knapserve::fuzz;
  static const std::string path = ScratchPath("model.safetensors");
  WriteScratchFile(path, data, size);
  auto file = SafetensorsFile::Open(path);
  if (!file.ok()) {
    CheckRefusal(file.status());
    return 0;
  }
  for (const TensorInfo& info : (*file)->tensors()) {
    FUZZ_CHECK((*file)->Find(info.name) != nullptr);
    auto view = (*file)->View(info.name);
    FUZZ_CHECK_MSG(view.ok(), view.status().ToString());
    int64_t elements = 1;
    for (int64_t dim : info.shape) elements *= dim;
    FUZZ_CHECK(view->numel() == elements);
    FUZZ_CHECK(static_cast<uint64_t>(view->nbytes()) == info.end - info.begin);
    FUZZ_CHECK(static_cast<int64_t>(view->nbytes()) ==
               elements * BytesPerElement(info.dtype));
    FUZZ_CHECK(info.end <= size);
    // Read every byte of the view: one past the mapping faults.
    const auto* bytes = static_cast<const uint8_t*>(view->data_ptr());
    uint8_t sum = 0;
    for (size_t i = 0; i < view->nbytes(); ++i) sum ^= bytes[i];
    volatile uint8_t sink = sum;
    (void)sink;
  }
  return 0;
}

// Fuzz target: a knapserve.v1.Tensor from arbitrary protobuf bytes
// (common/wire/tensor_codec.h). An accepted tensor must have the elements
// its shape names and encode back to the same message.
#include <torch/types.h>

#include <cstdint>

#include "common/wire/tensor_codec.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  knapserve::fuzz::SilenceProtobufLogs();
  knapserve::fuzz::UseOneTorchThread();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace knapserve;
  using namespace knapserve::fuzz;
  v1::Tensor proto;
  if (!proto.ParseFromArray(data, static_cast<int>(size))) return 0;
  auto tensor = DecodeTensor(proto, "tensor");
  if (!tensor.ok()) {
    CheckRefusal(tensor.status());
    return 0;
  }
  FUZZ_CHECK(tensor->dim() == proto.shape_size());
  int64_t elements = 1;
  for (int64_t dim : proto.shape()) elements *= dim;
  FUZZ_CHECK(tensor->numel() == elements);
  FUZZ_CHECK(static_cast<size_t>(tensor->nbytes()) == proto.data().size());
  v1::Tensor again;
  const absl::Status status = EncodeTensor(*tensor, &again);
  FUZZ_CHECK_MSG(status.ok(), status.ToString());
  FUZZ_CHECK(again.dtype() == proto.dtype());
  FUZZ_CHECK(again.data() == proto.data());
  FUZZ_CHECK(again.shape_size() == proto.shape_size());
  for (int i = 0; i < proto.shape_size(); ++i) {
    FUZZ_CHECK(again.shape(i) == proto.shape(i));
  }
  return 0;
}

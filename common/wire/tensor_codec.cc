#include "common/wire/tensor_codec.h"

#include <c10/core/InferenceMode.h>

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace knapserve {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the wire format is little-endian; a big-endian host would need "
              "byte swaps");

absl::StatusOr<v1::Dtype> WireDtype(torch::ScalarType type) {
  switch (type) {
    case torch::kFloat32:
      return v1::DTYPE_FLOAT32;
    case torch::kBFloat16:
      return v1::DTYPE_BFLOAT16;
    case torch::kFloat16:
      return v1::DTYPE_FLOAT16;
    case torch::kInt32:
      return v1::DTYPE_INT32;
    case torch::kInt64:
      return v1::DTYPE_INT64;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor dtype ", c10::toString(type), " has no wire form"));
  }
}

absl::StatusOr<torch::ScalarType> TorchDtype(v1::Dtype dtype,
                                             const std::string& field) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return torch::kFloat32;
    case v1::DTYPE_BFLOAT16:
      return torch::kBFloat16;
    case v1::DTYPE_FLOAT16:
      return torch::kFloat16;
    case v1::DTYPE_INT32:
      return torch::kInt32;
    case v1::DTYPE_INT64:
      return torch::kInt64;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".dtype: ",
          dtype == v1::DTYPE_UNSPECIFIED ? "unspecified" : "unknown value ",
          dtype == v1::DTYPE_UNSPECIFIED
              ? ""
              : std::to_string(static_cast<int>(dtype))));
  }
}

}  // namespace

absl::Status EncodeTensor(const torch::Tensor& tensor, v1::Tensor* out) {
  c10::InferenceMode guard;
  if (!tensor.defined())
    return absl::InvalidArgumentError("cannot encode an undefined tensor");
  absl::StatusOr<v1::Dtype> dtype = WireDtype(tensor.scalar_type());
  if (!dtype.ok()) return dtype.status();
  const torch::Tensor t = tensor.to(torch::kCPU).contiguous();
  out->Clear();
  out->set_dtype(*dtype);
  for (int64_t d : t.sizes()) out->add_shape(d);
  out->set_data(static_cast<const char*>(t.data_ptr()),
                static_cast<size_t>(t.numel()) * t.element_size());
  return absl::OkStatus();
}

absl::StatusOr<torch::Tensor> DecodeTensor(const v1::Tensor& proto,
                                           const std::string& field) {
  c10::InferenceMode guard;
  absl::StatusOr<torch::ScalarType> dtype = TorchDtype(proto.dtype(), field);
  if (!dtype.ok()) return dtype.status();
  std::vector<int64_t> shape(proto.shape().begin(), proto.shape().end());
  const int64_t element = static_cast<int64_t>(c10::elementSize(*dtype));
  int64_t bytes = element;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape[", i, "]: negative dimension ", shape[i]));
    }
    if (shape[i] > 0 &&
        bytes > std::numeric_limits<int64_t>::max() / shape[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape: size overflows"));
    }
    bytes *= shape[i];
  }
  if (static_cast<int64_t>(proto.data().size()) != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".data: ", proto.data().size(),
                     " bytes, but the dtype and shape need ", bytes));
  }
  torch::Tensor out = torch::empty(shape, torch::TensorOptions().dtype(*dtype));
  if (bytes > 0)
    std::memcpy(out.data_ptr(), proto.data().data(),
                static_cast<size_t>(bytes));
  return out;
}

}  // namespace knapserve

// Tensor codec: torch::Tensor <-> knapserve.v1.Tensor (proto/knapserve/v1/
// tensor.proto), the wire form of hidden states and K/V windows between the
// executor and a remote planner.
//
// The wire form is dtype + shape + raw little-endian, row-major bytes.
// Encoding copies the tensor's bytes once (moving it to the CPU and making it
// contiguous first if needed); decoding validates everything a peer could get
// wrong and returns a CPU tensor that owns a copy of the bytes (the message
// may be freed afterwards).
//
// Errors: InvalidArgument naming `field` (the message field being decoded,
// e.g. "reference_states"): unspecified or unknown dtype, a negative
// dimension, a shape whose size overflows, a data size that differs from
// product(shape) * element size. Encoding refuses dtypes the wire has no
// name for. Thread safety: pure functions.
#ifndef KNAPSERVE_COMMON_WIRE_TENSOR_CODEC_H_
#define KNAPSERVE_COMMON_WIRE_TENSOR_CODEC_H_

#include <torch/types.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "knapserve/v1/tensor.pb.h"

namespace knapserve {

// Writes `tensor` into `out` (replacing its contents).
absl::Status EncodeTensor(const torch::Tensor& tensor, v1::Tensor* out);

// Reads `proto` back into a CPU tensor.
absl::StatusOr<torch::Tensor> DecodeTensor(const v1::Tensor& proto,
                                           const std::string& field);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_WIRE_TENSOR_CODEC_H_

// Tests of the tensor wire codec (common/wire/tensor_codec.h): round trips for
// every wire dtype and odd shapes, and a clear error for each way a peer can
// send a broken tensor.
#include "common/wire/tensor_codec.h"

#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <string>

namespace knapserve {
namespace {

TEST(TensorCodecTest, RoundTripsEveryWireDtypeBitForBit) {
  c10::InferenceMode guard;
  torch::manual_seed(0);
  const torch::Tensor base = torch::randn({3, 5, 7});
  for (torch::ScalarType type :
       {torch::kFloat32, torch::kBFloat16, torch::kFloat16, torch::kInt32,
        torch::kInt64}) {
    const torch::Tensor t = (base * 100).to(type);
    v1::Tensor proto;
    ASSERT_TRUE(EncodeTensor(t, &proto).ok());
    EXPECT_EQ(proto.shape_size(), 3);
    EXPECT_EQ(proto.data().size(),
              static_cast<size_t>(t.numel() * t.element_size()));
    auto back = DecodeTensor(proto, "x");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->scalar_type(), type);
    EXPECT_TRUE(torch::equal(*back, t)) << c10::toString(type);
  }
}

TEST(TensorCodecTest, HandlesScalarsEmptyAndNonContiguousTensors) {
  c10::InferenceMode guard;
  v1::Tensor proto;
  ASSERT_TRUE(EncodeTensor(torch::tensor(2.5f), &proto).ok());
  EXPECT_EQ(proto.shape_size(), 0);
  auto scalar = DecodeTensor(proto, "x");
  ASSERT_TRUE(scalar.ok());
  EXPECT_EQ(scalar->dim(), 0);
  EXPECT_EQ(scalar->item<float>(), 2.5f);

  ASSERT_TRUE(EncodeTensor(torch::zeros({4, 0, 2}), &proto).ok());
  auto empty = DecodeTensor(proto, "x");
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->sizes(), torch::IntArrayRef({4, 0, 2}));

  const torch::Tensor t =
      torch::arange(24, torch::kFloat32).view({4, 6}).t();  // strided
  ASSERT_FALSE(t.is_contiguous());
  ASSERT_TRUE(EncodeTensor(t, &proto).ok());
  auto back = DecodeTensor(proto, "x");
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(torch::equal(*back, t));
}

TEST(TensorCodecTest, RejectsBrokenTensorsNamingTheField) {
  c10::InferenceMode guard;
  v1::Tensor good;
  ASSERT_TRUE(EncodeTensor(torch::ones({2, 3}), &good).ok());
  struct Case {
    std::string name;
    v1::Tensor proto;
    std::string expected;
  };
  std::vector<Case> cases;
  cases.push_back(
      {"unspecified dtype", good, "reference_states.dtype: unspecified"});
  cases.back().proto.set_dtype(v1::DTYPE_UNSPECIFIED);
  cases.push_back(
      {"unknown dtype", good, "reference_states.dtype: unknown value 77"});
  cases.back().proto.set_dtype(static_cast<v1::Dtype>(77));
  cases.push_back(
      {"negative dimension", good, "reference_states.shape[1]: negative"});
  cases.back().proto.set_shape(1, -3);
  cases.push_back({"short data", good, "reference_states.data: 23 bytes"});
  cases.back().proto.mutable_data()->pop_back();
  cases.push_back(
      {"overflowing shape", good, "reference_states.shape: size overflows"});
  cases.back().proto.set_shape(0, int64_t{1} << 40);
  cases.back().proto.set_shape(1, int64_t{1} << 40);
  for (const Case& c : cases) {
    auto decoded = DecodeTensor(c.proto, "reference_states");
    EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument)
        << c.name;
    EXPECT_NE(decoded.status().message().find(c.expected), std::string::npos)
        << c.name << ": " << decoded.status();
  }
  v1::Tensor out;
  EXPECT_EQ(EncodeTensor(torch::ones({2}, torch::kBool), &out).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodeTensor(torch::Tensor(), &out).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace knapserve

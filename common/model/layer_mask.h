// LayerMask: which of a model's 2L sublayers the self-speculative draft skips.
//
// Sublayer 2i is the attention of layer i, sublayer 2i+1 its MLP (model
// order). The text form, used in flags, logs, JSON and protos, is a
// comma-separated list of the *skipped* sublayers: "a3,m3,m7" skips layer 3's
// attention and MLP and layer 7's MLP; "" skips nothing. ToString() lists them
// in model order, so equal masks print equally.
//
// A plain value type: copyable, comparable, no shared state.
#ifndef KNAPSERVE_COMMON_MODEL_LAYER_MASK_H_
#define KNAPSERVE_COMMON_MODEL_LAYER_MASK_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace knapserve {

class LayerMask {
 public:
  // A mask over `num_layers` layers that skips nothing.
  explicit LayerMask(int num_layers = 0) : skipped_(2 * num_layers, false) {}

  // Parses the text form for a model of `num_layers` layers. InvalidArgument
  // for a malformed entry ("x3", "a", "a-1"), a layer >= num_layers, or a
  // sublayer named twice.
  static absl::StatusOr<LayerMask> Parse(std::string_view text, int num_layers);

  int num_layers() const { return static_cast<int>(skipped_.size() / 2); }
  int num_sublayers() const { return static_cast<int>(skipped_.size()); }

  bool skipped(int sublayer) const { return skipped_[sublayer]; }
  bool skip_attention(int layer) const { return skipped_[2 * layer]; }
  bool skip_mlp(int layer) const { return skipped_[2 * layer + 1]; }
  void set_skipped(int sublayer, bool skip) { skipped_[sublayer] = skip; }

  int num_skipped() const;
  int num_kept() const { return num_sublayers() - num_skipped(); }
  bool empty() const { return num_skipped() == 0; }

  // The text form, e.g. "a3,m3,m7"; "" when nothing is skipped.
  std::string ToString() const;

  bool operator==(const LayerMask& other) const = default;

 private:
  std::vector<bool> skipped_;
};

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_MODEL_LAYER_MASK_H_

#include "common/model/layer_mask.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace knapserve {

absl::StatusOr<LayerMask> LayerMask::Parse(std::string_view text_in,
                                           int num_layers) {
  LayerMask mask(num_layers);
  // Debian's Abseil has its own string_view type.
  const absl::string_view text = absl::StripAsciiWhitespace(
      absl::string_view(text_in.data(), text_in.size()));
  if (text.empty()) return mask;
  for (absl::string_view raw : absl::StrSplit(text, ',')) {
    const absl::string_view entry = absl::StripAsciiWhitespace(raw);
    int layer = -1;
    const bool kind_ok = !entry.empty() && (entry[0] == 'a' || entry[0] == 'm');
    if (!kind_ok || entry.size() < 2 ||
        !std::all_of(entry.begin() + 1, entry.end(), ::isdigit) ||
        !absl::SimpleAtoi(entry.substr(1), &layer)) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer mask: bad entry '", entry,
                       "' (expected aN for attention or mN for MLP of layer N, "
                       "e.g. \"a3,m3,m7\")"));
    }
    if (layer >= num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer mask: '", entry, "' names layer ", layer,
                       " but the model has ", num_layers, " layers (0..",
                       num_layers - 1, ")"));
    }
    const int sublayer = 2 * layer + (entry[0] == 'm' ? 1 : 0);
    if (mask.skipped(sublayer)) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer mask: '", entry, "' appears twice"));
    }
    mask.set_skipped(sublayer, true);
  }
  return mask;
}

int LayerMask::num_skipped() const {
  return static_cast<int>(std::count(skipped_.begin(), skipped_.end(), true));
}

std::string LayerMask::ToString() const {
  std::vector<std::string> parts;
  for (int s = 0; s < num_sublayers(); ++s) {
    if (skipped_[s])
      parts.push_back(absl::StrCat(s % 2 == 0 ? "a" : "m", s / 2));
  }
  return absl::StrJoin(parts, ",");
}

}  // namespace knapserve

// `knapserve make-model`: writes a random-weight checkpoint with a real layout.
#include <filesystem>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/make_model.h"
#include "tools/shared_data.h"

namespace knapserve {
namespace {

absl::Status MakeModelFromFlags() {
  MakeModelOptions options;
  options.shape = absl::GetFlag(FLAGS_shape);
  options.out_dir = absl::GetFlag(FLAGS_out);
  if (options.shape.empty() || options.out_dir.empty()) {
    return absl::InvalidArgumentError(
        "--shape and --out are required; shapes: " +
        absl::StrJoin(KnownModelShapes(), ", "));
  }
  options.dtype = absl::GetFlag(FLAGS_dtype);
  options.seed = absl::GetFlag(FLAGS_seed).value_or(0);
  options.tokenizer_json = absl::GetFlag(FLAGS_tokenizer);
  if (options.tokenizer_json.empty() && options.shape == "smollm2-135m") {
    // SmolLM2 uses the SmolLM tokenizer; use the real one when it is at hand.
    const std::string real = SharedPath("tokenizers/smollm/tokenizer.json");
    if (std::filesystem::exists(real)) options.tokenizer_json = real;
  }
  RETURN_IF_ERROR(MakeModel(options));
  std::cout << "wrote " << options.shape << " (" << options.dtype << ", seed "
            << options.seed << ") to " << options.out_dir << std::endl;
  return absl::OkStatus();
}

}  // namespace

int RunMakeModel() { return ExitCode(MakeModelFromFlags(), "make-model"); }

}  // namespace knapserve

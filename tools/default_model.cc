#include "tools/default_model.h"

#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"

namespace knapserve {

std::string ExecutableDir() {
  std::error_code ec;
  const std::filesystem::path exe =
      std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec || exe.empty()) return "";
  return exe.parent_path().string();
}

absl::StatusOr<std::string> DefaultModelDir() {
  if (const char* env = std::getenv("KNAPSERVE_MODEL");
      env != nullptr && *env != '\0') {
    return std::string(env);
  }
  const std::string exe_dir = ExecutableDir();
  std::string looked;
  if (!exe_dir.empty()) {
    const std::filesystem::path candidate =
        (std::filesystem::path(exe_dir) / kDefaultModelFromBinDir)
            .lexically_normal();
    std::error_code ec;
    if (std::filesystem::is_regular_file(candidate / "config.json", ec)) {
      return candidate.string();
    }
    looked = absl::StrCat(candidate.string(),
                          " (beside the executable: no config.json there)");
  } else {
    looked = "the executable's folder (/proc/self/exe could not be read)";
  }
  return absl::NotFoundError(
      absl::StrCat("no model given and the default model ", kDefaultModelName,
                   " was not found; looked at: --model (not given), "
                   "$KNAPSERVE_MODEL (not set), ",
                   looked,
                   ". Pass --model DIR (a Hugging Face checkpoint folder) or "
                   "set KNAPSERVE_MODEL, or run "
                   "a binary from a build folder or a `cmake --install` "
                   "prefix, which carry the model"));
}

}  // namespace knapserve

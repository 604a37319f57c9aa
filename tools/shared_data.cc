#include "tools/shared_data.h"

#include <cstdlib>
#include <filesystem>

namespace knapserve {

std::string SharedDir() {
  if (const char* env = std::getenv("KNAPSERVE_SHARED"); env != nullptr && *env != '\0') {
    return env;
  }
  std::error_code ec;
  if (std::filesystem::is_directory("../shared", ec)) return "../shared";
#ifdef KNAPSERVE_DEFAULT_SHARED_DIR
  return KNAPSERVE_DEFAULT_SHARED_DIR;
#else
  return "../shared";
#endif
}

std::string SharedPath(const std::string& relative) { return SharedDir() + "/" + relative; }

}  // namespace knapserve

#include "tools/shared_data.h"

#include <cstdlib>

namespace knapserve {

std::string SharedDir() {
  if (const char* env = std::getenv("KNAPSERVE_SHARED");
      env != nullptr && *env != '\0') {
    return env;
  }
  return "../shared";
}

std::string SharedPath(const std::string& relative) {
  return SharedDir() + "/" + relative;
}

}  // namespace knapserve

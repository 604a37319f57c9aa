#include "common/base/random_id.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/escaping.h"

namespace knapserve {

std::string UnguessableId(std::string_view prefix) {
  uint8_t bytes[16];
  size_t have = 0;
  while (have < sizeof(bytes)) {
    const ssize_t got = getrandom(bytes + have, sizeof(bytes) - have, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      std::perror("knapserve: getrandom");
      std::abort();
    }
    have += static_cast<size_t>(got);
  }
  std::string id(prefix);
  id += absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
  return id;
}

}  // namespace knapserve

#include "common/model/heap_reuse.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace knapserve {

bool KeepFreedTensorMemory() {
#if defined(__GLIBC__)
  // Set once: mallopt is process-wide, and fixing a threshold turns glibc's
  // own adjustment of both off.
  static const bool in_force =
      mallopt(M_MMAP_THRESHOLD, static_cast<int>(kMmapThresholdBytes)) == 1 &&
      mallopt(M_TRIM_THRESHOLD, static_cast<int>(kTrimThresholdBytes)) == 1;
  return in_force;
#else
  return false;
#endif
}

}  // namespace knapserve

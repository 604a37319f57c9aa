// Where the knapserve binaries find their default model (stories260k, shipped
// in the repository under tools/models/ and installed beside the binaries)
// when the command line names none.
//
// Lookup order, first hit wins:
//   1. the --model flag (the caller checks it; see ModelDirFromFlags),
//   2. the KNAPSERVE_MODEL environment variable (taken as given, not checked),
//   3. <dir of the running executable>/../share/knapserve/models/stories260k,
//      which is where `cmake --install` puts the model for <prefix>/bin/* and
//      where the build copies it for <build>/tools/* and <build>/tests/*.
// The source tree's location is never compiled in, and ../shared is not
// consulted: a bare clone (or an installed copy) runs on its own.
//
// Plain functions with no state; thread-safe.
#ifndef KNAPSERVE_TOOLS_DEFAULT_MODEL_H_
#define KNAPSERVE_TOOLS_DEFAULT_MODEL_H_

#include <string>

#include "absl/status/statusor.h"

namespace knapserve {

// The default model's folder name and its place relative to a binary's folder.
inline constexpr char kDefaultModelName[] = "stories260k";
inline constexpr char kDefaultModelFromBinDir[] =
    "../share/knapserve/models/stories260k";

// The folder of the running executable (from /proc/self/exe), or "" when the
// link cannot be read.
std::string ExecutableDir();

// The default model folder: $KNAPSERVE_MODEL when set and non-empty, else
// the folder beside the executable above when it holds a config.json.
// NotFound otherwise, with a message that lists every place looked at and
// says how to name a model (--model DIR or KNAPSERVE_MODEL).
absl::StatusOr<std::string> DefaultModelDir();

}  // namespace knapserve

#endif  // KNAPSERVE_TOOLS_DEFAULT_MODEL_H_

// Where knapserve finds the shared data folder (models, tokenizers, benchmark
// prompts) that lives beside the checkout as ../shared.
//
// Resolution order: the KNAPSERVE_SHARED environment variable, else "../shared"
// relative to the working directory if it exists, else the folder beside the
// source tree the binary was built from. Nothing here is cached; the functions
// are thread-safe.
#ifndef KNAPSERVE_TOOLS_SHARED_DATA_H_
#define KNAPSERVE_TOOLS_SHARED_DATA_H_

#include <string>

namespace knapserve {

// The shared data folder, without a trailing slash.
std::string SharedDir();

// SharedDir() + "/" + relative.
std::string SharedPath(const std::string& relative);

}  // namespace knapserve

#endif  // KNAPSERVE_TOOLS_SHARED_DATA_H_

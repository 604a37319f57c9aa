// Where knapserve finds the shared data folder (benchmark prompts, the larger
// test models, tokenizers, golden files) that lives beside a checkout as
// ../shared. Only benchmarks, make-model and tests read it; the main job
// (`knapserve generate` on the default model) never does (see
// tools/default_model.h).
//
// Resolution order: the KNAPSERVE_SHARED environment variable, else
// "../shared" relative to the working directory. No path is compiled in (the
// test binaries set KNAPSERVE_SHARED to the folder beside their source
// checkout when it is unset: tests/test_main.cc). Nothing here is cached;
// the functions are thread-safe.
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

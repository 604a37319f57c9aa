// Small file helpers shared by the loaders in common/ (config.json,
// safetensors index, tokenizer.json).
//
// Errors name the path: NotFound when the file does not exist,
// PermissionDenied when it exists but cannot be opened, DataLoss on a read
// error. Thread-safe.
#ifndef KNAPSERVE_COMMON_BASE_FILE_UTIL_H_
#define KNAPSERVE_COMMON_BASE_FILE_UTIL_H_

#include <string>

#include "absl/status/statusor.h"

namespace knapserve {

// The whole file as bytes. Meant for metadata files (JSON), not weights.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_BASE_FILE_UTIL_H_

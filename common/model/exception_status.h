// The exception boundary between LibTorch and knapserve's absl::Status world.
// LibTorch reports broken invariants by throwing (c10::Error from TORCH_CHECK
// and friends; std::exception subclasses from the standard library). Code
// that runs tensors on a server thread catches at a boundary (a decode step, a
// plan solve) and turns the exception into absl::InternalError for that one
// request, so the server goes on:
//
//   try {
//     RunStep();
//   } catch (...) {
//     return CurrentExceptionAsInternal("decode step 7");
//   }
//
// Header-only; no state. Thread safety: any thread.
#ifndef KNAPSERVE_COMMON_MODEL_EXCEPTION_STATUS_H_
#define KNAPSERVE_COMMON_MODEL_EXCEPTION_STATUS_H_

#include <c10/util/Exception.h>

#include <exception>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace knapserve {

// Call only inside a catch block: the exception being handled as an
// InternalError "<where>: <message>". A c10::Error contributes its message
// without the C++ backtrace LibTorch appends to what().
inline absl::Status CurrentExceptionAsInternal(absl::string_view where) {
  try {
    throw;
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat(where, ": ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(where, ": ", e.what()));
  } catch (...) {
    return absl::InternalError(
        absl::StrCat(where, ": an exception of unknown type"));
  }
}

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_MODEL_EXCEPTION_STATUS_H_

// Status helpers shared by every knapserve library.
//
// Abseil 20220623 (the Debian version) has no status macros, so the two we use
// everywhere live here. Errors cross every library boundary as absl::Status or
// absl::StatusOr<T>; they become gRPC status codes only at the service edge.
//
//   RETURN_IF_ERROR(expr);            // returns expr's status if it is not OK
//   ASSIGN_OR_RETURN(auto x, expr);   // x = *expr, or returns expr's status
//
// Both macros evaluate `expr` exactly once. They are safe to use from any
// thread.
#ifndef KNAPSERVE_COMMON_BASE_STATUS_H_
#define KNAPSERVE_COMMON_BASE_STATUS_H_

#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define KNAPSERVE_STATUS_CONCAT_INNER_(a, b) a##b
#define KNAPSERVE_STATUS_CONCAT_(a, b) KNAPSERVE_STATUS_CONCAT_INNER_(a, b)

#define RETURN_IF_ERROR(expr)                              \
  do {                                                     \
    const ::absl::Status knapserve_status_ = (expr);       \
    if (!knapserve_status_.ok()) return knapserve_status_; \
  } while (0)

#define KNAPSERVE_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                     \
  if (!statusor.ok()) return std::move(statusor).status();     \
  lhs = std::move(statusor).value()

#define ASSIGN_OR_RETURN(lhs, rexpr) \
  KNAPSERVE_ASSIGN_OR_RETURN_IMPL_(  \
      KNAPSERVE_STATUS_CONCAT_(knapserve_statusor_, __LINE__), lhs, rexpr)

namespace knapserve {

// Returns `status` with `context` and ": " prepended to its message, keeping
// its code. OK stays OK. Used to say which file or field an error came from.
inline absl::Status Annotate(const absl::Status& status,
                             std::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), std::string(context) + ": " +
                                         std::string(status.message()));
}

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_BASE_STATUS_H_

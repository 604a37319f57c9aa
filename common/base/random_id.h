// Unguessable identifiers: request ids the server chooses (the Generation
// service's "req-...", the HTTP API's "cmpl-..." and "chatcmpl-...") must
// not be predictable from the ones a client has seen, so that no client can
// name, and abort, another client's request.
//
// Thread safety: any thread. No state of its own: every call reads the
// kernel's CSPRNG (getrandom(2)).
#ifndef KNAPSERVE_COMMON_BASE_RANDOM_ID_H_
#define KNAPSERVE_COMMON_BASE_RANDOM_ID_H_

#include <string>
#include <string_view>

namespace knapserve {

// `prefix` followed by 32 lowercase hex digits: 128 bits from the kernel's
// CSPRNG. Aborts the process if the kernel cannot give random bytes (no
// fallback to a predictable generator).
std::string UnguessableId(std::string_view prefix);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_BASE_RANDOM_ID_H_

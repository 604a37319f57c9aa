// The instruction-set target the CPU kernels run on, chosen at run time.
//
// The projection, decode-attention and row kernels (linear_kernels.h,
// attention_kernels.h) are one source compiled by Google Highway for several
// targets; the best one this CPU supports runs, unless a target is pinned.
// knapserve names its targets by what they need from the CPU:
//
//   avx512bf16  Highway's AVX-512 code, plus the hand-written AVX512-BF16
//               dot-product kernel for bf16 projections (linear_kernels.h)
//   avx512      Highway's AVX-512 code (AVX3; AVX3_DL where compiled)
//   avx2        Highway's AVX2+FMA code
//   neon, sve, sve2 ...  Arm targets, from the same source
//   scalar      Highway's portable fallback (one lane, any CPU)
//
// Batch invariance holds within a target: a row's bits do not depend on the
// number of rows or the thread split, so speculative greedy output equals
// plain decoding on every target. Different targets may round differently
// (AVX-512 BF16 dot products, FMA or not), so a model's outputs can differ
// between machines in the last bits, never between runs on one.
//
// Pinning: the environment variable KNAPSERVE_SIMD (a name above, or "auto")
// pins the target for the whole process, for benchmarks and the per-target
// tests; EnsureChosen() reads it once. PinTarget() pins from code.
//
// Thread safety: CurrentTarget(), SupportedTargets() and Avx512Bf16Active()
// may be called from any thread. PinTarget() and EnsureChosen() change
// process-wide state: call them at startup or between runs, while no kernel
// is running (a kernel running during a switch may use either target).
#ifndef KNAPSERVE_COMMON_MODEL_SIMD_TARGET_H_
#define KNAPSERVE_COMMON_MODEL_SIMD_TARGET_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace knapserve::simd {

// Names of the targets this CPU can run (and this build compiled), best
// first.
std::vector<std::string> SupportedTargets();

// Every name KNAPSERVE_SIMD accepts on this architecture, whether or not this
// CPU can run it, best first (without "auto").
std::vector<std::string> KnownTargets();

// Reads KNAPSERVE_SIMD on the first call and pins that target; later calls
// return the same status. Unset or "auto" means the best supported target.
// An unknown name is INVALID_ARGUMENT, a target this CPU cannot run
// FAILED_PRECONDITION; both name the supported targets, and the best target
// is used instead. Binaries call it at startup and exit on an error; the
// kernels call it too, so a library user gets the same choice.
absl::Status EnsureChosen();

// Pins `name` ("auto" = best). Same errors as EnsureChosen; on error the
// target does not change.
absl::Status PinTarget(const std::string& name);

// The target the kernels run on now (after EnsureChosen).
std::string CurrentTarget();

// Whether bf16 projections use the hand-written AVX512-BF16 kernel.
bool Avx512Bf16Active();

// One line for logs and benchmark output: "simd avx2 (supported: avx512
// avx2 scalar; pinned by KNAPSERVE_SIMD)".
std::string Describe();

}  // namespace knapserve::simd

#endif  // KNAPSERVE_COMMON_MODEL_SIMD_TARGET_H_

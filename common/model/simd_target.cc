#include "common/model/simd_target.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "hwy/targets.h"

namespace knapserve::simd {
namespace {

// One knapserve target: the Highway targets it may run (the best of them that
// the CPU has is used) and whether it adds the AVX512-BF16 kernel.
struct TargetDef {
  std::string name;
  int64_t hwy_targets;
  bool avx512_bf16;
};

bool CpuHasAvx512Bf16() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  return __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

std::string HwyName(int64_t target) {
  if (target == HWY_SCALAR || target == HWY_EMU128) return "scalar";
#if HWY_ARCH_X86
  if (target == HWY_AVX3 || target == HWY_AVX3_DL) return "avx512";
#endif
  return absl::AsciiStrToLower(hwy::TargetName(target));
}

// Every target compiled into this build (HWY_TARGETS of the kernels'
// translation units, which share this file's compile definitions), best
// first, plus avx512bf16 on x86.
const std::vector<TargetDef>& AllTargets() {
  static const auto* all = [] {
    auto* defs = new std::vector<TargetDef>;
    for (int64_t bits = HWY_TARGETS; bits != 0; bits &= bits - 1) {
      const int64_t target = bits & -bits;  // lowest bit = best first
      const std::string name = HwyName(target);
      if (!defs->empty() && defs->back().name == name) {
        defs->back().hwy_targets |= target;  // AVX3_DL and AVX3 are one name
        continue;
      }
      defs->push_back({name, target, false});
    }
#if HWY_ARCH_X86
    if (HWY_TARGETS & (HWY_AVX3 | HWY_AVX3_DL)) {
      defs->insert(
          defs->begin(),
          {"avx512bf16", HWY_TARGETS & (HWY_AVX3 | HWY_AVX3_DL), true});
    }
#endif
    return defs;
  }();
  return *all;
}

// What the CPU itself supports, read before any pinning.
int64_t CpuHwyTargets() {
  static const int64_t targets = hwy::SupportedTargets();
  return targets;
}

bool Runs(const TargetDef& def) {
  if ((def.hwy_targets & CpuHwyTargets()) == 0) return false;
  return !def.avx512_bf16 || CpuHasAvx512Bf16();
}

absl::Mutex pin_mutex;
std::string current_name ABSL_GUARDED_BY(pin_mutex);
bool pinned_by_env ABSL_GUARDED_BY(pin_mutex) = false;
std::atomic<bool> bf16_active{false};

std::string SupportedList() { return absl::StrJoin(SupportedTargets(), " "); }

absl::Status Pin(const std::string& requested) {
  CpuHwyTargets();  // read the real CPU before mocking it
  const std::string name = absl::AsciiStrToLower(requested);
  const TargetDef* chosen = nullptr;
  if (name.empty() || name == "auto") {
    for (const TargetDef& def : AllTargets()) {
      if (Runs(def)) {
        chosen = &def;
        break;
      }
    }
  } else {
    for (const TargetDef& def : AllTargets()) {
      if (def.name == name) chosen = &def;
    }
    if (chosen == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown SIMD target \"", requested, "\"; this build knows ",
          absl::StrJoin(KnownTargets(), " "), " (or auto); this CPU runs ",
          SupportedList()));
    }
    if (!Runs(*chosen)) {
      return absl::FailedPreconditionError(
          absl::StrCat("SIMD target ", name, " is not supported by this CPU; ",
                       "it runs ", SupportedList()));
    }
  }
  if (chosen == nullptr) {
    return absl::InternalError("no SIMD target runs on this CPU");
  }
  const int64_t runnable = chosen->hwy_targets & CpuHwyTargets();
  const int64_t best = runnable & -runnable;
  hwy::SetSupportedTargetsForTest(best);
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
  bf16_active.store(chosen->avx512_bf16);
  absl::MutexLock lock(&pin_mutex);
  current_name = chosen->name;
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> SupportedTargets() {
  std::vector<std::string> names;
  for (const TargetDef& def : AllTargets()) {
    if (Runs(def)) names.push_back(def.name);
  }
  return names;
}

std::vector<std::string> KnownTargets() {
  std::vector<std::string> names;
  for (const TargetDef& def : AllTargets()) names.push_back(def.name);
  return names;
}

absl::Status EnsureChosen() {
  static const absl::Status* status = [] {
    const char* env = std::getenv("KNAPSERVE_SIMD");
    absl::Status s = Pin(env == nullptr ? "auto" : env);
    if (!s.ok()) {
      s = absl::Status(s.code(), absl::StrCat("KNAPSERVE_SIMD: ", s.message()));
      Pin("auto").IgnoreError();
    } else if (env != nullptr && absl::AsciiStrToLower(env) != "auto") {
      absl::MutexLock lock(&pin_mutex);
      pinned_by_env = true;
    }
    return new absl::Status(s);
  }();
  return *status;
}

absl::Status PinTarget(const std::string& name) {
  EnsureChosen().IgnoreError();
  absl::Status status = Pin(name);
  if (status.ok()) {
    absl::MutexLock lock(&pin_mutex);
    pinned_by_env = false;
  }
  return status;
}

std::string CurrentTarget() {
  EnsureChosen().IgnoreError();
  absl::MutexLock lock(&pin_mutex);
  return current_name;
}

bool Avx512Bf16Active() {
  EnsureChosen().IgnoreError();
  return bf16_active.load(std::memory_order_relaxed);
}

std::string Describe() {
  const std::string name = CurrentTarget();
  bool by_env = false;
  {
    absl::MutexLock lock(&pin_mutex);
    by_env = pinned_by_env;
  }
  return absl::StrCat("simd ", name, " (supported: ", SupportedList(),
                      by_env ? "; pinned by KNAPSERVE_SIMD)" : ")");
}

}  // namespace knapserve::simd

// The profile cache: latency profiles (planner/latency_profile.h) measured
// once per engine and kept in a per-user folder, so that planned generation
// (knapspec, clasp) needs no --profile flag. `knapserve generate`,
// `knapserve serve`, `knapserve-executor --planner inproc` and
// `knapserve-planner` all get their profile through ObtainProfile:
//
//   1. --profile FILE wins: the file is loaded (its errors are returned);
//   2. else the cache entry of the engine's key is used when it loads, is
//      for that key and covers the largest draft needed (a hit);
//   3. else the profile is measured (the caller's function) and stored in
//      the cache. A corrupt or mismatched entry is a warning and is measured
//      again; a cache folder that cannot be created or written is a warning
//      (the measured profile is used, not kept), never a failure.
//
// Layout: one LatencyProfile JSON per key,
//   <cache dir>/<model fingerprint>_<device>_<dtype>_t<threads>.json
// ("cuda:0" becomes "cuda-0"). Writes go to a temporary file in the same
// folder that is then renamed over the entry, so a reader never sees half a
// file; two processes that measure at once both write and the last rename
// wins (both profiles are valid).
//
// The functions keep no state and may be called from any thread; the
// measure function runs on the calling thread. The caller owns the returned
// profile.
#ifndef KNAPSERVE_PLANNER_PROFILE_CACHE_H_
#define KNAPSERVE_PLANNER_PROFILE_CACHE_H_

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/latency_profile.h"

namespace knapserve {

class LlamaModel;

// What a profile is measured for: the same four fields LatencyProfile keys
// on (CheckMatches).
struct ProfileKey {
  std::string model_fingerprint;  // ModelConfig::Fingerprint()
  std::string device;             // torch::Device::str()
  std::string dtype;              // DtypeName()
  int threads = 0;                // torch intra-op threads

  // The key of `model` as it runs now (threads: at::get_num_threads()).
  static ProfileKey Of(const LlamaModel& model);

  // The entry's file name: "<fingerprint>_<device>_<dtype>_t<threads>.json",
  // with any character other than [A-Za-z0-9.-] replaced by '-'.
  std::string FileName() const;
};

// The cache folder: `flag_dir` when non-empty (--profile-cache), else
// $KNAPSERVE_PROFILE_CACHE, else $XDG_CACHE_HOME/knapserve/profiles (when
// XDG_CACHE_HOME is an absolute path), else $HOME/.cache/knapserve/profiles;
// "" when none of them is set.
std::string ProfileCacheDir(const std::string& flag_dir);

// `name` + ".json" with any character other than [A-Za-z0-9._-] replaced by
// '-': the file name of a cache entry.
std::string CacheFileName(std::string name);

// Writes `text` to `path` (a cache entry) through a temporary file in the
// same folder and a rename, so a reader never sees half a file. Creates the
// folder first.
absl::Status WriteCacheFileAtomically(const std::string& path,
                                      const std::string& text);

// Where an obtained profile came from.
enum class ProfileOrigin {
  kFile,      // --profile FILE
  kCacheHit,  // the cache entry of the key
  kMeasured,  // measured now (and stored when the cache could be written)
};
// "file", "cache" or "measured".
std::string_view ProfileOriginName(ProfileOrigin origin);

struct ObtainedProfile {
  LatencyProfile profile;
  ProfileOrigin origin = ProfileOrigin::kMeasured;
  // The file read (kFile, kCacheHit) or the cache entry written (kMeasured;
  // "" when it could not be stored).
  std::string path;
  // Problems that did not stop it, one sentence each: a corrupt or
  // mismatched cache entry, no cache folder, a failed write, a --profile file
  // measured with another thread count than the key's.
  std::vector<std::string> warnings;
  // Wall time of the measurement (kMeasured only).
  double measure_seconds = 0;
};

struct ObtainProfileOptions {
  // --profile: when non-empty, the profile is this file and the cache is
  // neither read nor written.
  std::string profile_path;
  // The cache folder (ProfileCacheDir); "" = no cache: measure every time,
  // with a warning.
  std::string cache_dir;
  // The largest draft length the planner will be asked for: a cache entry
  // whose verify table is smaller (LatencyProfile::max_draft) counts as a
  // miss.
  int max_draft = 10;
};

// Measures a profile (ProfileModel with QuickProfileOptions in the tools;
// tests pass their own). Its errors are returned by ObtainProfile.
using MeasureProfileFn = std::function<absl::StatusOr<LatencyProfile>()>;

// The profile for `key` as the file comment says: from options.profile_path,
// else a cache hit, else `measure` (then stored). Errors: those of loading
// options.profile_path, and those of `measure`; a measured profile for
// another key is FailedPrecondition (it would never hit). FindProfile, then
// MeasureAndStoreProfile on a miss.
absl::StatusOr<ObtainedProfile> ObtainProfile(
    const ProfileKey& key, const ObtainProfileOptions& options,
    const MeasureProfileFn& measure);

// Steps 1 and 2 alone, which never measure: the profile of
// options.profile_path (its load errors are returned) or the cache hit;
// nullopt on a miss, with `warnings` (optional) receiving why an existing
// entry was not usable, or that there is no cache folder. A server uses it
// to start at once and measure in the background
// (planner/background_profile.h).
absl::StatusOr<std::optional<ObtainedProfile>> FindProfile(
    const ProfileKey& key, const ObtainProfileOptions& options,
    std::vector<std::string>* warnings = nullptr);

// Step 3 alone: measures with `measure` and stores the profile as the cache
// entry of `key` in options.cache_dir (when set; a failed write is a
// warning). `warnings` (FindProfile's) start the result's warnings. Errors:
// those of `measure`; a profile for another key is FailedPrecondition.
absl::StatusOr<ObtainedProfile> MeasureAndStoreProfile(
    const ProfileKey& key, const ObtainProfileOptions& options,
    const MeasureProfileFn& measure, std::vector<std::string> warnings = {});

// What a cache miss measures: 5 timed runs per point (what `knapserve serve`
// always measured at start-up), a verify table up to `max_draft`, and the
// contexts 128, 512, 1024, 2048, 4096 that fit the model plus the longest
// that fits; a point that has run for kQuickPointBudgetSeconds stops at 3
// timed runs after one warm-up (ProfileOptions::point_budget_seconds: it
// binds on models of 100M parameters and more, whose passes take tens of
// milliseconds, not on the small ones).
inline constexpr double kQuickPointBudgetSeconds = 1.0;
ProfileOptions QuickProfileOptions(const LlamaModel& model, int max_draft);

}  // namespace knapserve

#endif  // KNAPSERVE_PLANNER_PROFILE_CACHE_H_

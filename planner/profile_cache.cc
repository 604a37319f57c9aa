#include "planner/profile_cache.h"

#include <ATen/Parallel.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/model/llama.h"

namespace knapserve {
namespace {

namespace fs = std::filesystem;

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

// The cache entry at `path` when it is usable for `key` and `max_draft`;
// otherwise the reason it is not (NotFound when there is no file).
absl::StatusOr<LatencyProfile> ReadEntry(const std::string& path,
                                         const ProfileKey& key, int max_draft) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return absl::NotFoundError(path);
  ASSIGN_OR_RETURN(LatencyProfile profile, LatencyProfile::Load(path));
  RETURN_IF_ERROR(profile.CheckMatches(key.model_fingerprint, key.device,
                                       key.dtype, key.threads));
  if (profile.max_draft < max_draft) {
    return absl::FailedPreconditionError(
        absl::StrCat("its verify table covers drafts up to ", profile.max_draft,
                     ", ", max_draft, " are needed"));
  }
  return profile;
}

}  // namespace

// Writes `text` to `path` through a temporary file in the same folder and a
// rename. Creates the folder first.
absl::Status WriteCacheFileAtomically(const std::string& path,
                                      const std::string& text) {
  const fs::path target(path);
  std::error_code ec;
  fs::create_directories(target.parent_path(), ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create the profile cache folder ",
                     target.parent_path().string(), ": ", ec.message()));
  }
  static std::atomic<uint64_t> counter{0};
  const std::string temp =
      absl::StrCat(path, ".tmp.", getpid(), ".", counter++);
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    if (!out) {
      return absl::PermissionDeniedError(absl::StrCat("cannot write ", temp));
    }
    out << text;
    out.flush();
    if (!out) {
      out.close();
      fs::remove(temp, ec);
      return absl::DataLossError(absl::StrCat("write to ", temp, " failed"));
    }
  }
  fs::rename(temp, target, ec);
  if (ec) {
    const std::string message = ec.message();
    fs::remove(temp, ec);
    return absl::PermissionDeniedError(
        absl::StrCat("cannot rename ", temp, " to ", path, ": ", message));
  }
  return absl::OkStatus();
}

ProfileKey ProfileKey::Of(const LlamaModel& model) {
  ProfileKey key;
  key.model_fingerprint = model.config().Fingerprint();
  key.device = model.device().str();
  key.dtype = DtypeName(model.dtype());
  key.threads = at::get_num_threads();
  return key;
}

std::string CacheFileName(std::string name) {
  for (char& c : name) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                      (c >= '0' && c <= '9') || c == '.' || c == '-' ||
                      c == '_';
    if (!keep) c = '-';
  }
  return name + ".json";
}

std::string ProfileKey::FileName() const {
  return CacheFileName(
      absl::StrCat(model_fingerprint, "_", device, "_", dtype, "_t", threads));
}

std::string ProfileCacheDir(const std::string& flag_dir) {
  if (!flag_dir.empty()) return flag_dir;
  if (std::string env = Env("KNAPSERVE_PROFILE_CACHE"); !env.empty())
    return env;
  if (std::string xdg = Env("XDG_CACHE_HOME");
      !xdg.empty() && xdg.front() == '/') {
    return (fs::path(xdg) / "knapserve" / "profiles").string();
  }
  if (std::string home = Env("HOME"); !home.empty()) {
    return (fs::path(home) / ".cache" / "knapserve" / "profiles").string();
  }
  return "";
}

std::string_view ProfileOriginName(ProfileOrigin origin) {
  switch (origin) {
    case ProfileOrigin::kFile:
      return "file";
    case ProfileOrigin::kCacheHit:
      return "cache";
    case ProfileOrigin::kMeasured:
      return "measured";
  }
  return "unknown";
}

absl::StatusOr<std::optional<ObtainedProfile>> FindProfile(
    const ProfileKey& key, const ObtainProfileOptions& options,
    std::vector<std::string>* warnings) {
  std::vector<std::string> ignored;
  if (warnings == nullptr) warnings = &ignored;
  ObtainedProfile obtained;
  if (!options.profile_path.empty()) {
    ASSIGN_OR_RETURN(obtained.profile,
                     LatencyProfile::Load(options.profile_path));
    obtained.origin = ProfileOrigin::kFile;
    obtained.path = options.profile_path;
    // A given file is the user's choice, so a profile measured with another
    // decode thread count is used; its step times are then off by the
    // difference, which the warning says.
    if (obtained.profile.threads != key.threads) {
      obtained.warnings.push_back(absl::StrCat(
          options.profile_path, " was measured with ", obtained.profile.threads,
          " threads but decoding runs with ", key.threads,
          "; its latencies (and so the plans) may be off: "
          "measure it again with --threads ",
          key.threads));
    }
    return obtained;
  }
  if (options.cache_dir.empty()) {
    warnings->push_back(absl::StrCat(
        "no profile cache folder (none of --profile-cache, "
        "KNAPSERVE_PROFILE_CACHE, ",
        "XDG_CACHE_HOME, HOME is set); the measured profile is not kept"));
    return std::nullopt;
  }
  const std::string entry =
      (fs::path(options.cache_dir) / key.FileName()).string();
  absl::StatusOr<LatencyProfile> cached =
      ReadEntry(entry, key, options.max_draft);
  if (cached.ok()) {
    obtained.profile = std::move(*cached);
    obtained.origin = ProfileOrigin::kCacheHit;
    obtained.path = entry;
    return obtained;
  }
  if (!absl::IsNotFound(cached.status())) {
    warnings->push_back(
        absl::StrCat("profile cache entry ", entry, " is not usable (",
                     cached.status().message(), "); measuring it again"));
  }
  return std::nullopt;
}

absl::StatusOr<ObtainedProfile> MeasureAndStoreProfile(
    const ProfileKey& key, const ObtainProfileOptions& options,
    const MeasureProfileFn& measure, std::vector<std::string> warnings) {
  ObtainedProfile obtained;
  obtained.warnings = std::move(warnings);
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(obtained.profile, measure());
  obtained.measure_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  obtained.origin = ProfileOrigin::kMeasured;
  RETURN_IF_ERROR(obtained.profile.CheckMatches(
      key.model_fingerprint, key.device, key.dtype, key.threads));
  if (!options.cache_dir.empty()) {
    const std::string entry =
        (fs::path(options.cache_dir) / key.FileName()).string();
    const absl::Status written =
        WriteCacheFileAtomically(entry, obtained.profile.ToJson());
    if (written.ok()) {
      obtained.path = entry;
    } else {
      obtained.warnings.push_back(
          absl::StrCat("the measured profile is not kept in the cache: ",
                       written.message()));
    }
  }
  return obtained;
}

absl::StatusOr<ObtainedProfile> ObtainProfile(
    const ProfileKey& key, const ObtainProfileOptions& options,
    const MeasureProfileFn& measure) {
  std::vector<std::string> warnings;
  ASSIGN_OR_RETURN(std::optional<ObtainedProfile> found,
                   FindProfile(key, options, &warnings));
  if (found.has_value()) return std::move(*found);
  return MeasureAndStoreProfile(key, options, measure, std::move(warnings));
}

ProfileOptions QuickProfileOptions(const LlamaModel& model, int max_draft) {
  ProfileOptions options;
  options.repeats = 5;
  options.point_budget_seconds = kQuickPointBudgetSeconds;
  options.min_repeats = 3;
  options.max_draft = max_draft;
  options.contexts.clear();
  for (int64_t n : {128, 512, 1024, 2048, 4096}) {
    if (n + max_draft + 1 <= model.max_context()) options.contexts.push_back(n);
  }
  options.contexts.push_back(model.max_context() - max_draft - 1);
  return options;
}

}  // namespace knapserve

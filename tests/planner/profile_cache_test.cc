// Tests of the latency profile cache (planner/profile_cache.h): a miss
// measures and stores, a hit does not measure, keys are kept apart, corrupt
// or too small entries are measured again with a warning, --profile wins, an
// unwritable cache is a warning. Every test uses its own temporary folder.
#include "planner/profile_cache.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "common/model/llama.h"
#include "tests/testing/test_models.h"

namespace knapserve {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

// A key and a measure function that returns a hand-made profile for it and
// counts its calls.
struct Fixture {
  ProfileKey key;
  int calls = 0;
  double mlp = 2e-4;  // changes the profile so that tests can tell two apart

  explicit Fixture(const LlamaModel& model) {
    const LatencyProfile p = testing::HandLatencyProfile(model);
    key = {p.model_fingerprint, p.device, p.dtype, p.threads};
  }

  MeasureProfileFn Measure(const LlamaModel& model) {
    return [this, &model]() -> absl::StatusOr<LatencyProfile> {
      ++calls;
      LatencyProfile p = testing::HandLatencyProfile(model, 1e-4, mlp);
      p.dtype = key.dtype;
      p.threads = key.threads;
      return p;
    };
  }
};

ObtainProfileOptions InCache(const std::string& dir) {
  ObtainProfileOptions options;
  options.cache_dir = dir;
  return options;
}

const LlamaModel* Model() { return testing::CachedModel("tiny-llama"); }

TEST(ProfileCacheTest, MissMeasuresAndStoresThenHitDoesNotMeasure) {
  const LlamaModel* model = Model();
  ASSERT_NE(model, nullptr);
  const std::string dir =
      testing::MakeTempDir("profile_cache") + "/nested/profiles";
  Fixture f(*model);

  auto first = ObtainProfile(f.key, InCache(dir), f.Measure(*model));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->origin, ProfileOrigin::kMeasured);
  EXPECT_EQ(ProfileOriginName(first->origin), "measured");
  EXPECT_EQ(first->path, (fs::path(dir) / f.key.FileName()).string());
  EXPECT_THAT(first->warnings, IsEmpty());
  EXPECT_EQ(f.calls, 1);
  ASSERT_TRUE(fs::exists(first->path));
  // Stored through a temporary file and a rename: nothing else is left.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    ++files;
    EXPECT_EQ(entry.path().filename().string(), f.key.FileName());
  }
  EXPECT_EQ(files, 1);

  auto second = ObtainProfile(f.key, InCache(dir), f.Measure(*model));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->origin, ProfileOrigin::kCacheHit);
  EXPECT_EQ(ProfileOriginName(second->origin), "cache");
  EXPECT_EQ(second->path, first->path);
  EXPECT_EQ(f.calls, 1);  // not measured again
  EXPECT_EQ(second->profile.ToJson(), first->profile.ToJson());
}

// FindProfile never measures: a miss is nullopt, a stored entry a hit; a
// server starts on it and measures in the background on a miss.
TEST(ProfileCacheTest, FindProfileReportsAMissWithoutMeasuring) {
  const LlamaModel* model = Model();
  ASSERT_NE(model, nullptr);
  const std::string dir = testing::MakeTempDir("profile_cache_find");
  Fixture f(*model);
  std::vector<std::string> warnings;
  auto miss = FindProfile(f.key, InCache(dir), &warnings);
  ASSERT_TRUE(miss.ok()) << miss.status();
  EXPECT_FALSE(miss->has_value());
  EXPECT_THAT(warnings, IsEmpty());
  EXPECT_FALSE(fs::exists(fs::path(dir) / f.key.FileName()));

  auto stored = MeasureAndStoreProfile(f.key, InCache(dir), f.Measure(*model));
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->origin, ProfileOrigin::kMeasured);
  EXPECT_EQ(f.calls, 1);
  auto hit = FindProfile(f.key, InCache(dir), &warnings);
  ASSERT_TRUE(hit.ok()) << hit.status();
  ASSERT_TRUE(hit->has_value());
  EXPECT_EQ((*hit)->origin, ProfileOrigin::kCacheHit);
  EXPECT_EQ((*hit)->profile.ToJson(), stored->profile.ToJson());
  EXPECT_EQ(f.calls, 1);

  // A corrupt entry is a miss with a warning.
  std::ofstream(stored->path) << "{not json";
  auto corrupt = FindProfile(f.key, InCache(dir), &warnings);
  ASSERT_TRUE(corrupt.ok()) << corrupt.status();
  EXPECT_FALSE(corrupt->has_value());
  EXPECT_THAT(warnings, ElementsAre(HasSubstr("is not usable")));
}

TEST(ProfileCacheTest, DifferentDtypeOrThreadsAreDifferentEntries) {
  const LlamaModel* model = Model();
  ASSERT_NE(model, nullptr);
  const std::string dir = testing::MakeTempDir("profile_cache");
  Fixture base(*model);
  Fixture bf16(*model);
  bf16.key.dtype = "bf16";
  Fixture threads(*model);
  threads.key.threads = base.key.threads + 1;
  EXPECT_NE(base.key.FileName(), bf16.key.FileName());
  EXPECT_NE(base.key.FileName(), threads.key.FileName());
  EXPECT_NE(bf16.key.FileName(), threads.key.FileName());

  for (Fixture* f : {&base, &bf16, &threads}) {
    auto got = ObtainProfile(f->key, InCache(dir), f->Measure(*model));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->origin, ProfileOrigin::kMeasured) << f->key.FileName();
    EXPECT_EQ(got->profile.dtype, f->key.dtype);
    EXPECT_EQ(got->profile.threads, f->key.threads);
  }
  int files = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir))
    ++files;
  EXPECT_EQ(files, 3);
  // Each key now hits its own entry.
  for (Fixture* f : {&base, &bf16, &threads}) {
    auto got = ObtainProfile(f->key, InCache(dir), f->Measure(*model));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->origin, ProfileOrigin::kCacheHit) << f->key.FileName();
    EXPECT_EQ(got->profile.dtype, f->key.dtype);
    EXPECT_EQ(got->profile.threads, f->key.threads);
    EXPECT_EQ(f->calls, 1);
  }
}

TEST(ProfileCacheTest, FileNameIsKeyedAndSafe) {
  ProfileKey key{"0123456789abcdef", "cuda:0", "bf16", 8};
  EXPECT_EQ(key.FileName(), "0123456789abcdef_cuda-0_bf16_t8.json");
  key.device = "../x/y";
  EXPECT_EQ(key.FileName().find('/'), std::string::npos) << key.FileName();
}

TEST(ProfileCacheTest, CorruptOrMismatchedEntryIsMeasuredAgainWithAWarning) {
  const LlamaModel* model = Model();
  ASSERT_NE(model, nullptr);
  const std::string dir = testing::MakeTempDir("profile_cache");
  Fixture f(*model);
  const std::string entry = (fs::path(dir) / f.key.FileName()).string();

  // Not JSON (a write cut short by hand, say).
  std::ofstream(entry)
      << "{\"format\": \"knapserve-latency-profile\", \"version\": ";
  auto got = ObtainProfile(f.key, InCache(dir), f.Measure(*model));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->origin, ProfileOrigin::kMeasured);
  EXPECT_EQ(f.calls, 1);
  ASSERT_THAT(got->warnings, SizeIs(1));
  EXPECT_THAT(got->warnings[0],
              AllOf(HasSubstr(entry), HasSubstr("measuring it again")));
  // The entry was replaced by a good one.
  auto again = ObtainProfile(f.key, InCache(dir), f.Measure(*model));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->origin, ProfileOrigin::kCacheHit);
  EXPECT_EQ(f.calls, 1);

  // A valid profile of another key under this key's name.
  LatencyProfile other = testing::HandLatencyProfile(*model);
  other.threads = f.key.threads + 3;
  std::ofstream(entry, std::ios::trunc) << other.ToJson();
  got = ObtainProfile(f.key, InCache(dir), f.Measure(*model));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->origin, ProfileOrigin::kMeasured);
  EXPECT_EQ(f.calls, 2);
  ASSERT_THAT(got->warnings, SizeIs(1));
  EXPECT_THAT(got->warnings[0], HasSubstr("threads"));
}

TEST(ProfileCacheTest, EntryWithATooSmallVerifyTableIsAMiss) {
  const LlamaModel* model = Model();
  ASSERT_NE(model, nullptr);
  const std::string dir = testing::MakeTempDir("profile_cache");
  Fixture f(*model);
  ASSERT_TRUE(ObtainProfile(f.key, InCache(dir), f.Measure(*model)).ok());
  ObtainProfileOptions options = InCache(dir);
  options.max_draft = 12;  // the hand profile covers 10
  auto got = ObtainProfile(f.key, options, f.Measure(*model));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->origin, ProfileOrigin::kMeasured);
  EXPECT_EQ(f.calls, 2);
  ASSERT_THAT(got->warnings, SizeIs(1));
  EXPECT_THAT(got->warnings[0], HasSubstr("up to 10, 12 are needed"));
}

TEST(ProfileCacheTest, ProfileFileWinsOverTheCache) {
  const LlamaModel* model = Model();
  ASSERT_NE(model, nullptr);
  const std::string dir = testing::MakeTempDir("profile_cache");
  Fixture f(*model);
  ASSERT_TRUE(ObtainProfile(f.key, InCache(dir), f.Measure(*model))
                  .ok());  // fills the cache
  const std::string file = testing::MakeTempDir("profile_file") + "/p.json";
  LatencyProfile given = testing::HandLatencyProfile(*model, 1e-4, 7e-4);
  ASSERT_TRUE(given.Save(file).ok());

  ObtainProfileOptions options = InCache(dir);
  options.profile_path = file;
  auto got = ObtainProfile(f.key, options, f.Measure(*model));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->origin, ProfileOrigin::kFile);
  EXPECT_EQ(ProfileOriginName(got->origin), "file");
  EXPECT_EQ(got->path, file);
  EXPECT_DOUBLE_EQ(got->profile.mlp_seconds, 7e-4);
  EXPECT_EQ(f.calls, 1);
  EXPECT_THAT(got->warnings, IsEmpty());

  // A file measured with another thread count is still used, with a warning
  // that names both counts.
  LatencyProfile other_threads = given;
  other_threads.threads = f.key.threads + 3;
  const std::string other_file = file + ".threads.json";
  ASSERT_TRUE(other_threads.Save(other_file).ok());
  options.profile_path = other_file;
  auto warned = ObtainProfile(f.key, options, f.Measure(*model));
  ASSERT_TRUE(warned.ok()) << warned.status();
  EXPECT_EQ(warned->origin, ProfileOrigin::kFile);
  ASSERT_THAT(warned->warnings, SizeIs(1));
  EXPECT_THAT(warned->warnings[0],
              AllOf(HasSubstr(absl::StrCat(f.key.threads + 3, " threads")),
                    HasSubstr(absl::StrCat("--threads ", f.key.threads))));
  EXPECT_EQ(f.calls, 1);

  // A missing --profile file is an error, not a fallback to the cache.
  options.profile_path = file + ".missing";
  auto missing = ObtainProfile(f.key, options, f.Measure(*model));
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr(".missing"));
  EXPECT_EQ(f.calls, 1);
}

TEST(ProfileCacheTest, UnwritableOrMissingCacheIsAWarning) {
  const LlamaModel* model = Model();
  ASSERT_NE(model, nullptr);
  // A regular file where the cache folder should be: it cannot be created
  // (true for root too, unlike a permission bit).
  const std::string blocker =
      testing::MakeTempDir("profile_cache") + "/not_a_folder";
  std::ofstream(blocker) << "x";
  Fixture f(*model);
  auto got =
      ObtainProfile(f.key, InCache(blocker + "/profiles"), f.Measure(*model));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->origin, ProfileOrigin::kMeasured);
  EXPECT_EQ(got->path, "");
  ASSERT_THAT(got->warnings, SizeIs(1));
  EXPECT_THAT(got->warnings[0], HasSubstr("not kept"));

  got = ObtainProfile(f.key, InCache(""), f.Measure(*model));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->origin, ProfileOrigin::kMeasured);
  ASSERT_THAT(got->warnings, SizeIs(1));
  EXPECT_THAT(got->warnings[0], HasSubstr("no profile cache folder"));
  EXPECT_EQ(f.calls, 2);
}

TEST(ProfileCacheTest, MeasureErrorsAreReturned) {
  const LlamaModel* model = Model();
  ASSERT_NE(model, nullptr);
  Fixture f(*model);
  auto got =
      ObtainProfile(f.key, InCache(testing::MakeTempDir("profile_cache")),
                    []() -> absl::StatusOr<LatencyProfile> {
                      return absl::InternalError("torch threw");
                    });
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInternal);
}

// Sets (or unsets, with nullopt) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value.has_value()) {
      setenv(name, value->c_str(), 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_.has_value()) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(ProfileCacheTest, CacheDirComesFromFlagThenEnvironment) {
  ScopedEnv cache("KNAPSERVE_PROFILE_CACHE", "/c/env");
  ScopedEnv xdg("XDG_CACHE_HOME", "/c/xdg");
  ScopedEnv home("HOME", "/c/home");
  EXPECT_EQ(ProfileCacheDir("/c/flag"), "/c/flag");
  EXPECT_EQ(ProfileCacheDir(""), "/c/env");
  {
    ScopedEnv no_cache("KNAPSERVE_PROFILE_CACHE", std::nullopt);
    EXPECT_EQ(ProfileCacheDir(""), "/c/xdg/knapserve/profiles");
    {
      ScopedEnv relative_xdg("XDG_CACHE_HOME",
                             "relative");  // ignored, as XDG says
      EXPECT_EQ(ProfileCacheDir(""), "/c/home/.cache/knapserve/profiles");
      ScopedEnv no_home("HOME", std::nullopt);
      EXPECT_EQ(ProfileCacheDir(""), "");
    }
  }
}

TEST(ProfileCacheTest, QuickOptionsFitTheModel) {
  const LlamaModel* model = Model();
  ASSERT_NE(model, nullptr);
  const ProfileOptions options = QuickProfileOptions(*model, 10);
  EXPECT_EQ(options.repeats, 5);
  EXPECT_EQ(options.point_budget_seconds, kQuickPointBudgetSeconds);
  EXPECT_EQ(options.min_repeats, 3);
  EXPECT_EQ(options.max_draft, 10);
  ASSERT_FALSE(options.contexts.empty());
  for (int64_t n : options.contexts)
    EXPECT_LE(n + 11, model->max_context()) << n;
  EXPECT_EQ(options.contexts.back(), model->max_context() - 11);
}

}  // namespace
}  // namespace knapserve

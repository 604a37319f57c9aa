// `knapserve profile`: measures the latency model the planner needs
// (planner/latency_profile.h) on the real engine and writes it as JSON.
#include <algorithm>
#include <cstdio>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "planner/latency_profile.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/step_overhead.h"

namespace knapserve {
namespace {

absl::StatusOr<std::vector<int64_t>> ContextsFromFlags(const LlamaModel& model,
                                                       int max_draft) {
  ASSIGN_OR_RETURN(std::vector<int64_t> contexts,
                   TokenCountsFromFlag("profile-contexts",
                                       absl::GetFlag(FLAGS_profile_contexts)));
  if (contexts.empty()) {
    // The default grid plus the longest context that fits, so the fit spans
    // the whole range the planner will see.
    contexts = {128,  512,  1024,
                2048, 4096, model.max_context() - max_draft - 1};
  }
  std::erase_if(contexts, [&](int64_t n) {
    return n < 1 || n + max_draft + 1 > model.max_context();
  });
  std::sort(contexts.begin(), contexts.end());
  contexts.erase(std::unique(contexts.begin(), contexts.end()), contexts.end());
  if (contexts.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--profile-contexts: fewer than two context lengths fit the model's "
        "context of ",
        model.max_context(), " with --profile-max-draft ", max_draft));
  }
  return contexts;
}

absl::Status Profile() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return absl::InvalidArgumentError("--out FILE is required");
  ASSIGN_OR_RETURN(Engine engine, LoadEngineFromFlags());
  ProfileOptions options;
  options.max_draft = absl::GetFlag(FLAGS_profile_max_draft);
  if (options.max_draft < 1)
    return absl::InvalidArgumentError("--profile-max-draft must be >= 1");
  options.repeats = absl::GetFlag(FLAGS_profile_repeats);
  options.point_budget_seconds = absl::GetFlag(FLAGS_profile_point_budget);
  if (!(options.point_budget_seconds >= 0))
    return absl::InvalidArgumentError("--profile-point-budget must be >= 0");
  ASSIGN_OR_RETURN(options.contexts,
                   ContextsFromFlags(*engine.model, options.max_draft));
  options.measure_overhead =
      StepOverheadFunction(*engine.model, *engine.tokenizer);
  ASSIGN_OR_RETURN(LatencyProfile profile,
                   ProfileModel(*engine.model, options));
  RETURN_IF_ERROR(profile.Save(out));
  std::printf("profile of %s (%s, %s, %d threads) -> %s\n",
              engine.model_dir.c_str(), profile.device.c_str(),
              profile.dtype.c_str(), profile.threads, out.c_str());
  std::printf("  t_attn(n) = %.3f us + %.5f us * n   (R^2 %.4f)\n",
              profile.attention.a * 1e6, profile.attention.b * 1e6,
              profile.attention.r2);
  std::printf(
      "  t_mlp     = %.3f us                 (line through n: slope %.5f us, "
      "R^2 %.4f)\n",
      profile.mlp_seconds * 1e6, profile.mlp_fit.b * 1e6, profile.mlp_fit.r2);
  std::printf("  fixed per step (embed, norm, LM head) = %.3f us\n",
              profile.step_fixed_seconds * 1e6);
  std::printf(
      "  engine beyond the pass prices: %.1f us + %.4f us * n per step, %.1f "
      "us + %.4f us * n per draft token\n",
      profile.step_overhead_seconds * 1e6, profile.step_overhead_slope * 1e6,
      profile.draft_overhead_seconds * 1e6, profile.draft_overhead_slope * 1e6);
  std::printf("  %8s %12s %12s %12s\n", "context", "attn us", "verify 1 ms",
              absl::StrCat("verify ", profile.max_draft + 1, " ms").c_str());
  for (size_t c = 0; c < profile.verify_contexts.size(); ++c) {
    std::printf("  %8lld %12.3f %12.3f %12.3f\n",
                static_cast<long long>(profile.verify_contexts[c]),
                profile.AttentionSeconds(profile.verify_contexts[c]) * 1e6,
                profile.verify_seconds[c].front() * 1e3,
                profile.verify_seconds[c].back() * 1e3);
  }
  return absl::OkStatus();
}

}  // namespace

int RunProfile() { return ExitCode(Profile(), "profile"); }

}  // namespace knapserve

// `knapserve anchors`: builds the KNN-SSD domain anchors file for a model
// (tools/domain_anchors.h says how; executor/planning/domain_router.h is the
// file).
//
//   knapserve anchors --model DIR --domains NAME=FILE[#CATEGORY],...
//       --out FILE [--split train] [--samples-per-domain 1000]
//       [--anchors-per-domain 10] [--mask-samples 8] [--profile P]
//
// Prints one line per domain: samples, cluster purity, the chosen mask and
// gamma with their smoothed acceptance and predicted speed-up, and how many
// candidate masks the DP proposed (all of them in the --json output); then
// one line per longer prompt length (--longer-prompts) with its draft.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/domain_anchors.h"

ABSL_FLAG(int32_t, samples_per_domain, 1000,
          "anchors: at most this many samples per domain (the KNN-SSD paper "
          "uses about 1,000).");
ABSL_FLAG(int32_t, anchors_per_domain, 10,
          "anchors: samples nearest each domain's centroid kept as anchors.");
ABSL_FLAG(int32_t, mask_samples, 8,
          "anchors: representative samples per domain the draft is chosen "
          "on (0: no draft, every domain decodes plainly).");
ABSL_FLAG(int32_t, reference_tokens, 16,
          "anchors: greedy tokens per representative sample whose states "
          "the KnapSpec DP reads.");
ABSL_FLAG(int32_t, max_sample_tokens, 256,
          "anchors: samples are cut to this many tokens.");
ABSL_FLAG(std::vector<std::string>, longer_prompts,
          std::vector<std::string>({"512", "1024"}),
          "anchors: prompt lengths in tokens (ascending) that get a draft of "
          "their own, chosen on long contexts of the domain's text; a routed "
          "request takes the draft priced for the length nearest its "
          "prompt's. Empty: one draft per domain.");

namespace knapserve {
namespace {

absl::Status Anchors() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return absl::InvalidArgumentError("--out FILE is required");
  ASSIGN_OR_RETURN(std::vector<DomainSource> sources,
                   ParseDomainSources(absl::GetFlag(FLAGS_domains)));
  const std::string split_name = absl::GetFlag(FLAGS_split);
  ASSIGN_OR_RETURN(SampleSplit split,
                   ParseSampleSplit(split_name.empty() ? "train" : split_name));
  AnchorOptions options;
  options.anchors_per_domain = absl::GetFlag(FLAGS_anchors_per_domain);
  options.mask_samples = absl::GetFlag(FLAGS_mask_samples);
  options.reference_tokens = absl::GetFlag(FLAGS_reference_tokens);
  options.max_prompt_tokens = absl::GetFlag(FLAGS_max_sample_tokens);
  options.max_draft = absl::GetFlag(FLAGS_max_draft).value_or(10);
  ASSIGN_OR_RETURN(options.longer_prompt_tokens,
                   TokenCountsFromFlag("longer-prompts",
                                       absl::GetFlag(FLAGS_longer_prompts)));
  ASSIGN_OR_RETURN(options.knapspec, KnapSpecOptionsFromFlags());
  ASSIGN_OR_RETURN(Engine engine, LoadEngineFromFlags());
  ASSIGN_OR_RETURN(std::vector<DomainSamples> domains,
                   LoadDomainSamples(sources, split,
                                     absl::GetFlag(FLAGS_samples_per_domain)));
  std::optional<ObtainedProfile> profile;
  if (options.mask_samples > 0) {
    ASSIGN_OR_RETURN(profile, LatencyProfileFromFlags(engine, "anchors"));
  }
  ASSIGN_OR_RETURN(
      AnchorsBuild build,
      BuildDomainAnchors(*engine.model, *engine.tokenizer, domains,
                         profile.has_value() ? &profile->profile : nullptr,
                         options));
  RETURN_IF_ERROR(build.router->Save(out));

  const bool json = absl::GetFlag(FLAGS_json);
  FILE* text = json ? stderr : stdout;
  std::fprintf(
      text, "%zu domains, %lld anchors; K-means %s after %d iterations\n",
      domains.size(), static_cast<long long>(build.router->num_anchors()),
      build.kmeans_converged ? "converged" : "stopped",
      build.kmeans_iterations);
  std::fprintf(text, "%-16s %7s %7s %5s %6s %7s  %s\n", "domain", "samples",
               "purity", "gamma", "alpha", "pred", "mask (candidates)");
  nlohmann::json report = nlohmann::json::array();
  for (const DomainReport& r : build.reports) {
    std::fprintf(text, "%-16s %7lld %7.2f %5d %6.3f %6.2fx  %s (of %zu)\n",
                 r.name.c_str(), static_cast<long long>(r.samples),
                 r.cluster_purity, r.gamma, r.alpha, r.predicted_speedup,
                 r.mask.empty() ? "(plain)" : r.mask.c_str(),
                 r.candidates.size());
    nlohmann::json longer = nlohmann::json::array();
    for (const DomainReport::Longer& l : r.longer) {
      std::fprintf(text,
                   "  at %5lld tokens %16s %5d %6.3f %6.2fx  %s (own draft "
                   "%.2fx)\n",
                   static_cast<long long>(l.prompt_tokens), "", l.gamma,
                   l.alpha, l.predicted_speedup,
                   l.mask.empty() ? "(plain)" : l.mask.c_str(), l.own_speedup);
      longer.push_back({{"prompt_tokens", l.prompt_tokens},
                        {"mask", l.mask},
                        {"gamma", l.gamma},
                        {"alpha", l.alpha},
                        {"predicted_speedup", l.predicted_speedup},
                        {"own_speedup", l.own_speedup}});
    }
    report.push_back({{"name", r.name},
                      {"samples", r.samples},
                      {"cluster_purity", r.cluster_purity},
                      {"candidates", r.candidates},
                      {"mask", r.mask},
                      {"gamma", r.gamma},
                      {"alpha", r.alpha},
                      {"predicted_speedup", r.predicted_speedup},
                      {"prompt_tokens", r.prompt_tokens},
                      {"longer", std::move(longer)}});
  }
  for (const int64_t length : build.skipped_prompt_tokens) {
    std::fprintf(text,
                 "no draft for %lld-token prompts: they and the reference "
                 "tokens do not fit the model's context\n",
                 static_cast<long long>(length));
  }
  std::fprintf(text, "wrote %s (model fingerprint %s)\n", out.c_str(),
               build.router->model_fingerprint().c_str());
  if (json) {
    std::cout << nlohmann::json{{"out", out},
                                {"domains", report},
                                {"kmeans_iterations", build.kmeans_iterations},
                                {"kmeans_converged", build.kmeans_converged}}
                     .dump(2)
              << std::endl;
  }
  return absl::OkStatus();
}

}  // namespace

int RunAnchors() { return ExitCode(Anchors(), "anchors"); }

}  // namespace knapserve

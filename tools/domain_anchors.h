// KNN-SSD's offline half (`knapserve anchors`, and the mixed-domain stream of
// `bench spec --domains`): which samples make up a domain, the hidden vector
// a prompt is routed by, K-means over those vectors, the anchors, and the
// drafts (skip mask, gamma) each domain gets: one for prompts like its
// samples and one for each longer prompt length.
// executor/planning/domain_router.h is the request-time half and the file
// format.
//
// How a domain's draft is chosen. The KNN-SSD paper runs Bayesian
// optimisation of measured time per token on about 8 samples per domain. We
// use the project's own KnapSpec DP instead (planner/planner.h), for two
// reasons: it needs no timing runs (on a shared 2-core VM a timed search is
// dominated by noise: README, "Why not the mask from --search-masks"), and it
// is the planner the other policies already trust. For each of the domain's
// `mask_samples` representative samples (those nearest its centroid) the
// model greedily continues the prompt by `reference_tokens` tokens; the full
// model's states over those tokens are one PlanInputs, exactly what an
// executor snapshot would hold. SolveKnapSpec on each sample proposes a
// candidate mask; every candidate's acceptance is then measured on all the
// samples (SolveStatic's alpha_hat), pooled and smoothed, and the latency
// profile's TPT grid picks the (mask, gamma) with the most expected tokens
// per second over the domain, or no speculation when nothing beats plain
// decoding.
//
// Drafts for longer prompts. A mask's acceptance falls far into a long
// context (executor/planning/domain_router.h), so the same choice is made
// again for each of `longer_prompt_tokens`: each representative's text
// followed by the domain's next samples (nearest the centroid first, as
// documents one after another) and cut to that many tokens is a long
// sample; the DP on the long samples may propose more candidates, and every
// candidate so far is priced on them at their context; the best, or plain
// decoding when none beats it, is the draft for that length. A request
// routed to the domain takes the draft priced for the length nearest its
// prompt's. Measured (2-core Zen 4 VM, 1000-token prompts, `bench spec`):
// on stories-24l-skip knn now decodes plainly there (0.99-1.0x of plain
// decoding, where the domain's one draft lost until the guard held it plain:
// 0.965-0.985x); on stories-24l it drafts at gamma 1 with other masks, 1.02-
// 1.04x, where the domain's own draft at gamma 2 measured 1.06-1.08x in the
// same runs: the price of that draft at 1024 tokens (0.97-0.98x) is below
// what it measures, and nothing here overrides the price.
//
// Thread safety: plain functions; they use the model's intra-op threads, so
// run one at a time.
#ifndef KNAPSERVE_TOOLS_DOMAIN_ANCHORS_H_
#define KNAPSERVE_TOOLS_DOMAIN_ANCHORS_H_

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model/llama.h"
#include "common/text/tokenizer.h"
#include "executor/planning/domain_router.h"
#include "planner/latency_profile.h"
#include "planner/planner.h"

namespace knapserve {

// One source of a domain's samples, as `--domains` spells it:
// NAME=FILE[#CATEGORY]. FILE is a prompt set (.jsonl, one {"turns": [...],
// "category": ...} per line; the first turn is the sample), optionally only
// the rows of CATEGORY, or a text file (anything else) whose blank-line
// separated blocks are the samples. A NAME may have several sources.
struct DomainSource {
  std::string name;
  std::string path;
  std::string category;  // "" = every row
};

// Parses "NAME=FILE[#CATEGORY]" items; InvalidArgument naming the item.
absl::StatusOr<std::vector<DomainSource>> ParseDomainSources(
    const std::vector<std::string>& items);

// Which of a source's samples to take, so anchors and an evaluation can use
// disjoint halves of the same files: kTrain the even-indexed samples (0, 2,
// ...), kTest the odd-indexed ones, kAll every sample.
enum class SampleSplit { kAll, kTrain, kTest };
// "all", "train", "test".
absl::StatusOr<SampleSplit> ParseSampleSplit(const std::string& name);

// One domain and its sample texts, in file order.
struct DomainSamples {
  std::string name;
  std::vector<std::string> texts;
};

// Reads every source, groups them by NAME (in first-appearance order), keeps
// `split`'s samples and at most `max_per_domain` (<= 0: all) per domain.
// Errors name the file (unreadable, malformed row, no samples left).
absl::StatusOr<std::vector<DomainSamples>> LoadDomainSamples(
    const std::vector<DomainSource>& sources, SampleSplit split,
    int max_per_domain);

// The vector a prompt is routed by (executor/planning/domain_router.h's
// RoutingVector, float32 [hidden]), from the same batched forward the
// executor's prefill runs.
absl::StatusOr<torch::Tensor> PromptRoutingVector(
    const LlamaModel& model, const std::vector<int32_t>& prompt_ids);

// Spherical K-means (cosine geometry: rows and centroids are normalized) of
// x [N, d] from the initial centroids `init` [k, d]; Lloyd iterations until
// no assignment changes or max_iterations. A centroid is the weighted mean
// direction of its members (`weights`: one per row, > 0; empty = all 1). A
// cluster left empty keeps its previous centroid.
struct KMeansResult {
  torch::Tensor centroids;  // [k, d], unit rows
  std::vector<int> assignment;
  int iterations = 0;
  bool converged = false;
};
KMeansResult SphericalKMeans(const torch::Tensor& x, const torch::Tensor& init,
                             int max_iterations,
                             const std::vector<double>& weights = {});

struct AnchorOptions {
  int anchors_per_domain = 10;  // k of the paper
  // Representative samples per domain the draft is chosen on; 0 skips the
  // choice (every domain decodes plainly; for tests of routing alone).
  int mask_samples = 8;
  int reference_tokens = 16;      // greedy tokens per sample (r)
  int max_prompt_tokens = 256;    // samples are cut to this many tokens
  int64_t lifetime_tokens = 128;  // the plan is priced at n + this / 2
  int max_draft = 10;             // D of the TPT grid
  // Prompt lengths (ascending) that get drafts of their own beside the one
  // for the samples' length; lengths whose samples would not fit the
  // model's context with the reference tokens are skipped.
  std::vector<int64_t> longer_prompt_tokens = {512, 1024};
  KnapSpecOptions knapspec;  // the DP's options (max_draft is set from D)
  int kmeans_iterations = 50;
};

// What BuildDomainAnchors found for one domain.
struct DomainReport {
  std::string name;
  int64_t samples = 0;
  // Share of the domain's samples that K-means put in the domain's own
  // cluster (1 = the domains separate cleanly in hidden-state space).
  double cluster_purity = 0;
  std::vector<std::string> candidates;  // masks the DP proposed (all lengths)
  std::string mask;                     // chosen ("" = no speculation)
  int gamma = 0;
  double alpha = 0;                // pooled, smoothed acceptance of it
  double predicted_speedup = 1.0;  // TPT over plain decoding's
  int64_t prompt_tokens = 0;       // the samples' mean length
  // The draft for each longer prompt length (mask "" = no speculation).
  struct Longer {
    int64_t prompt_tokens = 0;
    std::string mask;
    int gamma = 0;
    double alpha = 0;
    double predicted_speedup = 1.0;
    // The domain's own draft (its mask and gamma) priced at this length
    // (0: it does not draft), to show how far it falls.
    double own_speedup = 0;
  };
  std::vector<Longer> longer;
};

struct AnchorsBuild {
  std::shared_ptr<const DomainRouter> router;
  std::vector<DomainReport> reports;
  int kmeans_iterations = 0;
  bool kmeans_converged = false;
  // AnchorOptions::longer_prompt_tokens that were priced, and those skipped
  // because they would not fit the model's context.
  std::vector<int64_t> longer_prompt_tokens;
  std::vector<int64_t> skipped_prompt_tokens;
};

// The whole offline step: the vectors of every sample, K-means with one
// cluster per domain (initialized at each domain's mean direction, so
// cluster i belongs to domain i; each sample weighs 1 / its domain's sample
// count, so a domain of 1,000 samples does not pull the centroids of a
// domain of 5 into its own territory), the anchors_per_domain samples of each
// domain nearest its centroid as its anchors, and each domain's draft (see
// the file comment; `profile` may be null only with mask_samples == 0).
absl::StatusOr<AnchorsBuild> BuildDomainAnchors(
    const LlamaModel& model, const Tokenizer& tokenizer,
    const std::vector<DomainSamples>& domains, const LatencyProfile* profile,
    const AnchorOptions& options);

}  // namespace knapserve

#endif  // KNAPSERVE_TOOLS_DOMAIN_ANCHORS_H_

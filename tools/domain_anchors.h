// KNN-SSD's offline half (`knapserve anchors`, and the mixed-domain stream of
// `bench spec --domains`): which samples make up a domain, the hidden vector
// a prompt is routed by, K-means over those vectors, the anchors, and the one
// draft (skip mask, gamma) each domain gets. executor/planning/domain_router.h
// is the request-time half and the file format.
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
  KnapSpecOptions knapspec;       // the DP's options (max_draft is set from D)
  int kmeans_iterations = 50;
};

// What BuildDomainAnchors found for one domain.
struct DomainReport {
  std::string name;
  int64_t samples = 0;
  // Share of the domain's samples that K-means put in the domain's own
  // cluster (1 = the domains separate cleanly in hidden-state space).
  double cluster_purity = 0;
  std::vector<std::string> candidates;  // masks the DP proposed
  std::string mask;                     // chosen ("" = no speculation)
  int gamma = 0;
  double alpha = 0;                // pooled, smoothed acceptance of it
  double predicted_speedup = 1.0;  // TPT over plain decoding's
};

struct AnchorsBuild {
  std::shared_ptr<const DomainRouter> router;
  std::vector<DomainReport> reports;
  int kmeans_iterations = 0;
  bool kmeans_converged = false;
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

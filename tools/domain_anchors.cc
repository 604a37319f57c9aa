#include "tools/domain_anchors.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <numeric>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/model/exception_status.h"
#include "executor/engine/generator.h"
#include "planner/tpt.h"
#include "tools/prompt_set.h"

namespace knapserve {
namespace {

// The blank-line separated blocks of a text file, whitespace-trimmed.
absl::StatusOr<std::vector<std::string>> TextBlocks(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::vector<std::string> blocks;
  std::string line, block;
  auto flush = [&] {
    const size_t begin = block.find_first_not_of(" \t\r\n");
    if (begin != std::string::npos) {
      const size_t end = block.find_last_not_of(" \t\r\n");
      blocks.push_back(block.substr(begin, end - begin + 1));
    }
    block.clear();
  };
  while (std::getline(in, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) {
      flush();
    } else {
      if (!block.empty()) block += '\n';
      block += line;
    }
  }
  flush();
  return blocks;
}

// The samples of one source, in file order.
absl::StatusOr<std::vector<std::string>> SourceTexts(
    const DomainSource& source) {
  std::vector<std::string> texts;
  if (absl::EndsWith(source.path, ".jsonl")) {
    ASSIGN_OR_RETURN(std::vector<BenchPrompt> rows,
                     LoadPromptSet(source.path, 0));
    // LoadPromptSet interleaves categories; file order is question order.
    std::stable_sort(rows.begin(), rows.end(),
                     [](const BenchPrompt& a, const BenchPrompt& b) {
                       return a.question_id < b.question_id;
                     });
    for (BenchPrompt& row : rows) {
      if (source.category.empty() || row.category == source.category)
        texts.push_back(std::move(row.text));
    }
  } else {
    if (!source.category.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--domains ", source.name, ": #", source.category,
          " needs a .jsonl prompt set, ", source.path, " is a text file"));
    }
    ASSIGN_OR_RETURN(texts, TextBlocks(source.path));
  }
  return texts;
}

torch::Tensor Normalized(const torch::Tensor& x) {
  const torch::Tensor norms = x.norm(2, /*dim=*/-1, /*keepdim=*/true);
  return x / torch::where(norms > 0, norms, torch::ones_like(norms));
}

// One sample as the planner sees it: the prompt continued greedily by r
// tokens, and the full model's states over those tokens.
struct SampleInputs {
  std::vector<LayerKv> kv;
  PlanInputs inputs;
};

absl::StatusOr<SampleInputs> ReferenceInputs(const LlamaModel& model,
                                             const Tokenizer& tokenizer,
                                             const std::vector<int32_t>& ids,
                                             const AnchorOptions& options) {
  const int r = options.reference_tokens;
  GenerationRequest request;
  request.prompt_ids = ids;
  request.max_new_tokens = r + 1;
  request.ignore_eos = true;
  ASSIGN_OR_RETURN(GenerationResult result,
                   Generate(model, tokenizer, request));
  if (static_cast<int>(result.output_ids.size()) < r + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a sample of ", ids.size(), " tokens leaves no room for ",
                     r + 1, " reference tokens in the model's context"));
  }
  std::vector<int64_t> all(ids.begin(), ids.end());
  for (int j = 0; j < r; ++j) all.push_back(result.output_ids[j]);
  const int64_t total = static_cast<int64_t>(all.size());
  SampleInputs sample;
  try {
    c10::InferenceMode guard;
    sample.kv = model.AllocateKv(total);
    torch::Tensor states;
    ForwardOptions forward;
    forward.num_logits = 0;
    forward.boundary_states = &states;
    model.Forward(torch::tensor(all, torch::kInt64), 0, sample.kv, forward);
    sample.inputs.states = states.narrow(1, total - r, r).contiguous();
  } catch (...) {
    return CurrentExceptionAsInternal("reference states of a sample");
  }
  // The full model's argmax after output j is output j + 1 (greedy).
  for (int j = 0; j < r; ++j)
    sample.inputs.target_argmax.push_back(result.output_ids[j + 1]);
  sample.inputs.first_position = total - r;
  sample.inputs.prefix_len = total;
  sample.inputs.context_length = total;
  sample.inputs.plan_lifetime_tokens = options.lifetime_tokens;
  return sample;
}

// Every sample's reference inputs, each pointed at its own K/V.
absl::StatusOr<std::vector<SampleInputs>> SamplesInputs(
    const LlamaModel& model, const Tokenizer& tokenizer,
    const std::vector<std::vector<int32_t>>& samples,
    const AnchorOptions& options) {
  std::vector<SampleInputs> inputs;
  for (const std::vector<int32_t>& ids : samples) {
    ASSIGN_OR_RETURN(SampleInputs sample,
                     ReferenceInputs(model, tokenizer, ids, options));
    inputs.push_back(std::move(sample));
  }
  // Pointed at once the vector no longer grows (moving the vector keeps its
  // elements where they are).
  for (SampleInputs& sample : inputs) sample.inputs.prefix_kv = &sample.kv;
  return inputs;
}

// Adds the mask of every sample's KnapSpec plan that drafts and is not yet
// among `candidates` (texts in `proposed`, in the order found).
absl::Status ProposeCandidates(const LlamaModel& model,
                               const LatencyProfile& profile,
                               const std::vector<SampleInputs>& inputs,
                               const AnchorOptions& options,
                               std::vector<std::string>& proposed,
                               std::vector<LayerMask>& candidates) {
  KnapSpecOptions knapspec = options.knapspec;
  knapspec.max_draft = options.max_draft;
  for (const SampleInputs& sample : inputs) {
    ASSIGN_OR_RETURN(DraftPlan plan,
                     SolveKnapSpec(model, profile, sample.inputs, knapspec));
    if (plan.gamma == 0) continue;
    const std::string text = plan.mask.ToString();
    if (std::find(proposed.begin(), proposed.end(), text) != proposed.end())
      continue;
    proposed.push_back(text);
    candidates.push_back(plan.mask);
  }
  return absl::OkStatus();
}

// The candidates priced over the samples, and the best (candidate, gamma).
struct PricedCandidates {
  std::vector<TptCandidate> grid;  // one per candidate
  std::vector<double> verify;      // t_verify(n, t), t = 1..max_draft + 1
  TptChoice choice;
  double alpha() const {
    return choice.candidate >= 0 ? grid[choice.candidate].alpha : 0.0;
  }
};

// Every candidate's acceptance measured on all the samples, pooled and
// smoothed, priced by the profile at the samples' mean pricing context.
absl::StatusOr<PricedCandidates> PriceCandidates(
    const LlamaModel& model, const LatencyProfile& profile,
    const std::vector<SampleInputs>& inputs,
    const std::vector<LayerMask>& candidates, const AnchorOptions& options) {
  int64_t context = 0;
  for (const SampleInputs& sample : inputs)
    context += PricingContextLength(sample.inputs);
  context /= static_cast<int64_t>(inputs.size());
  PricedCandidates priced;
  std::vector<TptCandidate>& grid = priced.grid;
  StaticOptions static_options;
  static_options.max_draft = options.max_draft;
  static_options.alpha_prior = options.knapspec.alpha_prior;
  const int64_t r_total =
      static_cast<int64_t>(inputs.size()) * options.reference_tokens;
  for (const LayerMask& mask : candidates) {
    double share = 0;
    for (const SampleInputs& sample : inputs) {
      ASSIGN_OR_RETURN(
          DraftPlan plan,
          SolveStatic(model, profile, sample.inputs, mask, static_options));
      share += plan.alpha_hat;
    }
    share /= static_cast<double>(inputs.size());
    // One share for every draft position: the planner's later-draft odds
    // (planner.h SmoothedLaterOdds) are not pooled over the samples here, so
    // a domain's gamma may come out lower than a plan's for the same mask.
    // knn's domain masks at the gamma chosen this way are this project's best
    // at 1000 tokens of context on stories-24l (tools/README.md); changing
    // how they are priced wants its own comparison.
    TptCandidate candidate;
    candidate.alpha = SmoothAlpha(share, r_total, options.knapspec.alpha_prior);
    candidate.draft_seconds = profile.DraftTokenSeconds(mask, context);
    grid.push_back(candidate);
  }
  for (int t = 1; t <= options.max_draft + 1; ++t)
    priced.verify.push_back(profile.StepSeconds(context, t));
  ASSIGN_OR_RETURN(priced.choice,
                   MaximizeTpt(grid, priced.verify, options.max_draft));
  return priced;
}

double Speedup(const TptChoice& choice) {
  return choice.candidate >= 0 && choice.baseline_tpt > 0
             ? choice.tpt / choice.baseline_tpt
             : 1.0;
}

// The domain's draft from its representative samples (see the header).
absl::Status ChooseDraft(const LlamaModel& model, const Tokenizer& tokenizer,
                         const LatencyProfile& profile,
                         const std::vector<std::vector<int32_t>>& samples,
                         const AnchorOptions& options, DomainReport& report,
                         std::vector<LayerMask>& candidates,
                         RoutedDomain& domain) {
  ASSIGN_OR_RETURN(std::vector<SampleInputs> inputs,
                   SamplesInputs(model, tokenizer, samples, options));
  int64_t tokens = 0;
  for (const std::vector<int32_t>& ids : samples)
    tokens += static_cast<int64_t>(ids.size());
  domain.prompt_tokens = tokens / static_cast<int64_t>(samples.size());
  report.prompt_tokens = domain.prompt_tokens;
  RETURN_IF_ERROR(ProposeCandidates(model, profile, inputs, options,
                                    report.candidates, candidates));
  domain.mask = LayerMask(model.num_layers());
  domain.gamma = 0;
  domain.mask_source = "knapspec-dp";
  if (candidates.empty()) {
    domain.mask_source = "knapspec-dp: no sample's plan drafts";
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(
      PricedCandidates priced,
      PriceCandidates(model, profile, inputs, candidates, options));
  const TptChoice& choice = priced.choice;
  if (choice.candidate < 0) {
    domain.mask_source =
        "knapspec-dp: no candidate beats plain decoding on the domain";
    return absl::OkStatus();
  }
  domain.mask = candidates[choice.candidate];
  domain.gamma = choice.gamma;
  domain.predicted_speedup = Speedup(choice);
  report.mask = domain.mask.ToString();
  report.gamma = domain.gamma;
  report.alpha = priced.alpha();
  report.predicted_speedup = domain.predicted_speedup;
  return absl::OkStatus();
}

// The domain's draft for prompts of `length` tokens: long samples (each
// representative's text followed by the domain's next samples, cut to
// `length`) propose more candidates, and all candidates are priced on them.
absl::StatusOr<ContextDraft> ChooseLongerDraft(
    const LlamaModel& model, const Tokenizer& tokenizer,
    const LatencyProfile& profile, const std::vector<const std::string*>& texts,
    int64_t length, const AnchorOptions& options, const RoutedDomain& domain,
    DomainReport& report, std::vector<LayerMask>& candidates) {
  std::vector<std::vector<int32_t>> samples;
  const size_t m = std::min<size_t>(options.mask_samples, texts.size());
  for (size_t j = 0; j < m; ++j) {
    std::string text = *texts[j];
    std::vector<int32_t> ids;
    size_t last_pass = 0;  // tokens after the previous pass over the texts
    for (size_t next = j + 1;; ++next) {
      ASSIGN_OR_RETURN(ids,
                       tokenizer.Encode(text, /*add_special_tokens=*/true));
      if (static_cast<int64_t>(ids.size()) >= length) break;
      if ((next - j - 1) % texts.size() == 0) {
        if (next > j + 1 && ids.size() <= last_pass) {
          return absl::InvalidArgumentError(
              absl::StrCat("domain '", report.name,
                           "': its texts one after another add "
                           "no tokens, so they make no ",
                           length, "-token sample"));
        }
        last_pass = ids.size();
      }
      text += "\n\n";
      text += *texts[next % texts.size()];
    }
    ids.resize(length);
    samples.push_back(std::move(ids));
  }
  ASSIGN_OR_RETURN(std::vector<SampleInputs> inputs,
                   SamplesInputs(model, tokenizer, samples, options));
  RETURN_IF_ERROR(ProposeCandidates(model, profile, inputs, options,
                                    report.candidates, candidates));
  ContextDraft draft;
  draft.prompt_tokens = length;
  draft.mask = LayerMask(model.num_layers());
  DomainReport::Longer line;
  line.prompt_tokens = length;
  if (!candidates.empty()) {
    ASSIGN_OR_RETURN(
        PricedCandidates priced,
        PriceCandidates(model, profile, inputs, candidates, options));
    const TptChoice& choice = priced.choice;
    if (choice.candidate >= 0) {
      draft.mask = candidates[choice.candidate];
      draft.gamma = choice.gamma;
      draft.predicted_speedup = Speedup(choice);
      line.mask = draft.mask.ToString();
      line.alpha = priced.alpha();
    }
    // For the report: the domain's own draft priced at this length.
    const auto own =
        std::find(candidates.begin(), candidates.end(), domain.mask);
    if (domain.gamma > 0 && own != candidates.end()) {
      const TptCandidate& odds = priced.grid[own - candidates.begin()];
      line.own_speedup =
          TokensPerSecond(odds.alpha, domain.gamma, odds.draft_seconds,
                          priced.verify[domain.gamma]) /
          choice.baseline_tpt;
    }
  }
  line.gamma = draft.gamma;
  line.predicted_speedup = draft.predicted_speedup;
  report.longer.push_back(line);
  return draft;
}

}  // namespace

absl::StatusOr<std::vector<DomainSource>> ParseDomainSources(
    const std::vector<std::string>& items) {
  std::vector<DomainSource> sources;
  for (const std::string& item : items) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == item.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--domains: '", item, "' is not NAME=FILE[#CATEGORY]"));
    }
    DomainSource source;
    source.name = item.substr(0, eq);
    source.path = item.substr(eq + 1);
    const size_t hash = source.path.rfind('#');
    if (hash != std::string::npos) {
      source.category = source.path.substr(hash + 1);
      source.path = source.path.substr(0, hash);
      if (source.category.empty() || source.path.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--domains: '", item, "' is not NAME=FILE[#CATEGORY]"));
      }
    }
    sources.push_back(std::move(source));
  }
  if (sources.empty())
    return absl::InvalidArgumentError("--domains: no domain given");
  return sources;
}

absl::StatusOr<SampleSplit> ParseSampleSplit(const std::string& name) {
  if (name == "all") return SampleSplit::kAll;
  if (name == "train") return SampleSplit::kTrain;
  if (name == "test") return SampleSplit::kTest;
  return absl::InvalidArgumentError(
      absl::StrCat("split: '", name, "' is not all, train or test"));
}

absl::StatusOr<std::vector<DomainSamples>> LoadDomainSamples(
    const std::vector<DomainSource>& sources, SampleSplit split,
    int max_per_domain) {
  std::vector<DomainSamples> domains;
  std::map<std::string, size_t> index;
  for (const DomainSource& source : sources) {
    ASSIGN_OR_RETURN(std::vector<std::string> texts, SourceTexts(source));
    auto [it, inserted] = index.emplace(source.name, domains.size());
    if (inserted) domains.push_back({source.name, {}});
    DomainSamples& domain = domains[it->second];
    size_t kept = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      if (split == SampleSplit::kTrain && i % 2 != 0) continue;
      if (split == SampleSplit::kTest && i % 2 != 1) continue;
      if (max_per_domain > 0 &&
          static_cast<int>(domain.texts.size()) >= max_per_domain)
        break;
      domain.texts.push_back(std::move(texts[i]));
      ++kept;
    }
    if (kept == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--domains ", source.name, ": ", source.path,
          source.category.empty() ? "" : absl::StrCat("#", source.category),
          " gives no samples"));
    }
  }
  return domains;
}

absl::StatusOr<torch::Tensor> PromptRoutingVector(
    const LlamaModel& model, const std::vector<int32_t>& prompt_ids) {
  if (prompt_ids.empty())
    return absl::InvalidArgumentError("an empty prompt has no hidden vector");
  try {
    c10::InferenceMode guard;
    std::vector<LayerKv> kv =
        model.AllocateKv(static_cast<int64_t>(prompt_ids.size()));
    torch::Tensor states;
    BatchSequence seq;
    seq.tokens = prompt_ids;
    seq.kv = &kv;
    seq.num_logits = 0;
    seq.output_states = &states;
    model.ForwardBatch({seq});
    RoutingVector vector;
    vector.Add(states, 0);
    return vector.Mean();
  } catch (...) {
    return CurrentExceptionAsInternal("the prompt's hidden vector");
  }
}

KMeansResult SphericalKMeans(const torch::Tensor& x, const torch::Tensor& init,
                             int max_iterations,
                             const std::vector<double>& weights) {
  c10::InferenceMode guard;
  const torch::Tensor points = Normalized(x.to(torch::kFloat32));
  KMeansResult result;
  result.centroids = Normalized(init.to(torch::kFloat32)).clone();
  const int64_t n = points.size(0);
  const int64_t k = result.centroids.size(0);
  const torch::Tensor w = weights.empty()
                              ? torch::ones({n, 1})
                              : torch::tensor(weights, torch::kFloat64)
                                    .to(torch::kFloat32)
                                    .reshape({n, 1});
  result.assignment.assign(n, -1);
  for (int it = 0; it < std::max(1, max_iterations); ++it) {
    result.iterations = it + 1;
    const torch::Tensor nearest =
        torch::mm(points, result.centroids.t()).argmax(1);
    bool changed = false;
    for (int64_t i = 0; i < n; ++i) {
      const int a = static_cast<int>(nearest[i].item<int64_t>());
      changed = changed || a != result.assignment[i];
      result.assignment[i] = a;
    }
    if (!changed) {
      result.converged = true;
      break;
    }
    for (int64_t c = 0; c < k; ++c) {
      std::vector<int64_t> members;
      for (int64_t i = 0; i < n; ++i) {
        if (result.assignment[i] == c) members.push_back(i);
      }
      if (members.empty()) continue;
      const torch::Tensor rows = torch::tensor(members, torch::kInt64);
      const torch::Tensor mean =
          (points.index_select(0, rows) * w.index_select(0, rows)).sum(0);
      result.centroids[c] = Normalized(mean);
    }
  }
  return result;
}

absl::StatusOr<AnchorsBuild> BuildDomainAnchors(
    const LlamaModel& model, const Tokenizer& tokenizer,
    const std::vector<DomainSamples>& domains, const LatencyProfile* profile,
    const AnchorOptions& options) {
  if (domains.empty()) return absl::InvalidArgumentError("no domains");
  if (options.anchors_per_domain < 1 || options.mask_samples < 0 ||
      options.reference_tokens < 1 || options.max_prompt_tokens < 1 ||
      options.max_draft < 1) {
    return absl::InvalidArgumentError(
        "anchors: anchors_per_domain, reference_tokens, max_prompt_tokens and "
        "max_draft must be >= 1, mask_samples >= 0");
  }
  for (size_t i = 0; i < options.longer_prompt_tokens.size(); ++i) {
    if (options.longer_prompt_tokens[i] < 1 ||
        (i > 0 && options.longer_prompt_tokens[i] <=
                      options.longer_prompt_tokens[i - 1])) {
      return absl::InvalidArgumentError(
          "anchors: the longer prompt lengths must be positive and "
          "ascending");
    }
  }
  if (options.mask_samples > 0 && profile == nullptr) {
    return absl::InvalidArgumentError(
        "anchors: choosing the domains' drafts needs a latency profile");
  }
  // Every sample's ids and vector, domain by domain.
  std::vector<std::vector<int32_t>> ids;
  std::vector<const std::string*> text_of;
  std::vector<int> domain_of;
  std::vector<torch::Tensor> vectors;
  for (size_t d = 0; d < domains.size(); ++d) {
    for (const std::string& text : domains[d].texts) {
      ASSIGN_OR_RETURN(std::vector<int32_t> sample,
                       tokenizer.Encode(text, /*add_special_tokens=*/true));
      if (static_cast<int>(sample.size()) > options.max_prompt_tokens)
        sample.resize(options.max_prompt_tokens);
      if (sample.empty()) continue;
      ASSIGN_OR_RETURN(torch::Tensor v, PromptRoutingVector(model, sample));
      ids.push_back(std::move(sample));
      text_of.push_back(&text);
      domain_of.push_back(static_cast<int>(d));
      vectors.push_back(v);
    }
  }
  const torch::Tensor x = torch::stack(vectors);  // [N, hidden]
  const torch::Tensor unit = Normalized(x);
  // One cluster per domain, started at the domain's mean direction.
  std::vector<torch::Tensor> means;
  for (size_t d = 0; d < domains.size(); ++d) {
    std::vector<int64_t> rows;
    for (size_t i = 0; i < domain_of.size(); ++i) {
      if (domain_of[i] == static_cast<int>(d))
        rows.push_back(static_cast<int64_t>(i));
    }
    if (rows.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "domain '", domains[d].name, "' has no non-empty sample"));
    }
    means.push_back(
        unit.index_select(0, torch::tensor(rows, torch::kInt64)).mean(0));
  }
  std::vector<double> weights(domain_of.size());
  std::vector<int> count(domains.size(), 0);
  for (int d : domain_of) ++count[d];
  for (size_t i = 0; i < domain_of.size(); ++i)
    weights[i] = 1.0 / count[domain_of[i]];
  const KMeansResult kmeans = SphericalKMeans(
      x, torch::stack(means), options.kmeans_iterations, weights);

  AnchorsBuild build;
  // The longer lengths whose samples and reference tokens fit the context.
  for (const int64_t length : options.longer_prompt_tokens) {
    if (length + options.reference_tokens + 1 > model.max_context()) {
      build.skipped_prompt_tokens.push_back(length);
    } else {
      build.longer_prompt_tokens.push_back(length);
    }
  }
  build.kmeans_iterations = kmeans.iterations;
  build.kmeans_converged = kmeans.converged;
  std::vector<RoutedDomain> routed;
  std::vector<torch::Tensor> anchors;
  std::vector<int> anchor_domain;
  for (size_t d = 0; d < domains.size(); ++d) {
    // The domain's samples by cosine similarity to its centroid, nearest
    // first.
    std::vector<std::pair<double, size_t>> order;
    int in_cluster = 0;
    for (size_t i = 0; i < domain_of.size(); ++i) {
      if (domain_of[i] != static_cast<int>(d)) continue;
      in_cluster += kmeans.assignment[i] == static_cast<int>(d) ? 1 : 0;
      const double sim = torch::dot(unit[static_cast<int64_t>(i)],
                                    kmeans.centroids[static_cast<int64_t>(d)])
                             .item<double>();
      order.push_back({-sim, i});
    }
    std::stable_sort(order.begin(), order.end());
    DomainReport report;
    report.name = domains[d].name;
    report.samples = static_cast<int64_t>(order.size());
    report.cluster_purity =
        static_cast<double>(in_cluster) / static_cast<double>(order.size());
    const size_t k = std::min<size_t>(options.anchors_per_domain, order.size());
    for (size_t j = 0; j < k; ++j) {
      anchors.push_back(x[static_cast<int64_t>(order[j].second)]);
      anchor_domain.push_back(static_cast<int>(d));
    }
    RoutedDomain domain;
    domain.name = domains[d].name;
    domain.samples = report.samples;
    domain.mask = LayerMask(model.num_layers());
    domain.mask_source = "none: no draft chosen (mask_samples 0)";
    if (options.mask_samples > 0) {
      std::vector<std::vector<int32_t>> representative;
      const size_t m = std::min<size_t>(options.mask_samples, order.size());
      for (size_t j = 0; j < m; ++j)
        representative.push_back(ids[order[j].second]);
      std::vector<LayerMask> candidates;
      RETURN_IF_ERROR(ChooseDraft(model, tokenizer, *profile, representative,
                                  options, report, candidates, domain));
      // The domain's texts nearest its centroid first, for long samples.
      std::vector<const std::string*> ordered;
      for (const auto& [similarity, i] : order) ordered.push_back(text_of[i]);
      for (const int64_t length : build.longer_prompt_tokens) {
        if (length <= domain.prompt_tokens) continue;
        ASSIGN_OR_RETURN(
            ContextDraft draft,
            ChooseLongerDraft(model, tokenizer, *profile, ordered, length,
                              options, domain, report, candidates));
        domain.longer.push_back(std::move(draft));
      }
    }
    routed.push_back(std::move(domain));
    build.reports.push_back(std::move(report));
  }
  ASSIGN_OR_RETURN(
      build.router,
      DomainRouter::Create(model.config().Fingerprint(),
                           model.weights_fingerprint(), model.num_layers(),
                           std::move(routed), torch::stack(anchors),
                           std::move(anchor_domain)));
  return build;
}

}  // namespace knapserve

// DomainRouter: KNN-SSD's request-time half. A request in SpeculationMode::kKnn
// is routed once, after its prompt is prefilled: the prompt's routing vector
// (RoutingVector below: its last-layer hidden states, averaged) is compared
// by cosine similarity with every anchor, and the domain of the nearest
// anchor (1-NN) gives the draft for prompts of its length (mask, gamma)
// that the request keeps to its end.
//
// The routing vector. The KNN-SSD paper routes by the last hidden vector
// of the input. We average the last layer's hidden states (after the last
// sublayer, before the final norm; BatchSequence::output_states) over the
// prompt's positions instead, leaving out position 0 (BOS in most prompts,
// the same for every prompt) unless it is the only one. Measured on
// stories-24l, the last position's state alone routed a plain story opening
// to the wrong domain with a cosine of 0.11 to its nearest anchor: it mostly
// says what the next token will be, not what the text is about; the mean
// says what the text is about and costs one add per prefilled row.
//
// The anchors and per-domain drafts come from one file that `knapserve
// anchors` writes (tools/domain_anchors.h: K-means with one cluster per
// domain, the k samples nearest each centroid as anchors, masks and gammas
// per domain and prompt length from the KnapSpec DP). A .safetensors file:
//
//   tensor    "anchors"            [N, hidden] float32, one anchor per row
//   metadata  "format"             "knapserve.domain_anchors.v1"
//             "anchor_domain"      JSON array of N domain indices
//             "model_fingerprint"  ModelConfig::Fingerprint() and
//             "weights_fingerprint" LlamaModel::weights_fingerprint() of the
//                                  model whose hidden states the anchors are
//             "domains"            JSON array of {name, mask, gamma,
//                                  samples, mask_source, predicted_speedup,
//                                  prompt_tokens, longer}; `longer` (may be
//                                  absent) is an array of {prompt_tokens,
//                                  mask, gamma, predicted_speedup}
//
// A domain's draft depends on the prompt's length. The same mask accepts
// differently far into a long context: on stories-24l-skip knn's domain
// masks accepted 85-90% of their drafts after story openings and 40-73%
// 1000 tokens in, where they lost to plain decoding until the guard held
// them plain. So a domain carries its draft for prompts like its samples (mask,
// gamma, priced at their mean length `prompt_tokens`) and drafts for longer
// prompts (`longer`, each chosen on long contexts of the domain's own text);
// a request takes the one priced for the length nearest its prompt's
// (RoutedDomain::DraftFor). A file without `longer` gives every prompt the
// domain's one draft.
//
// A file made for another model (another architecture, or the same one with
// other weights) is refused at load with FailedPrecondition naming both
// fingerprints; a malformed one with InvalidArgument naming the file and the
// problem.
//
// Ownership and threads: a DomainRouter is immutable once made; share it by
// shared_ptr<const DomainRouter> (PlanningShared::router) and call Route()
// from any thread.
#ifndef KNAPSERVE_EXECUTOR_PLANNING_DOMAIN_ROUTER_H_
#define KNAPSERVE_EXECUTOR_PLANNING_DOMAIN_ROUTER_H_

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/checkpoint/model_config.h"
#include "common/model/layer_mask.h"

namespace knapserve {

// A domain's draft for prompts of about `prompt_tokens` tokens.
struct ContextDraft {
  int64_t prompt_tokens = 0;
  LayerMask mask;  // the sublayers its drafts skip
  int gamma = 0;   // draft length; 0 decodes plainly (nothing paid)
  double predicted_speedup = 1.0;  // over plain decoding, at that length
};

// One domain: its name and the drafts requests routed to it use.
struct RoutedDomain {
  std::string name;
  // The draft for prompts like the domain's samples.
  LayerMask mask;  // the sublayers its drafts skip
  int gamma = 0;   // draft length; 0 decodes plainly (nothing paid)
  // Provenance, for people reading the file: samples the domain was built
  // from, how its mask was chosen ("knapspec-dp", "none"), and the speed-up
  // over plain decoding the latency model predicted for (mask, gamma).
  int64_t samples = 0;
  std::string mask_source;
  double predicted_speedup = 1.0;
  // The samples' mean prompt length that draft was priced at (0: unknown,
  // a file written before drafts by length; then `longer` must be empty).
  int64_t prompt_tokens = 0;
  // Drafts for longer prompts, prompt_tokens ascending and above the
  // domain's own.
  std::vector<ContextDraft> longer;

  // The draft for a prompt of `prompt_tokens` tokens: of the domain's own
  // and `longer`, the one priced at the length nearest it on a log scale
  // (lengths span 10 to 10,000 tokens); ties go to the shorter.
  ContextDraft DraftFor(int64_t prompt_tokens) const;
};

// A prompt's routing vector, built chunk by chunk as its prefill runs.
// Not thread-safe (one sequence's prefill).
class RoutingVector {
 public:
  // The final hidden states ([rows, hidden]) of prompt positions start_pos ..
  // start_pos + rows - 1.
  void Add(const torch::Tensor& final_states, int64_t start_pos);
  // The mean over positions 1.. (position 0 alone when nothing else was
  // added), float32 [hidden]; undefined before any Add.
  torch::Tensor Mean() const;

 private:
  torch::Tensor first_;  // position 0's state
  torch::Tensor sum_;    // over positions >= 1
  int64_t count_ = 0;
};

// What Route() decided.
struct DomainRoute {
  int domain = -1;        // index into DomainRouter::domains()
  int anchor = -1;        // the nearest anchor's row
  double similarity = 0;  // its cosine similarity with the state
};

class DomainRouter {
 public:
  // Checks and builds a router. `anchors` is [N, hidden] (any float dtype,
  // any device; kept as float32 on CPU), `anchor_domain` has N entries, each
  // a valid index into `domains`; every domain needs at least one anchor,
  // its masks (its own and `longer`'s) must have `num_layers` layers, its
  // gammas be >= 0 and `longer` ascend above its own prompt_tokens.
  // InvalidArgument naming the problem otherwise.
  static absl::StatusOr<std::shared_ptr<const DomainRouter>> Create(
      std::string model_fingerprint, std::string weights_fingerprint,
      int num_layers, std::vector<RoutedDomain> domains,
      const torch::Tensor& anchors, std::vector<int> anchor_domain);

  // Reads a file Save() wrote and checks it against the model of `config`
  // and `weights_fingerprint` (LlamaModel::weights_fingerprint(); see the
  // file comment for the errors).
  static absl::StatusOr<std::shared_ptr<const DomainRouter>> Load(
      const std::string& path, const ModelConfig& config,
      const std::string& weights_fingerprint);

  // Writes the file format above (atomically: a temporary file, renamed).
  absl::Status Save(const std::string& path) const;

  // The nearest anchor to `state` ([hidden], any float dtype and device) by
  // cosine similarity; ties go to the lower anchor row. A state of norm 0
  // routes to anchor 0's domain with similarity 0.
  DomainRoute Route(const torch::Tensor& state) const;

  const std::vector<RoutedDomain>& domains() const { return domains_; }
  const std::string& model_fingerprint() const { return fingerprint_; }
  const std::string& weights_fingerprint() const {
    return weights_fingerprint_;
  }
  int64_t hidden_size() const { return anchors_.size(1); }
  int64_t num_anchors() const { return anchors_.size(0); }
  // The anchors as given (float32, CPU) and each one's domain.
  const torch::Tensor& anchors() const { return anchors_; }
  const std::vector<int>& anchor_domain() const { return anchor_domain_; }

 private:
  DomainRouter() = default;

  std::string fingerprint_;
  std::string weights_fingerprint_;
  std::vector<RoutedDomain> domains_;
  torch::Tensor anchors_;  // [N, hidden] float32
  torch::Tensor unit_;     // anchors_ with rows scaled to norm 1 (0 rows: 0)
  std::vector<int> anchor_domain_;
};

}  // namespace knapserve

#endif  // KNAPSERVE_EXECUTOR_PLANNING_DOMAIN_ROUTER_H_

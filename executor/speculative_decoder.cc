#include "executor/speculative_decoder.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>

namespace knapserve {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

torch::Tensor OneToken(int32_t id) {
  return torch::tensor({static_cast<int64_t>(id)}, torch::kInt64);
}

}  // namespace

int32_t ChooseDraft(Sampler& sampler, const torch::Tensor& logits,
                    double exit_threshold,
                    std::vector<torch::Tensor>& draft_dists, bool& confident) {
  int32_t draft;
  if (sampler.greedy()) {
    draft = Argmax(logits);
  } else {
    torch::Tensor q = sampler.Distribution(logits);
    draft = sampler.SampleFrom(q);
    draft_dists.push_back(q);
  }
  // Dynamic exit: stop once the draft is unsure of its own top token.
  const double top1 = torch::softmax(logits, 0).max().item<double>();
  confident = top1 >= exit_threshold;
  return draft;
}

Acceptance AcceptDrafts(Sampler& sampler, const std::vector<int32_t>& drafts,
                        const std::vector<torch::Tensor>& draft_dists,
                        const torch::Tensor& logits, const int64_t* target) {
  const int64_t m = static_cast<int64_t>(drafts.size());
  Acceptance out;
  int64_t& accepted = out.accepted;
  int32_t& next = out.next;
  if (sampler.greedy()) {
    while (accepted < m && target[accepted] == drafts[accepted]) ++accepted;
    next = static_cast<int32_t>(target[accepted]);
  } else if (m == 0) {
    next = sampler.Sample(logits[0]);
  } else {
    for (; accepted < m; ++accepted) {
      torch::Tensor p = sampler.Distribution(logits[accepted]);
      const torch::Tensor& q = draft_dists[accepted];
      const int32_t d = drafts[accepted];
      const double pd = p[d].item<double>();
      const double qd = q[d].item<double>();
      if (qd > 0 && sampler.Uniform() < std::min(1.0, pd / qd)) continue;
      torch::Tensor residual = (p - q).clamp_min(0);
      next = residual.sum().item<double>() > 0 ? sampler.SampleFrom(residual)
                                               : sampler.SampleFrom(p);
      break;
    }
    if (accepted == m)
      next = sampler.SampleFrom(sampler.Distribution(logits[m]));
  }
  return out;
}

void RecordVerification(SpeculationStats& stats, int64_t drafted,
                        int64_t accepted) {
  if (drafted == 0) return;
  ++stats.drafts;
  stats.draft_tokens += drafted;
  stats.accepted_tokens += accepted;
  if (static_cast<int64_t>(stats.accepted_per_position.size()) < drafted) {
    stats.accepted_per_position.resize(drafted, 0);
  }
  for (int64_t j = 0; j < accepted; ++j) ++stats.accepted_per_position[j];
}

StepResult FinishVerification(Sampler& sampler,
                              const std::vector<int32_t>& drafts,
                              const std::vector<torch::Tensor>& draft_dists,
                              const torch::Tensor& logits,
                              const torch::Tensor& states,
                              int64_t first_position, bool capture,
                              SpeculationStats& stats) {
  torch::Tensor argmax = logits.argmax(-1).to(torch::kCPU);
  const int64_t* target = argmax.data_ptr<int64_t>();
  const Acceptance acceptance =
      AcceptDrafts(sampler, drafts, draft_dists, logits, target);
  const int64_t accepted = acceptance.accepted;
  const int64_t m = static_cast<int64_t>(drafts.size());
  StepResult result;
  result.first_position = first_position;
  result.tokens.assign(drafts.begin(), drafts.begin() + accepted);
  result.tokens.push_back(acceptance.next);
  result.drafted = static_cast<int>(m);
  result.accepted = static_cast<int>(accepted);
  RecordVerification(stats, m, accepted);
  if (capture) {
    result.boundary_states = states.narrow(1, 0, accepted + 1);
    result.target_argmax.assign(target, target + accepted + 1);
  }
  return result;
}

double SpeculationStats::acceptance_rate() const {
  return draft_tokens > 0 ? static_cast<double>(accepted_tokens) / draft_tokens
                          : 0.0;
}

double SpeculationStats::mean_exit_depth() const {
  int64_t count = 0;
  int64_t sum = 0;
  for (size_t d = 0; d < exit_depths.size(); ++d) {
    count += exit_depths[d];
    sum += exit_depths[d] * static_cast<int64_t>(d + 1);
  }
  return count > 0 ? static_cast<double>(sum) / count : 0.0;
}

double SpeculationStats::mean_acceptance_length() const {
  return drafts > 0 ? 1.0 + static_cast<double>(accepted_tokens) / drafts : 1.0;
}

SpeculativeDecoder::SpeculativeDecoder(const LlamaModel& model, KvCache& cache,
                                       Sampler& sampler, LayerMask mask,
                                       int gamma, double exit_threshold)
    : model_(model),
      cache_(cache),
      sampler_(sampler),
      mask_(std::move(mask)),
      gamma_(gamma),
      exit_threshold_(exit_threshold) {}

StepResult SpeculativeDecoder::Step(int32_t last, int64_t max_tokens,
                                    bool capture_states) {
  c10::InferenceMode inference_mode;
  TORCH_CHECK(max_tokens >= 1, "Step needs max_tokens >= 1");
  const int64_t pos = cache_.length();
  TORCH_CHECK(pos < cache_.capacity(), "no KV room for the step");
  // Drafts + the verified token must fit both the budget and the cache.
  const int64_t budget =
      std::min<int64_t>({gamma_, max_tokens - 1, cache_.capacity() - pos - 1});

  // 1. Draft with the masked sub-network.
  std::vector<int32_t> drafts;
  std::vector<torch::Tensor> draft_dists;  // q_j, sampling only
  if (budget > 0) {
    const auto t0 = std::chrono::steady_clock::now();
    ForwardOptions options;
    options.skip = &mask_;
    options.num_logits = 1;
    int32_t token = last;
    for (int64_t j = 0; j < budget; ++j) {
      torch::Tensor logits =
          model_.Forward(OneToken(token), pos + j, cache_.layers(), options)[0];
      bool confident = false;
      const int32_t draft = ChooseDraft(sampler_, logits, exit_threshold_,
                                        draft_dists, confident);
      drafts.push_back(draft);
      token = draft;
      if (!confident) break;
    }
    stats_.draft_seconds += Seconds(t0);
  }

  // 2. Verify [last, drafts...] with one full forward.
  const auto t1 = std::chrono::steady_clock::now();
  std::vector<int64_t> input = {last};
  input.insert(input.end(), drafts.begin(), drafts.end());
  torch::Tensor states;
  ForwardOptions verify;
  verify.boundary_states = capture_states ? &states : nullptr;
  torch::Tensor logits = model_.Forward(torch::tensor(input, torch::kInt64),
                                        pos, cache_.layers(), verify);

  // 3. Accept.
  StepResult result = FinishVerification(sampler_, drafts, draft_dists, logits,
                                         states, pos, capture_states, stats_);
  stats_.verify_seconds += Seconds(t1);

  // 4. Keep [last, accepted drafts]; the rest of the written positions are
  // dropped by length and overwritten later.
  cache_.Commit(pos + result.accepted + 1);
  return result;
}

}  // namespace knapserve

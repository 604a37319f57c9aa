#include "executor/engine/speculation_step.h"

#include <algorithm>

namespace knapserve {

int32_t DrawDraft(Sampler& sampler, const torch::Tensor& logits,
                  int64_t position, std::vector<torch::Tensor>& draft_dists) {
  if (sampler.greedy()) return Argmax(logits);
  torch::Tensor q = sampler.Distribution(logits);
  if (sampler.coupled()) return sampler.DrawAt(q, position);
  const int32_t draft = sampler.SampleFrom(q);
  draft_dists.push_back(std::move(q));
  return draft;
}

int32_t ChooseDraft(Sampler& sampler, const torch::Tensor& logits,
                    int64_t position, double exit_threshold,
                    std::vector<torch::Tensor>& draft_dists, bool& confident) {
  const int32_t draft = DrawDraft(sampler, logits, position, draft_dists);
  // Dynamic exit: stop once the draft is unsure of its own top token.
  const double top1 = torch::softmax(logits, 0).max().item<double>();
  confident = top1 >= exit_threshold;
  return draft;
}

Acceptance AcceptDrafts(Sampler& sampler, const std::vector<int32_t>& drafts,
                        const std::vector<torch::Tensor>& draft_dists,
                        const torch::Tensor& logits, const int64_t* target,
                        int64_t position) {
  const int64_t m = static_cast<int64_t>(drafts.size());
  Acceptance out;
  int64_t& accepted = out.accepted;
  int32_t& next = out.next;
  if (sampler.greedy()) {
    while (accepted < m && target[accepted] == drafts[accepted]) ++accepted;
    next = static_cast<int32_t>(target[accepted]);
  } else if (sampler.coupled()) {
    // The target's own coupled draw at each position, as plain decoding
    // would make it; the first that differs from the draft is committed.
    for (;; ++accepted) {
      next = sampler.Sample(logits[accepted], position + accepted);
      if (accepted == m || next != drafts[accepted]) break;
    }
  } else if (m == 0) {
    next = sampler.Sample(logits[0], position);
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
  const Acceptance acceptance = AcceptDrafts(
      sampler, drafts, draft_dists, logits, target, first_position + 1);
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

}  // namespace knapserve

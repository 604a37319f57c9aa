#include "planner/knapsack.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/model/llama.h"

namespace knapserve {
namespace {

// Checks reference [2L+1, r, d] against the runner and the target ids.
absl::Status CheckReference(const SublayerRunner& runner,
                            const torch::Tensor& reference,
                            absl::Span<const int32_t> target_argmax) {
  if (!reference.defined() || reference.dim() != 3) {
    return absl::InvalidArgumentError(
        "reference states must be a [2L+1, r, hidden] tensor");
  }
  const int64_t boundaries = runner.num_sublayers() + 1;
  if (reference.size(0) != boundaries) {
    return absl::InvalidArgumentError(
        absl::StrCat("reference states have ", reference.size(0),
                     " boundaries, expected 2L+1 = ", boundaries));
  }
  if (reference.size(1) < 1) {
    return absl::InvalidArgumentError(
        "reference states hold no tokens (r = 0)");
  }
  if (!target_argmax.empty() &&
      static_cast<int64_t>(target_argmax.size()) != reference.size(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target_argmax has ", target_argmax.size(),
        " ids but the reference states hold ", reference.size(1), " tokens"));
  }
  return absl::OkStatus();
}

// The pair counts of LaterDraftCounts from per-token accept and go_on [B, r]
// (bool), r >= 1.
std::vector<LaterDraftCounts> PairCounts(const torch::Tensor& accept,
                                         const torch::Tensor& go_on) {
  const int64_t b = accept.size(0);
  const int64_t r = accept.size(1);
  std::vector<LaterDraftCounts> out(b);
  if (r < 2) return out;
  const torch::Tensor acc0 = accept.narrow(1, 0, r - 1);
  const torch::Tensor acc1 = accept.narrow(1, 1, r - 1);
  const torch::Tensor go0 = go_on.narrow(1, 0, r - 1);
  const torch::Tensor go1 = go_on.narrow(1, 1, r - 1);
  const torch::Tensor reached = acc0.logical_and(go0);
  const torch::Tensor counts =
      torch::stack({reached, reached.logical_and(acc1),
                    reached.logical_and(acc1).logical_and(go1), go0,
                    go0.logical_and(go1)},
                   1)
          .to(torch::kFloat64)
          .sum(-1)
          .cpu()
          .contiguous();  // [B, 5]
  const double* p = counts.data_ptr<double>();
  for (int64_t k = 0; k < b; ++k) {
    out[k] = {p[5 * k], p[5 * k + 1], p[5 * k + 2], p[5 * k + 3], p[5 * k + 4]};
  }
  return out;
}

absl::StatusOr<std::vector<DraftShares>> Shares(
    const SublayerRunner& runner, const torch::Tensor& final_states,
    absl::Span<const int32_t> target_argmax, double exit_threshold) {
  const int64_t b = final_states.size(0);
  std::vector<DraftShares> out(b);
  std::vector<int64_t> ids(target_argmax.begin(), target_argmax.end());
  const torch::Tensor target = torch::tensor(ids, torch::kInt64).unsqueeze(0);
  torch::Tensor accept;
  torch::Tensor go_on;
  if (!(exit_threshold > 0)) {
    ASSIGN_OR_RETURN(torch::Tensor top, runner.TopTokens(final_states));
    accept = top.to(torch::kCPU, torch::kInt64).eq(target);
    go_on = torch::ones_like(accept);
  } else {
    ASSIGN_OR_RETURN(SublayerRunner::Top top,
                     runner.TopTokensWithProbability(final_states));
    accept = top.ids.to(torch::kCPU, torch::kInt64).eq(target);
    go_on = top.probability.to(torch::kCPU, torch::kFloat64).ge(exit_threshold);
  }
  torch::Tensor shares =
      torch::stack({accept, go_on, accept.logical_and(go_on)}, 1)
          .to(torch::kFloat64)
          .mean(-1)
          .contiguous();  // [B, 3]
  const std::vector<LaterDraftCounts> later = PairCounts(accept, go_on);
  const double* p = shares.data_ptr<double>();
  for (int64_t k = 0; k < b; ++k)
    out[k] = {p[3 * k], p[3 * k + 1], p[3 * k + 2], later[k]};
  return out;
}

absl::StatusOr<torch::Tensor> CheckedApply(const SublayerRunner& runner,
                                           int sublayer,
                                           const torch::Tensor& h) {
  ASSIGN_OR_RETURN(torch::Tensor out, runner.Apply(sublayer, h));
  if (!out.defined() || out.sizes() != h.sizes()) {
    return absl::InternalError(absl::StrCat(
        "sublayer ", sublayer, " returned a tensor of the wrong shape"));
  }
  return out;
}

}  // namespace

// ---- ModelSublayerRunner ----

absl::StatusOr<ModelSublayerRunner> ModelSublayerRunner::Create(
    const LlamaModel& model, const std::vector<LayerKv>* prefix,
    int64_t prefix_len, int64_t first_position, const Options& options) {
  const int layers =
      options.num_layers <= 0 ? model.num_layers() : options.num_layers;
  if (layers > model.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("runner over ", layers,
                                                   " layers but the model has ",
                                                   model.num_layers()));
  }
  if (first_position < 0 || first_position >= model.max_context()) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_position ", first_position, " outside [0, ",
                     model.max_context(), ")"));
  }
  const std::vector<int64_t>& limits = options.row_prefix_limits;
  const int64_t most_entries =
      limits.empty() ? first_position
                     : first_position + static_cast<int64_t>(limits.size()) - 1;
  if (prefix_len < 0 || prefix_len > most_entries) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_len ", prefix_len, " outside [0, ", most_entries,
                     "] (first_position ", first_position, ", ", limits.size(),
                     " row prefix limits)"));
  }
  for (size_t i = 0; i < limits.size(); ++i) {
    if (limits[i] < 0 || limits[i] > prefix_len ||
        limits[i] > first_position + static_cast<int64_t>(i) ||
        (i > 0 && limits[i] < limits[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "row_prefix_limits[", i, "] = ", limits[i],
          ": limits must be non-decreasing, at most prefix_len ", prefix_len,
          " and at most the token's position ", first_position + i));
    }
  }
  if (prefix_len > 0) {
    if (prefix == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prefix_len is ", prefix_len, " but no prefix K/V was given"));
    }
    if (static_cast<int>(prefix->size()) != model.num_layers()) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefix K/V has ", prefix->size(),
                       " layers, the model has ", model.num_layers()));
    }
    for (int i = 0; i < layers; ++i) {
      const LayerKv& kv = (*prefix)[i];
      if (!kv.k.defined() || !kv.v.defined() || kv.k.dim() != 3 ||
          kv.v.dim() != 3 ||
          kv.k.size(0) != model.config().num_key_value_heads ||
          kv.k.size(2) != model.config().head_dim ||
          kv.k.sizes() != kv.v.sizes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "prefix K/V of layer ", i,
            " must be two [kv_heads, capacity, head_dim] tensors"));
      }
      if (kv.k.size(1) < prefix_len) {
        return absl::InvalidArgumentError(
            absl::StrCat("prefix K/V of layer ", i, " holds ", kv.k.size(1),
                         " positions, prefix_len is ", prefix_len));
      }
      if (kv.k.device() != model.device() ||
          kv.k.scalar_type() != model.dtype()) {
        return absl::InvalidArgumentError(
            absl::StrCat("prefix K/V of layer ", i,
                         " is not on the model's device and dtype"));
      }
    }
  }
  return ModelSublayerRunner(model, prefix, prefix_len, first_position, layers,
                             options);
}

absl::StatusOr<torch::Tensor> ModelSublayerRunner::Apply(
    int sublayer, const torch::Tensor& h) const {
  if (sublayer < 0 || sublayer >= num_sublayers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sublayer ", sublayer, " outside [0, ", num_sublayers(), ")"));
  }
  if (h.dim() != 3 || h.size(2) != model_->config().hidden_size) {
    return absl::InvalidArgumentError("runner input must be [B, r, hidden]");
  }
  const int layer = sublayer / 2;
  const int64_t r = h.size(1);
  if (first_position_ + r > model_->max_context()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reference tokens at ", first_position_, "..", first_position_ + r - 1,
        " run past the model's context ", model_->max_context()));
  }
  try {
    c10::InferenceMode guard;
    torch::Tensor x = h.to(model_->device(), model_->dtype());
    if (sublayer % 2 == 1) return model_->Mlp(layer, x);
    static const LayerKv kEmpty;
    const LayerKv& kv = prefix_len_ > 0 ? (*prefix_)[layer] : kEmpty;
    // Score tensors: [B, heads, r, prefix+r] float32, about one live copy
    // (counted twice for the temporaries of the reductions).
    const int64_t per_branch =
        2 * 4 * model_->config().num_attention_heads * r * (prefix_len_ + r);
    const int64_t b = x.size(0);
    const int64_t limit = options_.max_attention_bytes > 0
                              ? options_.max_attention_bytes
                          : model_->device().is_cuda() ? int64_t{1} << 30
                                                       : int64_t{16} << 20;
    const int64_t chunk = std::max<int64_t>(1, limit / per_branch);
    const std::vector<int64_t>& limits = options_.row_prefix_limits;
    if (!limits.empty() && static_cast<int64_t>(limits.size()) != r) {
      return absl::InvalidArgumentError(
          absl::StrCat("runner input has ", r, " tokens, the runner ",
                       limits.size(), " row prefix limits"));
    }
    if (chunk >= b)
      return model_->BranchAttention(layer, x, first_position_, kv, prefix_len_,
                                     limits);
    std::vector<torch::Tensor> parts;
    for (int64_t begin = 0; begin < b; begin += chunk) {
      parts.push_back(model_->BranchAttention(
          layer, x.narrow(0, begin, std::min(chunk, b - begin)),
          first_position_, kv, prefix_len_, limits));
    }
    return torch::cat(parts, 0);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(
        "sublayer ", sublayer, ": torch error: ", e.what_without_backtrace()));
  }
}

absl::StatusOr<SublayerRunner::Top> ModelSublayerRunner::Head(
    const torch::Tensor& h, bool with_probability) const {
  if (h.dim() != 3 || h.size(2) != model_->config().hidden_size) {
    return absl::InvalidArgumentError("runner input must be [B, r, hidden]");
  }
  try {
    c10::InferenceMode guard;
    torch::Tensor rows =
        h.to(model_->device(), model_->dtype()).reshape({-1, h.size(2)});
    const int64_t n = rows.size(0);
    const int64_t chunk = std::max<int64_t>(
        1, options_.max_logits_bytes / (4 * model_->config().vocab_size));
    std::vector<torch::Tensor> ids;
    std::vector<torch::Tensor> probability;
    for (int64_t begin = 0; begin < n; begin += chunk) {
      torch::Tensor logits =
          model_->Logits(rows.narrow(0, begin, std::min(chunk, n - begin)));
      ids.push_back(logits.argmax(-1));
      if (with_probability) {
        probability.push_back(
            std::get<0>(torch::softmax(logits.to(torch::kFloat32), -1).max(-1))
                .to(torch::kFloat64));
      }
    }
    Top top;
    top.ids = torch::cat(ids, 0).view({h.size(0), h.size(1)});
    if (with_probability) {
      top.probability = torch::cat(probability, 0).view({h.size(0), h.size(1)});
    }
    return top;
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("LM head: torch error: ", e.what_without_backtrace()));
  }
}

absl::StatusOr<torch::Tensor> ModelSublayerRunner::TopTokens(
    const torch::Tensor& h) const {
  ASSIGN_OR_RETURN(Top top, Head(h, /*with_probability=*/false));
  return top.ids;
}

absl::StatusOr<SublayerRunner::Top>
ModelSublayerRunner::TopTokensWithProbability(const torch::Tensor& h) const {
  return Head(h, /*with_probability=*/true);
}

absl::StatusOr<SublayerRunner::Top> SublayerRunner::TopTokensWithProbability(
    const torch::Tensor& h) const {
  ASSIGN_OR_RETURN(torch::Tensor ids, TopTokens(h));
  c10::InferenceMode guard;
  return Top{ids, torch::ones(ids.sizes(), torch::kFloat64)};
}

// ---- The DP ----

absl::StatusOr<std::vector<double>> MeasureAlphaHats(
    const SublayerRunner& runner, const torch::Tensor& final_states,
    absl::Span<const int32_t> target_argmax) {
  if (!final_states.defined() || final_states.dim() != 3) {
    return absl::InvalidArgumentError(
        "final states must be a [B, r, hidden] tensor");
  }
  if (static_cast<int64_t>(target_argmax.size()) != final_states.size(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_argmax has ", target_argmax.size(),
                     " ids for r = ", final_states.size(1), " tokens"));
  }
  if (target_argmax.empty())
    return std::vector<double>(final_states.size(0), 0.0);
  c10::InferenceMode guard;
  ASSIGN_OR_RETURN(std::vector<DraftShares> shares,
                   Shares(runner, final_states, target_argmax, 0.0));
  std::vector<double> out;
  out.reserve(shares.size());
  for (const DraftShares& share : shares) out.push_back(share.accept);
  return out;
}

namespace {

void AddLater(const LaterDraftCounts& from, LaterDraftCounts& to) {
  to.accept_trials += from.accept_trials;
  to.accepted += from.accepted;
  to.accept_and_go_on += from.accept_and_go_on;
  to.go_on_trials += from.go_on_trials;
  to.went_on += from.went_on;
}

}  // namespace

absl::StatusOr<std::vector<DraftShares>> PoolSharesByCosine(
    absl::Span<const DraftShares> shares, absl::Span<const double> cosines) {
  if (shares.size() != cosines.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("PoolSharesByCosine: ", shares.size(), " shares but ",
                     cosines.size(), " cosines"));
  }
  std::vector<size_t> order(shares.size());
  std::iota(order.begin(), order.end(), size_t{0});
  // A NaN cosine sorts last (a comparator must order every pair).
  auto key = [&](size_t i) {
    return std::isnan(cosines[i]) ? -std::numeric_limits<double>::infinity()
                                  : cosines[i];
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return key(a) > key(b); });
  // Blocks of consecutive positions in `order`, each with its sums; a block
  // whose mean accept exceeds its predecessor's merges into it.
  struct Block {
    size_t begin = 0, count = 0;
    DraftShares sum;
    double mean() const { return sum.accept / static_cast<double>(count); }
  };
  std::vector<Block> blocks;
  for (size_t k = 0; k < order.size(); ++k) {
    const DraftShares& s = shares[order[k]];
    blocks.push_back({k, 1, s});
    while (blocks.size() >= 2 &&
           blocks[blocks.size() - 2].mean() < blocks.back().mean()) {
      Block& prev = blocks[blocks.size() - 2];
      prev.count += blocks.back().count;
      prev.sum.accept += blocks.back().sum.accept;
      prev.sum.go_on += blocks.back().sum.go_on;
      prev.sum.accept_and_go_on += blocks.back().sum.accept_and_go_on;
      AddLater(blocks.back().sum.later, prev.sum.later);
      blocks.pop_back();
    }
  }
  std::vector<DraftShares> pooled(shares.size());
  for (const Block& b : blocks) {
    const double n = static_cast<double>(b.count);
    const LaterDraftCounts& later = b.sum.later;
    const DraftShares mean{b.sum.accept / n,
                           b.sum.go_on / n,
                           b.sum.accept_and_go_on / n,
                           {later.accept_trials / n, later.accepted / n,
                            later.accept_and_go_on / n, later.go_on_trials / n,
                            later.went_on / n}};
    for (size_t k = b.begin; k < b.begin + b.count; ++k)
      pooled[order[k]] = mean;
  }
  return pooled;
}

absl::StatusOr<std::vector<DraftShares>> MeasureDraftShares(
    const SublayerRunner& runner, const torch::Tensor& final_states,
    absl::Span<const int32_t> target_argmax, double exit_threshold) {
  if (!final_states.defined() || final_states.dim() != 3) {
    return absl::InvalidArgumentError(
        "final states must be a [B, r, hidden] tensor");
  }
  if (target_argmax.empty() ||
      static_cast<int64_t>(target_argmax.size()) != final_states.size(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target_argmax has ", target_argmax.size(),
        " ids for r = ", final_states.size(1), " tokens (r >= 1 needed)"));
  }
  c10::InferenceMode guard;
  return Shares(runner, final_states, target_argmax, exit_threshold);
}

std::vector<double> MeanCosines(const torch::Tensor& h,
                                const torch::Tensor& x) {
  c10::InferenceMode guard;
  // float32 at least; float64 inputs (synthetic tests) keep their precision.
  const torch::ScalarType type =
      h.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  torch::Tensor cos =
      torch::cosine_similarity(h.to(type), x.to(h.device(), type).unsqueeze(0),
                               /*dim=*/-1, /*eps=*/1e-8)
          .mean(-1)
          .to(torch::kFloat64)
          .cpu()
          .contiguous();
  return std::vector<double>(cos.data_ptr<double>(),
                             cos.data_ptr<double>() + cos.numel());
}

absl::StatusOr<std::vector<SkipCandidate>> RunSkipDp(
    const SublayerRunner& runner, const torch::Tensor& reference,
    absl::Span<const int32_t> target_argmax, absl::Span<const SkipUnit> units,
    const SkipDpOptions& options, SkipDpStats* stats,
    torch::Tensor* final_states) {
  RETURN_IF_ERROR(CheckReference(runner, reference, target_argmax));
  const int num_sublayers = runner.num_sublayers();
  if (num_sublayers < 2 || num_sublayers % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "runner has ", num_sublayers, " sublayers; expected 2L with L >= 1"));
  }
  int next = 0;
  for (const SkipUnit& unit : units) {
    if (unit.first_sublayer != next || unit.num_sublayers < 1 ||
        unit.weight < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("DP units must cover the sublayers in order with "
                       "weights >= 1; unit at sublayer ",
                       unit.first_sublayer, " does not"));
    }
    next += unit.num_sublayers;
  }
  if (next != num_sublayers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DP units cover ", next, " sublayers, the runner has ", num_sublayers));
  }
  if (options.max_weight < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_weight must be >= 0, got ", options.max_weight));
  }

  c10::InferenceMode guard;
  const int max_weight = options.max_weight;
  const size_t num_units = units.size();
  // back[u][j]: how cell j after unit u was reached: from_j and whether unit u
  // was skipped; from_j = -1 marks a dead cell.
  struct Back {
    int from = -1;
    bool skipped = false;
    double cosine = 0;
  };
  std::vector<std::vector<Back>> back(num_units,
                                      std::vector<Back>(max_weight + 1));

  // Live cells of the current boundary: their weights (increasing) and their
  // states, row k of `states` belongs to live[k].
  std::vector<int> live = {0};
  torch::Tensor states = reference[0].unsqueeze(0);
  std::vector<double> cosines = MeanCosines(states, reference[0]);
  const double start_cosine = cosines[0];

  for (size_t u = 0; u < num_units; ++u) {
    const SkipUnit& unit = units[u];
    const int boundary = unit.first_sublayer + unit.num_sublayers;
    torch::Tensor executed = states;
    for (int s = unit.first_sublayer; s < boundary; ++s) {
      ASSIGN_OR_RETURN(executed, CheckedApply(runner, s, executed));
      if (stats != nullptr) {
        ++stats->sublayer_calls;
        stats->branch_rows += executed.size(0);
      }
    }
    const torch::Tensor& x = reference[boundary];
    const std::vector<double> exec_cos = MeanCosines(executed, x);
    std::vector<double> skip_cos;
    if (unit.skippable) skip_cos = MeanCosines(states, x);

    // Row index of each live weight (-1 when dead).
    std::vector<int> row_of(max_weight + 1, -1);
    for (size_t k = 0; k < live.size(); ++k)
      row_of[live[k]] = static_cast<int>(k);
    const int64_t b = static_cast<int64_t>(live.size());

    std::vector<int> next_live;
    std::vector<int64_t> gather;  // rows of cat({executed, states})
    std::vector<double> next_cos;
    for (int j = 0; j <= max_weight; ++j) {
      Back best;
      double best_cos = -std::numeric_limits<double>::infinity();
      int64_t best_row = -1;
      if (row_of[j] >= 0) {  // execute unit u from cell j
        best = {j, false, exec_cos[row_of[j]]};
        best_cos = best.cosine;
        best_row = row_of[j];
      }
      const int from = j - unit.weight;
      if (unit.skippable && from >= 0 && row_of[from] >= 0 &&
          skip_cos[row_of[from]] > best_cos) {
        best = {from, true, skip_cos[row_of[from]]};
        best_cos = best.cosine;
        best_row = b + row_of[from];
      }
      if (best_row < 0) continue;
      if (j != 0 && !(best_cos >= options.tau)) continue;  // pruned (NaN too)
      back[u][j] = best;
      next_live.push_back(j);
      gather.push_back(best_row);
      next_cos.push_back(best_cos);
    }
    const bool any_skip = std::any_of(gather.begin(), gather.end(),
                                      [b](int64_t row) { return row >= b; });
    torch::Tensor pool =
        any_skip ? torch::cat({executed, states}, 0) : executed;
    torch::Tensor index =
        torch::tensor(gather, torch::kInt64).to(pool.device());
    states = pool.index_select(0, index);
    live = std::move(next_live);
    cosines = std::move(next_cos);
    if (stats != nullptr) {
      stats->max_live_cells =
          std::max(stats->max_live_cells, static_cast<int>(live.size()));
    }
  }

  std::vector<DraftShares> measured;
  if (!target_argmax.empty()) {
    ASSIGN_OR_RETURN(measured, Shares(runner, states, target_argmax, 0.0));
  }
  if (final_states != nullptr) *final_states = states;
  std::vector<SkipCandidate> candidates;
  candidates.reserve(live.size());
  for (size_t k = 0; k < live.size(); ++k) {
    SkipCandidate c;
    c.mask = LayerMask(num_sublayers / 2);
    c.skipped_weight = live[k];
    c.mean_cosine = cosines[k];
    if (!measured.empty()) {
      c.alpha_hat = measured[k].accept;
      c.later = measured[k].later;
    }
    c.path_cosines.assign(num_units + 1, 0.0);
    c.path_cosines[0] = start_cosine;
    int j = live[k];
    for (size_t u = num_units; u-- > 0;) {
      const Back& step = back[u][j];
      c.path_cosines[u + 1] = step.cosine;
      if (step.skipped) {
        for (int s = 0; s < units[u].num_sublayers; ++s) {
          c.mask.set_skipped(units[u].first_sublayer + s, true);
        }
      }
      j = step.from;
    }
    candidates.push_back(std::move(c));
  }
  return candidates;
}

SublayerWeights ComputeSublayerWeights(double attention_seconds,
                                       double mlp_seconds, int cap,
                                       double tolerance) {
  cap = std::max(1, cap);
  tolerance = std::max(0.0, tolerance);
  SublayerWeights w;
  if (!(attention_seconds > 0) || !(mlp_seconds > 0) ||
      !std::isfinite(attention_seconds) || !std::isfinite(mlp_seconds)) {
    return w;
  }
  const bool attention_dearer = attention_seconds > mlp_seconds;
  const double ratio = attention_dearer
                           ? attention_seconds / mlp_seconds
                           : mlp_seconds / attention_seconds;  // >= 1
  // p / q for the smallest q within tolerance; else the least error under the
  // cap.
  int best_p = 1, best_q = 1;
  double best_error = std::numeric_limits<double>::infinity();
  for (int q = 1; q <= cap; ++q) {
    const double exact = ratio * q;
    const int p = static_cast<int>(
        std::clamp(std::round(exact), 1.0, static_cast<double>(cap)));
    // Relative to the smaller of the two ratios: the same error whichever
    // kind's ratio (attention:MLP or MLP:attention) one looks at.
    const double weight_ratio = static_cast<double>(p) / q;
    const double error =
        std::abs(weight_ratio - ratio) / std::min(weight_ratio, ratio);
    if (error < best_error) {
      best_error = error;
      best_p = p;
      best_q = q;
    }
    if (error <= tolerance) break;
    if (exact > cap + 0.5)
      break;  // larger q only moves p further above the cap
  }
  if (attention_dearer) {
    w.attention = best_p;
    w.mlp = best_q;
  } else {
    w.attention = best_q;
    w.mlp = best_p;
  }
  return w;
}

absl::Status CheckSkippedShare(double share) {
  if (share > 0 && share <= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("max_skipped_share must be in (0, 1], got ", share));
}

absl::StatusOr<std::vector<SkipCandidate>> SolveKnapsack(
    const SublayerRunner& runner, const torch::Tensor& reference,
    absl::Span<const int32_t> target_argmax, SublayerWeights weights,
    const KnapsackOptions& options, SkipDpStats* stats,
    torch::Tensor* final_states) {
  const int num_layers = runner.num_sublayers() / 2;
  if (weights.attention < 1 || weights.mlp < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("sublayer weights must be >= 1, got attention ",
                     weights.attention, ", mlp ", weights.mlp));
  }
  const int kept_layers =
      options.keep_first_and_last ? std::min(num_layers, 2) : 0;
  if (num_layers - kept_layers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("the model has ", num_layers,
                     " layers; with the first and last layer kept there is "
                     "nothing to skip"));
  }
  std::vector<SkipUnit> units;
  units.reserve(2 * num_layers);
  for (int s = 0; s < 2 * num_layers; ++s) {
    const int layer = s / 2;
    SkipUnit unit;
    unit.first_sublayer = s;
    unit.num_sublayers = 1;
    unit.weight = s % 2 == 0 ? weights.attention : weights.mlp;
    unit.skippable = !(options.keep_first_and_last &&
                       (layer == 0 || layer == num_layers - 1));
    units.push_back(unit);
  }
  RETURN_IF_ERROR(CheckSkippedShare(options.max_skipped_share));
  SkipDpOptions dp;
  // floor(share * K); the epsilon keeps share * K = 15.999... at 16.
  dp.max_weight =
      static_cast<int>(std::floor(options.max_skipped_share * num_layers *
                                      (weights.attention + weights.mlp) +
                                  1e-9));
  dp.tau = options.tau;
  return RunSkipDp(runner, reference, target_argmax, units, dp, stats,
                   final_states);
}

absl::StatusOr<SkipCandidate> SolveLayerSkip(
    const SublayerRunner& runner, const torch::Tensor& reference,
    absl::Span<const int32_t> target_argmax, int num_skipped_layers,
    bool keep_first_and_last, SkipDpStats* stats) {
  const int num_layers = runner.num_sublayers() / 2;
  const int skippable =
      keep_first_and_last ? std::max(0, num_layers - 2) : num_layers;
  if (num_skipped_layers < 1 || num_skipped_layers > skippable) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot skip exactly ", num_skipped_layers, " layers: the model has ",
        num_layers, " layers, ", skippable, " of them skippable",
        keep_first_and_last ? " (the first and last are kept)" : "",
        "; choose 1..", skippable));
  }
  std::vector<SkipUnit> units;
  for (int layer = 0; layer < num_layers; ++layer) {
    SkipUnit unit;
    unit.first_sublayer = 2 * layer;
    unit.num_sublayers = 2;
    unit.weight = 1;
    unit.skippable =
        !(keep_first_and_last && (layer == 0 || layer == num_layers - 1));
    units.push_back(unit);
  }
  SkipDpOptions dp;
  dp.max_weight = num_skipped_layers;
  ASSIGN_OR_RETURN(
      std::vector<SkipCandidate> all,
      RunSkipDp(runner, reference, target_argmax, units, dp, stats));
  for (SkipCandidate& c : all) {
    if (c.skipped_weight == num_skipped_layers) return std::move(c);
  }
  // Without pruning every reachable weight survives unless its cosines are
  // NaN (the DP drops NaN cells): states the planner refuses, or K/V that
  // holds NaN or Inf.
  return absl::InvalidArgumentError(absl::StrCat(
      "no draft skips exactly ", num_skipped_layers,
      " layers with a finite hidden-state cosine: the reference states or "
      "the K/V hold NaN or infinite values"));
}

absl::StatusOr<std::vector<SkipCandidate>> EvaluateMasks(
    const SublayerRunner& runner, const torch::Tensor& reference,
    absl::Span<const int32_t> target_argmax, absl::Span<const LayerMask> masks,
    SublayerWeights weights, double exit_threshold) {
  RETURN_IF_ERROR(CheckReference(runner, reference, target_argmax));
  for (const LayerMask& mask : masks) {
    if (mask.num_sublayers() != runner.num_sublayers()) {
      return absl::InvalidArgumentError(
          absl::StrCat("mask '", mask.ToString(), "' has ", mask.num_layers(),
                       " layers, the model has ", runner.num_sublayers() / 2));
    }
  }
  std::vector<SkipCandidate> out(masks.size());
  if (masks.empty()) return out;
  c10::InferenceMode guard;
  const int64_t b = static_cast<int64_t>(masks.size());
  torch::Tensor h = reference[0].unsqueeze(0).expand({b, -1, -1}).contiguous();
  std::vector<double> cos = MeanCosines(h, reference[0]);
  for (int64_t k = 0; k < b; ++k) {
    out[k].mask = masks[k];
    out[k].path_cosines.push_back(cos[k]);
  }
  for (int s = 0; s < runner.num_sublayers(); ++s) {
    std::vector<int64_t> kept;
    for (int64_t k = 0; k < b; ++k) {
      if (masks[k].skipped(s)) {
        out[k].skipped_weight += s % 2 == 0 ? weights.attention : weights.mlp;
      } else {
        kept.push_back(k);
      }
    }
    if (static_cast<int64_t>(kept.size()) == b) {
      ASSIGN_OR_RETURN(h, CheckedApply(runner, s, h));
    } else if (!kept.empty()) {
      torch::Tensor rows = torch::tensor(kept, torch::kInt64).to(h.device());
      ASSIGN_OR_RETURN(torch::Tensor applied,
                       CheckedApply(runner, s, h.index_select(0, rows)));
      h = h.index_copy(0, rows, applied);
    }
    cos = MeanCosines(h, reference[s + 1]);
    for (int64_t k = 0; k < b; ++k) out[k].path_cosines.push_back(cos[k]);
  }
  for (int64_t k = 0; k < b; ++k)
    out[k].mean_cosine = out[k].path_cosines.back();
  if (target_argmax.empty()) return out;
  ASSIGN_OR_RETURN(std::vector<DraftShares> shares,
                   Shares(runner, h, target_argmax, exit_threshold));
  for (int64_t k = 0; k < b; ++k) {
    out[k].alpha_hat = shares[k].accept;
    out[k].later = shares[k].later;
    if (exit_threshold > 0) {
      out[k].go_on_share = shares[k].go_on;
      out[k].accept_and_go_on_share = shares[k].accept_and_go_on;
    }
  }
  return out;
}

absl::StatusOr<SkipCandidate> EvaluateMask(
    const SublayerRunner& runner, const torch::Tensor& reference,
    absl::Span<const int32_t> target_argmax, const LayerMask& mask,
    SublayerWeights weights, double exit_threshold) {
  ASSIGN_OR_RETURN(std::vector<SkipCandidate> one,
                   EvaluateMasks(runner, reference, target_argmax, {&mask, 1},
                                 weights, exit_threshold));
  return std::move(one[0]);
}

}  // namespace knapserve

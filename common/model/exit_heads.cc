#include "common/model/exit_heads.h"

#include <c10/core/InferenceMode.h>
#include <torch/optim/adam.h>

#include <map>
#include <random>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "common/checkpoint/safetensors.h"

namespace knapserve {
namespace {

constexpr char kFormat[] = "knapserve-exit-heads";
constexpr char kVersion[] = "1";

std::string TensorName(int layer, const char* part) {
  return absl::StrCat("exit_heads.", layer, ".", part);
}

}  // namespace

std::shared_ptr<const ExitHeads> ExitHeads::TrainingFree() {
  static const std::shared_ptr<const ExitHeads> kHeads(new ExitHeads());
  return kHeads;
}

std::string DefaultExitHeadsPath(const std::string& model_dir) {
  return model_dir + "/exit_heads.safetensors";
}

torch::Tensor TrainedHeadInput(const torch::Tensor& h,
                               const torch::Tensor& norm,
                               const torch::Tensor& down,
                               const torch::Tensor& up, double eps) {
  // As the model's RMSNorm: normalize in float32, cast back, then scale.
  torch::Tensor hf = h.to(torch::kFloat32);
  hf = hf * torch::rsqrt(hf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  torch::Tensor x = norm * hf.to(h.scalar_type());
  return x + torch::matmul(torch::matmul(x, down.t()), up.t());
}

torch::Tensor ExitHeads::Logits(const LlamaModel& model, int layer,
                                const torch::Tensor& h) const {
  c10::InferenceMode guard;
  TORCH_CHECK(layer >= 0 && layer < model.num_layers(), "exit head of layer ",
              layer, " for a model of ", model.num_layers(), " layers");
  if (!trained()) return model.Logits(h);
  TORCH_CHECK(layer < static_cast<int>(norm_.size()), "exit heads have ",
              norm_.size(), " layers, asked for layer ", layer);
  return model.LmHead(TrainedHeadInput(
      h, norm_[layer], down_[layer], up_[layer], model.config().rms_norm_eps));
}

absl::Status ExitHeads::Save(const std::string& path,
                             const LlamaModel& model) const {
  if (!trained()) {
    return absl::FailedPreconditionError(
        "exit heads: the training-free heads have nothing to save");
  }
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (size_t l = 0; l < norm_.size(); ++l) {
    const int layer = static_cast<int>(l);
    tensors.emplace_back(TensorName(layer, "norm"),
                         norm_[l].to(torch::kCPU, torch::kFloat32));
    tensors.emplace_back(TensorName(layer, "down"),
                         down_[l].to(torch::kCPU, torch::kFloat32));
    tensors.emplace_back(TensorName(layer, "up"),
                         up_[l].to(torch::kCPU, torch::kFloat32));
  }
  const ModelConfig& config = model.config();
  std::map<std::string, std::string> metadata = {
      {"format", kFormat},
      {"version", kVersion},
      {"model_fingerprint", config.Fingerprint()},
      {"num_layers", absl::StrCat(norm_.size())},
      {"hidden_size", absl::StrCat(config.hidden_size)},
      {"rank", absl::StrCat(rank_)},
  };
  return Annotate(WriteSafetensors(path, tensors, metadata),
                  absl::StrCat("exit heads ", path));
}

absl::StatusOr<std::shared_ptr<const ExitHeads>> ExitHeads::Load(
    const std::string& path, const LlamaModel& model) {
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                   SafetensorsFile::Open(path));
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("exit heads ", path, ": ", what));
  };
  const std::map<std::string, std::string>& meta = file->metadata();
  auto field = [&](const std::string& key) -> std::string {
    auto it = meta.find(key);
    return it == meta.end() ? std::string() : it->second;
  };
  if (field("format") != kFormat) {
    return bad(absl::StrCat("metadata format is '", field("format"),
                            "', expected '", kFormat, "'"));
  }
  if (field("version") != kVersion) {
    return bad(absl::StrCat("unsupported version '", field("version"), "'"));
  }
  const ModelConfig& config = model.config();
  if (field("model_fingerprint") != config.Fingerprint()) {
    return bad(absl::StrCat("made for the model with fingerprint '",
                            field("model_fingerprint"), "', this model's is '",
                            config.Fingerprint(), "'"));
  }
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t rank = 0;
  if (!absl::SimpleAtoi(field("num_layers"), &layers) ||
      layers != model.num_layers()) {
    return bad(absl::StrCat("num_layers '", field("num_layers"),
                            "', the model has ", model.num_layers()));
  }
  if (!absl::SimpleAtoi(field("hidden_size"), &hidden) ||
      hidden != config.hidden_size) {
    return bad(absl::StrCat("hidden_size '", field("hidden_size"),
                            "', the model has ", config.hidden_size));
  }
  if (!absl::SimpleAtoi(field("rank"), &rank) || rank < 1 || rank > hidden) {
    return bad(
        absl::StrCat("rank '", field("rank"), "' not in [1, ", hidden, "]"));
  }
  std::shared_ptr<ExitHeads> heads(new ExitHeads());
  heads->rank_ = static_cast<int>(rank);
  auto get = [&](int layer, const char* part,
                 std::vector<int64_t> shape) -> absl::StatusOr<torch::Tensor> {
    const std::string name = TensorName(layer, part);
    const TensorInfo* info = file->Find(name);
    if (info == nullptr) return bad(absl::StrCat("no tensor ", name));
    if (info->shape != shape || info->dtype != "F32") {
      return bad(absl::StrCat("tensor ", name, " is ", info->dtype, " [",
                              absl::StrJoin(info->shape, ", "),
                              "], expected F32 [", absl::StrJoin(shape, ", "),
                              "]"));
    }
    ASSIGN_OR_RETURN(torch::Tensor view, file->View(name));
    // A copy in the model's dtype and device (the view dies with the file).
    return view.to(model.device(), model.dtype(), /*non_blocking=*/false,
                   /*copy=*/true);
  };
  for (int l = 0; l < model.num_layers(); ++l) {
    ASSIGN_OR_RETURN(torch::Tensor norm, get(l, "norm", {hidden}));
    ASSIGN_OR_RETURN(torch::Tensor down, get(l, "down", {rank, hidden}));
    ASSIGN_OR_RETURN(torch::Tensor up, get(l, "up", {hidden, rank}));
    heads->norm_.push_back(std::move(norm));
    heads->down_.push_back(std::move(down));
    heads->up_.push_back(std::move(up));
  }
  return std::shared_ptr<const ExitHeads>(std::move(heads));
}

absl::StatusOr<std::shared_ptr<const ExitHeads>> TrainExitHeads(
    const LlamaModel& model, const std::vector<std::vector<int32_t>>& documents,
    const ExitHeadsTrainOptions& options, std::vector<double>* losses) {
  const ModelConfig& config = model.config();
  const int64_t hidden = config.hidden_size;
  const int layers = model.num_layers();
  if (options.rank < 1 || options.rank > hidden) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank: must be in [1, ", hidden, "], got ", options.rank));
  }
  if (options.steps < 1 || options.batch < 1 || options.seq_len < 2 ||
      !(options.lr > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "steps, batch (>= 1), seq_len (>= 2) and lr (> 0): got ", options.steps,
        ", ", options.batch, ", ", options.seq_len, ", ", options.lr));
  }
  std::vector<const std::vector<int32_t>*> usable;
  for (const std::vector<int32_t>& doc : documents) {
    if (doc.size() >= 2) usable.push_back(&doc);
  }
  if (usable.empty()) {
    return absl::InvalidArgumentError(
        "corpus: no document of at least 2 tokens");
  }
  const int64_t max_len = std::min(options.seq_len, model.max_context());
  std::mt19937_64 rng(options.seed);
  torch::manual_seed(options.seed);

  // Parameters in float32 on the model's device, starting as the
  // training-free head: norm = the final norm, up = 0.
  const auto f32 =
      torch::TensorOptions().dtype(torch::kFloat32).device(model.device());
  const torch::Tensor final_norm =
      model.final_norm_weight().to(f32).clone().detach();
  std::vector<torch::Tensor> norm, down, up;
  std::vector<torch::Tensor> params;
  for (int l = 0; l < layers; ++l) {
    norm.push_back(final_norm.clone().requires_grad_(true));
    down.push_back((torch::randn({options.rank, hidden}, f32) /
                    std::sqrt(static_cast<double>(hidden)))
                       .requires_grad_(true));
    up.push_back(
        torch::zeros({hidden, options.rank}, f32).requires_grad_(true));
    params.push_back(norm.back());
    params.push_back(down.back());
    params.push_back(up.back());
  }
  torch::optim::Adam optimizer(params, torch::optim::AdamOptions(options.lr));
  // The frozen LM head, a plain (non-inference) tensor autograd may save.
  const torch::Tensor lm_head = model.LmHeadWeight().to(f32).clone().detach();
  const double eps = config.rms_norm_eps;

  for (int step = 0; step < options.steps; ++step) {
    // Targets: the full model's hidden states after each layer and its
    // log-probabilities, for a batch of random windows.
    std::vector<torch::Tensor> state_parts;   // [L, T, hidden] each
    std::vector<torch::Tensor> target_parts;  // [T, vocab] each
    {
      c10::InferenceMode inference;
      for (int b = 0; b < options.batch; ++b) {
        const std::vector<int32_t>& doc = *usable[rng() % usable.size()];
        const int64_t n = std::min<int64_t>(max_len, doc.size());
        const int64_t begin = doc.size() > static_cast<size_t>(n)
                                  ? rng() % (doc.size() - n + 1)
                                  : 0;
        std::vector<int64_t> ids(doc.begin() + begin, doc.begin() + begin + n);
        std::vector<LayerKv> kv = model.AllocateKv(n);
        torch::Tensor boundaries;
        ForwardOptions forward;
        forward.num_logits = -1;
        forward.boundary_states = &boundaries;
        torch::Tensor logits =
            model.Forward(torch::tensor(ids, torch::kInt64), 0, kv, forward);
        // After layer l is boundary 2l + 2.
        std::vector<int64_t> after;
        for (int l = 0; l < layers; ++l) after.push_back(2 * l + 2);
        state_parts.push_back(boundaries.index_select(
            0, torch::tensor(after, torch::kInt64).to(model.device())));
        target_parts.push_back(torch::log_softmax(logits, -1));
      }
    }
    // Out of inference mode: copies autograd may use.
    const torch::Tensor states = torch::cat(state_parts, 1).to(f32).clone();
    const torch::Tensor log_p = torch::cat(target_parts, 0).to(f32).clone();
    const torch::Tensor p = log_p.exp();

    optimizer.zero_grad();
    torch::Tensor loss = torch::zeros({}, f32);
    for (int l = 0; l < layers; ++l) {
      torch::Tensor x =
          TrainedHeadInput(states[l], norm[l], down[l], up[l], eps);
      torch::Tensor log_q =
          torch::log_softmax(torch::matmul(x, lm_head.t()), -1);
      loss = loss + (p * (log_p - log_q)).sum(-1).mean();
    }
    loss = loss / layers;
    loss.backward();
    optimizer.step();
    const double value = loss.item<double>();
    if (losses != nullptr) losses->push_back(value);
    if (options.on_step) options.on_step(step, value);
  }

  std::shared_ptr<ExitHeads> heads(new ExitHeads());
  heads->rank_ = options.rank;
  for (int l = 0; l < layers; ++l) {
    heads->norm_.push_back(norm[l].detach().to(model.dtype()).clone());
    heads->down_.push_back(down[l].detach().to(model.dtype()).clone());
    heads->up_.push_back(up[l].detach().to(model.dtype()).clone());
  }
  return std::shared_ptr<const ExitHeads>(std::move(heads));
}

}  // namespace knapserve

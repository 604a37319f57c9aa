// ExitHeads: the exit heads of SpecBound's early-exit drafting
// (executor/engine/specbound.h). After layer l (0-based: the hidden state h
// after layers 0..l), the exit head of layer l turns h into float32 logits z_l;
// the draft exits there when softmax(z_l / T_l) is confident enough.
//
// Two kinds:
//  * training-free (ExitHeads::TrainingFree()): the model's own final RMSNorm
//    and LM head at every layer, z_l = LmHead(RMSNorm(h; final norm)).
//    Nothing to load or train.
//  * trained (TrainExitHeads, Load): per layer a small head in front of the
//    model's shared, frozen LM head:
//        x   = RMSNorm(h) * norm_l                      [hidden]
//        z_l = LmHead(x + up_l (down_l x))              down_l [rank, hidden],
//                                                       up_l   [hidden, rank]
//    Why this shape: it starts as the training-free head (norm_l = the final
//    norm's weight, up_l = 0), so training only moves it from a head that
//    already works; the per-layer norm weight rescales the features the LM
//    head sees, and the rank-r residual adapter can map a shallow layer's
//    residual stream toward the last layer's. It is small and cheap: with
//    r = 32 on stories-24l (hidden 192, vocab 512), 12.5K parameters and
//    12K multiply-adds per check per layer, against the 98K of the shared LM
//    head, so a trained check costs about what a training-free one does.
//    Self-distillation trains it: the target is the full model's own
//    next-token distribution p at the same position (no gradient through
//    the model), the loss KL(p || softmax(z_l)) averaged over positions and
//    layers, optimized with Adam (LibTorch autograd).
//
// The file: safetensors (common/checkpoint/safetensors.h) with float32
// tensors "exit_heads.<l>.norm" [hidden], "exit_heads.<l>.down" [rank,
// hidden] and "exit_heads.<l>.up" [hidden, rank] for every layer l, and
// __metadata__ {"format": "knapserve-exit-heads", "version": "1",
// "model_fingerprint": ModelConfig::Fingerprint(), "num_layers",
// "hidden_size", "rank"}. Its default place is beside the checkpoint:
// DefaultExitHeadsPath(model_dir) = MODEL_DIR/exit_heads.safetensors.
//
// Ownership: an ExitHeads owns its tensors (in the model's dtype and device
// after Load or TrainExitHeads); the model is borrowed per call.
// Thread safety: immutable after construction; Logits from any thread.
#ifndef KNAPSERVE_COMMON_MODEL_EXIT_HEADS_H_
#define KNAPSERVE_COMMON_MODEL_EXIT_HEADS_H_

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model/llama.h"

namespace knapserve {

struct ExitHeadsTrainOptions;

class ExitHeads {
 public:
  // The training-free heads (the model's final norm and LM head), one shared
  // instance.
  static std::shared_ptr<const ExitHeads> TrainingFree();
  // Reads trained heads for `model` from `path`. Errors name the file:
  // NotFound without it; InvalidArgument for a malformed file, another
  // format, a fingerprint, layer count or hidden size that is not the
  // model's, or a missing or misshapen tensor.
  static absl::StatusOr<std::shared_ptr<const ExitHeads>> Load(
      const std::string& path, const LlamaModel& model);

  // Writes trained heads to `path` (float32) with the metadata above
  // (`model` gives the fingerprint). FailedPrecondition for training-free
  // heads (there is nothing to write).
  absl::Status Save(const std::string& path, const LlamaModel& model) const;

  bool trained() const { return !norm_.empty(); }
  // "trained" or "training-free".
  std::string kind_name() const {
    return trained() ? "trained" : "training-free";
  }
  int rank() const { return rank_; }

  // The exit head of layer `layer` (0 <= layer < L) over hidden states h
  // ([rows, hidden] in the model dtype): float32 logits [rows, vocab]. Each
  // row's logits depend only on that row.
  torch::Tensor Logits(const LlamaModel& model, int layer,
                       const torch::Tensor& h) const;

 private:
  friend absl::StatusOr<std::shared_ptr<const ExitHeads>> TrainExitHeads(
      const LlamaModel&, const std::vector<std::vector<int32_t>>&,
      const ExitHeadsTrainOptions&, std::vector<double>*);
  ExitHeads() = default;

  int rank_ = 0;
  std::vector<torch::Tensor> norm_;  // per layer [hidden]
  std::vector<torch::Tensor> down_;  // per layer [rank, hidden]
  std::vector<torch::Tensor> up_;    // per layer [hidden, rank]
};

// MODEL_DIR/exit_heads.safetensors.
std::string DefaultExitHeadsPath(const std::string& model_dir);

// The trained head's part before the LM head, x + up (down x) with
// x = RMSNorm(h) * norm, in plain LibTorch ops (differentiable; training and
// inference share it). h: [..., hidden]; returns h's shape and dtype.
torch::Tensor TrainedHeadInput(const torch::Tensor& h,
                               const torch::Tensor& norm,
                               const torch::Tensor& down,
                               const torch::Tensor& up, double eps);

struct ExitHeadsTrainOptions {
  int rank = 32;         // adapter rank, >= 1
  int steps = 300;       // optimizer steps, >= 1
  double lr = 3e-3;      // Adam's learning rate, > 0
  int64_t seq_len = 64;  // tokens per training window, >= 2
  int batch = 4;         // windows per step, >= 1
  uint64_t seed = 0;     // window sampling and adapter initialization
  // Called after each step with its 0-based index and loss (may be empty).
  std::function<void(int step, double loss)> on_step;
};

// Trains exit heads for `model` (which must be float32 on the CPU, or any
// dtype: the targets and the heads are computed in float32) by
// self-distillation on windows of `documents` (token ids, each a separate
// text; windows of options.seq_len drawn at random, shorter documents
// whole). `losses` (optional) receives every step's loss. InvalidArgument
// for bad options or no document of at least 2 tokens. The returned heads
// are in the model's dtype and device, ready for Logits and Save.
absl::StatusOr<std::shared_ptr<const ExitHeads>> TrainExitHeads(
    const LlamaModel& model, const std::vector<std::vector<int32_t>>& documents,
    const ExitHeadsTrainOptions& options, std::vector<double>* losses);

}  // namespace knapserve

#endif  // KNAPSERVE_COMMON_MODEL_EXIT_HEADS_H_

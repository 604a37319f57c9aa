// Random-weight checkpoints with the real layouts of small Llama-family
// models, for tests, benchmarks and demos without downloading weights.
//
//   MakeModelOptions options;
//   options.shape = "tiny-llama";
//   options.out_dir = "/tmp/tiny";
//   RETURN_IF_ERROR(MakeModel(options));
//   // /tmp/tiny now holds config.json, generation_config.json,
//   // model.safetensors, tokenizer.json and knapserve_make_model.json.
//
// Weights are deterministic in (shape, dtype, seed): each tensor is drawn from
// its own generator seeded from the seed and the tensor's name. Matrices,
// embeddings and biases are normal(0, 0.02); RMSNorm weights are
// 1 + normal(0, 0.02).
//
// Without options.tokenizer_json a synthetic byte-level BPE tokenizer.json is
// written: the 256 GPT-2 byte tokens (ids 0..255), kSyntheticMerges merges of
// common English pairs (the next ids), then the special tokens <|bos|> and
// <|eos|> (ids kSyntheticBosId, kSyntheticEosId). The tiny-* shapes use those
// ids as bos/eos, so their config and tokenizer agree. The real-model shapes
// keep their real bos/eos ids, which the synthetic tokenizer does not know:
// pass the model's real tokenizer.json when token semantics matter.
//
// Functions are thread-safe; MakeModel writes only inside options.out_dir.
#ifndef KNAPSERVE_TOOLS_MAKE_MODEL_H_
#define KNAPSERVE_TOOLS_MAKE_MODEL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/checkpoint/model_config.h"

namespace knapserve {

// The synthetic tokenizer's layout (see above).
inline constexpr int kSyntheticMerges = 30;
inline constexpr int32_t kSyntheticBosId = 256 + kSyntheticMerges;
inline constexpr int32_t kSyntheticEosId = kSyntheticBosId + 1;
inline constexpr int32_t kSyntheticVocabSize = kSyntheticEosId + 1;

struct MakeModelOptions {
  std::string shape;    // One of KnownModelShapes().
  std::string out_dir;  // Created if missing; existing files are replaced.
  std::string dtype = "bf16";  // fp32 | bf16 | fp16.
  uint64_t seed = 0;
  // Optional path of a tokenizer.json to copy instead of the synthetic one.
  std::string tokenizer_json;
};

// The shape names, in a fixed order: smollm2-135m, llama-3.2-1b, qwen3-0.6b,
// qwen2.5-0.5b, tiny-llama, tiny-qwen2, tiny-qwen3, tiny-llama3.
std::vector<std::string> KnownModelShapes();

// The config of `shape` (torch_dtype left empty). InvalidArgument listing the
// known shapes if `shape` is unknown.
absl::StatusOr<ModelConfig> ModelShapeConfig(const std::string& shape);

// Writes the checkpoint folder. InvalidArgument for an unknown shape or dtype,
// NotFound if tokenizer_json is given and missing, Internal/other for I/O
// errors. model.safetensors is streamed tensor by tensor, so peak memory is
// about one tensor (in fp32) rather than the whole model.
absl::Status MakeModel(const MakeModelOptions& options);

}  // namespace knapserve

#endif  // KNAPSERVE_TOOLS_MAKE_MODEL_H_

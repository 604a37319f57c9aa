// GenerateMany: many seeded generations of one request, run side by side
// through the engine's own step code (RunBatchStep, executor/engine/
// sequence.h) instead of one Generate() after another. The statistical
// tests (sampling losslessness, with and without logits processors) draw
// thousands of short generations; on the small test models a step's fixed
// costs (dispatch, sampling set-up) dominate, and a batch of 32 shares them.
//
// What a sequence produces does not depend on its neighbours: the target's
// logits and K/V are bit-identical in any batch (LlamaModel::ForwardBatch's
// batch invariance), each sequence samples from its own seeded generator,
// and no cost model drops drafts here, so every sequence drafts as it would
// alone. Results come back in seed order.
//
// Header-only; call from the test thread. `planner` and `shared` as for
// Generate().
#ifndef KNAPSERVE_TESTS_TESTING_GENERATE_MANY_H_
#define KNAPSERVE_TESTS_TESTING_GENERATE_MANY_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model/llama.h"
#include "common/text/tokenizer.h"
#include "executor/engine/generator.h"
#include "executor/engine/sequence.h"

namespace knapserve {
namespace testing {

// `n` generations of `request` with sampling seeds first_seed,
// first_seed + 1, ..., `batch` sequences at a time.
inline std::vector<absl::StatusOr<GenerationResult>> GenerateMany(
    const LlamaModel& model, const Tokenizer& tokenizer,
    GenerationRequest request, uint64_t first_seed, int n,
    PlannerClient* planner = nullptr, const PlanningShared* shared = nullptr,
    int batch = 32) {
  std::vector<absl::StatusOr<GenerationResult>> results;
  results.reserve(n);
  for (int start = 0; start < n; start += batch) {
    const int count = std::min(batch, n - start);
    // One contiguous K/V cache per sequence, never moved once bound; the
    // sequences (declared after) are destroyed first.
    std::vector<std::vector<LayerKv>> kv(count);
    std::vector<std::unique_ptr<Sequence>> sequences(count);
    std::vector<absl::Status> refused(count);
    for (int i = 0; i < count; ++i) {
      request.sampling.seed = first_seed + static_cast<uint64_t>(start + i);
      absl::StatusOr<std::unique_ptr<Sequence>> created = Sequence::Create(
          model, tokenizer, request, nullptr, nullptr, planner, shared);
      if (!created.ok()) {
        refused[i] = created.status();
        continue;
      }
      sequences[i] = std::move(*created);
      kv[i] = model.AllocateKv(sequences[i]->max_positions());
      sequences[i]->UseKv(&kv[i]);
    }
    BatchStepOptions options;
    options.max_batch_tokens =
        std::max<int64_t>(options.max_batch_tokens, request.prefill_chunk);
    for (;;) {
      std::vector<Sequence*> live;
      for (const std::unique_ptr<Sequence>& sequence : sequences) {
        if (sequence != nullptr && !sequence->done()) {
          live.push_back(sequence.get());
        }
      }
      if (live.empty()) break;
      RunBatchStep(model, live, options);
    }
    for (int i = 0; i < count; ++i) {
      if (sequences[i] == nullptr) {
        results.push_back(refused[i]);
      } else {
        results.push_back(sequences[i]->TakeResult());
      }
    }
  }
  return results;
}

}  // namespace testing
}  // namespace knapserve

#endif  // KNAPSERVE_TESTS_TESTING_GENERATE_MANY_H_

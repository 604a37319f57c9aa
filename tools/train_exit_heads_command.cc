// `knapserve train-exit-heads`: trains SpecBound's per-layer exit heads
// (common/model/exit_heads.h) by self-distillation on a text corpus and
// writes them as safetensors with the model's fingerprint.
//
//   knapserve train-exit-heads --model DIR --corpus FILE --out FILE
//       [--steps 300 --lr 3e-3 --seq-len 64 --batch 4 --rank 32 --seed 0]
//
// The corpus is plain text, documents separated by blank lines (as
// ../shared/corpus/stories_train_sample.txt); each is tokenized with BOS.
// Default --corpus: <shared>/corpus/stories_train_sample.txt
// (tools/shared_data.h); default --out: beside the checkpoint,
// MODEL_DIR/exit_heads.safetensors. Prints the loss every 10 steps to
// stderr and a JSON summary (first and last loss, seconds, the file) to
// stdout.
#include <chrono>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/base/status.h"
#include "common/model/exit_heads.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"
#include "tools/shared_data.h"

ABSL_FLAG(std::string, corpus, "",
          "train-exit-heads: the training text, documents separated by blank "
          "lines (default <shared>/corpus/stories_train_sample.txt).");
ABSL_FLAG(int32_t, steps, knapserve::ExitHeadsTrainOptions().steps,
          "train-exit-heads: optimizer steps.");
ABSL_FLAG(double, lr, knapserve::ExitHeadsTrainOptions().lr,
          "train-exit-heads: Adam's learning rate.");
ABSL_FLAG(int64_t, seq_len, knapserve::ExitHeadsTrainOptions().seq_len,
          "train-exit-heads: tokens per training window.");
ABSL_FLAG(int32_t, batch, knapserve::ExitHeadsTrainOptions().batch,
          "train-exit-heads: windows per step.");
ABSL_FLAG(int32_t, rank, knapserve::ExitHeadsTrainOptions().rank,
          "train-exit-heads: the rank of each layer's adapter.");

namespace knapserve {
namespace {

// Blank-line separated documents of `path`, tokenized with BOS.
absl::StatusOr<std::vector<std::vector<int32_t>>> ReadCorpus(
    const std::string& path, const Tokenizer& tokenizer) {
  std::ifstream in(path);
  if (!in)
    return absl::NotFoundError(absl::StrCat("corpus: cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  std::vector<std::vector<int32_t>> documents;
  std::string current;
  auto flush = [&]() -> absl::Status {
    const absl::string_view doc = absl::StripAsciiWhitespace(current);
    if (!doc.empty()) {
      ASSIGN_OR_RETURN(
          std::vector<int32_t> ids,
          tokenizer.Encode(std::string_view(doc.data(), doc.size()),
                           /*add_special_tokens=*/true));
      documents.push_back(std::move(ids));
    }
    current.clear();
    return absl::OkStatus();
  };
  for (absl::string_view line : absl::StrSplit(text.str(), '\n')) {
    if (absl::StripAsciiWhitespace(line).empty()) {
      RETURN_IF_ERROR(flush());
    } else {
      absl::StrAppend(&current, line, "\n");
    }
  }
  RETURN_IF_ERROR(flush());
  if (documents.empty())
    return absl::InvalidArgumentError(
        absl::StrCat("corpus: ", path, " is empty"));
  return documents;
}

absl::Status TrainExitHeadsCommand() {
  ASSIGN_OR_RETURN(Engine engine, LoadEngineFromFlags());
  std::string corpus = absl::GetFlag(FLAGS_corpus);
  if (corpus.empty()) corpus = SharedPath("corpus/stories_train_sample.txt");
  std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) out = DefaultExitHeadsPath(engine.model_dir);
  ASSIGN_OR_RETURN(std::vector<std::vector<int32_t>> documents,
                   ReadCorpus(corpus, *engine.tokenizer));
  ExitHeadsTrainOptions options;
  options.steps = absl::GetFlag(FLAGS_steps);
  options.lr = absl::GetFlag(FLAGS_lr);
  options.seq_len = absl::GetFlag(FLAGS_seq_len);
  options.batch = absl::GetFlag(FLAGS_batch);
  options.rank = absl::GetFlag(FLAGS_rank);
  options.seed = absl::GetFlag(FLAGS_seed).value_or(0);
  const auto start = std::chrono::steady_clock::now();
  options.on_step = [&](int step, double loss) {
    if (step % 10 == 0 || step + 1 == options.steps) {
      const double seconds = std::chrono::duration<double>(
                                 std::chrono::steady_clock::now() - start)
                                 .count();
      std::cerr << "knapserve train-exit-heads: step " << step << " loss "
                << loss << " (" << seconds << " s)" << std::endl;
    }
  };
  std::cerr << "knapserve train-exit-heads: " << documents.size()
            << " documents from " << corpus << ", " << options.steps
            << " steps of " << options.batch << " x " << options.seq_len
            << " tokens, rank " << options.rank << std::endl;
  std::vector<double> losses;
  ASSIGN_OR_RETURN(std::shared_ptr<const ExitHeads> heads,
                   TrainExitHeads(*engine.model, documents, options, &losses));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  RETURN_IF_ERROR(heads->Save(out, *engine.model));
  // The mean of the first and last tenth, less noisy than single steps.
  const size_t tenth = std::max<size_t>(1, losses.size() / 10);
  double first = 0;
  double last = 0;
  for (size_t i = 0; i < tenth; ++i) {
    first += losses[i] / tenth;
    last += losses[losses.size() - 1 - i] / tenth;
  }
  nlohmann::json summary = {
      {"model", engine.model_dir},
      {"model_fingerprint", engine.model->config().Fingerprint()},
      {"corpus", corpus},
      {"documents", documents.size()},
      {"out", out},
      {"steps", options.steps},
      {"lr", options.lr},
      {"seq_len", options.seq_len},
      {"batch", options.batch},
      {"rank", options.rank},
      {"first_loss", losses.front()},
      {"last_loss", losses.back()},
      {"first_tenth_mean_loss", first},
      {"last_tenth_mean_loss", last},
      {"seconds", seconds}};
  std::cout << summary.dump(2) << std::endl;
  return absl::OkStatus();
}

}  // namespace

int RunTrainExitHeads() {
  return ExitCode(TrainExitHeadsCommand(), "train-exit-heads");
}

}  // namespace knapserve

#include "executor/engine/batch_engine.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/base/status.h"
#include "common/model/exception_status.h"

namespace knapserve {
namespace {

// Step time as a + b * rows, fitted by least squares over recent
// decode-only steps (exponentially weighted, so it follows the context
// growing). With one batch size seen so far it is proportional to rows.
class StepTimeFit {
 public:
  void Add(double rows, double seconds) {
    constexpr double kDecay = 0.95;
    w_ = kDecay * w_ + 1;
    sx_ = kDecay * sx_ + rows;
    sy_ = kDecay * sy_ + seconds;
    sxx_ = kDecay * sxx_ + rows * rows;
    sxy_ = kDecay * sxy_ + rows * seconds;
  }
  bool known() const { return w_ > 0; }
  double At(double rows) const {
    if (w_ == 0) return 0;
    const double mx = sx_ / w_, my = sy_ / w_;
    const double var = sxx_ / w_ - mx * mx;
    if (var < 1e-6 * std::max(1.0, mx * mx)) {
      return mx > 0 ? my / mx * rows : my;
    }
    const double b = std::max(0.0, (sxy_ / w_ - mx * my) / var);
    const double a = my - b * mx;
    return std::max(0.0, a + b * rows);
  }

 private:
  double w_ = 0, sx_ = 0, sy_ = 0, sxx_ = 0, sxy_ = 0;
};

}  // namespace

struct BatchEngine::Entry {
  // Choice 0: the only one unless the request asked for n > 1. It
  // prefills the prompt for every choice.
  std::unique_ptr<Sequence> seq;
  std::optional<SequenceKv> kv;  // set at admission, reset when it ends
  // Choices 1..n-1: reserved at admission (without the prompt's full
  // blocks), started from choice 0's prefill.
  struct Choice {
    std::unique_ptr<Sequence> seq;
    std::optional<SequenceKv> kv;
    bool started = false;
  };
  std::vector<Choice> more;
  std::function<bool()> should_stop;
  absl::Notification done;

  int sequences() const { return 1 + static_cast<int>(more.size()); }
  // The sequences that take part in steps now (started, not done).
  std::vector<Sequence*> Live() const {
    std::vector<Sequence*> live;
    if (!seq->done()) live.push_back(seq.get());
    for (const Choice& choice : more) {
      if (choice.started && !choice.seq->done())
        live.push_back(choice.seq.get());
    }
    return live;
  }
  bool AllDone() const {
    if (!seq->done()) return false;
    for (const Choice& choice : more) {
      if (!choice.seq->done()) return false;
    }
    return true;
  }
  void Abort() {
    seq->Abort();
    for (Choice& choice : more) choice.seq->Abort();
  }
  bool AnyFailed() const {
    if (seq->failed()) return true;
    for (const Choice& choice : more) {
      if (choice.seq->failed()) return true;
    }
    return false;
  }
  // Blocks of the whole group: choice 0's, and each other choice's
  // without the prompt's full blocks.
  int64_t Blocks(const KvPool& pool) const {
    const int64_t own = pool.BlocksFor(seq->max_positions());
    const int64_t shared = seq->prompt_tokens() / pool.block_rows();
    return own + static_cast<int64_t>(more.size()) * (own - shared);
  }
};

BatchEngine::BatchEngine(const LlamaModel& model, const Tokenizer& tokenizer,
                         KvPool& pool, PlannerClient* planner,
                         PlanningShared planning, BatchEngineOptions options)
    : model_(model),
      tokenizer_(tokenizer),
      pool_(pool),
      planner_(planner),
      planning_(planning.cache != nullptr ? std::move(planning)
                                          : PlanningShared::Create()),
      options_(options),
      threads_(at::get_num_threads()),
      thread_([this] { Loop(); }) {}

BatchEngine::~BatchEngine() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

absl::StatusOr<GenerationResult> BatchEngine::Generate(
    const GenerationRequest& request, StreamCallback on_tokens,
    ReferenceCallback on_reference, std::function<bool()> should_stop) {
  Entry entry;
  ASSIGN_OR_RETURN(
      entry.seq,
      Sequence::Create(model_, tokenizer_, request, std::move(on_tokens),
                       std::move(on_reference), planner_, &planning_));
  entry.should_stop = std::move(should_stop);
  RETURN_IF_ERROR(Run(entry));
  return entry.seq->TakeResult();
}

absl::StatusOr<std::vector<GenerationResult>> BatchEngine::GenerateChoices(
    const GenerationRequest& request, int n,
    const std::function<StreamCallback(int)>& on_tokens,
    std::function<bool()> should_stop) {
  if (n < 1 || n > options_.max_running) {
    return absl::InvalidArgumentError(
        absl::StrCat("n: must be in [1, ", options_.max_running,
                     "] (the server's --max-running), got ", n));
  }
  Entry entry;
  for (int i = 0; i < n; ++i) {
    GenerationRequest choice = request;
    if (i > 0) choice.sequence_id = 0;  // each its own planner session
    if (choice.sampling.seed.has_value()) {
      choice.sampling.seed = ChoiceSeed(*choice.sampling.seed, i);
    }
    ASSIGN_OR_RETURN(std::unique_ptr<Sequence> seq,
                     Sequence::Create(model_, tokenizer_, std::move(choice),
                                      on_tokens ? on_tokens(i) : nullptr,
                                      nullptr, planner_, &planning_));
    if (i == 0) {
      entry.seq = std::move(seq);
      if (n > 1) entry.seq->KeepPrefillLogits();
    } else {
      entry.more.push_back({std::move(seq), std::nullopt, false});
    }
  }
  entry.should_stop = std::move(should_stop);
  RETURN_IF_ERROR(Run(entry));
  // The first choice's error that is not the stop it caused in the others.
  std::vector<absl::StatusOr<GenerationResult>> taken;
  taken.push_back(entry.seq->TakeResult());
  for (Entry::Choice& choice : entry.more) {
    taken.push_back(choice.seq->TakeResult());
  }
  std::vector<GenerationResult> results;
  for (absl::StatusOr<GenerationResult>& result : taken) {
    if (!result.ok()) return result.status();
    results.push_back(*std::move(result));
  }
  return results;
}

absl::Status BatchEngine::Run(Entry& entry) {
  const int64_t positions = entry.seq->max_positions();
  const int64_t blocks = entry.Blocks(pool_);
  if (blocks > pool_.total_blocks()) {
    {
      absl::MutexLock lock(&mu_);
      ++stats_.refused_never_fit;
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "prompt: ", entry.seq->prompt_tokens(), " tokens plus up to ",
        positions - entry.seq->prompt_tokens(), " new ones",
        entry.more.empty() ? ""
                           : absl::StrCat(" for each of ", entry.sequences(),
                                          " choices sharing the prompt"),
        " need K/V for ", blocks, " blocks of ", pool_.block_rows(),
        " positions, more than the whole K/V pool (", pool_.total_blocks(),
        " blocks); lower max_new_tokens or raise --kv-cache-memory"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the engine is stopping");
    incoming_.push_back(&entry);
    ++waiting_;
  }
  entry.done.WaitForNotification();
  return absl::OkStatus();
}

bool BatchEngine::HasWork() const { return stopping_ || !incoming_.empty(); }

void BatchEngine::Loop() {
  // The intra-op thread count is per thread for OpenMP: use the creator's.
  at::set_num_threads(threads_);
  std::deque<Entry*> waiting;  // FIFO, not yet admitted
  std::vector<Entry*> running;
  // Pacing: the time of a decode-only step by its rows, and a moving
  // average of the extra time per prompt row (0 = not measured yet).
  StepTimeFit decode_time;
  double prefill_row_seconds = 0;
  auto average = [](double& mean, double sample) {
    constexpr double kWeight = 0.2;
    mean = mean == 0 ? sample : (1 - kWeight) * mean + kWeight * sample;
  };
  // Ends `entry`: its blocks go back to the pool and the gauges count it
  // out before its caller wakes.
  auto end = [&](Entry* entry, bool was_running) {
    for (Entry::Choice& choice : entry->more) choice.kv.reset();
    entry->kv.reset();
    {
      absl::MutexLock lock(&mu_);
      if (was_running) {
        running_ -= entry->sequences();
      } else {
        --waiting_;
      }
    }
    entry->done.Notify();
  };
  // Starts the choices of `entry` whose prompt choice 0 has just put in
  // the K/V: each takes the prompt's blocks over and its first token from
  // choice 0's last prompt row. A choice 0 that ended before its prompt was
  // in leaves the others nothing to start from.
  auto start_choices = [&](Entry* entry) {
    for (Entry::Choice& choice : entry->more) {
      if (choice.started || choice.seq->done()) continue;
      if (!entry->seq->prefilled()) {
        if (entry->seq->done()) {
          choice.seq->Fail(absl::AbortedError(
              "the request's shared prompt was never prefilled"));
        }
        continue;
      }
      choice.started = true;
      absl::Status status;
      try {
        status =
            choice.kv->SharePrefix(*entry->kv, entry->seq->prompt_tokens());
        if (status.ok()) {
          choice.seq->UseKv(&*choice.kv);
          status = choice.seq->StartFromPrefill(*entry->seq);
        }
      } catch (...) {
        status = CurrentExceptionAsInternal("starting a choice");
      }
      if (!status.ok()) choice.seq->Fail(status);
    }
  };
  for (;;) {
    bool stopping = false;
    {
      absl::MutexLock lock(&mu_);
      if (waiting.empty() && running.empty()) {
        mu_.Await(absl::Condition(this, &BatchEngine::HasWork));
      }
      while (!incoming_.empty()) {
        waiting.push_back(incoming_.front());
        incoming_.pop_front();
      }
      stopping = stopping_;
    }
    // Stops: cancelled, past the deadline, aborted; everything when the
    // engine itself stops.
    auto stop_requested = [&](Entry* entry) {
      if (stopping) return true;
      try {
        return entry->should_stop && entry->should_stop();
      } catch (...) {
        return true;
      }
    };
    for (auto it = waiting.begin(); it != waiting.end();) {
      if (stop_requested(*it)) {
        (*it)->Abort();
        end(*it, /*was_running=*/false);
        it = waiting.erase(it);
      } else {
        ++it;
      }
    }
    for (Entry* entry : running) {
      if (stop_requested(entry)) entry->Abort();
    }
    // Admission, first come first served: K/V blocks (a request's choices
    // all at once) and max_running sequences.
    int running_sequences = 0;
    for (Entry* entry : running) running_sequences += entry->sequences();
    while (!waiting.empty()) {
      Entry* entry = waiting.front();
      if (running_sequences + entry->sequences() > options_.max_running) break;
      std::optional<SequenceKv> kv =
          pool_.TryReserve(entry->seq->max_positions());
      if (!kv.has_value()) break;
      std::vector<std::optional<SequenceKv>> more_kv;
      for (const Entry::Choice& choice : entry->more) {
        more_kv.push_back(pool_.TryReserve(choice.seq->max_positions(),
                                           entry->seq->prompt_tokens()));
        if (!more_kv.back().has_value()) break;
      }
      // All or nothing: what was reserved goes back with the vectors.
      if (!more_kv.empty() && !more_kv.back().has_value()) break;
      entry->kv = std::move(kv);
      entry->seq->UseKv(&*entry->kv);
      for (size_t i = 0; i < more_kv.size(); ++i) {
        entry->more[i].kv = std::move(more_kv[i]);
      }
      running.push_back(entry);
      waiting.pop_front();
      running_sequences += entry->sequences();
      absl::MutexLock lock(&mu_);
      --waiting_;
      running_ += entry->sequences();
    }
    // One step of everything running.
    std::vector<Sequence*> batch;
    std::vector<BatchMember> members;
    int64_t context_sum = 0;
    bool any_draft = false;
    for (Entry* entry : running) {
      for (Sequence* seq : entry->Live()) {
        batch.push_back(seq);
        if (seq->prefilling()) continue;
        members.push_back(seq->batch_member());
        any_draft = any_draft || members.back().gamma > 0;
        context_sum += seq->context_length();
      }
    }
    const int decoding = static_cast<int>(members.size());
    const bool any_prefill = static_cast<int>(batch.size()) > decoding;
    BatchStepStats step;
    bool plain_by_policy = false;
    bool budgeted = false;
    if (!batch.empty()) {
      BatchStepOptions options;
      options.max_batch_tokens = options_.max_batch_tokens;
      options.min_prefill_rows = options_.min_prefill_rows;
      if (any_prefill && decoding > 0 && options_.prefill_step_budget > 0 &&
          decode_time.known() && prefill_row_seconds > 0) {
        // The baseline is a decode step of every sequence in the batch,
        // the prefilling ones included (they decode once loaded), so
        // prompts that arrive together still load in large chunks.
        const double n = static_cast<double>(batch.size());
        const double rows = (options_.prefill_step_budget * decode_time.At(n) -
                             decode_time.At(decoding)) /
                            prefill_row_seconds;
        options.max_prefill_rows = std::max<int64_t>(
            1, static_cast<int64_t>(std::min<double>(rows, 1 << 20)));
        budgeted =
            options.max_prefill_rows < options_.max_batch_tokens - decoding;
      }
      options.allow_drafts = options_.plain_batch_size <= 0 ||
                             decoding <= options_.plain_batch_size;
      if (options.allow_drafts && any_draft && decoding >= 2 &&
          options_.cost_model != nullptr) {
        try {
          options.allow_drafts =
              options_.cost_model->DraftsPay(context_sum / decoding, members);
        } catch (...) {
          options.allow_drafts = true;  // a pricing failure changes nothing
        }
      }
      plain_by_policy = any_draft && !options.allow_drafts;
      try {
        step = RunBatchStep(model_, batch, options);
        // Learn the pacing: decode-only steps, and the extra time per
        // prompt row of steps that carried both.
        const int64_t decode_rows = step.main_rows - step.prefill_rows;
        if (step.decoding > 0 && step.prefill_rows == 0 && decode_rows > 0) {
          decode_time.Add(static_cast<double>(decode_rows), step.seconds);
        } else if (step.prefill_rows > 0) {
          const double base =
              decode_rows > 0 ? decode_time.At(static_cast<double>(decode_rows))
                              : 0.0;
          average(prefill_row_seconds,
                  std::max(0.0, step.seconds - base) /
                      static_cast<double>(step.prefill_rows));
        }
      } catch (...) {
        // RunBatchStep guards each sequence and pass; this is a last resort
        // so that the step thread never dies.
        const absl::Status status =
            CurrentExceptionAsInternal("batched step failed");
        for (Sequence* seq : batch) seq->Fail(status);
      }
    }
    for (Entry* entry : running) {
      start_choices(entry);
      // One choice failed: the request fails, so the others stop now
      // instead of decoding for nothing.
      if (!entry->more.empty() && entry->AnyFailed()) entry->Abort();
    }
    // Ended requests leave the batch and give their blocks back.
    for (auto it = running.begin(); it != running.end();) {
      if ((*it)->AllDone()) {
        end(*it, /*was_running=*/true);
        it = running.erase(it);
      } else {
        ++it;
      }
    }
    {
      absl::MutexLock lock(&mu_);
      if (!batch.empty()) {
        ++stats_.steps;
        stats_.rows += step.main_rows;
        stats_.decode_rows += step.decoding;
        stats_.prefill_chunks += step.prefilling;
        stats_.last_batch_size = static_cast<int>(batch.size());
        if (plain_by_policy) ++stats_.plain_steps;
        if (budgeted && step.prefill_rows > 0) ++stats_.budgeted_prefill_steps;
      }
      if (stopping_ && waiting.empty() && running.empty() &&
          incoming_.empty()) {
        return;
      }
    }
  }
}

int BatchEngine::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

int BatchEngine::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiting_;
}

BatchEngineStats BatchEngine::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace knapserve

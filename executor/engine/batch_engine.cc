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
  std::unique_ptr<Sequence> seq;
  std::function<bool()> should_stop;
  std::optional<SequenceKv> kv;  // set at admission, reset when it ends
  absl::Notification done;
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
  const int64_t positions = entry.seq->max_positions();
  if (!pool_.CanEverFit(positions)) {
    {
      absl::MutexLock lock(&mu_);
      ++stats_.refused_never_fit;
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "prompt: ", entry.seq->prompt_tokens(), " tokens plus up to ",
        positions - entry.seq->prompt_tokens(), " new ones need K/V for ",
        positions, " positions (", pool_.BlocksFor(positions),
        " blocks), more than the whole K/V pool (", pool_.total_blocks(),
        " blocks of ", pool_.block_rows(),
        " positions); lower max_new_tokens or raise --kv-cache-memory"));
  }
  entry.should_stop = std::move(should_stop);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the engine is stopping");
    incoming_.push_back(&entry);
    ++waiting_;
  }
  entry.done.WaitForNotification();
  return entry.seq->TakeResult();
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
    entry->kv.reset();
    {
      absl::MutexLock lock(&mu_);
      if (was_running) {
        --running_;
      } else {
        --waiting_;
      }
    }
    entry->done.Notify();
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
        (*it)->seq->Abort();
        end(*it, /*was_running=*/false);
        it = waiting.erase(it);
      } else {
        ++it;
      }
    }
    for (Entry* entry : running) {
      if (stop_requested(entry)) entry->seq->Abort();
    }
    // Admission, first come first served: K/V blocks and max_running.
    while (!waiting.empty() &&
           static_cast<int>(running.size()) < options_.max_running) {
      Entry* entry = waiting.front();
      std::optional<SequenceKv> kv =
          pool_.TryReserve(entry->seq->max_positions());
      if (!kv.has_value()) break;
      entry->kv = std::move(kv);
      entry->seq->UseKv(&*entry->kv);
      running.push_back(entry);
      waiting.pop_front();
      absl::MutexLock lock(&mu_);
      --waiting_;
      ++running_;
    }
    // One step of everything running.
    std::vector<Sequence*> batch;
    std::vector<BatchMember> members;
    int64_t context_sum = 0;
    bool any_draft = false;
    for (Entry* entry : running) {
      if (entry->seq->done()) continue;
      batch.push_back(entry->seq.get());
      if (entry->seq->prefilling()) continue;
      members.push_back(entry->seq->batch_member());
      any_draft = any_draft || members.back().gamma > 0;
      context_sum += entry->seq->context_length();
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
    // Ended sequences leave the batch and give their blocks back.
    for (auto it = running.begin(); it != running.end();) {
      if ((*it)->seq->done()) {
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

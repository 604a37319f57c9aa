// --threads auto: how many CPU threads decode and prefill passes use, chosen
// by measuring them, not by counting cores.
//
// Why: on small models and shared VMs more threads are often slower (a decode
// step of a 24-layer model of width 192 is about 100 fork/joins of a few
// microseconds of work each), and the best count differs between decode (few
// rows, bound by reading the weights) and prefill (many rows, bound by
// arithmetic). The first run on a (model, device, dtype, SIMD target, cores)
// times a decode step and a prefill chunk at 1..max_threads threads and keeps
// the fastest of each (fewer threads unless more are at least 3% faster, so
// noise does not pick extra cores), stores the choice in the profile cache
// folder beside the latency profiles (planner/profile_cache.h) as
//   <fingerprint>_<device>_<dtype>_<simd>_c<cores>_threads.json
// and later runs read it. ApplyThreadChoice sets at::set_num_threads to the
// larger count and SetPassThreads (common/model/parallel_for.h) to each
// phase's count.
//
// Thread safety: ChooseThreads runs passes on the model and changes the
// calling thread's at::get_num_threads and the process-wide pass threads:
// call it at startup, before the model serves. The caller owns the result.
#ifndef KNAPSERVE_PLANNER_THREAD_CHOICE_H_
#define KNAPSERVE_PLANNER_THREAD_CHOICE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace knapserve {

class LlamaModel;

struct ThreadChoice {
  int decode_threads = 1;
  int prefill_threads = 1;
  // Median milliseconds of one decode step and of one prefill chunk at
  // 1, 2, ... threads (index t - 1).
  std::vector<double> decode_ms;
  std::vector<double> prefill_ms;
  int prefill_rows = 0;  // tokens in the timed prefill chunk
  // "measured" or "cache"; path: the cache entry read or written ("" when
  // none could be written).
  std::string origin;
  std::string path;
  std::vector<std::string> warnings;

  // One line for the log: what was chosen and why.
  std::string Describe() const;
};

// Reads the choice for `model` from `cache_dir` (ProfileCacheDir; "" = no
// cache) or measures it at 1..max_threads threads and stores it. A corrupt
// entry or an unwritable folder is a warning, never a failure. Errors: a
// pass that fails (INTERNAL), max_threads < 1 (INVALID_ARGUMENT).
absl::StatusOr<ThreadChoice> ChooseThreads(const LlamaModel& model,
                                           const std::string& cache_dir,
                                           int max_threads);

// at::set_num_threads(max of the two) on the calling thread and
// SetPassThreads(decode, prefill).
void ApplyThreadChoice(const ThreadChoice& choice);

}  // namespace knapserve

#endif  // KNAPSERVE_PLANNER_THREAD_CHOICE_H_

// Benchmark prompt sets: Spec-Bench style JSONL files, one object per line
// with "category" and "turns" (the first turn is the prompt).
//
// LoadPromptSet picks prompts round-robin over the categories in file order,
// so a small --num-prompts still covers every task type, and the choice is
// the same on every run.
#ifndef KNAPSERVE_TOOLS_PROMPT_SET_H_
#define KNAPSERVE_TOOLS_PROMPT_SET_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace knapserve {

struct BenchPrompt {
  int64_t question_id = 0;
  std::string category;
  std::string text;
};

// Errors name the file and line: unreadable file, malformed JSON, a row
// without turns. count <= 0 returns every prompt.
absl::StatusOr<std::vector<BenchPrompt>> LoadPromptSet(const std::string& path,
                                                       int count);

}  // namespace knapserve

#endif  // KNAPSERVE_TOOLS_PROMPT_SET_H_

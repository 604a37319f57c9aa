#include "tools/prompt_set.h"

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace knapserve {

absl::StatusOr<std::vector<BenchPrompt>> LoadPromptSet(const std::string& path,
                                                       int count) {
  std::ifstream in(path);
  if (!in)
    return absl::NotFoundError(absl::StrCat(path, ": cannot open prompt set"));
  std::vector<std::string> category_order;
  std::map<std::string, std::vector<BenchPrompt>> by_category;
  std::string line;
  int line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json row =
        nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (row.is_discarded() || !row.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", line_number, ": not a JSON object"));
    }
    auto turns = row.find("turns");
    if (turns == row.end() || !turns->is_array() || turns->empty() ||
        !(*turns)[0].is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", line_number,
                       ": needs a non-empty \"turns\" array of strings"));
    }
    BenchPrompt prompt;
    prompt.text = (*turns)[0].get<std::string>();
    prompt.category = row.value("category", std::string("uncategorized"));
    prompt.question_id =
        row.value("question_id", static_cast<int64_t>(line_number));
    if (!by_category.count(prompt.category))
      category_order.push_back(prompt.category);
    by_category[prompt.category].push_back(std::move(prompt));
  }
  std::vector<BenchPrompt> picked;
  for (size_t round = 0;; ++round) {
    bool any = false;
    for (const std::string& category : category_order) {
      const std::vector<BenchPrompt>& rows = by_category[category];
      if (round >= rows.size()) continue;
      any = true;
      picked.push_back(rows[round]);
      if (count > 0 && static_cast<int>(picked.size()) == count) return picked;
    }
    if (!any) break;
  }
  if (picked.empty())
    return absl::InvalidArgumentError(absl::StrCat(path, ": no prompts"));
  return picked;
}

}  // namespace knapserve

// `knapserve tokenize`: prints the ids of --text as a JSON array.
#include <iostream>
#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "common/base/status.h"
#include "tools/cli_flags.h"
#include "tools/commands.h"

namespace knapserve {
namespace {

absl::Status Tokenize() {
  ASSIGN_OR_RETURN(const std::string model_dir, ModelDirFromFlags());
  const std::string path = model_dir + "/tokenizer.json";
  ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer,
                   Tokenizer::FromFile(path));
  ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                   tokenizer->Encode(absl::GetFlag(FLAGS_text),
                                     /*add_special_tokens=*/true));
  std::cout << nlohmann::json(ids).dump() << std::endl;
  return absl::OkStatus();
}

}  // namespace

int RunTokenize() { return ExitCode(Tokenize(), "tokenize"); }

}  // namespace knapserve

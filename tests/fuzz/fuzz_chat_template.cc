// Fuzz target: the chat-template renderer (common/text/chat_template.h), which
// runs the Jinja source of a checkpoint's tokenizer_config.json on messages a
// client sent. The input is the template, then optionally a NUL byte and the
// render context's JSON (without one: a fixed two-turn conversation). Parse
// and Render may refuse, always with InvalidArgument and a message; an
// accepted render stays within the output cap.
#include <cstdint>
#include <string>

#include "common/text/chat_template.h"
#include "tests/fuzz/fuzz_support.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace knapserve;
  using namespace knapserve::fuzz;
  const std::string_view input = AsText(data, size);
  const size_t nul = input.find('\0');
  const std::string_view source = input.substr(0, nul);
  nlohmann::json context = {
      {"messages",
       {{{"role", "system"}, {"content", "Be brief."}},
        {{"role", "user"}, {"content", "Once upon a time"}}}},
      {"add_generation_prompt", true},
      {"tools", nullptr},
      {"bos_token", "<s>"},
      {"eos_token", "</s>"}};
  if (nul != std::string_view::npos) {
    nlohmann::json parsed =
        nlohmann::json::parse(input.substr(nul + 1), nullptr, false);
    if (parsed.is_discarded()) return 0;
    context = std::move(parsed);
  }
  auto tmpl = ChatTemplate::Parse(source);
  if (!tmpl.ok()) {
    CheckRefusal(tmpl.status());
    FUZZ_CHECK(tmpl.status().code() == absl::StatusCode::kInvalidArgument);
    return 0;
  }
  auto rendered = tmpl->Render(context);
  if (!rendered.ok()) {
    CheckRefusal(rendered.status());
    FUZZ_CHECK_MSG(
        rendered.status().code() == absl::StatusCode::kInvalidArgument,
        rendered.status().ToString());
    return 0;
  }
  FUZZ_CHECK(rendered->size() <= ChatTemplate::kMaxOutputBytes);
  return 0;
}

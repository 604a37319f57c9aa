// ChatTemplate (chat_template.h): the chat glue around the template engine
// in common/text/jinja/ (lexer, parser, values, evaluator, filters and
// tests). What is chat-specific lives here: the "chat template: " prefix of
// every error, the render context as JSON (transformers passes its variables
// as Python objects; the server has them as JSON), and reading a checkpoint's
// tokenizer_config.json the way transformers does (a template string or a
// list of named templates, bos / eos tokens as strings or AddedToken
// objects).
#include "common/text/chat_template.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/file_util.h"
#include "common/base/json_fields.h"
#include "common/base/status.h"
#include "common/text/jinja/ast.h"
#include "common/text/jinja/errors.h"
#include "common/text/jinja/evaluator.h"
#include "common/text/jinja/json.h"
#include "common/text/jinja/parser.h"
#include "common/text/jinja/value.h"

namespace knapserve {

// The engine's limits are the ones chat_template.h promises.
static_assert(ChatTemplate::kMaxOutputBytes == jinja::kMaxOutputBytes);
static_assert(ChatTemplate::kMaxLoopIterations == jinja::kMaxLoopIterations);
static_assert(ChatTemplate::kMaxStringBytes == jinja::kMaxStringBytes);

struct ChatTemplate::Tree {
  std::vector<jinja::Node> body;
};

namespace {

// The engine's errors (all InvalidArgument) as the API gives them:
// InvalidArgument "chat template: <message>".
absl::Status ChatTemplateError(const absl::Status& status) {
  return absl::InvalidArgumentError(
      absl::StrCat("chat template: ", status.message()));
}

template <typename Json>
absl::StatusOr<std::string> RenderJson(const ChatTemplate::Tree& tree,
                                       const Json& context) {
  if (!context.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat template: the context must be a JSON object, not ",
                     context.type_name()));
  }
  absl::StatusOr<jinja::Value> root = jinja::FromJson(context);
  if (!root.ok()) return ChatTemplateError(root.status());
  absl::StatusOr<std::string> out = jinja::Render(tree.body, *root->dict);
  if (!out.ok()) return ChatTemplateError(out.status());
  return out;
}

// The token text of "bos_token" / "eos_token": a string or an AddedToken
// object {"content": ...}; "" when absent or null.
absl::StatusOr<std::string> TokenText(const JsonReader& root,
                                      std::string_view key) {
  const JsonReader field = root.Field(key);
  if (field.is_null()) return std::string();
  if (field.value().is_string()) return field.AsString();
  if (field.value().is_object()) return field.RequiredString("content");
  return field.TypeError("a string or an AddedToken object {\"content\": ...}");
}

}  // namespace

absl::StatusOr<ChatTemplate> ChatTemplate::Parse(std::string_view source) {
  absl::StatusOr<std::vector<jinja::Node>> body = jinja::ParseTemplate(source);
  if (!body.ok()) return ChatTemplateError(body.status());
  auto tree = std::make_shared<Tree>();
  tree->body = *std::move(body);
  return ChatTemplate(std::move(tree));
}

absl::StatusOr<std::string> ChatTemplate::Render(
    const nlohmann::json& context) const {
  return RenderJson(*tree_, context);
}

absl::StatusOr<std::string> ChatTemplate::Render(
    const nlohmann::ordered_json& context) const {
  return RenderJson(*tree_, context);
}

absl::StatusOr<ChatTemplateConfig> LoadChatTemplateConfig(
    const std::string& model_dir) {
  const std::string path = model_dir + "/tokenizer_config.json";
  ChatTemplateConfig config;
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (absl::IsNotFound(text.status())) return config;
  if (!text.ok()) return text.status();
  ASSIGN_OR_RETURN(nlohmann::json json, ParseJsonText(*text, path));
  const JsonReader root(json, path);
  RETURN_IF_ERROR(root.ExpectObject());
  const JsonReader field = root.Field("chat_template");
  if (field.value().is_string()) {
    ASSIGN_OR_RETURN(config.source, field.AsString());
  } else if (field.value().is_array()) {
    ASSIGN_OR_RETURN(std::vector<JsonReader> templates, field.AsArray());
    for (const JsonReader& named : templates) {
      RETURN_IF_ERROR(named.ExpectObject());
      ASSIGN_OR_RETURN(std::string name, named.RequiredString("name"));
      ASSIGN_OR_RETURN(std::string source, named.RequiredString("template"));
      if (name == "default") {
        config.source = std::move(source);
        break;
      }
    }
  } else if (!field.is_null()) {
    return field.TypeError(
        "a string or a list of {\"name\", \"template\"} objects");
  }
  ASSIGN_OR_RETURN(config.bos_token, TokenText(root, "bos_token"));
  ASSIGN_OR_RETURN(config.eos_token, TokenText(root, "eos_token"));
  return config;
}

}  // namespace knapserve

// JsonReader: every getter, wrong types, missing and null fields, nested
// paths, and the exact error message format.
#include "common/base/json_fields.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tests/testing/test_util.h"

namespace knapserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

using testing::Message;

// A document with one field of every kind.
nlohmann::json Document() {
  return nlohmann::json::parse(R"({
    "int": 7, "negative": -3, "float_int": 512.0, "big": 9000000000, "huge": 1e30,
    "fraction": 12.5, "number": 0.25, "yes": true, "name": "llama", "null": null,
    "one_string": "a b", "strings": ["a", "b"], "one_int": 2, "ints": [1, 2, 3],
    "doubles": [1, 2.5], "mixed": [1, "x"], "empty": [],
    "model": {"type": "BPE", "merges": ["a b", ["c", "d"], 3],
              "vocab": {"a": 0, "<s>": "one"}}
  })");
}

class JsonReaderTest : public ::testing::Test {
 protected:
  nlohmann::json json_ = Document();
  JsonReader root_{json_, "config.json"};
};

TEST_F(JsonReaderTest, Integers) {
  EXPECT_EQ(*root_.RequiredInt("int"), 7);
  EXPECT_EQ(*root_.RequiredInt("negative"), -3);
  EXPECT_EQ(*root_.RequiredInt("float_int"),
            512);  // Integral floats are integers.
  EXPECT_EQ(*root_.RequiredInt64("big"), 9000000000);
  EXPECT_EQ(*root_.OptionalInt("absent", 4), 4);
  EXPECT_EQ(*root_.OptionalInt("null", 4), 4);
  EXPECT_EQ(*root_.OptionalInt64("int", 4), 7);
  EXPECT_EQ(*root_.OptionalInt64("absent", -1), -1);

  EXPECT_EQ(
      Message(root_.RequiredInt("name").status()),
      "config.json: field \"name\": expected an integer, got string \"llama\"");
  EXPECT_EQ(
      Message(root_.RequiredInt64("fraction").status()),
      "config.json: field \"fraction\": expected an integer, got number 12.5");
  EXPECT_EQ(
      Message(root_.OptionalInt("yes", 0).status()),
      "config.json: field \"yes\": expected an integer, got boolean true");
  EXPECT_EQ(Message(root_.RequiredInt("big").status()),
            "config.json: field \"big\": integer 9000000000 is out of the "
            "32-bit range");
  EXPECT_EQ(
      Message(root_.RequiredInt64("huge").status()),
      "config.json: field \"huge\": integer 1e+30 is out of the 64-bit range");
  EXPECT_EQ(root_.RequiredInt("name").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(JsonReaderTest, DoublesAndBools) {
  EXPECT_DOUBLE_EQ(*root_.RequiredDouble("number"), 0.25);
  EXPECT_DOUBLE_EQ(*root_.RequiredDouble("int"), 7);
  EXPECT_DOUBLE_EQ(*root_.OptionalDouble("absent", 1.5), 1.5);
  EXPECT_EQ(
      Message(root_.RequiredDouble("name").status()),
      "config.json: field \"name\": expected a number, got string \"llama\"");

  EXPECT_TRUE(*root_.RequiredBool("yes"));
  EXPECT_FALSE(*root_.OptionalBool("absent", false));
  EXPECT_TRUE(*root_.OptionalBool("null", true));
  EXPECT_EQ(Message(root_.RequiredBool("int").status()),
            "config.json: field \"int\": expected true or false, got number 7");
}

TEST_F(JsonReaderTest, Strings) {
  EXPECT_EQ(*root_.RequiredString("name"), "llama");
  EXPECT_EQ(*root_.OptionalString("absent", "x"), "x");
  EXPECT_EQ(Message(root_.RequiredString("ints").status()),
            "config.json: field \"ints\": expected a string, got array");
  EXPECT_EQ(Message(root_.RequiredString("model").status()),
            "config.json: field \"model\": expected a string, got object");
  // Long values are cut in messages.
  nlohmann::json long_value = {{"s", 1}, {"t", std::string(100, 'x')}};
  JsonReader reader(long_value, "f.json");
  EXPECT_EQ(
      Message(reader.RequiredInt("t").status()),
      absl::StrCat("f.json: field \"t\": expected an integer, got string \"",
                   std::string(39, 'x'), "..."));
}

TEST_F(JsonReaderTest, StringOrListAndIntOrList) {
  EXPECT_THAT(*root_.RequiredStringOrList("one_string"), ElementsAre("a b"));
  EXPECT_THAT(*root_.RequiredStringOrList("strings"), ElementsAre("a", "b"));
  EXPECT_TRUE(root_.OptionalStringOrList("absent")->empty());
  EXPECT_EQ(Message(root_.RequiredStringOrList("int").status()),
            "config.json: field \"int\": expected a string or a list of "
            "strings, got number 7");
  EXPECT_EQ(Message(root_.RequiredStringOrList("mixed").status()),
            "config.json: field \"mixed[0]\": expected a string, got number 1");

  EXPECT_THAT(*root_.RequiredInt64OrList("one_int"), ElementsAre(2));
  EXPECT_THAT(*root_.RequiredInt64OrList("ints"), ElementsAre(1, 2, 3));
  EXPECT_TRUE(root_.OptionalInt64OrList("null")->empty());
  EXPECT_EQ(Message(root_.RequiredInt64OrList("name").status()),
            "config.json: field \"name\": expected an integer or a list of "
            "integers, got "
            "string \"llama\"");
  EXPECT_EQ(
      Message(root_.RequiredInt64OrList("mixed").status()),
      "config.json: field \"mixed[1]\": expected an integer, got string \"x\"");
}

TEST_F(JsonReaderTest, Arrays) {
  EXPECT_THAT(*root_.RequiredInt64Array("ints"), ElementsAre(1, 2, 3));
  EXPECT_THAT(*root_.RequiredDoubleArray("doubles"), ElementsAre(1.0, 2.5));
  EXPECT_THAT(*root_.RequiredStringArray("strings"), ElementsAre("a", "b"));
  EXPECT_TRUE(root_.RequiredInt64Array("empty")->empty());
  EXPECT_TRUE(root_.OptionalInt64Array("absent")->empty());
  EXPECT_TRUE(root_.OptionalDoubleArray("absent")->empty());
  EXPECT_TRUE(root_.OptionalStringArray("absent")->empty());
  EXPECT_EQ(
      Message(root_.RequiredDoubleArray("mixed").status()),
      "config.json: field \"mixed[1]\": expected a number, got string \"x\"");
  EXPECT_EQ(
      Message(root_.RequiredInt64Array("doubles").status()),
      "config.json: field \"doubles[1]\": expected an integer, got number 2.5");
  EXPECT_EQ(Message(root_.RequiredStringArray("name").status()),
            "config.json: field \"name\": expected an array of strings, got "
            "string \"llama\"");

  auto items = root_.RequiredArray("mixed");
  ASSERT_TRUE(items.ok()) << items.status();
  ASSERT_EQ(items->size(), 2u);
  EXPECT_EQ((*items)[1].path(), "mixed[1]");
  EXPECT_EQ(*(*items)[1].AsString(), "x");
  EXPECT_TRUE(root_.OptionalArray("absent")->empty());
  EXPECT_EQ(Message(root_.RequiredArray("int").status()),
            "config.json: field \"int\": expected an array, got number 7");
}

TEST_F(JsonReaderTest, MissingAndNullFields) {
  EXPECT_EQ(Message(root_.RequiredInt("absent").status()),
            "config.json: field \"absent\": required but missing");
  EXPECT_EQ(Message(root_.RequiredString("null").status()),
            "config.json: field \"null\": expected a string, got null");
  EXPECT_TRUE(root_.Has("int"));
  EXPECT_FALSE(root_.Has("null"));
  EXPECT_FALSE(root_.Has("absent"));
  EXPECT_TRUE(root_.Field("absent").is_null());
  EXPECT_EQ(root_.Field("absent").path(), "absent");
  // Every getter of each kind says "required but missing" the same way.
  for (const absl::Status& status :
       {root_.RequiredInt64("absent").status(),
        root_.RequiredDouble("absent").status(),
        root_.RequiredBool("absent").status(),
        root_.RequiredStringOrList("absent").status(),
        root_.RequiredInt64OrList("absent").status(),
        root_.RequiredDoubleArray("absent").status(),
        root_.RequiredStringArray("absent").status(),
        root_.RequiredInt64Array("absent").status(),
        root_.RequiredArray("absent").status(),
        root_.Child("absent").status()}) {
    EXPECT_EQ(Message(status),
              "config.json: field \"absent\": required but missing");
  }
}

TEST_F(JsonReaderTest, NestedPaths) {
  auto model = root_.Child("model");
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->path(), "model");
  EXPECT_EQ(model->file(), "config.json");
  EXPECT_EQ(*model->RequiredString("type"), "BPE");
  EXPECT_EQ(Message(model->RequiredInt("type").status()),
            "config.json: field \"model.type\": expected an integer, got "
            "string \"BPE\"");

  auto merges = model->RequiredArray("merges");
  ASSERT_TRUE(merges.ok());
  EXPECT_THAT(*(*merges)[1].AsStringOrList(), ElementsAre("c", "d"));
  EXPECT_EQ(Message((*merges)[2].AsStringOrList().status()),
            "config.json: field \"model.merges[2]\": expected a string or a "
            "list of strings, "
            "got number 3");
  EXPECT_EQ(model->Field("merges").Element(1).Element(0).path(),
            "model.merges[1][0]");
  EXPECT_TRUE(model->Field("merges").Element(9).is_null());

  // Keys that are not identifiers are quoted.
  auto vocab = model->Child("vocab");
  ASSERT_TRUE(vocab.ok());
  auto members = vocab->AsMembers();
  ASSERT_TRUE(members.ok());
  ASSERT_EQ(members->size(), 2u);
  EXPECT_EQ((*members)[0].first, "<s>");
  EXPECT_EQ(Message((*members)[0].second.AsInt64().status()),
            "config.json: field \"model.vocab['<s>']\": expected an integer, "
            "got string \"one\"");
  EXPECT_EQ(vocab->Field("it's").path(), "model.vocab['it\\'s']");

  // Child and OptionalChild need objects.
  EXPECT_EQ(Message(root_.Child("ints").status()),
            "config.json: field \"ints\": expected an object, got array");
  EXPECT_FALSE(root_.OptionalChild("absent")->has_value());
  EXPECT_FALSE(root_.OptionalChild("null")->has_value());
  EXPECT_TRUE(root_.OptionalChild("model")->has_value());
  EXPECT_EQ(
      Message(root_.OptionalChild("name").status()),
      "config.json: field \"name\": expected an object, got string \"llama\"");
}

TEST_F(JsonReaderTest, FieldsOfANonObject) {
  auto ints = root_.Field("ints");
  EXPECT_EQ(Message(ints.RequiredInt("x").status()),
            "config.json: field \"ints\": expected an object, got array");
  EXPECT_EQ(Message(ints.OptionalInt("x", 1).status()),
            "config.json: field \"ints\": expected an object, got array");
  EXPECT_FALSE(ints.Has("x"));
  EXPECT_TRUE(ints.Field("x").is_null());
  EXPECT_EQ(Message(ints.AsMembers().status()),
            "config.json: field \"ints\": expected an object, got array");
  // At the root there is no field to name.
  nlohmann::json array = nlohmann::json::array({1});
  JsonReader root(array, "some/config.json");
  EXPECT_EQ(Message(root.ExpectObject()),
            "some/config.json: expected an object, got array");
}

TEST_F(JsonReaderTest, ErrorHelpers) {
  EXPECT_EQ(Message(root_.FieldError("vocab_size", "must be positive, got 0")),
            "config.json: field \"vocab_size\": must be positive, got 0");
  EXPECT_EQ(Message(root_.Error("bad")), "config.json: bad");
  EXPECT_EQ(Message(root_.Field("model").Error("bad")),
            "config.json: field \"model\": bad");
  EXPECT_EQ(
      Message(root_.Field("name").TypeError("a token id")),
      "config.json: field \"name\": expected a token id, got string \"llama\"");
  const absl::Status annotated = root_.Field("model").Annotate(
      absl::UnimplementedError("unsupported model type 'X'"));
  EXPECT_EQ(annotated.code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(Message(annotated),
            "config.json: field \"model\": unsupported model type 'X'");
  EXPECT_TRUE(root_.Annotate(absl::OkStatus()).ok());
}

TEST(ParseJsonTextTest, NamesTheFileAndThePosition) {
  auto json = ParseJsonText(R"({"a": [1, 2]})", "x.json");
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ((*json)["a"][1], 2);

  auto bad = ParseJsonText("{\"a\": ", "dir/x.json");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(bad.status()),
              StartsWith("dir/x.json: not valid JSON: "));
  EXPECT_THAT(Message(bad.status()), HasSubstr("line 1"));
  EXPECT_FALSE(ParseJsonText("", "empty.json").ok());
  EXPECT_FALSE(ParseJsonText("\xff\xfe", "binary.json").ok());
}

TEST(JsonReaderInvalidUtf8Test, MessagesNeverThrow) {
  // nlohmann::json::dump throws on invalid UTF-8 by default; messages quoting
  // such a value or key must not.
  nlohmann::json json = {{"s", "\xff\xfe"}};
  json["k\xff"] = 1;
  JsonReader reader(json, "u.json");
  auto value = reader.RequiredInt("s");
  EXPECT_EQ(value.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(value.status()),
              StartsWith("u.json: field \"s\": expected an integer"));
  EXPECT_EQ(*reader.RequiredInt("k\xff"), 1);
  EXPECT_EQ(reader.RequiredString("k\xff").status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace knapserve

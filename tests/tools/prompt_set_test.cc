#include "tools/prompt_set.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "tests/testing/test_models.h"
#include "tests/testing/test_util.h"
#include "tools/shared_data.h"

namespace knapserve {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

using testing::Message;

// Writes `content` to a fresh file and returns its path.
std::string WriteFile(const std::string& name, const std::string& content) {
  const std::string path =
      knapserve::testing::MakeTempDir("prompt_set") + "/" + name;
  std::ofstream(path) << content;
  return path;
}

std::string Row(const std::string& category, int id, const std::string& text) {
  return "{\"question_id\": " + std::to_string(id) + ", \"category\": \"" +
         category + "\", \"turns\": [\"" + text + "\", \"a second turn\"]}\n";
}

std::vector<int64_t> QuestionIds(const std::vector<BenchPrompt>& prompts) {
  std::vector<int64_t> ids;
  for (const BenchPrompt& p : prompts) ids.push_back(p.question_id);
  return ids;
}

// writing: 1, 2, 5; math: 3; coding: 4, 6 (file order of first appearance:
// writing, math, coding).
std::string ThreeCategories() {
  return Row("writing", 1, "w1") + Row("writing", 2, "w2") +
         Row("math", 3, "m1") + Row("coding", 4, "c1") + "\n   \n" +
         Row("writing", 5, "w3") + Row("coding", 6, "c2");
}

TEST(PromptSetTest, RoundRobinOverCategoriesInFileOrder) {
  const std::string path = WriteFile("q.jsonl", ThreeCategories());
  auto all = LoadPromptSet(path, 0);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_THAT(QuestionIds(*all), ElementsAre(1, 3, 4, 2, 6, 5));
  EXPECT_EQ((*all)[0].category, "writing");
  EXPECT_EQ((*all)[0].text, "w1");  // the first turn only
  EXPECT_EQ((*all)[1].category, "math");
  EXPECT_EQ((*all)[2].text, "c1");
}

TEST(PromptSetTest, CountTakesThatManyCoveringEveryCategoryFirst) {
  const std::string path = WriteFile("q.jsonl", ThreeCategories());
  auto three = LoadPromptSet(path, 3);
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_THAT(QuestionIds(*three), ElementsAre(1, 3, 4));
  auto four = LoadPromptSet(path, 4);
  ASSERT_TRUE(four.ok()) << four.status();
  EXPECT_THAT(QuestionIds(*four), ElementsAre(1, 3, 4, 2));
  auto one = LoadPromptSet(path, 1);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_THAT(QuestionIds(*one), ElementsAre(1));
  // More than the file has: every prompt, once.
  auto many = LoadPromptSet(path, 100);
  ASSERT_TRUE(many.ok()) << many.status();
  EXPECT_EQ(many->size(), 6u);
  // Same file, same choice.
  auto again = LoadPromptSet(path, 4);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(QuestionIds(*again), QuestionIds(*four));
}

TEST(PromptSetTest, DefaultsForMissingCategoryAndQuestionId) {
  const std::string path =
      WriteFile("q.jsonl", "{\"turns\": [\"only text\"]}\n");
  auto prompts = LoadPromptSet(path, 0);
  ASSERT_TRUE(prompts.ok()) << prompts.status();
  ASSERT_EQ(prompts->size(), 1u);
  EXPECT_EQ((*prompts)[0].category, "uncategorized");
  EXPECT_EQ((*prompts)[0].question_id, 1);  // the line number
  EXPECT_EQ((*prompts)[0].text, "only text");
}

TEST(PromptSetTest, MalformedJsonNamesFileAndLine) {
  const std::string path =
      WriteFile("bad.jsonl", Row("writing", 1, "w1") + "\n" + "{not json\n" +
                                 Row("math", 2, "m"));
  auto prompts = LoadPromptSet(path, 0);
  ASSERT_FALSE(prompts.ok());
  EXPECT_EQ(prompts.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(prompts.status()),
              AllOf(HasSubstr(path + ":3"), HasSubstr("JSON")));
}

TEST(PromptSetTest, NonObjectRowNamesFileAndLine) {
  const std::string path = WriteFile("array.jsonl", "[1, 2]\n");
  auto prompts = LoadPromptSet(path, 0);
  ASSERT_FALSE(prompts.ok());
  EXPECT_THAT(Message(prompts.status()), HasSubstr(path + ":1"));
}

TEST(PromptSetTest, RowWithoutTurnsNamesFileAndLine) {
  for (const std::string& bad :
       {std::string("{\"category\": \"x\"}"), std::string("{\"turns\": []}"),
        std::string("{\"turns\": [3]}"),
        std::string("{\"turns\": \"text\"}")}) {
    SCOPED_TRACE(bad);
    const std::string path =
        WriteFile("turns.jsonl", Row("writing", 1, "w1") + bad + "\n");
    auto prompts = LoadPromptSet(path, 0);
    ASSERT_FALSE(prompts.ok());
    EXPECT_EQ(prompts.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(Message(prompts.status()),
                AllOf(HasSubstr(path + ":2"), HasSubstr("turns")));
  }
}

TEST(PromptSetTest, MissingAndEmptyFiles) {
  auto missing = LoadPromptSet("/nonexistent/questions.jsonl", 0);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Message(missing.status()),
              HasSubstr("/nonexistent/questions.jsonl"));

  const std::string empty = WriteFile("empty.jsonl", "\n\n");
  auto none = LoadPromptSet(empty, 0);
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(Message(none.status()),
              AllOf(HasSubstr(empty), HasSubstr("no prompts")));
}

TEST(PromptSetTest, SharedSpecBenchFileLoads) {
  // The default prompt set of `knapserve bench`: one prompt per category first.
  KNAPSERVE_SKIP_WITHOUT_SHARED("bench/spec_bench/question.jsonl");
  auto prompts =
      LoadPromptSet(SharedPath("bench/spec_bench/question.jsonl"), 13);
  ASSERT_TRUE(prompts.ok()) << prompts.status();
  ASSERT_EQ(prompts->size(), 13u);  // 13 categories
  for (size_t i = 0; i < prompts->size(); ++i) {
    EXPECT_FALSE((*prompts)[i].text.empty());
    for (size_t j = 0; j < i; ++j)
      EXPECT_NE((*prompts)[i].category, (*prompts)[j].category);
  }
}

}  // namespace
}  // namespace knapserve

#include "common/text/tokenizer.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/text/unicode_util.h"
#include "nlohmann/json.hpp"
#include "tests/testing/test_models.h"
#include "tests/testing/test_util.h"
#include "tools/shared_data.h"

namespace knapserve {
namespace {

using nlohmann::json;
using testing::LoadTokenizerOrFail;
using testing::ReadFile;

struct Golden {
  std::string text;
  std::vector<int32_t> ids;
  std::string decoded;
};

// A tokenizer.json and its golden.jsonl.
struct GoldenSet {
  std::string name;
  std::string tokenizer_path;
  std::string golden_path;
};

std::vector<Golden> LoadGoldens(const std::string& path) {
  std::vector<Golden> goldens;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const json j = json::parse(line);
    goldens.push_back({j.at("text").get<std::string>(),
                       j.at("ids").get<std::vector<int32_t>>(),
                       j.at("decoded").get<std::string>()});
  }
  return goldens;
}

// Every golden set present under the shared folder: tokenizers/*/ with
// tokenizer.json + golden.jsonl, and the bundled stories260k tokenizer with
// its golden file from <shared>/models/stories260k.
std::vector<GoldenSet> FindGoldenSets() {
  namespace fs = std::filesystem;
  std::vector<GoldenSet> sets;
  std::error_code ec;
  const fs::path tokenizers = fs::path(SharedDir()) / "tokenizers";
  if (fs::is_directory(tokenizers, ec)) {
    std::vector<fs::path> dirs;
    for (const auto& entry : fs::directory_iterator(tokenizers, ec)) {
      if (entry.is_directory()) dirs.push_back(entry.path());
    }
    std::sort(dirs.begin(), dirs.end());
    for (const fs::path& dir : dirs) {
      if (fs::exists(dir / "tokenizer.json") &&
          fs::exists(dir / "golden.jsonl")) {
        sets.push_back({dir.filename().string(),
                        (dir / "tokenizer.json").string(),
                        (dir / "golden.jsonl").string()});
      }
    }
  }
  const std::string stories = testing::Stories260kDir() + "/tokenizer.json";
  const std::string golden =
      SharedPath("models/stories260k/golden_tokenizer.jsonl");
  if (fs::exists(stories) && fs::exists(golden))
    sets.push_back({"stories260k", stories, golden});
  return sets;
}

std::string Printable(const std::string& s) { return json(s).dump(); }

// Streams `ids` through an IncrementalDecoder; checks every piece is valid
// UTF-8 and returns the concatenation (including Flush).
std::string Stream(const Tokenizer& tokenizer, const std::vector<int32_t>& ids,
                   bool skip, std::vector<int32_t> prompt = {}) {
  IncrementalDecoder decoder(tokenizer, skip, std::move(prompt));
  std::string text;
  for (int32_t id : ids) {
    auto piece = decoder.Push(id);
    EXPECT_TRUE(piece.ok()) << piece.status();
    if (!piece.ok()) return text;
    EXPECT_TRUE(IsValidUtf8(*piece)) << Printable(*piece);
    text += *piece;
  }
  const std::string tail = decoder.Flush();
  EXPECT_TRUE(IsValidUtf8(tail));
  return text + tail;
}

// --- Goldens -----------------------------------------------------------------

TEST(TokenizerGoldenTest, EncodeAndDecodeReproduceEveryGoldenLine) {
  const std::vector<GoldenSet> sets = FindGoldenSets();
  if (sets.empty())
    GTEST_SKIP() << testing::NeedsSharedMessage("tokenizers/*/golden.jsonl");
  for (const GoldenSet& set : sets) {
    SCOPED_TRACE(set.golden_path);
    std::unique_ptr<Tokenizer> tokenizer =
        LoadTokenizerOrFail(set.tokenizer_path);
    ASSERT_NE(tokenizer, nullptr);
    const std::vector<Golden> goldens = LoadGoldens(set.golden_path);
    ASSERT_FALSE(goldens.empty());
    int encode_pass = 0, decode_pass = 0;
    for (const Golden& golden : goldens) {
      auto ids = tokenizer->Encode(golden.text, /*add_special_tokens=*/false);
      ASSERT_TRUE(ids.ok()) << ids.status();
      EXPECT_EQ(*ids, golden.ids) << "text " << Printable(golden.text);
      encode_pass += *ids == golden.ids;
      auto decoded =
          tokenizer->Decode(golden.ids, /*skip_special_tokens=*/false);
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      EXPECT_EQ(*decoded, golden.decoded)
          << "ids of " << Printable(golden.text);
      decode_pass += *decoded == golden.decoded;
    }
    std::cout << "[ golden   ] " << set.name << ": encode " << encode_pass
              << "/" << goldens.size() << ", decode " << decode_pass << "/"
              << goldens.size() << "\n";
  }
}

TEST(TokenizerGoldenTest, IncrementalDecodeConcatenationEqualsDecode) {
  const std::vector<GoldenSet> sets = FindGoldenSets();
  if (sets.empty())
    GTEST_SKIP() << testing::NeedsSharedMessage("tokenizers/*/golden.jsonl");
  for (const GoldenSet& set : sets) {
    SCOPED_TRACE(set.golden_path);
    std::unique_ptr<Tokenizer> tokenizer =
        LoadTokenizerOrFail(set.tokenizer_path);
    ASSERT_NE(tokenizer, nullptr);
    for (const Golden& golden : LoadGoldens(set.golden_path)) {
      for (bool skip : {false, true}) {
        auto full = tokenizer->Decode(golden.ids, skip);
        ASSERT_TRUE(full.ok());
        EXPECT_EQ(Stream(*tokenizer, golden.ids, skip), *full)
            << "text " << Printable(golden.text) << " skip " << skip;
      }
    }
  }
}

// With a prompt, the generated part streams as the continuation of the
// prompt's text (where the prompt does not end inside a character).
TEST(TokenizerGoldenTest, IncrementalDecodeAfterPromptContinuesPromptText) {
  const std::vector<GoldenSet> sets = FindGoldenSets();
  if (sets.empty())
    GTEST_SKIP() << testing::NeedsSharedMessage("tokenizers/*/golden.jsonl");
  for (const GoldenSet& set : sets) {
    SCOPED_TRACE(set.golden_path);
    std::unique_ptr<Tokenizer> tokenizer =
        LoadTokenizerOrFail(set.tokenizer_path);
    ASSERT_NE(tokenizer, nullptr);
    for (const Golden& golden : LoadGoldens(set.golden_path)) {
      const auto full = tokenizer->Decode(golden.ids);
      ASSERT_TRUE(full.ok());
      for (size_t k = 1; k < golden.ids.size(); ++k) {
        const std::vector<int32_t> prompt(golden.ids.begin(),
                                          golden.ids.begin() + k);
        const std::vector<int32_t> rest(golden.ids.begin() + k,
                                        golden.ids.end());
        const auto prompt_text = tokenizer->Decode(prompt);
        ASSERT_TRUE(prompt_text.ok());
        if (prompt_text->ends_with(kReplacementChar))
          continue;  // Split inside a character.
        EXPECT_EQ(*prompt_text + Stream(*tokenizer, rest, false, prompt), *full)
            << "text " << Printable(golden.text) << " split at " << k;
      }
    }
  }
}

// --- SentencePiece-style BPE (stories260k)
// ------------------------------------

class Stories260kTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = testing::Stories260kDir() + "/tokenizer.json";
    if (!std::filesystem::exists(path_)) GTEST_SKIP() << path_ << " is absent";
    tokenizer_ = LoadTokenizerOrFail(path_);
    ASSERT_NE(tokenizer_, nullptr);
  }
  std::string path_;
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_F(Stories260kTest, AddSpecialTokensPrependsBos) {
  EXPECT_EQ(tokenizer_->bos_id(), 1);
  EXPECT_EQ(tokenizer_->vocab_size(), 512);
  auto plain = tokenizer_->Encode("Zoo", false);
  auto with_bos = tokenizer_->Encode("Zoo", true);
  ASSERT_TRUE(plain.ok() && with_bos.ok());
  // From SOURCE.md: the prompt "Zoo" is [1, 410, 469, 347].
  EXPECT_EQ(*with_bos, (std::vector<int32_t>{1, 410, 469, 347}));
  EXPECT_EQ(*plain, (std::vector<int32_t>{410, 469, 347}));
  auto empty = tokenizer_->Encode("", true);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, std::vector<int32_t>{1});
}

TEST_F(Stories260kTest, TokenLookupsAndSpecials) {
  EXPECT_EQ(tokenizer_->TokenToId("<s>"), 1);
  EXPECT_EQ(tokenizer_->TokenToId("<0x0A>"), 13);
  EXPECT_EQ(tokenizer_->TokenToId("no such token"), std::nullopt);
  EXPECT_EQ(tokenizer_->IdToToken(2), "</s>");
  EXPECT_EQ(tokenizer_->IdToToken(512), std::nullopt);
  EXPECT_TRUE(tokenizer_->IsSpecial(1));
  EXPECT_FALSE(tokenizer_->IsSpecial(410));
  // Special tokens in the text are matched as their ids; the text around
  // them is normalized separately (each part gets its own "▁").
  auto ids = tokenizer_->Encode("<s>Once</s>", false);
  ASSERT_TRUE(ids.ok());
  auto once = tokenizer_->Encode("Once", false);
  ASSERT_TRUE(once.ok());
  std::vector<int32_t> expected{1};
  expected.insert(expected.end(), once->begin(), once->end());
  expected.push_back(2);
  EXPECT_EQ(*ids, expected);
  auto text = tokenizer_->Decode(*ids, /*skip_special_tokens=*/true);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "Once");
}

TEST_F(Stories260kTest, StreamingAfterPromptKeepsTheSpace) {
  auto prompt = tokenizer_->Encode("Zoo", true);
  auto hello = tokenizer_->Encode("Hello", false);  // "▁H" "ello"...
  ASSERT_TRUE(prompt.ok() && hello.ok());
  IncrementalDecoder decoder(*tokenizer_, /*skip_special_tokens=*/true,
                             *prompt);
  std::string text;
  for (int32_t id : *hello) {
    auto piece = decoder.Push(id);
    ASSERT_TRUE(piece.ok());
    text += *piece;
  }
  text += decoder.Flush();
  EXPECT_EQ(text, " Hello");
  // Without a prompt the leading space is stripped, as Decode does.
  EXPECT_EQ(Stream(*tokenizer_, *hello, true), "Hello");
}

TEST_F(Stories260kTest, StreamingHoldsBackPartialCharacters) {
  // "中" is three byte-fallback tokens after "▁".
  auto ids = tokenizer_->Encode("中", false);
  ASSERT_TRUE(ids.ok());
  ASSERT_EQ(ids->size(), 4u);
  IncrementalDecoder decoder(*tokenizer_);
  std::vector<std::string> pieces;
  for (int32_t id : *ids) {
    auto piece = decoder.Push(id);
    ASSERT_TRUE(piece.ok());
    pieces.push_back(*piece);
  }
  EXPECT_EQ(pieces, (std::vector<std::string>{"", "", "", "中"}));
  EXPECT_EQ(decoder.Flush(), "");
  // A character cut off at the end comes out of Flush as U+FFFD.
  IncrementalDecoder cut(*tokenizer_);
  for (size_t i = 0; i < 3; ++i) {
    auto piece = cut.Push((*ids)[i]);
    ASSERT_TRUE(piece.ok());
    EXPECT_EQ(*piece, "");
  }
  auto decoded = tokenizer_->Decode(absl::MakeConstSpan(*ids).first(3));
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(cut.Flush(), *decoded);
  EXPECT_EQ(*decoded,
            "\xEF\xBF\xBD");  // One U+FFFD for the truncated sequence.
}

TEST_F(Stories260kTest, MetaspacePreTokenizerVariantMatchesGoldens) {
  // The newer Llama-2 / Mistral form: no normalizer, Metaspace pre-tokenizer
  // with prepend_scheme "first". Same vocab and merges, same ids.
  json j = json::parse(ReadFile(path_));
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "Metaspace"},
                        {"replacement", "\xE2\x96\x81"},
                        {"prepend_scheme", "first"},
                        {"split", false}};
  auto metaspace = Tokenizer::FromJson(j.dump(), "metaspace.json");
  ASSERT_TRUE(metaspace.ok()) << metaspace.status();
  KNAPSERVE_SKIP_WITHOUT_SHARED("models/stories260k/golden_tokenizer.jsonl");
  const std::string golden_path =
      SharedPath("models/stories260k/golden_tokenizer.jsonl");
  for (const Golden& golden : LoadGoldens(golden_path)) {
    auto ids = (*metaspace)->Encode(golden.text, false);
    ASSERT_TRUE(ids.ok());
    // Metaspace does not prepend "▁" to text that already starts with a space
    // (which became "▁"); Prepend does.
    std::vector<int32_t> expected = golden.ids;
    if (golden.text.starts_with(' ')) {
      ASSERT_EQ(expected.front(), 410);
      expected.erase(expected.begin());
    }
    EXPECT_EQ(*ids, expected) << Printable(golden.text);
  }
  // "first" prepends only at the start of the input, not after a special token.
  auto after_special = (*metaspace)->Encode("<s>Once", false);
  auto plain = (*metaspace)->Encode("Once", false);
  ASSERT_TRUE(after_special.ok() && plain.ok());
  ASSERT_FALSE(after_special->empty());
  EXPECT_EQ((*after_special)[0], 1);
  EXPECT_NE(
      std::vector<int32_t>(after_special->begin() + 1, after_special->end()),
      *plain);

  // The Metaspace decoder drops the first token's "▁" and keeps the others.
  j["decoder"] = {{"type", "Metaspace"},
                  {"replacement", "\xE2\x96\x81"},
                  {"prepend_scheme", "always"}};
  auto decoder_variant = Tokenizer::FromJson(j.dump(), "metaspace.json");
  ASSERT_TRUE(decoder_variant.ok()) << decoder_variant.status();
  auto ids = (*decoder_variant)->Encode("Once upon a time", false);
  ASSERT_TRUE(ids.ok());
  auto text = (*decoder_variant)->Decode(*ids);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "Once upon a time");
}

// --- SmolLM (byte-level BPE)
// ---------------------------------------------------

class SmolLmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KNAPSERVE_SKIP_WITHOUT_SHARED("tokenizers/smollm/tokenizer.json");
    path_ = SharedPath("tokenizers/smollm/tokenizer.json");
    tokenizer_ = LoadTokenizerOrFail(path_);
    ASSERT_NE(tokenizer_, nullptr);
  }
  std::string path_;
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_F(SmolLmTest, NoBosAndSpecialTokens) {
  EXPECT_EQ(tokenizer_->bos_id(), std::nullopt);
  EXPECT_EQ(tokenizer_->vocab_size(), 49153);  // [PAD] = 49152 was added.
  auto plain = tokenizer_->Encode("Hello world", false);
  auto with_special = tokenizer_->Encode("Hello world", true);
  ASSERT_TRUE(plain.ok() && with_special.ok());
  EXPECT_EQ(*plain, *with_special);
  EXPECT_TRUE(tokenizer_->IsSpecial(0));
  EXPECT_TRUE(tokenizer_->IsSpecial(49152));
  EXPECT_FALSE(tokenizer_->IsSpecial(905));
  EXPECT_EQ(tokenizer_->TokenToId("<|im_start|>"), 1);
  EXPECT_EQ(tokenizer_->IdToToken(905), "\xC4\xA0world");  // "Ġworld".
  auto chat = tokenizer_->Encode("<|im_start|>user\nHi<|im_end|>[PAD]", false);
  ASSERT_TRUE(chat.ok());
  EXPECT_EQ(chat->front(), 1);
  EXPECT_EQ(chat->back(), 49152);
  auto text = tokenizer_->Decode(*chat, /*skip_special_tokens=*/true);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "user\nHi");
}

TEST_F(SmolLmTest, RoundTripsAndStreamsMixedScripts) {
  const std::vector<std::string> texts = {
      "Hello 👋🏽 wörld! 中文 text, 日本語 and 한국어… "
      "🏳️‍🌈 "
      "done.",
      "  leading and trailing  ",
      "\n\n\t tabs\r\nand CRLF\r\n",
      "emoji run: 😀😃😄😁😆😅😂🤣",
  };
  for (const std::string& text : texts) {
    auto ids = tokenizer_->Encode(text, false);
    ASSERT_TRUE(ids.ok());
    auto decoded = tokenizer_->Decode(*ids);
    ASSERT_TRUE(decoded.ok());
    EXPECT_EQ(*decoded, text);
    EXPECT_EQ(Stream(*tokenizer_, *ids, false), text);
  }
}

// --- Random id sequences
// -------------------------------------------------------

TEST(IncrementalDecoderTest, RandomIdsConcatenateToDecode) {
  const std::vector<GoldenSet> sets = FindGoldenSets();
  if (sets.empty())
    GTEST_SKIP() << testing::NeedsSharedMessage("tokenizers/*/golden.jsonl");
  std::mt19937 rng(1234);
  for (const GoldenSet& set : sets) {
    SCOPED_TRACE(set.tokenizer_path);
    std::unique_ptr<Tokenizer> tokenizer =
        LoadTokenizerOrFail(set.tokenizer_path);
    ASSERT_NE(tokenizer, nullptr);
    // Ids of byte tokens (<0xNN>) or of single-byte byte-level pieces, so that
    // characters are split and ill-formed sequences occur.
    std::vector<int32_t> byte_ids;
    for (int32_t id = 0; id < tokenizer->vocab_size(); ++id) {
      auto token = tokenizer->IdToToken(id);
      if (!token.has_value()) continue;
      if ((token->size() == 6 && token->starts_with("<0x")) ||
          (token->size() == 2 && static_cast<uint8_t>((*token)[0]) >= 0xC2)) {
        byte_ids.push_back(id);
      }
    }
    std::uniform_int_distribution<int32_t> any(0, tokenizer->vocab_size() - 1);
    for (int trial = 0; trial < 500; ++trial) {
      std::vector<int32_t> ids(1 + rng() % 24);
      for (int32_t& id : ids) {
        id = (!byte_ids.empty() && rng() % 2 == 0)
                 ? byte_ids[rng() % byte_ids.size()]
                 : any(rng);
      }
      for (bool skip : {false, true}) {
        auto full = tokenizer->Decode(ids, skip);
        ASSERT_TRUE(full.ok());
        ASSERT_TRUE(IsValidUtf8(*full));
        EXPECT_EQ(Stream(*tokenizer, ids, skip), *full)
            << "ids " << json(ids).dump() << " skip " << skip;
        // With a prompt of random ids the pieces are still valid UTF-8.
        std::vector<int32_t> prompt(rng() % 8);
        for (int32_t& id : prompt) {
          id = byte_ids.empty() ? any(rng) : byte_ids[rng() % byte_ids.size()];
        }
        Stream(*tokenizer, ids, skip, prompt);
      }
    }
  }
}

// --- A hand-written byte-level tokenizer
// ---------------------------------------

// GPT-2's bytes_to_unicode character for byte b.
std::string ByteChar(int b) {
  const bool printable =
      (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
  int cp = b;
  if (!printable) {
    int n = 0;
    for (int i = 0; i < b; ++i) {
      if (!((i >= '!' && i <= '~') || (i >= 0xA1 && i <= 0xAC) || i >= 0xAE))
        ++n;
    }
    cp = 256 + n;
  }
  std::string out;
  AppendUtf8(static_cast<char32_t>(cp), &out);
  return out;
}

// ASCII text in byte-level form (only ' ' changes: it becomes "Ġ").
std::string Bl(const std::string& text) {
  std::string out;
  for (char c : text) out += ByteChar(static_cast<uint8_t>(c));
  return out;
}

constexpr char kLlama3Pattern[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

json HandWrittenTokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteChar(b)] = b;
  // Merges, in rank order, as pairs of ASCII strings; written alternately in
  // the ["a", "b"] and the "a b" forms.
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"l", "l"}, {"h", "e"},   {"he", "ll"},   {"hell", "o"}, {" ", "w"},
      {"o", "r"}, {" w", "or"}, {" wor", "ld"}, {"l", "d"},    {"a", "b"},
      {"b", "c"}, {"ab", "c"},  {"'", "s"}};
  json merge_list = json::array();
  int next_id = 256;
  for (const auto& [left, right] : merges) {
    const std::string merged = Bl(left + right);
    if (!vocab.contains(merged)) vocab[merged] = next_id++;
    if (merge_list.size() % 2 == 0) {
      merge_list.push_back(json::array({Bl(left), Bl(right)}));
    } else {
      merge_list.push_back(Bl(left) + " " + Bl(right));
    }
  }
  // Note " wor"+"ld" (rank 7) can only apply after "l"+"d" (rank 8) made "ld".
  json j = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", json::array({{{"id", 300},
                                     {"content", "<|eot|>"},
                                     {"single_word", false},
                                     {"lstrip", false},
                                     {"rstrip", false},
                                     {"normalized", false},
                                     {"special", true}},
                                    {{"id", 301},
                                     {"content", "<mask>"},
                                     {"single_word", false},
                                     {"lstrip", true},
                                     {"rstrip", false},
                                     {"normalized", false},
                                     {"special", true}},
                                    {{"id", 302},
                                     {"content", "foo"},
                                     {"single_word", true},
                                     {"lstrip", false},
                                     {"rstrip", false},
                                     {"normalized", true},
                                     {"special", false}}})},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         json::array({{{"type", "Split"},
                       {"pattern", {{"Regex", kLlama3Pattern}}},
                       {"behavior", "Isolated"},
                       {"invert", false}},
                      {{"type", "ByteLevel"},
                       {"add_prefix_space", false},
                       {"trim_offsets", true},
                       {"use_regex", false}}})}}},
      {"post_processor",
       {{"type", "Sequence"},
        {"processors",
         json::array(
             {{{"type", "ByteLevel"}, {"trim_offsets", false}},
              {{"type", "TemplateProcessing"},
               {"single",
                json::array(
                    {{{"SpecialToken", {{"id", "<|eot|>"}, {"type_id", 0}}}},
                     {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
               {"pair", json::array()},
               {"special_tokens",
                {{"<|eot|>",
                  {{"id", "<|eot|>"},
                   {"ids", {300}},
                   {"tokens", {"<|eot|>"}}}}}}}})}}},
      {"decoder",
       {{"type", "ByteLevel"},
        {"add_prefix_space", true},
        {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merge_list}}},
  };
  return j;
}

class HandWrittenTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto tokenizer =
        Tokenizer::FromJson(HandWrittenTokenizer().dump(), "handwritten.json");
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = std::move(tokenizer).value();
  }
  int32_t Id(const std::string& ascii) {
    auto id = tokenizer_->TokenToId(Bl(ascii));
    EXPECT_TRUE(id.has_value()) << ascii;
    return id.value_or(-1);
  }
  std::vector<int32_t> Encode(const std::string& text) {
    auto ids = tokenizer_->Encode(text, false);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : std::vector<int32_t>{};
  }
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_F(HandWrittenTokenizerTest, AppliesMergesByRank) {
  EXPECT_EQ(Encode("hello world"),
            (std::vector<int32_t>{Id("hello"), Id(" world")}));
  // "abc": "a b" (rank 9) beats "b c" (rank 10), then "ab c".
  EXPECT_EQ(Encode("abc"), std::vector<int32_t>{Id("abc")});
  // "bc" alone uses the lower-priority merge.
  EXPECT_EQ(Encode("bcd"), (std::vector<int32_t>{Id("bc"), 'd'}));
  // Ties go to the leftmost pair: "llll" -> "ll" "ll".
  EXPECT_EQ(Encode("llll"), (std::vector<int32_t>{Id("ll"), Id("ll")}));
  EXPECT_EQ(Encode("lll"), (std::vector<int32_t>{Id("ll"), 'l'}));
  // The Llama-3 regex isolates "'s" (case-insensitively), digits by threes
  // and punctuation runs.
  EXPECT_EQ(Encode("he's"), (std::vector<int32_t>{Id("he"), Id("'s")}));
  EXPECT_EQ(Encode("HE'S"), (std::vector<int32_t>{'H', 'E', '\'', 'S'}));
  EXPECT_EQ(Encode("12345"), (std::vector<int32_t>{'1', '2', '3', '4', '5'}));
  // Bytes that are not printable map to their GPT-2 characters.
  EXPECT_EQ(Encode("\n"), std::vector<int32_t>{'\n'});
  EXPECT_EQ(Encode("é"), (std::vector<int32_t>{0xC3, 0xA9}));
}

TEST_F(HandWrittenTokenizerTest, NormalizesToNfcAndRoundTrips) {
  // "e" + COMBINING ACUTE ACCENT composes to "é" before byte mapping.
  EXPECT_EQ(Encode("e\xCC\x81"), Encode("\xC3\xA9"));
  const std::vector<std::string> texts = {
      "hello world",
      "  two  spaces ",
      "tabs\tand\nnewlines\r\n",
      "naïve café 中文 🙂 👍🏽",
      "numbers 1234567 and punctuation!!! ...",
      "it's HE'LL we'd",
      ""};
  for (const std::string& text : texts) {
    auto ids = tokenizer_->Encode(text, false);
    ASSERT_TRUE(ids.ok());
    auto decoded = tokenizer_->Decode(*ids);
    ASSERT_TRUE(decoded.ok());
    EXPECT_EQ(*decoded, text);
    EXPECT_EQ(Stream(*tokenizer_, *ids, false), text);
  }
}

TEST_F(HandWrittenTokenizerTest, PostProcessorAndAddedTokens) {
  EXPECT_EQ(tokenizer_->bos_id(), 300);
  EXPECT_EQ(tokenizer_->vocab_size(), 303);
  auto ids = tokenizer_->Encode("hello", true);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (std::vector<int32_t>{300, Id("hello")}));
  // Special tokens in the text.
  EXPECT_EQ(Encode("hello<|eot|>hello"),
            (std::vector<int32_t>{Id("hello"), 300, Id("hello")}));
  // lstrip: <mask> takes the spaces before it.
  EXPECT_EQ(Encode("hello  <mask>"), (std::vector<int32_t>{Id("hello"), 301}));
  // single_word: "foo" only as a whole word.
  EXPECT_EQ(Encode("a foo b"), (std::vector<int32_t>{'a', ' ', 302, ' ', 'b'}));
  EXPECT_EQ(Encode("food"), (std::vector<int32_t>{'f', 'o', 'o', 'd'}));
  auto text = tokenizer_->Decode(
      std::vector<int32_t>{300, Id("hello"), 302, 301}, false);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "<|eot|>hellofoo<mask>");
  text = tokenizer_->Decode(std::vector<int32_t>{300, Id("hello"), 302, 301},
                            true);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "hellofoo");
}

TEST_F(HandWrittenTokenizerTest, IsThreadSafe) {
  const std::string text =
      "hello world, it's 2024! naïve café 中文 🙂 <|eot|> hello";
  const std::string expected_text = "<|eot|>" + text;
  auto expected = tokenizer_->Encode(text, true);
  ASSERT_TRUE(expected.ok());
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        auto ids = tokenizer_->Encode(text + std::to_string(i % 7), true);
        if (!ids.ok() || ids->size() < expected->size()) ++mismatches[t];
        auto back = ids.ok() ? tokenizer_->Decode(*ids)
                             : absl::StatusOr<std::string>("");
        if (!back.ok() || *back != expected_text + std::to_string(i % 7))
          ++mismatches[t];
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

// --- Errors
// --------------------------------------------------------------------

TEST(TokenizerErrorTest, InvalidUtf8IsAnError) {
  auto tokenizer =
      Tokenizer::FromJson(HandWrittenTokenizer().dump(), "handwritten.json");
  ASSERT_TRUE(tokenizer.ok());
  for (const std::string& bad :
       {std::string("abc\xFF"), std::string("\xC3"),
        std::string("\xED\xA0\x80"), std::string("\xC0\xAF")}) {
    auto ids = (*tokenizer)->Encode(bad, false);
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument)
        << Printable(bad);
  }
}

TEST(TokenizerErrorTest, OutOfRangeIds) {
  auto tokenizer =
      Tokenizer::FromJson(HandWrittenTokenizer().dump(), "handwritten.json");
  ASSERT_TRUE(tokenizer.ok());
  // Ids past the tokenizer (padded embeddings) decode to nothing, as in the
  // crate; negative ids are errors.
  auto known = (*tokenizer)->Decode(std::vector<int32_t>{'h'});
  auto padded = (*tokenizer)->Decode(std::vector<int32_t>{'h', 303, 5000});
  ASSERT_TRUE(known.ok() && padded.ok());
  EXPECT_EQ(*padded, *known);
  EXPECT_EQ((*tokenizer)->Decode(std::vector<int32_t>{-1}).status().code(),
            absl::StatusCode::kOutOfRange);
  IncrementalDecoder decoder(**tokenizer);
  EXPECT_EQ(decoder.Push(-3).status().code(), absl::StatusCode::kOutOfRange);
  auto nothing = decoder.Push(5000);
  ASSERT_TRUE(nothing.ok());
  EXPECT_EQ(*nothing, "");
  auto piece = decoder.Push('h');
  ASSERT_TRUE(piece.ok());
  EXPECT_EQ(*piece, "h");
}

TEST(TokenizerErrorTest, MalformedJsonNamesTheFile) {
  auto tokenizer =
      Tokenizer::FromJson("{\"model\": [1, 2", "broken/tokenizer.json");
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(tokenizer.status().message().find("broken/tokenizer.json"),
            std::string::npos);

  EXPECT_EQ(Tokenizer::FromJson("[1, 2]", "x.json").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Tokenizer::FromFile("/nonexistent/tokenizer.json").status().code(),
            absl::StatusCode::kNotFound);

  // Wrong types inside an otherwise valid file.
  json j = HandWrittenTokenizer();
  j["model"]["vocab"] = json::array({1, 2});
  EXPECT_EQ(Tokenizer::FromJson(j.dump(), "x.json").status().code(),
            absl::StatusCode::kInvalidArgument);
  j = HandWrittenTokenizer();
  j["model"]["merges"].push_back("only_one_part");
  EXPECT_EQ(Tokenizer::FromJson(j.dump(), "x.json").status().code(),
            absl::StatusCode::kInvalidArgument);
  j = HandWrittenTokenizer();
  j["model"]["merges"].push_back(json::array({"zz_not", "in_vocab"}));
  EXPECT_EQ(Tokenizer::FromJson(j.dump(), "x.json").status().code(),
            absl::StatusCode::kInvalidArgument);
  j = HandWrittenTokenizer();
  j["added_tokens"][0]["id"] = "seven";
  EXPECT_EQ(Tokenizer::FromJson(j.dump(), "x.json").status().code(),
            absl::StatusCode::kInvalidArgument);
  j = HandWrittenTokenizer();
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "(unclosed"}};
  EXPECT_EQ(Tokenizer::FromJson(j.dump(), "x.json").status().code(),
            absl::StatusCode::kInvalidArgument);
  j = HandWrittenTokenizer();
  j["decoder"] = {{"no_type", 1}};
  EXPECT_EQ(Tokenizer::FromJson(j.dump(), "x.json").status().code(),
            absl::StatusCode::kInvalidArgument);
  j = HandWrittenTokenizer();
  j["normalizer"] = {{"type", "Replace"}, {"pattern", 5}, {"content", "x"}};
  EXPECT_EQ(Tokenizer::FromJson(j.dump(), "x.json").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TokenizerErrorTest, MalformedFieldNamesFileAndField) {
  json j = HandWrittenTokenizer();
  j["model"]["merges"].push_back(5);
  EXPECT_EQ(Tokenizer::FromJson(j.dump(), "tokenizer.json").status().message(),
            "tokenizer.json: field \"model.merges[13]\": expected a merge \"a "
            "b\" or [\"a\", "
            "\"b\"], got number 5");
  j = HandWrittenTokenizer();
  j["added_tokens"][0]["id"] = "seven";
  EXPECT_EQ(
      Tokenizer::FromJson(j.dump(), "dir/tokenizer.json").status().message(),
      "dir/tokenizer.json: field \"added_tokens[0].id\": expected an integer, "
      "got string "
      "\"seven\"");
  j = HandWrittenTokenizer();
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", "(unclosed"}};
  const std::string message(
      Tokenizer::FromJson(j.dump(), "tokenizer.json").status().message());
  EXPECT_EQ(message.rfind("tokenizer.json: field "
                          "\"pre_tokenizer.pretokenizers[0].pattern.Regex\": "
                          "bad regex '(unclosed'",
                          0),
            0u)
      << message;
  // A "String" that is not a string falls through to "Regex", as it always did.
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"String", 5},
                                                       {"Regex", "x"}};
  EXPECT_TRUE(Tokenizer::FromJson(j.dump(), "tokenizer.json").ok());
  j = HandWrittenTokenizer();
  j["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = "no";
  EXPECT_EQ(Tokenizer::FromJson(j.dump(), "tokenizer.json").status().message(),
            "tokenizer.json: field "
            "\"pre_tokenizer.pretokenizers[1].use_regex\": expected true or "
            "false, got string \"no\"");
}

TEST(TokenizerErrorTest, UnsupportedComponentsNameFileAndComponent) {
  struct Case {
    const char* field;
    json value;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"pre_tokenizer",
       {{"type", "BertPreTokenizer"}},
       "t.json: field \"pre_tokenizer\": unsupported pre_tokenizer type "
       "'BertPreTokenizer'"},
      {"normalizer",
       {{"type", "Precompiled"}, {"precompiled_charsmap", "AAAA"}},
       "t.json: field \"normalizer\": unsupported normalizer type "
       "'Precompiled'"},
      {"decoder",
       {{"type", "WordPiece"}, {"prefix", "##"}},
       "t.json: field \"decoder\": unsupported decoder type 'WordPiece'"},
      {"post_processor",
       {{"type", "Mystery"}},
       "t.json: field \"post_processor\": unsupported post_processor type "
       "'Mystery'"},
      {"model",
       {{"type", "Unigram"}, {"vocab", json::array()}},
       "t.json: field \"model\": unsupported model type 'Unigram'"},
  };
  for (const Case& c : cases) {
    json j = HandWrittenTokenizer();
    j[c.field] = c.value;
    auto tokenizer = Tokenizer::FromJson(j.dump(), "t.json");
    ASSERT_FALSE(tokenizer.ok()) << c.field;
    EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_EQ(tokenizer.status().message(), c.message);
  }
  // Nested in a Sequence too.
  json j = HandWrittenTokenizer();
  j["pre_tokenizer"]["pretokenizers"].push_back({{"type", "Punctuation"}});
  auto tokenizer = Tokenizer::FromJson(j.dump(), "t.json");
  EXPECT_EQ(tokenizer.status().message(),
            "t.json: field \"pre_tokenizer.pretokenizers[2]\": unsupported "
            "pre_tokenizer type "
            "'Punctuation'");
}

// --- Speed
// -----------------------------------------------------------------------

// About 100 KB of varied text: golden lines and pseudo-words.
std::string HundredKilobytes() {
  std::string text;
  std::mt19937 rng(7);
  const std::vector<std::string> syllables = {"ka",  "ter", "mo", "lin", "ra",
                                              "ble", "sh",  "ou", "ing", "pre",
                                              "st",  "ion", "é",  "中"};
  const std::vector<std::string> separators = {" ",  " ",  " ",    ", ",
                                               ". ", "\n", " 42 ", "!? "};
  while (text.size() < 100 * 1024) {
    const int n = 1 + rng() % 4;
    for (int i = 0; i < n; ++i) text += syllables[rng() % syllables.size()];
    text += separators[rng() % separators.size()];
  }
  return text;
}

TEST(TokenizerSpeedTest, EncodesHundredKilobytesQuickly) {
  const std::vector<GoldenSet> sets = FindGoldenSets();
  if (sets.empty())
    GTEST_SKIP() << testing::NeedsSharedMessage("tokenizers/*/golden.jsonl");
  const std::string text = HundredKilobytes();
  for (const GoldenSet& set : sets) {
    std::unique_ptr<Tokenizer> tokenizer =
        LoadTokenizerOrFail(set.tokenizer_path);
    ASSERT_NE(tokenizer, nullptr);
    const auto start = std::chrono::steady_clock::now();
    auto ids = tokenizer->Encode(text, false);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    ASSERT_TRUE(ids.ok());
    auto decoded = tokenizer->Decode(*ids);
    ASSERT_TRUE(decoded.ok());
    EXPECT_EQ(*decoded, text);
    std::cout << "[ speed    ] " << set.name << ": " << text.size()
              << " bytes -> " << ids->size() << " ids in " << seconds * 1000
              << " ms\n";
    // Generous: the machine may be busy. Typically a few tens of ms.
    EXPECT_LT(seconds, 2.0);
  }
}

}  // namespace
}  // namespace knapserve

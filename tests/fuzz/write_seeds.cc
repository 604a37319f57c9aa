// fuzz_seeds OUT_DIR: writes the seed corpus of every fuzz target in
// tests/fuzz/ to OUT_DIR/<target>/, made from the real files of the shared
// data folder ($KNAPSERVE_SHARED, else ../shared) and the real encoders:
//   safetensors        stories260k's small tensors rewritten in F32, BF16 and
//                      F16
//   model_config       every shared model's config.json and
//                      generation_config.json, and every make-model shape
//   tokenizer_json     stories260k's tokenizer.json, SmolLM's cut to its
//                      first 300 tokens, make-model's synthetic one
//   tokenizer_text     the texts of the tokenizer goldens and bench prompts
//   tensor_codec       stories260k weights through EncodeTensor
//   plan_codec         plan requests for stories260k (every policy, with and
//                      without K/V) through EncodePlanRequest, and plans and
//                      plan errors through EncodePlanResponse
//   generate_request   requests with the bench prompts, as text and ids, with
//                      sampling, stops and each speculation mode
//   latency_profile    a profile of stories260k measured by ProfileModel
//   chat_template      the real templates of tests/testing/chat_templates/,
//                      alone and with a NUL and a conversation's JSON
//   traceparent        W3C traceparents (sampled, not, a later version) and
//                      a span name and request id
// tools/fuzz.sh runs it before fuzzing, and the FuzzReplay tests before
// replaying. Prints the number of seeds per target; exit 1 on any error.
#include <c10/core/InferenceMode.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/base/file_util.h"
#include "common/base/status.h"
#include "common/checkpoint/model_config.h"
#include "common/checkpoint/safetensors.h"
#include "common/model/llama.h"
#include "common/text/tokenizer.h"
#include "common/wire/plan_codec.h"
#include "common/wire/tensor_codec.h"
#include "knapserve/v1/generation.pb.h"
#include "planner/latency_profile.h"
#include "tools/make_model.h"
#include "tools/prompt_set.h"
#include "tools/shared_data.h"

namespace knapserve {
namespace {

class SeedWriter {
 public:
  explicit SeedWriter(std::string out_dir) : out_dir_(std::move(out_dir)) {}

  absl::Status Write(const std::string& target, const std::string& name,
                     const std::string& bytes) {
    const std::string dir = out_dir_ + "/" + target;
    std::filesystem::create_directories(dir);
    std::ofstream out(dir + "/" + name, std::ios::binary | std::ios::trunc);
    out << bytes;
    out.close();
    if (!out.good()) return absl::InternalError("cannot write " + dir);
    ++counts_[target];
    return absl::OkStatus();
  }

  void PrintCounts() const {
    for (const auto& [target, count] : counts_) {
      std::printf("fuzz_seeds: %-18s %d seeds\n", target.c_str(), count);
    }
  }

 private:
  std::string out_dir_;
  std::map<std::string, int> counts_;
};

const char* const kModels[] = {"stories260k", "stories-24l",
                               "stories-24l-skip"};

absl::Status SafetensorsSeeds(SeedWriter& seeds, const std::string& scratch) {
  ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(SharedPath(
                                  "models/stories260k/model.safetensors")));
  std::vector<std::pair<std::string, torch::Tensor>> small;
  for (const TensorInfo& info : file->tensors()) {
    ASSIGN_OR_RETURN(torch::Tensor view, file->View(info.name));
    if (view.numel() <= 1024) small.emplace_back(info.name, view.clone());
  }
  for (const auto& [dtype, name] :
       {std::pair{torch::kFloat32, "f32"}, std::pair{torch::kBFloat16, "bf16"},
        std::pair{torch::kFloat16, "f16"}}) {
    std::vector<std::pair<std::string, torch::Tensor>> converted;
    for (const auto& [tensor_name, tensor] : small) {
      converted.emplace_back(tensor_name, tensor.to(dtype));
    }
    const std::string path = scratch + "/seed.safetensors";
    RETURN_IF_ERROR(
        WriteSafetensors(path, converted, {{"format", "pt"}, {"seed", name}}));
    ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
    RETURN_IF_ERROR(
        seeds.Write("safetensors", absl::StrCat("stories260k-", name), bytes));
  }
  MakeModelOptions options;
  options.shape = "tiny-llama";
  options.out_dir = scratch + "/tiny-llama";
  options.dtype = "fp32";
  RETURN_IF_ERROR(MakeModel(options));
  // Its tokenizer only: its model.safetensors (450 KB) is all data, too big
  // for the fuzzer to mutate quickly, and the header is like the others.
  ASSIGN_OR_RETURN(std::string tokenizer,
                   ReadFileToString(options.out_dir + "/tokenizer.json"));
  return seeds.Write("tokenizer_json", "make-model-synthetic", tokenizer);
}

absl::Status ModelConfigSeeds(SeedWriter& seeds) {
  for (const char* model : kModels) {
    const std::string dir = SharedPath(absl::StrCat("models/", model));
    ASSIGN_OR_RETURN(std::string config,
                     ReadFileToString(dir + "/config.json"));
    RETURN_IF_ERROR(seeds.Write("model_config", absl::StrCat(model, "-config"),
                                std::string(1, '\0') + config));
    ASSIGN_OR_RETURN(std::string generation,
                     ReadFileToString(dir + "/generation_config.json"));
    RETURN_IF_ERROR(seeds.Write("model_config",
                                absl::StrCat(model, "-generation"),
                                std::string(1, '\1') + generation));
  }
  for (const std::string& shape : KnownModelShapes()) {
    ASSIGN_OR_RETURN(ModelConfig config, ModelShapeConfig(shape));
    RETURN_IF_ERROR(
        seeds.Write("model_config", shape,
                    std::string(1, '\0') + ModelConfigToJson(config)));
  }
  return absl::OkStatus();
}

// SmolLM's tokenizer.json with only the first `keep` vocabulary entries and
// the merges among them: the same components, small enough to mutate.
absl::StatusOr<std::string> CutTokenizer(const std::string& text, int keep) {
  nlohmann::json json = nlohmann::json::parse(text, nullptr, false);
  if (json.is_discarded()) return absl::InvalidArgumentError("bad tokenizer");
  nlohmann::json vocab = nlohmann::json::object();
  for (const auto& [piece, id] : json["model"]["vocab"].items()) {
    if (id.get<int>() < keep) vocab[piece] = id;
  }
  nlohmann::json merges = nlohmann::json::array();
  for (const auto& merge : json["model"]["merges"]) {
    const std::string pair = merge.get<std::string>();
    const size_t space = pair.find(' ');
    const std::string left = pair.substr(0, space);
    const std::string right = pair.substr(space + 1);
    if (vocab.contains(left) && vocab.contains(right) &&
        vocab.contains(left + right)) {
      merges.push_back(merge);
    }
  }
  json["model"]["vocab"] = vocab;
  json["model"]["merges"] = merges;
  return json.dump(1);
}

absl::Status TokenizerSeeds(SeedWriter& seeds) {
  ASSIGN_OR_RETURN(
      std::string stories,
      ReadFileToString(SharedPath("models/stories260k/tokenizer.json")));
  RETURN_IF_ERROR(seeds.Write("tokenizer_json", "stories260k", stories));
  ASSIGN_OR_RETURN(
      std::string smollm,
      ReadFileToString(SharedPath("tokenizers/smollm/tokenizer.json")));
  ASSIGN_OR_RETURN(std::string cut, CutTokenizer(smollm, 300));
  RETURN_IF_ERROR(seeds.Write("tokenizer_json", "smollm-cut", cut));

  // Texts: the goldens' inputs, then a few bench prompts, each with every
  // selector byte (tokenizer, add_special_tokens, skip_special_tokens).
  std::vector<std::string> texts;
  for (const char* golden : {"models/stories260k/golden_tokenizer.jsonl",
                             "tokenizers/smollm/golden.jsonl"}) {
    std::ifstream in(SharedPath(golden));
    std::string line;
    while (std::getline(in, line)) {
      const nlohmann::json row = nlohmann::json::parse(line, nullptr, false);
      if (row.is_object() && row.contains("text") && row["text"].is_string()) {
        texts.push_back(row["text"].get<std::string>());
      }
    }
  }
  for (const char* set :
       {"bench/stories/prompts.jsonl", "bench/novels/prompts.jsonl"}) {
    ASSIGN_OR_RETURN(std::vector<BenchPrompt> prompts,
                     LoadPromptSet(SharedPath(set), 4));
    for (const BenchPrompt& prompt : prompts) texts.push_back(prompt.text);
  }
  if (texts.empty()) return absl::NotFoundError("no tokenizer golden texts");
  for (size_t i = 0; i < texts.size(); ++i) {
    const char selector = static_cast<char>(i % 8);
    RETURN_IF_ERROR(seeds.Write("tokenizer_text", absl::StrCat("text-", i),
                                std::string(1, selector) + texts[i]));
  }
  return absl::OkStatus();
}

absl::Status TensorSeeds(SeedWriter& seeds, const LlamaModel& model) {
  ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(SharedPath(
                                  "models/stories260k/model.safetensors")));
  int written = 0;
  for (const TensorInfo& info : file->tensors()) {
    if (written == 4) break;
    ASSIGN_OR_RETURN(torch::Tensor view, file->View(info.name));
    if (view.numel() > 4096) continue;
    for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
      v1::Tensor proto;
      RETURN_IF_ERROR(EncodeTensor(view.to(dtype), &proto));
      RETURN_IF_ERROR(seeds.Write(
          "tensor_codec", absl::StrCat(info.name, "-", DtypeName(dtype)),
          proto.SerializeAsString()));
    }
    ++written;
  }
  for (auto dtype : {torch::kInt32, torch::kInt64}) {
    v1::Tensor proto;
    RETURN_IF_ERROR(
        EncodeTensor(torch::arange(12, dtype).view({3, 4}), &proto));
    RETURN_IF_ERROR(seeds.Write("tensor_codec",
                                absl::StrCat("ids-", c10::toString(dtype)),
                                proto.SerializeAsString()));
  }
  return absl::OkStatus();
}

absl::Status PlanSeeds(SeedWriter& seeds, const LlamaModel& model) {
  const ModelConfig& config = model.config();
  const int layers = model.num_layers();
  torch::manual_seed(1);
  int index = 0;
  for (PlanPolicy policy :
       {PlanPolicy::kKnapSpec, PlanPolicy::kClasp, PlanPolicy::kStatic}) {
    for (bool with_kv : {false, true}) {
      PlanRequest request;
      request.sequence_id = 7 + index;
      request.step = 64;
      request.first_position = 20;
      const int64_t r = 4;
      request.context_length = request.first_position + r;
      request.plan_lifetime_tokens = 32;
      request.policy = policy;
      request.static_mask = "a1,m2";
      request.clasp_layers = 2;
      request.max_draft = 4;
      request.model_fingerprint = config.Fingerprint();
      request.states = torch::randn({2 * layers + 1, r, config.hidden_size});
      if (index % 2 == 1) request.states = request.states.to(torch::kBFloat16);
      for (int64_t i = 0; i < r; ++i) request.target_argmax.push_back(30 + i);
      if (with_kv) {
        for (int l = 0; l < layers; ++l) {
          const int64_t capacity = request.context_length + 8;
          request.kv.push_back({torch::randn({config.num_key_value_heads,
                                              capacity, config.head_dim}),
                                torch::randn({config.num_key_value_heads,
                                              capacity, config.head_dim})});
        }
        request.kv_length = request.context_length;
      }
      v1::PlanRequest wire;
      RETURN_IF_ERROR(EncodePlanRequest(request, {4, 8}, &wire));
      RETURN_IF_ERROR(
          seeds.Write("plan_codec", absl::StrCat("request-", index),
                      std::string(1, '\0') + wire.SerializeAsString()));
      ++index;
    }
  }
  ASSIGN_OR_RETURN(LayerMask mask, LayerMask::Parse("a1,m2,a3", layers));
  DraftPlan plan;
  plan.mask = mask;
  plan.gamma = 3;
  plan.predicted_tpt = 900;
  plan.alpha_hat = 0.75;
  plan.alpha_smoothed = 0.7;
  plan.num_candidates = 12;
  plan.num_evaluated = 5;
  const std::pair<const char*, absl::StatusOr<DraftPlan>> responses[] = {
      {"plan", plan},
      {"error-fingerprint", absl::FailedPreconditionError("fingerprint")},
      {"error-superseded", absl::CancelledError("superseded")},
      {"error-exhausted", absl::ResourceExhaustedError("busy")}};
  for (const auto& [name, response] : responses) {
    RETURN_IF_ERROR(seeds.Write(
        "plan_codec", absl::StrCat("response-", name),
        std::string(1, '\1') +
            EncodePlanResponse(7, 64, response).SerializeAsString()));
  }
  return absl::OkStatus();
}

absl::Status GenerateRequestSeeds(SeedWriter& seeds,
                                  const Tokenizer& tokenizer) {
  ASSIGN_OR_RETURN(std::vector<BenchPrompt> prompts,
                   LoadPromptSet(SharedPath("bench/stories/prompts.jsonl"), 4));
  const v1::SpeculationMode modes[] = {
      v1::SPECULATION_MODE_UNSPECIFIED, v1::SPECULATION_MODE_OFF,
      v1::SPECULATION_MODE_STATIC, v1::SPECULATION_MODE_KNAPSPEC};
  for (size_t i = 0; i < prompts.size(); ++i) {
    v1::GenerateRequest request;
    request.set_request_id(absl::StrCat("seed-", i));
    if (i % 2 == 0) {
      request.set_text(prompts[i].text);
    } else {
      ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                       tokenizer.Encode(prompts[i].text, true));
      for (int32_t id : ids) request.mutable_token_ids()->add_ids(id);
    }
    request.set_max_new_tokens(16);
    if (i >= 2) {
      request.set_temperature(0.8);
      request.set_top_k(20);
      request.set_top_p(0.9);
      request.set_seed(1234 + i);
    }
    // The logits processors (executor/engine/logits_processors.h).
    if (i == 1 || i == 3) {
      request.set_repetition_penalty(1.2);
      (*request.mutable_logit_bias())[13] = -5;
      v1::TokenIds* word = request.add_bad_words();
      word->add_ids(13);
      word->add_ids(14);
    }
    if (i >= 2) {
      request.set_presence_penalty(0.5);
      request.set_frequency_penalty(-0.3);
      request.set_min_tokens(4);
      request.set_min_p(0.05);
    }
    request.add_stop("Lily");
    request.add_stop_token_ids(13);
    request.set_ignore_eos(i == 3);
    request.mutable_speculation()->set_mode(modes[i % 4]);
    request.mutable_speculation()->set_max_draft_tokens(3);
    if (modes[i % 4] == v1::SPECULATION_MODE_STATIC) {
      request.mutable_speculation()->set_static_mask("a1,m2");
    }
    RETURN_IF_ERROR(seeds.Write("generate_request", absl::StrCat("request-", i),
                                request.SerializeAsString()));
  }
  return absl::OkStatus();
}

absl::Status ProfileSeeds(SeedWriter& seeds, const LlamaModel& model) {
  ProfileOptions options;
  options.contexts = {16, 64, 256};
  options.repeats = 2;
  options.warmup = 1;
  options.max_draft = 4;
  ASSIGN_OR_RETURN(LatencyProfile profile, ProfileModel(model, options));
  return seeds.Write("latency_profile", "stories260k", profile.ToJson());
}

// The real chat templates (read from the checkout: the tools run from the
// source folder), alone and followed by a NUL and a render context.
absl::Status ChatTemplateSeeds(SeedWriter& seeds) {
  const std::string dir = "tests/testing/chat_templates";
  const nlohmann::json context = {
      {"messages",
       {{{"role", "user"}, {"content", "Hi"}},
        {{"role", "assistant"}, {"content", "Hello!"}},
        {{"role", "user"}, {"content", "Tell me a story."}}}},
      {"add_generation_prompt", true},
      {"bos_token", "<s>"},
      {"eos_token", "</s>"}};
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".jinja") continue;
    ASSIGN_OR_RETURN(std::string source,
                     ReadFileToString(entry.path().string()));
    const std::string name = entry.path().stem().string();
    RETURN_IF_ERROR(seeds.Write("chat_template", name, source));
    RETURN_IF_ERROR(
        seeds.Write("chat_template", name + "-context",
                    source + std::string(1, '\0') + context.dump()));
    ++count;
  }
  if (count == 0) {
    return absl::NotFoundError(dir + ": no templates (run from the checkout)");
  }
  return absl::OkStatus();
}

// Traceparents as clients send them (byte 0 even), and a span name with a
// request id (byte 0 odd).
absl::Status TraceparentSeeds(SeedWriter& seeds) {
  const std::string header =
      "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-";
  RETURN_IF_ERROR(seeds.Write("traceparent", "sampled",
                              std::string(1, '\0') + header + "01"));
  RETURN_IF_ERROR(seeds.Write("traceparent", "not-sampled",
                              std::string(1, '\0') + " " + header + "00\t"));
  RETURN_IF_ERROR(
      seeds.Write("traceparent", "later-version",
                  std::string(1, '\0') + "cc" + header.substr(2) + "01-x"));
  return seeds.Write("traceparent", "span",
                     std::string(1, '\1') + "generate" + std::string(1, '\0') +
                         "req-\xff\xfe-1");
}

absl::Status WriteAll(const std::string& out_dir) {
  c10::InferenceMode guard;
  at::set_num_threads(1);
  SeedWriter seeds(out_dir);
  const std::string scratch = out_dir + "/.scratch";
  std::filesystem::create_directories(scratch);
  ASSIGN_OR_RETURN(std::unique_ptr<LlamaModel> model,
                   LlamaModel::Load(SharedPath("models/stories260k"), {}));
  ASSIGN_OR_RETURN(
      std::unique_ptr<Tokenizer> tokenizer,
      Tokenizer::FromFile(SharedPath("models/stories260k/tokenizer.json")));
  RETURN_IF_ERROR(SafetensorsSeeds(seeds, scratch));
  RETURN_IF_ERROR(ModelConfigSeeds(seeds));
  RETURN_IF_ERROR(TokenizerSeeds(seeds));
  RETURN_IF_ERROR(TensorSeeds(seeds, *model));
  RETURN_IF_ERROR(PlanSeeds(seeds, *model));
  RETURN_IF_ERROR(GenerateRequestSeeds(seeds, *tokenizer));
  RETURN_IF_ERROR(ProfileSeeds(seeds, *model));
  RETURN_IF_ERROR(ChatTemplateSeeds(seeds));
  RETURN_IF_ERROR(TraceparentSeeds(seeds));
  std::filesystem::remove_all(scratch);
  seeds.PrintCounts();
  return absl::OkStatus();
}

}  // namespace
}  // namespace knapserve

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seeds OUT_DIR\n");
    return 2;
  }
  const absl::Status status = knapserve::WriteAll(argv[1]);
  if (!status.ok()) {
    std::fprintf(stderr, "fuzz_seeds: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

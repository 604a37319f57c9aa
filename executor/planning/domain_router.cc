#include "executor/planning/domain_router.h"

#include <c10/core/InferenceMode.h>

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/checkpoint/safetensors.h"
#include "common/model/exception_status.h"

namespace knapserve {
namespace {

constexpr char kFormat[] = "knapserve.domain_anchors.v1";

using Json = nlohmann::json;

}  // namespace

void RoutingVector::Add(const torch::Tensor& final_states, int64_t start_pos) {
  c10::InferenceMode guard;
  torch::Tensor rows = final_states.to(torch::kFloat32);
  if (start_pos == 0) {
    first_ = rows[0].clone();
    rows = rows.narrow(0, 1, rows.size(0) - 1);
  }
  if (rows.size(0) == 0) return;
  const torch::Tensor sum = rows.sum(0);
  sum_ = sum_.defined() ? sum_ + sum : sum;
  count_ += rows.size(0);
}

torch::Tensor RoutingVector::Mean() const {
  if (count_ == 0) return first_;
  return sum_ / static_cast<double>(count_);
}

ContextDraft RoutedDomain::DraftFor(int64_t prompt_tokens) const {
  ContextDraft best{this->prompt_tokens, mask, gamma, predicted_speedup};
  if (longer.empty() || prompt_tokens <= this->prompt_tokens) return best;
  // Log-scale distance; lengths are positive here (Create checks).
  const double at = std::log(static_cast<double>(prompt_tokens));
  double best_distance =
      at - std::log(static_cast<double>(this->prompt_tokens));
  for (const ContextDraft& draft : longer) {
    const double distance =
        std::abs(std::log(static_cast<double>(draft.prompt_tokens)) - at);
    if (distance < best_distance) {
      best = draft;
      best_distance = distance;
    }
  }
  return best;
}

absl::StatusOr<std::shared_ptr<const DomainRouter>> DomainRouter::Create(
    std::string model_fingerprint, std::string weights_fingerprint,
    int num_layers, std::vector<RoutedDomain> domains,
    const torch::Tensor& anchors, std::vector<int> anchor_domain) {
  if (domains.empty())
    return absl::InvalidArgumentError("domain anchors: no domains");
  if (!anchors.defined() || anchors.dim() != 2 || anchors.size(0) == 0 ||
      anchors.size(1) == 0) {
    return absl::InvalidArgumentError(
        "domain anchors: anchors must be a non-empty [N, hidden] tensor");
  }
  if (!anchors.is_floating_point())
    return absl::InvalidArgumentError("domain anchors: anchors must be float");
  if (static_cast<int64_t>(anchor_domain.size()) != anchors.size(0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("domain anchors: ", anchors.size(0), " anchors but ",
                     anchor_domain.size(), " anchor domains"));
  }
  std::vector<int> per_domain(domains.size(), 0);
  for (int d : anchor_domain) {
    if (d < 0 || d >= static_cast<int>(domains.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("domain anchors: anchor domain ", d,
                       " is not one of the ", domains.size(), " domains"));
    }
    ++per_domain[d];
  }
  for (size_t d = 0; d < domains.size(); ++d) {
    const RoutedDomain& domain = domains[d];
    if (domain.name.empty())
      return absl::InvalidArgumentError(
          absl::StrCat("domain anchors: domain ", d, " has no name"));
    for (size_t e = 0; e < d; ++e) {
      if (domains[e].name == domain.name) {
        return absl::InvalidArgumentError(absl::StrCat(
            "domain anchors: domain '", domain.name, "' appears twice"));
      }
    }
    if (per_domain[d] == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "domain anchors: domain '", domain.name, "' has no anchor"));
    }
    if (domain.mask.num_layers() != num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "domain anchors: domain '", domain.name, "' has a mask of ",
          domain.mask.num_layers(), " layers, the model has ", num_layers));
    }
    if (domain.gamma < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("domain anchors: domain '", domain.name, "' has gamma ",
                       domain.gamma));
    }
    if (domain.prompt_tokens < 0 ||
        (domain.prompt_tokens == 0 && !domain.longer.empty())) {
      return absl::InvalidArgumentError(
          absl::StrCat("domain anchors: domain '", domain.name,
                       "' has prompt_tokens ", domain.prompt_tokens,
                       domain.longer.empty() ? "" : " and longer drafts"));
    }
    int64_t shorter = domain.prompt_tokens;
    for (const ContextDraft& draft : domain.longer) {
      const std::string what = absl::StrCat(
          "domain anchors: domain '", domain.name, "': its draft for ",
          draft.prompt_tokens, "-token prompts ");
      if (draft.prompt_tokens <= shorter) {
        return absl::InvalidArgumentError(
            absl::StrCat(what,
                         "is not for longer prompts than the draft "
                         "before it (",
                         shorter, " tokens)"));
      }
      if (draft.mask.num_layers() != num_layers) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, "has a mask of ", draft.mask.num_layers(),
                         " layers, the model has ", num_layers));
      }
      if (draft.gamma < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, "has gamma ", draft.gamma));
      }
      shorter = draft.prompt_tokens;
    }
  }
  std::shared_ptr<DomainRouter> router(new DomainRouter());
  router->fingerprint_ = std::move(model_fingerprint);
  router->weights_fingerprint_ = std::move(weights_fingerprint);
  router->domains_ = std::move(domains);
  router->anchor_domain_ = std::move(anchor_domain);
  try {
    c10::InferenceMode guard;
    router->anchors_ =
        anchors.detach().to(torch::kCPU, torch::kFloat32).contiguous().clone();
    if (!torch::isfinite(router->anchors_).all().item<bool>())
      return absl::InvalidArgumentError(
          "domain anchors: anchors hold a non-finite value");
    const torch::Tensor norms =
        router->anchors_.norm(2, /*dim=*/1, /*keepdim=*/true);
    router->unit_ = router->anchors_ /
                    torch::where(norms > 0, norms, torch::ones_like(norms));
  } catch (...) {
    return CurrentExceptionAsInternal("domain anchors");
  }
  return std::shared_ptr<const DomainRouter>(std::move(router));
}

absl::StatusOr<std::shared_ptr<const DomainRouter>> DomainRouter::Load(
    const std::string& path, const ModelConfig& config,
    const std::string& weights_fingerprint) {
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                   SafetensorsFile::Open(path));
  const auto& meta = file->metadata();
  auto field = [&](const char* key) -> absl::StatusOr<std::string> {
    auto it = meta.find(key);
    if (it == meta.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": not a domain anchors file (no '", key,
                       "' in its metadata)"));
    }
    return it->second;
  };
  ASSIGN_OR_RETURN(std::string format, field("format"));
  if (format != kFormat) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": format '", format, "', expected '", kFormat, "'"));
  }
  ASSIGN_OR_RETURN(std::string fingerprint, field("model_fingerprint"));
  if (fingerprint != config.Fingerprint()) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": the anchors were made for model fingerprint ",
                     fingerprint, ", this model's is ", config.Fingerprint(),
                     " (run `knapserve anchors` for this model)"));
  }
  ASSIGN_OR_RETURN(std::string weights, field("weights_fingerprint"));
  if (weights != weights_fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, ": the anchors were made for weights fingerprint ", weights,
        ", this model's weights are ", weights_fingerprint,
        " (the same architecture, other weights: run `knapserve anchors` "
        "for this model)"));
  }
  ASSIGN_OR_RETURN(std::string domains_text, field("domains"));
  ASSIGN_OR_RETURN(std::string anchor_domain_text, field("anchor_domain"));
  std::vector<RoutedDomain> domains;
  std::vector<int> anchor_domain;
  try {
    const Json list = Json::parse(domains_text);
    if (!list.is_array())
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": 'domains' is not a JSON array"));
    for (const Json& d : list) {
      RoutedDomain domain;
      domain.name = d.at("name").get<std::string>();
      const std::string mask = d.at("mask").get<std::string>();
      auto parsed =
          LayerMask::Parse(mask, static_cast<int>(config.num_hidden_layers));
      if (!parsed.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": domain '", domain.name, "': ", parsed.status().message()));
      }
      domain.mask = *parsed;
      domain.gamma = d.at("gamma").get<int>();
      domain.samples = d.value("samples", int64_t{0});
      domain.mask_source = d.value("mask_source", std::string());
      domain.predicted_speedup = d.value("predicted_speedup", 1.0);
      domain.prompt_tokens = d.value("prompt_tokens", int64_t{0});
      for (const Json& l : d.value("longer", Json::array())) {
        ContextDraft draft;
        draft.prompt_tokens = l.at("prompt_tokens").get<int64_t>();
        auto longer =
            LayerMask::Parse(l.at("mask").get<std::string>(),
                             static_cast<int>(config.num_hidden_layers));
        if (!longer.ok()) {
          return absl::InvalidArgumentError(absl::StrCat(
              path, ": domain '", domain.name, "' at ", draft.prompt_tokens,
              " tokens: ", longer.status().message()));
        }
        draft.mask = *longer;
        draft.gamma = l.at("gamma").get<int>();
        draft.predicted_speedup = l.value("predicted_speedup", 1.0);
        domain.longer.push_back(std::move(draft));
      }
      domains.push_back(std::move(domain));
    }
    const Json ids = Json::parse(anchor_domain_text);
    if (!ids.is_array())
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": 'anchor_domain' is not a JSON array"));
    for (const Json& id : ids) anchor_domain.push_back(id.get<int>());
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": bad domain anchors metadata: ", e.what()));
  }
  const TensorInfo* info = file->Find("anchors");
  if (info == nullptr)
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": no 'anchors' tensor"));
  if (info->shape.size() != 2 || info->shape[1] != config.hidden_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": 'anchors' must be [N, ", config.hidden_size,
                     "] (the model's hidden size)"));
  }
  ASSIGN_OR_RETURN(torch::Tensor anchors, file->View("anchors"));
  auto router = Create(std::move(fingerprint), std::move(weights),
                       static_cast<int>(config.num_hidden_layers),
                       std::move(domains), anchors, std::move(anchor_domain));
  if (!router.ok()) {
    return absl::Status(router.status().code(),
                        absl::StrCat(path, ": ", router.status().message()));
  }
  return router;
}

absl::Status DomainRouter::Save(const std::string& path) const {
  Json list = Json::array();
  for (const RoutedDomain& d : domains_) {
    Json longer = Json::array();
    for (const ContextDraft& l : d.longer) {
      longer.push_back({{"prompt_tokens", l.prompt_tokens},
                        {"mask", l.mask.ToString()},
                        {"gamma", l.gamma},
                        {"predicted_speedup", l.predicted_speedup}});
    }
    list.push_back({{"name", d.name},
                    {"mask", d.mask.ToString()},
                    {"gamma", d.gamma},
                    {"samples", d.samples},
                    {"mask_source", d.mask_source},
                    {"predicted_speedup", d.predicted_speedup},
                    {"prompt_tokens", d.prompt_tokens},
                    {"longer", std::move(longer)}});
  }
  const std::map<std::string, std::string> metadata = {
      {"format", kFormat},
      {"model_fingerprint", fingerprint_},
      {"weights_fingerprint", weights_fingerprint_},
      {"domains", list.dump()},
      {"anchor_domain", Json(anchor_domain_).dump()}};
  return WriteSafetensors(path, {{"anchors", anchors_}}, metadata);
}

DomainRoute DomainRouter::Route(const torch::Tensor& state) const {
  c10::InferenceMode guard;
  const torch::Tensor x =
      state.detach().to(torch::kCPU, torch::kFloat32).reshape({-1});
  const double norm = x.norm().item<double>();
  DomainRoute route;
  if (!(norm > 0)) {
    route.anchor = 0;
    route.domain = anchor_domain_[0];
    return route;
  }
  const torch::Tensor sims = torch::mv(unit_, x / norm);  // [N]
  const float* s = sims.data_ptr<float>();
  int best = 0;
  for (int i = 1; i < static_cast<int>(sims.size(0)); ++i) {
    if (s[i] > s[best]) best = i;
  }
  route.anchor = best;
  route.domain = anchor_domain_[best];
  route.similarity = s[best];
  return route;
}

}  // namespace knapserve

#include "engine/weight_digests.h"

#include <algorithm>

#include <fmt/format.h>
#include <xxhash.h>

#include <nlohmann/json.hpp>

namespace ferry {

std::string WeightCheck::to_string() const {
  std::string s = fmt::format("weights of version {}: {}; {} of {} param bytes checked ({:.1f}%), {} of {} replicated "
                              "boxes compared",
                              version ? std::to_string(*version) : "none", ok() ? "as delivered" : "NOT as delivered",
                              bytes_checked, bytes, 100 * coverage(), replicated_checked, replicated_boxes);
  for (const auto& c : changed) s += fmt::format("; param '{}' changed since it went live", c);
  for (const auto& d : drifted) s += "; " + d;
  return s;
}

namespace engine {

std::optional<uint64_t> tensor_digest(const Tensor& t) {
  if (!t.device().is_host() || !t.is_contiguous()) return std::nullopt;
  auto data = t.data_ptr();
  if (!data.ok()) return std::nullopt;
  return XXH3_64bits(*data, static_cast<size_t>(t.numel()) * dtype_size(t.dtype()));
}

void BoxDigests::begin(uint64_t version) {
  version_ = version;
  boxes_.clear();
}

void BoxDigests::add(const Holdings& held, const std::vector<LocalBox>& boxes) {
  for (const LocalBox& b : boxes) {
    if (b.box >= held.boxes.size()) continue;
    const HeldBox& hb = held.boxes[b.box];
    const std::optional<uint64_t> d = tensor_digest(b.data);
    if (!d || hb.tensor >= held.tensors.size()) continue;
    boxes_[fmt::format("{} {}", held.tensors[hb.tensor].name, hb.box.to_string())] = *d;
  }
}

Status BoxDigests::publish(Store& store, const JobKeys& keys, int rank) const {
  nlohmann::json boxes = nlohmann::json::object();
  for (const auto& [k, d] : boxes_) boxes[k] = fmt::format("{:016x}", d);
  const nlohmann::json j = {{"version", version_}, {"boxes", boxes}};
  return store.set(keys.digest(rank), j.dump())
      .with_context(fmt::format("producer {}: publishing its digests of version {}", rank, version_));
}

void ParamDigests::take(uint64_t version, const TensorMap& live) {
  version_ = version;
  params_.clear();
  for (const auto& [name, t] : live) params_[name] = tensor_digest(t);
}

Result<WeightCheck> ParamDigests::check(const TensorMap& live, Store& store, const JobKeys& keys,
                                        int num_producers) const {
  WeightCheck w;
  w.version = version_;
  if (!version_) return w;
  for (const auto& [name, t] : live) {
    const uint64_t n = static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype());
    w.bytes += n;
    auto it = params_.find(name);
    if (it == params_.end() || !it->second) continue;
    const std::optional<uint64_t> now = tensor_digest(t);
    if (!now) continue;
    w.bytes_checked += n;
    if (*now != *it->second) w.changed.push_back(name);
  }
  // The replicas: every producer's published boxes of this version, pair by pair.
  std::map<std::string, std::map<int, std::pair<uint64_t, std::string>>> holders;  // box -> producer -> (version, digest)
  for (int p = 0; p < num_producers; ++p) {
    auto v = store.get(keys.digest(p));
    if (!v.ok()) {
      if (v.status().code() == StatusCode::kNotFound) continue;
      return v.status().with_context("check_weights");
    }
    const nlohmann::json j = nlohmann::json::parse(*v, nullptr, false);
    if (!j.is_object() || !j.contains("version") || !j["version"].is_number_unsigned() || !j.contains("boxes") ||
        !j["boxes"].is_object())
      return corrupt("check_weights: producer {}'s digests ({}) are not {{\"version\", \"boxes\"}}", p, keys.digest(p));
    for (const auto& [box, d] : j["boxes"].items()) {
      if (!d.is_string()) return corrupt("check_weights: producer {}'s digest of '{}' is not a string", p, box);
      holders[box][p] = {j["version"].get<uint64_t>(), d.get<std::string>()};
    }
  }
  for (const auto& [box, by] : holders) {
    if (by.size() < 2) continue;
    ++w.replicated_boxes;
    std::vector<std::pair<int, std::string>> of_v;
    for (const auto& [p, vd] : by)
      if (vd.first == *version_) of_v.emplace_back(p, vd.second);
    if (of_v.size() < 2) continue;
    ++w.replicated_checked;
    const size_t space = box.find(' ');
    for (size_t i = 1; i < of_v.size(); ++i) {
      if (of_v[i].second == of_v[0].second) continue;
      w.drifted.push_back(fmt::format("producers {} and {} disagree on '{}' {} at version {}", of_v[0].first,
                                      of_v[i].first, box.substr(0, space), box.substr(space + 1), *version_));
    }
  }
  return w;
}

void ContentWatch::begin(uint64_t routes_hash) {
  hash_ = routes_hash;
  unknown_ = false;
  groups_.clear();
}

void ContentWatch::add(int group, const std::map<int64_t, uint64_t>& sums) {
  if (sums.empty()) unknown_ = true;
  groups_[group] = sums;
}

std::optional<bool> ContentWatch::finish(uint64_t routes_hash, bool ok) {
  if (!ok) {
    forget();
    return std::nullopt;
  }
  if (unknown_ || routes_hash != hash_ || groups_.empty()) {
    last_.reset();  // (nothing to compare the next one with)
    return std::nullopt;
  }
  std::optional<bool> same;
  // (Over the same groups only: a group no consumer needed this time was not packed.)
  auto same_groups = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](const auto& x, const auto& y) {
             return x.first == y.first;
           });
  };
  if (last_ && last_->first == routes_hash && same_groups(last_->second, groups_)) same = last_->second == groups_;
  last_ = std::make_pair(routes_hash, std::move(groups_));
  groups_.clear();
  return same;
}

}  // namespace engine
}  // namespace ferry

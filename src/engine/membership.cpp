// One side of a job as its leases say (engine/membership.h).
#include "engine/membership.h"

#include <algorithm>

#include "engine/rendezvous.h"

namespace ferry::engine {

Membership::Membership(Store& store, std::function<std::string(int)> key_of,
                       std::function<std::string(std::string_view)> instance_of, int size,
                       std::chrono::milliseconds lease_ttl, std::function<std::string(int)> left_key_of)
    : store_(store),
      key_of_(std::move(key_of)),
      instance_of_(std::move(instance_of)),
      lease_ttl_(lease_ttl),
      left_key_of_(std::move(left_key_of)),
      instances_(static_cast<size_t>(std::max(size, 0))) {}

void Membership::resize(int n) {
  if (n == size()) return;
  instances_.resize(static_cast<size_t>(std::max(n, 0)));
  ++epoch_;
}

Result<std::optional<std::string>> Membership::get(int r) {
  auto v = store_.get(key_of_(r));
  if (v.ok()) return std::optional<std::string>(std::move(*v));
  if (v.status().code() == StatusCode::kNotFound) return std::optional<std::string>();
  return v.status();
}

Result<bool> Membership::has_left(int r) {
  if (!left_key_of_) return false;
  auto mark = store_.get(left_key_of_(r));
  if (mark.ok()) return true;
  if (mark.status().code() == StatusCode::kNotFound) return false;
  return mark.status();
}

Result<Membership::Roll> Membership::call(const std::function<bool(int)>& heal) {
  Roll roll(instances_.size());
  std::set<int> left;
  for (int r = 0; r < size(); ++r) {
    auto lease = get(r);
    if (!lease.ok()) return lease.status();
    roll[static_cast<size_t>(r)] = std::move(*lease);
    if (roll[static_cast<size_t>(r)]) continue;
    FERRY_ASSIGN_OR_RETURN(const bool gone, has_left(r));
    if (gone) left.insert(r);
  }
  auto waited = [&] {
    std::vector<int> out;
    for (int r = 0; r < size(); ++r)
      if (!roll[static_cast<size_t>(r)] && !left.count(r) && heal && heal(r)) out.push_back(r);
    return out;
  };
  std::vector<int> missing;
  Status error;
  heal_leases(
      lease_ttl_, [&] { return error.ok() && !(missing = waited()).empty(); },
      [&] {
        for (int r : missing) {
          auto again = get(r);
          if (!again.ok()) {
            error = again.status();
            return;
          }
          roll[static_cast<size_t>(r)] = std::move(*again);
        }
      });
  FERRY_RETURN_IF_ERROR(error);
  bool changed = false;
  joined_.clear();
  for (int r = 0; r < size(); ++r) {
    const std::optional<std::string>& lease = roll[static_cast<size_t>(r)];
    std::optional<std::string> instance = lease ? std::optional<std::string>(instance_of_(*lease)) : std::nullopt;
    if (instance != instances_[static_cast<size_t>(r)]) {
      if (instance && called_) joined_.push_back(r);
      instances_[static_cast<size_t>(r)] = std::move(instance);
      changed = true;
    }
  }
  called_ = true;
  if (changed) ++epoch_;
  left_ = std::move(left);
  return roll;
}

}  // namespace ferry::engine

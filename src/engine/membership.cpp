// One side of a job as its leases say (engine/membership.h).
#include "engine/membership.h"

#include <algorithm>

#include "engine/rendezvous.h"

namespace ferry::engine {

Membership::Membership(Store& store, std::function<std::string(int)> key_of,
                       std::function<std::string(std::string_view)> instance_of, int size,
                       std::chrono::milliseconds lease_ttl)
    : store_(store),
      key_of_(std::move(key_of)),
      instance_of_(std::move(instance_of)),
      lease_ttl_(lease_ttl),
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

Result<Membership::Roll> Membership::call(const std::function<bool(int)>& heal) {
  Roll roll(instances_.size());
  for (int r = 0; r < size(); ++r) {
    auto lease = get(r);
    if (!lease.ok()) return lease.status();
    roll[static_cast<size_t>(r)] = std::move(*lease);
  }
  auto waited = [&] {
    std::vector<int> out;
    for (int r = 0; r < size(); ++r)
      if (!roll[static_cast<size_t>(r)] && heal && heal(r)) out.push_back(r);
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
  for (int r = 0; r < size(); ++r) {
    const std::optional<std::string>& lease = roll[static_cast<size_t>(r)];
    std::optional<std::string> instance = lease ? std::optional<std::string>(instance_of_(*lease)) : std::nullopt;
    if (instance != instances_[static_cast<size_t>(r)]) {
      instances_[static_cast<size_t>(r)] = std::move(instance);
      changed = true;
    }
  }
  if (changed) ++epoch_;
  return roll;
}

}  // namespace ferry::engine

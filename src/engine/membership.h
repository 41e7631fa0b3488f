// engine/membership.h — one side of a job as the store's leases say (internal): the
// members a rank reads from or serves, as data. A roll call reads every rank's lease
// once. A lease that is gone may be healing (a holder that resumed from a pause, or a
// store that restarted and lost every lease, renews within ttl/3 once it runs): a rank
// its owner still counts on is given up to one lease_ttl to come back, the one rule both
// sides apply. The epoch advances whenever the set of live instances (rank -> instance)
// changes or the world is resized, so an owner that keeps per-member state (connections,
// imports, routes) rebuilds it then and only then.
//
// Threading: one owner thread (the sync thread). Errors: the store's, other than a lease
// not found, which is an absent member.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"
#include "ferry/store.h"

namespace ferry::engine {

class Membership {
 public:
  // `key_of(r)`: rank r's lease key. `instance_of(value)`: the part of a lease value that
  // names its instance (what a restart changes; not what the holder updates as it runs,
  // as a consumer's versions). `size`: the ranks of the side now.
  Membership(Store& store, std::function<std::string(int)> key_of,
             std::function<std::string(std::string_view)> instance_of, int size, std::chrono::milliseconds lease_ttl);

  int size() const { return static_cast<int>(instances_.size()); }
  uint64_t epoch() const { return epoch_; }
  // The side has n ranks from now on (between syncs); a new epoch when n differs.
  void resize(int n);

  // Every rank's lease now, nullopt where absent. `heal(r)`: whether an absent rank r is
  // waited for (all of them at once, up to one lease_ttl). A new epoch when the live
  // instances differ from the last roll's.
  using Roll = std::vector<std::optional<std::string>>;
  Result<Roll> call(const std::function<bool(int)>& heal);

 private:
  Result<std::optional<std::string>> get(int r);

  Store& store_;
  std::function<std::string(int)> key_of_;
  std::function<std::string(std::string_view)> instance_of_;
  std::chrono::milliseconds lease_ttl_;
  std::vector<std::optional<std::string>> instances_;  // per rank, as the last roll found it
  uint64_t epoch_ = 0;
};

}  // namespace ferry::engine

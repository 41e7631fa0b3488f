// engine/membership.h — one side of a job as the store's leases say (internal): the
// members a rank reads from or serves, as data. A roll call reads every rank's lease
// once. A lease that is gone may be healing (a holder that resumed from a pause, or a
// store that restarted and lost every lease, renews within ttl/3 once it runs): a rank
// its owner still counts on is given up to one lease_ttl to come back, the one rule both
// sides apply. The epoch advances whenever the set of live instances (rank -> instance)
// changes or the world is resized, so an owner that keeps per-member state (connections,
// imports, routes) rebuilds it then and only then. A rank whose lease is gone and that
// left on purpose (its left mark set: Consumer::leave) is not waited for: it left.
//
// Threading: one owner thread (the sync thread). Errors: the store's, other than a lease
// not found, which is an absent member.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
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
  // `left_key_of(r)`: rank r's left mark (null: ranks of this side never leave).
  Membership(Store& store, std::function<std::string(int)> key_of,
             std::function<std::string(std::string_view)> instance_of, int size, std::chrono::milliseconds lease_ttl,
             std::function<std::string(int)> left_key_of = nullptr);

  int size() const { return static_cast<int>(instances_.size()); }
  uint64_t epoch() const { return epoch_; }
  // The side has n ranks from now on (between syncs); a new epoch when n differs.
  void resize(int n);

  // Every rank's lease now, nullopt where absent. `heal(r)`: whether an absent rank r is
  // waited for (all of them at once, up to one lease_ttl). A new epoch when the live
  // instances differ from the last roll's.
  using Roll = std::vector<std::optional<std::string>>;
  Result<Roll> call(const std::function<bool(int)>& heal);
  // The ranks the last roll found absent and left on purpose, and those whose instance
  // appeared or changed since the roll before it (none at the first roll).
  const std::set<int>& left() const { return left_; }
  std::vector<int> joined() const { return joined_; }
  // Whether rank r left on purpose now (its left mark set), read from the store.
  Result<bool> has_left(int r);

 private:
  Result<std::optional<std::string>> get(int r);

  Store& store_;
  std::function<std::string(int)> key_of_;
  std::function<std::string(std::string_view)> instance_of_;
  std::chrono::milliseconds lease_ttl_;
  std::function<std::string(int)> left_key_of_;
  std::vector<std::optional<std::string>> instances_;  // per rank, as the last roll found it
  std::set<int> left_;
  std::vector<int> joined_;
  bool called_ = false;
  uint64_t epoch_ = 0;
};

}  // namespace ferry::engine

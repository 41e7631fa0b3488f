// engine/rendezvous.h — what every participant builds the same routes from, fetched
// once at rendezvous, and the routes rebuilt when producers fail over (internal).
// Routes are a pure function of these inputs and of the set of producers marked dead
// in the store, so participants that read the same dead set run the same routes
// without any routes crossing the wire.
#pragma once

#include <functional>
#include <set>
#include <vector>

#include "engine/protocol.h"
#include "ferry/engine.h"

namespace ferry::engine {

struct RouteInputs {
  std::vector<TensorDecl> metadata;
  std::vector<Holdings> holdings;  // per producer
  std::vector<Plan> plans;         // per consumer
};

// Waits (rendezvous_timeout) for every producer's holdings and every consumer's plan.
Result<RouteInputs> rendezvous_inputs(Store& store, const JobKeys& keys, const EngineOptions& options,
                                      const std::vector<TensorDecl>& metadata);

// The routes one participant runs by, and the producers excluded from them. Not
// thread-safe: owned by the participant's sync thread.
class RouteState {
 public:
  RouteState(Store& store, JobKeys keys, bool failover) : store_(store), keys_(std::move(keys)), failover_(failover) {}

  // Takes the rendezvous inputs, reads the dead set (failover on) and builds the first routes.
  Result<Routes> start(RouteInputs inputs);
  const RouteInputs& inputs() const { return inputs_; }
  const std::set<int>& dead() const { return dead_; }

  // Producers marked dead in the store ({job}/dead/{p}); empty with failover off.
  Result<std::set<int>> read_dead() const;
  // build_routes over the inputs with the holdings of `dead` emptied (indices kept).
  Result<Routes> routes_without(const std::set<int>& dead) const;
  // Marks `dead` in the store, for every participant's next refresh.
  Status mark_dead(const std::set<int>& dead) const;

  // When the dead set in the store differs from dead(): builds routes without it and
  // hands them to `apply`; dead() follows only when apply succeeds. OK and no call when
  // nothing changed (or failover is off).
  Status refresh(const std::function<Status(Routes)>& apply);
  // After a failover decided here: routes without `dead` handed to `apply`, then dead() = dead.
  Status adopt(const std::set<int>& dead, Routes routes, const std::function<Status(Routes)>& apply);

 private:
  Store& store_;
  JobKeys keys_;
  bool failover_;
  RouteInputs inputs_;
  std::set<int> dead_;
};

std::string encode_decls(const std::vector<TensorDecl>& decls);
Result<std::vector<TensorDecl>> decode_decls(std::string_view text);
std::string encode_holdings(const Holdings& h);
Result<Holdings> decode_holdings(std::string_view text);

}  // namespace ferry::engine

// engine/rendezvous.h — what every participant builds the same routes from, fetched
// once at rendezvous, and the routes rebuilt when producers fail over (internal).
// Routes are a pure function of these inputs and of the set of producers marked dead
// in the store, so participants that read the same dead set run the same routes
// without any routes crossing the wire.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/protocol.h"
#include "ferry/engine.h"

namespace ferry::engine {

struct RouteInputs {
  std::vector<TensorDecl> metadata;
  std::vector<Holdings> holdings;  // per producer
  std::vector<Plan> plans;         // per consumer
  // Every rank's host as its first instance published it (JobKeys::host).
  std::vector<std::string> producer_hosts, consumer_hosts;
  // Per consumer: the host it relays within (its host where JobKeys::relays says it
  // relays; "" where it does not).
  std::vector<std::string> relay_hosts;
};

// Relay groups for the group order (GroupOrderOptions::relay_group): per consumer, the
// lowest consumer of the same plan class that relays within the same host, or -1 where
// it relays with nobody. Under the rotated order a group reads in one cohort, so its
// members can copy each group from its relay as it lands (docs/relay.md).
std::vector<int> relay_groups(const RouteInputs& inputs, const std::vector<uint32_t>& consumer_plan);

// What a rank publishes once, before its holdings or plan (JobKeys::host, relays): the
// first instance of the rank writes `value` and every later one keeps what is there
// (compare_set on an absent key), so every participant, whenever it meets, reads the same
// inputs (the same group order, the same delta_runs). Returns the value the store holds
// (for republish).
Result<std::string> publish_once(Store& store, const std::string& key, const std::string& value);

// Who is waiting (for errors and the world-size check).
struct Participant {
  const char* role = "producer";  // "producer" | "consumer"
  int rank = 0;
};

// Whether delta syncs run in this job (EngineOptions::delta): not where every rank was on
// one host when it met, unless delta_same_host. There the bytes move over shared memory
// faster than they are encoded and applied, and without delta both sides keep their zero
// copy paths (served in place, read into params). Every rank decides the same from the
// same inputs.
bool delta_runs(const EngineOptions& options, const RouteInputs& inputs);

// World sizes: every participant publishes the num_producers / num_consumers it was
// given, in the name of a key under {job}/world/ (so one list() reads them all, with a
// ttl of rendezvous_timeout: they matter only while ranks meet, and a later job under
// the same prefix with other sizes is not refused because of them). A participant
// whose sizes differ from another's fails at once, naming both.
// publish_world refuses first a job name that could collide with another job's keys
// (JobKeys::check).
// The same key names the choices every rank must share because they shape the routes,
// the order they run in or what crosses the wire (routing_choices: "{group_order}.
// {convert_on}", e.g. "rotated.producer", with ".quantize-consumer", ".push",
// ".checksums", ".delta" and ".delta-same-host" appended where quantize_on is the
// consumer, mode is push, checksums, delta and delta_same_host are on); a participant whose
// choices differ fails at once, naming each option that differs and both values.
std::string routing_choices(const EngineOptions& options);
Status publish_world(Store& store, const JobKeys& keys, const EngineOptions& options, Participant me);
Status check_world(Store& store, const JobKeys& keys, const EngineOptions& options, Participant me);

// Store::wait for `wanted` within rendezvous_timeout, checking between slices (250 ms)
// the world sizes (a mismatch fails in well under a second rather than at the timeout)
// and the failures other participants published (publish_failure): one that stays
// published for kFailureGrace fails this wait with PeerFailed naming that participant
// and its reason, within a few seconds rather than at the timeout. (The grace lets a
// rank of a job relaunched under the same name at once take back its earlier instance's
// failure when it starts, before it fails the others.) A timeout says the time really
// waited and the keys still missing.
inline constexpr std::chrono::milliseconds kFailureGrace{2000};
Status await_keys(Store& store, const JobKeys& keys, const EngineOptions& options, Participant me,
                  const std::vector<std::string>& wanted, std::string_view what);

// --- Membership: a rank is held by one instance ------------------------------------------
//
// claim_rank: the first thing a participant writes. It claims {job}/instance/{role}/{rank}
// for this instance (Store::claim_lease of `instance`, a unique id naming the process,
// its pid and host: instance_name(); renewed every lease_ttl/3 for the instance's life). A rank another instance keeps
// alive is refused: AlreadyExists naming the rank and the holder, and nothing of the
// holder's is touched (a second process started with a running rank's number, or a
// second set of trainer ranks, takes nothing over). A holder that died stops renewing and
// its claim lapses within lease_ttl, so a restarted rank retries for up to 1.5 lease_ttl
// and takes the rank (an instance destroyed in-process releases it at once; a holder
// whose process is gone from this host's pid space — a rank killed and restarted on its
// host — is taken over at once, by compare-set from its value). Once held,
// the failure an earlier instance of this rank published is taken back (publish_failure).
// Refuses a job name that could collide with another job's keys first (JobKeys::check).
Result<std::unique_ptr<Lease>> claim_rank(Store& store, const JobKeys& keys, const EngineOptions& options,
                                          Participant me, const std::string& instance);

// OK while `claim` is held. Once another instance took the rank (this one was away past
// lease_ttl — paused, cut off — and a restart of the rank claimed it meanwhile: the Lease
// is lost), FailedPrecondition naming the rank and the new holder: this instance syncs no
// more (it would serve or take a rank that is no longer its own).
Status check_claim(const Lease& claim, Store& store, Participant me, const std::string& instance);

// What an instance of this process is called in claims and failures: "instance 1f..e4
// (pid 4242 on host-a, pid space 5c..9a)", unique per call (the pid space:
// common::process_space_tag, which claim_rank compares before it looks the pid up).
std::string instance_name();

// A participant whose create() failed publishes why under {job}/failed/{role}/{rank}
// (value: `instance` and the status; ttl rendezvous_timeout, like the world keys: it
// matters while ranks meet), for the others' await_keys — except failures that are not
// its own: a refused claim (AlreadyExists), another participant's published failure
// (PeerFailed), and a job name that could collide. Best effort: a store error is ignored
// (the caller returns `why` either way).
void publish_failure(Store& store, const JobKeys& keys, const EngineOptions& options, Participant me,
                     const std::string& instance, const Status& why);

// Waits (rendezvous_timeout) for every producer's holdings and every consumer's plan.
Result<RouteInputs> rendezvous_inputs(Store& store, const JobKeys& keys, const EngineOptions& options,
                                      Participant me, const std::vector<TensorDecl>& metadata);

// What a participant published once at create (producer: metadata on rank 0 and its
// holdings; consumer: its plan), key -> value. A store that restarted without its data
// (the embedded store, or Redis without persistence) has lost them, and a rank that
// starts later would wait for them in vain: republish() writes back each one that is
// gone (checked with one list() per key, so a sync pays a round trip each, not the
// values) and says how many it wrote. The leases heal by themselves (Lease). Store
// errors are returned as they are (they name the store).
using Published = std::vector<std::pair<std::string, std::string>>;
Result<int> republish(Store& store, const Published& published);

// A participant's registration in the job's store, one per producer or consumer (its
// create() fills it; released, in this order, when it is destroyed): this instance's
// name and its claim on the rank (claim_rank), what it published (put back by republish
// if the store lost it), and its lease (its address and what peers import; renewed by
// the store's heartbeat every ttl/3, so a paused or dead instance's lapses) with the
// value it holds now (the side's encoding: encode_lease).
struct Registration {
  const std::string instance = instance_name();
  std::unique_ptr<Lease> claim;
  Published published;
  std::unique_ptr<Lease> lease;
  std::string lease_value;
};

// Gives leases that are gone the time to heal: a holder that resumed (from a pause, or
// after the store restarted or paused and every lease lapsed) renews within ttl/3 once
// it runs. While `missing()` is true and less than one lease_ttl has passed, sleeps a
// poll (ttl/10, between 1 and 50 ms) and calls `again()` (which looks again). Both
// sides use it: a consumer for a producer's lease, a producer for its consumers'.
void heal_leases(std::chrono::milliseconds lease_ttl, const std::function<bool()>& missing,
                 const std::function<void()>& again);

// "0,2,5": a set of ranks as reports and errors print them.
std::string rank_list(const std::set<int>& ranks);

// The routes one participant runs by, and the producers excluded from them. Not
// thread-safe: owned by the participant's sync thread.
class RouteState {
 public:
  RouteState(Store& store, JobKeys keys, bool failover, RouterOptions router = {})
      : store_(store), keys_(std::move(keys)), failover_(failover), router_(router) {}

  // Takes the rendezvous inputs, reads the dead set (failover on) and builds the first routes.
  Result<Routes> start(RouteInputs inputs);
  const RouteInputs& inputs() const { return inputs_; }
  const std::set<int>& dead() const { return dead_; }

  // Producers marked dead in the store ({job}/dead/{p}); empty with failover off. Only
  // keys of exactly that form count (JobKeys::dead_rank), with p below the number of
  // producers once start() has the inputs.
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
  // Whose ops the routes it builds hold (producer_/consumer_router_options).
  const RouterOptions& router() const { return router_; }

 private:
  Store& store_;
  JobKeys keys_;
  bool failover_;
  RouterOptions router_;
  RouteInputs inputs_;
  std::set<int> dead_;
};

std::string encode_decls(const std::vector<TensorDecl>& decls);
Result<std::vector<TensorDecl>> decode_decls(std::string_view text);
std::string encode_holdings(const Holdings& h);
Result<Holdings> decode_holdings(std::string_view text);

}  // namespace ferry::engine

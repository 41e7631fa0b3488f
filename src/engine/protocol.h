// engine/protocol.h — the engine's wire and store formats (internal): the typed control
// messages producers and consumers exchange over the Transport, the typed leases each
// publishes in the store, and the store's key names. Every format has one encode and
// one decode, side by side here; decoding takes untrusted bytes (exact lengths, known
// types, flags 0/1) and never reads past them (fuzz/engine_protocol_fuzz.cpp).
//
// The messages of one sync (see ferry/engine.h for the protocol they make):
//   pull:  p -> c  Announce   group g of version v is packed at slot_offset of p's staging
//                             (delta: c's segment there may be a patch, the dense bytes
//                             at dense_offset)
//          c -> p  Release    c has read (v, g) (the patch or the dense bytes): p may
//                             reuse the slot
//   push:  c -> p  Ready      c's receive slot `recv_slot` is free for (v, g)
//          p -> c  Pushed     (v, g) is written into receive slot `recv_slot` and flushed
//   both:  p -> c  Dropped    c was dropped from sync v
//          c -> p  Abort      c gave up sync v
//          c -> p  Done       c committed v
//   membership:
//          c -> p  Leave      c left the job on purpose (Consumer::leave): not missed
//   failover:
//          c -> p  Failover   c runs sync v with routes `routes` (producers marked dead
//                             in the store excluded); p restarts v with them
//          p -> c  RoutesNotice  p runs sync v with routes `routes` (after a failover)
//          p -> c  Flushed    (push) answer to Failover or Abort: no write of other routes
//                             (Abort: of that sync) to c in flight, into its ring or params
//   relay within a host (ConsumerOptions::relay, docs/relay.md), between consumers of one
//   plan class on one host:
//          c -> r  Relay ask      c's receive slot is free for (v, g): offer it when you have it
//          r -> c  Relay offer    (v, g) lies verified at `offset` of r's receive ring: read it
//          r -> c  Relay gone     r cannot offer (v, g) (its slot was reused, or it reads
//                                 none of it): read it from the producers
//          c -> r  Relay release  c's read of the offer ended
//          r -> c  Relay kept     r kept the slot intact throughout: the bytes are good
//          r -> c  Relay cut      r reused the slot before the release: read from the producers
//   and c -> p Release{took kRelayed} for a group copied from the relay (nothing read from p).
//   catch-up (Consumer::catch_up, docs/elastic.md), between a joiner j and a replica s of
//   its plan class that holds the live version:
//          j -> s  Replica ask      let me read your live params of version v
//          s -> j  Replica offer    read them as the serving table in the store says (set
//                                   `set`, table hash `table`); held unchanged until done
//          s -> j  Replica refuse   not now (syncing, another version, nothing to serve)
//          j -> s  Replica done     the reads ended
//          s -> j  Replica intact   the params were held unchanged throughout: the bytes are good
//          s -> j  Replica revoked  the hold was given up (its next sync could not wait): discard them
// Every message carries the sender's rank, the version and the hash of the routes the
// sender runs (or, for Pushed, laid the bytes out by).
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/fields.h"
#include "ferry/status.h"

namespace ferry::engine {

// Transport tag of every engine message.
inline constexpr uint32_t kEngineTag = 0xFE770001u;
// Slots of a consumer's receive ring: a Ready naming another slot is refused.
inline constexpr uint32_t kReceiveSlots = 2;

struct Announce {
  uint32_t producer = 0;
  uint64_t version = 0;
  int32_t group = 0;
  uint64_t routes = 0;
  uint64_t slot_offset = 0;              // byte offset of the group in the staging ring
  std::optional<uint64_t> checksum;      // checksums on: xxHash64 of c's segment
  // Delta syncs (EngineOptions::delta): c's segment is a patch (src/delta/patch.h) of
  // `patch_bytes` against version `patch_base` of the same bytes, laid out as the group at
  // `patch_offset` of the staging ring (the slot itself, or its patch area without a
  // kept copy), and the group's dense bytes lie at `dense_offset` (the kept copy, or the
  // slot) for a consumer that does not hold that version. A GPU staging slot (CUDA IPC,
  // at slot_offset) is never patched. Absent base: the segment is dense at slot_offset
  // (the patch fields 0).
  std::optional<uint64_t> patch_base;
  uint64_t patch_bytes = 0;
  uint64_t dense_offset = 0;
  uint64_t patch_offset = 0;
  friend bool operator==(const Announce&, const Announce&) = default;
};
struct Release {
  uint32_t consumer = 0;
  uint64_t version = 0;
  int32_t group = 0;
  uint64_t routes = 0;
  // What c read of its segment (what the producer's report counts): the dense bytes, the
  // announced patch, the patch and then the dense bytes (the patch failed its check:
  // repaired), or nothing (c copied the group from a relay on its host; in push mode too:
  // no write to c is owed for it). One byte on the wire, 0-3.
  enum Took : uint8_t { kDense = 0, kPatch = 1, kRepaired = 2, kRelayed = 3 };
  uint8_t took = kDense;
  friend bool operator==(const Release&, const Release&) = default;
};
struct Ready {
  uint32_t consumer = 0;
  uint64_t version = 0;
  int32_t group = 0;
  uint64_t routes = 0;
  uint32_t recv_slot = 0;
  // Which of the consumer's two published param sets the producer writes params into
  // (ParamTable::keys: 0, ParamTable::other_keys: 1): the shadow of a consumer that
  // commits by a flip alternates between them. 0 for every other consumer.
  uint8_t landing = 0;
  // Delta syncs: the version c's live params hold, intact, for this group, and that it
  // takes a patch against (absent: write it the dense bytes).
  std::optional<uint64_t> base;
  friend bool operator==(const Ready&, const Ready&) = default;
};
struct Pushed {
  uint32_t producer = 0;
  uint64_t version = 0;
  int32_t group = 0;
  uint64_t routes = 0;
  uint32_t recv_slot = 0;
  std::optional<uint64_t> checksum;
  // Delta syncs: what was written into the receive slot at c's segment is a patch of
  // `patch_bytes` against version `patch_base`, the group's dense bytes at `dense_offset`
  // of p's staging ring (c reads them there if the patch fails its check). Absent base:
  // the dense bytes were written (patch_bytes and dense_offset 0).
  std::optional<uint64_t> patch_base;
  uint64_t patch_bytes = 0;
  uint64_t dense_offset = 0;
  friend bool operator==(const Pushed&, const Pushed&) = default;
};
struct Dropped {
  uint32_t producer = 0;
  uint64_t version = 0;
  uint64_t routes = 0;
  std::string reason;  // why (at most kMaxReasonBytes; longer is cut on encode)
  friend bool operator==(const Dropped&, const Dropped&) = default;
};
struct Abort {
  uint32_t consumer = 0;
  uint64_t version = 0;
  uint64_t routes = 0;
  // Why it gave up (its sync's error, at most kMaxReasonBytes): the producers' drop lines
  // say it, so a surviving producer names the producer whose death ended the sync.
  std::string reason;
  friend bool operator==(const Abort&, const Abort&) = default;
};
struct Done {
  uint32_t consumer = 0;
  uint64_t version = 0;
  uint64_t routes = 0;
  friend bool operator==(const Done&, const Done&) = default;
};
struct Failover {
  uint32_t consumer = 0;
  uint64_t version = 0;
  uint64_t routes = 0;
  friend bool operator==(const Failover&, const Failover&) = default;
};
struct RoutesNotice {
  uint32_t producer = 0;
  uint64_t version = 0;
  uint64_t routes = 0;
  friend bool operator==(const RoutesNotice&, const RoutesNotice&) = default;
};
// A consumer entered sync `version` (sent to each producer it reaches as the sync
// begins): from then on it can lag the others as a straggler; before it, only the join
// window applies (EngineOptions::join_window).
struct Join {
  uint32_t consumer = 0;
  uint64_t version = 0;
  uint64_t routes = 0;
  friend bool operator==(const Join&, const Join&) = default;
};
// A consumer left the job on purpose (Consumer::leave; sent to each producer it
// reaches): not waited for from now on, and not missed. `version`: the last it committed
// (0: none).
struct Leave {
  uint32_t consumer = 0;
  uint64_t version = 0;
  uint64_t routes = 0;
  friend bool operator==(const Leave&, const Leave&) = default;
};
struct Flushed {
  uint32_t producer = 0;
  uint64_t version = 0;
  uint64_t routes = 0;
  friend bool operator==(const Flushed&, const Flushed&) = default;
};

// Between two consumers of one plan class on one host (relay within a host): the header
// above lists the kinds. `consumer` is the sender's rank, `offset` the group's byte offset
// in the relay's receive ring (kOffer only; 0 otherwise).
struct Relay {
  enum Kind : uint8_t { kAsk, kOffer, kGone, kRelease, kKept, kCut };
  static constexpr uint8_t kMaxKind = kCut;
  uint32_t consumer = 0;
  uint64_t version = 0;
  int32_t group = 0;
  uint64_t routes = 0;
  uint8_t kind = kAsk;
  uint64_t offset = 0;
  friend bool operator==(const Relay&, const Relay&) = default;
};

// Between a joiner and a replica of its plan class (catch-up): the header above lists the
// kinds. `consumer` is the sender's rank, `plan` the hash of the plan class both are of;
// `set` (which published set of the serving table holds the live params: 0, or 1 for one
// that flips) and `table` (XXH3-64 of the serving table in the store) only in an offer.
struct Replica {
  enum Kind : uint8_t { kAsk, kOffer, kRefuse, kDone, kIntact, kRevoked };
  static constexpr uint8_t kMaxKind = kRevoked;
  uint32_t consumer = 0;
  uint64_t version = 0;
  uint64_t plan = 0;
  uint8_t kind = kAsk;
  uint8_t set = 0;
  uint64_t table = 0;
  friend bool operator==(const Replica&, const Replica&) = default;
};

inline constexpr size_t kMaxReasonBytes = 1024;

using Message =
    std::variant<Announce, Release, Ready, Pushed, Dropped, Abort, Done, Failover, RoutesNotice, Flushed, Join, Relay,
                 Leave, Replica>;

// The sender's rank (producer or consumer, by message type), version and routes.
uint32_t sender_of(const Message& m);
uint64_t version_of(const Message& m);
const char* message_name(const Message& m);

std::vector<std::byte> encode_message(const Message& m);
// Exact-length, known-type, magic-checked decoding; kCorrupt otherwise.
Result<Message> decode_message(std::span<const std::byte> bytes);

// ---------------------------------------------------------------------------------------
// Leases ({job}/producer/{p}, {job}/consumer/{c}): what a peer needs to reach a rank.

struct ProducerLease {
  std::string address;      // Transport::address()
  std::string staging_key;  // exported key of the staging ring
  uint64_t slot_bytes = 0;  // bytes per staging slot
  std::string in_place;     // InPlaceTable::encode() ("" when nothing is served in place)
  std::string cuda_ipc;     // encode_cuda_ipc() of its GPU staging ring ("" when staging is host memory)
  friend bool operator==(const ProducerLease&, const ProducerLease&) = default;
};
struct ConsumerLease {
  std::string address;           // Transport::address()
  std::string recv_key;          // exported key of the receive ring (push writes there)
  uint64_t recv_slot_bytes = 0;  // bytes per receive slot
  std::string params;            // ParamTable::encode() (push: where producers may write into params)
  std::string host;              // host_identity() of its process (relay within a host)
  // The version its live params hold (committed) and one received into the shadow and
  // waiting for commit() or discard() (CommitPolicy::kShadow), absent when none: the
  // consumer updates its lease as they change (Lease::update), so that producers, and
  // anyone reading the store, know which version each consumer serves.
  std::optional<uint64_t> committed, received;
  // The lease without the versions: what names the instance and its memory (a producer
  // reconnects when this changes, not when a version does).
  ConsumerLease instance() const {
    ConsumerLease l = *this;
    l.committed.reset();
    l.received.reset();
    return l;
  }
  friend bool operator==(const ConsumerLease&, const ConsumerLease&) = default;
};
std::string encode_lease(const ProducerLease& l);
std::string encode_lease(const ConsumerLease& l);
Result<ProducerLease> decode_producer_lease(std::string_view blob);
Result<ConsumerLease> decode_consumer_lease(std::string_view blob);
// The instance a consumer's lease value names (encode_lease of its instance(): not the
// versions it updates as it commits); a value that does not decode, as it is.
std::string consumer_instance(std::string_view blob);

// The leases' framing: a store blob of length-prefixed fields (common/fields.h, which
// the tools' own blobs use too).
using fields::bytes_to_string;
using fields::decode_fields;
using fields::encode_fields;
using fields::parse_u64_field;
using fields::string_bytes;
using fields::u64_field;

// ---------------------------------------------------------------------------------------
// Store keys of one job (every key under the prefix `job/`).
//
// Job names cannot collide: a name is 1..kMaxJobBytes bytes with no '/' (the key
// separator) and no control character (check()), so the first '/' of every key ends the
// job's name and no job's keys lie under another's (a job named 'j/dead/1' would write
// j/dead/1/meta, under job j's dead marks). Every key listed back is parsed exactly:
// the whole rest of the key, canonical decimals in range, or it is not one of ours.
class JobKeys {
 public:
  static constexpr size_t kMaxJobBytes = 256;
  explicit JobKeys(std::string job) : job_(std::move(job)) {}
  // InvalidArgument naming the job and the rule it breaks.
  static Status check(std::string_view job);
  const std::string& job() const { return job_; }
  std::string meta() const;               // trainer metadata (JSON; producer 0)
  std::string holdings(int p) const;      // producer p's holdings (JSON)
  std::string plan(int c) const;          // consumer c's canonical plan
  // A rank's host, and whether consumer c relays ("1" or "0": ConsumerOptions::relay), as
  // the rank's first instance published them before its holdings or plan (rendezvous.h,
  // publish_once).
  std::string host(std::string_view role, int rank) const;
  std::string relays(int c) const;
  std::string producer(int p) const;      // producer p's lease
  std::string consumer(int c) const;      // consumer c's lease
  // Consumer c left the job on purpose (Consumer::leave): the instance that left. A new
  // instance of c clears it as it registers.
  std::string left(int c) const;
  // Where consumer c's live params lie for joiners (a ParamTable of its registered live
  // sets, published once it holds a version: Consumer::catch_up), and the joiners
  // catching up now (the instance, with a ttl: a joiner that died stops counting).
  std::string serving(int c) const;
  std::string catching_up(int c) const;
  std::string dead(int p) const;          // producer p failed over (failover)
  std::string dead_prefix() const;
  // The world sizes a participant was given and the choices that shape the routes
  // (`routing`: rendezvous.h, routing_choices), in the key's name (rendezvous.h).
  std::string world(std::string_view role, int rank, int num_producers, int num_consumers,
                    std::string_view routing) const;
  std::string world_prefix() const;
  std::string committed(int c) const;     // the last version consumer c committed
  // Producer p's digest of every box it served in its last sync (EngineOptions::weight_digests).
  std::string digest(int p) const;
  // The instance that holds a rank ({job}/instance/{role}/{rank}; rendezvous.h, claim_rank).
  std::string instance(std::string_view role, int rank) const;
  // Why a participant failed to join ({job}/failed/{role}/{rank}; rendezvous.h,
  // publish_failure). Its rank may lie outside the world (that may be why it failed).
  std::string failed(std::string_view role, int rank) const;
  std::string failed_prefix() const;

  // Parses of keys listed back (nullopt for any key that is not exactly of that form):
  // the producer a dead mark names ({job}/dead/{p}), a world key's fields, and the
  // participant a failure names (a canonical decimal rank, "-1" included).
  std::optional<int> dead_rank(std::string_view key) const;
  struct World {
    std::string role;  // "producer" | "consumer"
    int rank = 0, num_producers = 0, num_consumers = 0;
    std::string routing;  // no '/'
  };
  std::optional<World> world_of(std::string_view key) const;
  struct Failed {
    std::string role;  // "producer" | "consumer"
    int rank = 0;
  };
  std::optional<Failed> failed_of(std::string_view key) const;

 private:
  std::string job_;
};

}  // namespace ferry::engine

// engine/weight_digests.h — the weight checker's digests (EngineOptions::weight_digests;
// Consumer::check_weights): what each side held, as XXH3-64 per box or param, taken as it
// held it, so that what holds later (or what another replica holds) can be compared.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "engine/protocol.h"
#include "ferry/engine.h"
#include "ferry/source.h"
#include "ferry/store.h"
#include "ferry/tensor.h"

namespace ferry::engine {

// XXH3-64 of a host tensor's bytes; nullopt for device memory or a strided view.
std::optional<uint64_t> tensor_digest(const Tensor& t);

// Producer: the digests of the boxes it materialised in one sync, published after it as
// {job}/digest/{rank}: {"version": v, "boxes": {"NAME [0:4, 0:8]": "16 hex digits"}}.
// The sync thread only.
class BoxDigests {
 public:
  void begin(uint64_t version);
  void add(const Holdings& held, const std::vector<LocalBox>& boxes);
  Status publish(Store& store, const JobKeys& keys, int rank) const;

 private:
  uint64_t version_ = 0;
  std::map<std::string, uint64_t> boxes_;
};

// Consumer: the digests of its params as a version went live, and the check against them
// and against the producers' published boxes. The caller's thread (between syncs).
class ParamDigests {
 public:
  void take(uint64_t version, const TensorMap& live);
  Result<WeightCheck> check(const TensorMap& live, Store& store, const JobKeys& keys, int num_producers) const;

 private:
  std::optional<uint64_t> version_;
  std::map<std::string, std::optional<uint64_t>> params_;  // nullopt: not hashed (GPU memory)
};

// Whether a sync moved the same weights as the previous one (SyncReport::unchanged),
// from the checksums producers already send (EngineOptions::checksums): per layer group,
// the checksum of each segment (keyed by plan class on the producer, by producer on the
// consumer), compared with the last successful sync's over the same routes. A trainer
// that serves version 7 with version 6's bytes (an adapter never updated, a frozen draft)
// is told so instead of reporting a sync of nothing new. Unknown (nullopt) without
// checksums, when a group came without them (relay, a catch-up), when the routes changed
// during the sync or since the compared one, or for the first sync. The sync thread only.
class ContentWatch {
 public:
  void begin(uint64_t routes_hash);
  // The checksums of group g as this attempt moved it (a group moved again replaces
  // them); empty: it came without checksums.
  void add(int group, const std::map<int64_t, uint64_t>& sums);
  // The sync's answer; a successful one (`ok`) becomes the next sync's reference, a
  // failed one leaves none (what it left live is not what the reference moved).
  std::optional<bool> finish(uint64_t routes_hash, bool ok);
  // No reference: the live params changed otherwise (a catch-up, a received version
  // dropped, a failed sync), so the next sync cannot be compared with the last one.
  void forget() { last_.reset(); }

 private:
  uint64_t hash_ = 0;
  bool unknown_ = false;
  std::map<int, std::map<int64_t, uint64_t>> groups_;
  std::optional<std::pair<uint64_t, std::map<int, std::map<int64_t, uint64_t>>>> last_;
};

}  // namespace ferry::engine

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

}  // namespace ferry::engine

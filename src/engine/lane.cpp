#include "engine/lane.h"

#include <fmt/format.h>

#include "common/fields.h"
#include "engine/param_set.h"
#include "engine/schedule.h"

namespace ferry::engine {

const char* lane_name(LaneKind kind) {
  switch (kind) {
    case LaneKind::kTransport: return "transport";
    case LaneKind::kCudaIpc: return "cuda_ipc";
    case LaneKind::kRelay: return "relay";
  }
  return "unknown";
}

void TransportLane::connect(int p, const RemoteRegion& staging, std::vector<RemoteRegion> regions) {
  std::lock_guard<std::mutex> lk(mu_);
  remotes_[p] = Remote{staging, std::move(regions)};
}

Result<size_t> TransportLane::import(int p, const std::string& staging_key, const std::vector<std::string>& region_keys) {
  auto staging = transport_.import_key(fields::string_bytes(staging_key));
  if (!staging.ok()) return staging.status().with_context(fmt::format("staging key of producer {}", p));
  std::vector<RemoteRegion> regions;
  for (size_t k = 0; k < region_keys.size(); ++k) {
    auto r = transport_.import_key(fields::string_bytes(region_keys[k]));
    if (!r.ok()) return r.status().with_context(fmt::format("source region {} key of producer {}", k, p));
    regions.push_back(*r);
  }
  const size_t n = regions.size();
  connect(p, *staging, std::move(regions));
  return n;
}

Status TransportLane::check_in_place(int p, const InPlaceTable& table, const Holdings& holdings) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = remotes_.find(p);
  if (it == remotes_.end()) return not_found("consumer {}: producer {} is not connected", rank_, p);
  return table.check_regions(it->second.regions, holdings);
}

void TransportLane::disconnect(int p) {
  std::lock_guard<std::mutex> lk(mu_);
  remotes_.erase(p);
}

Result<RmaPath> TransportLane::rma_path(int p) const {
  RemoteRegion staging;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = remotes_.find(p);
    if (it == remotes_.end()) return not_found("consumer {}: producer {} is not connected", rank_, p);
    staging = it->second.staging;
  }
  return transport_.rma_path(staging);
}

bool TransportLane::viable(int p) const {
  std::lock_guard<std::mutex> lk(mu_);
  return remotes_.count(p) > 0;
}

std::string TransportLane::why_not(int p) const {
  return viable(p) ? std::string() : fmt::format("producer {} is not connected", p);
}

Status TransportLane::post(const Transfer& t, uint64_t at, uint64_t n, uint64_t staging_offset, uint64_t slot_offset,
                           std::vector<Completion>& ops) {
  const SubRead& sr = *t.read;
  RemoteRegion from;
  uint64_t remote = staging_offset + sr.remote + at;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = remotes_.find(t.producer);
    if (it == remotes_.end())
      return peer_failed("consumer {} reading group {} from producer {}: not connected", rank_, t.group, t.producer);
    from = it->second.staging;
    if (sr.region >= 0) {
      if (static_cast<size_t>(sr.region) >= it->second.regions.size())
        return out_of_range("consumer {} reading group {} from producer {}: source region {} not imported", rank_,
                            t.group, t.producer, sr.region);
      from = it->second.regions[static_cast<size_t>(sr.region)];
      remote = sr.remote + at;
    }
  }
  Result<Completion> c = Completion();
  if (sr.param) {
    params_.touch();  // params change from here on: a failure now leaves them torn
    const ParamSet::Landing to = params_.landing(sr);
    c = transport_.read(to.region, to.offset + at, from, remote, n);
  } else {
    c = transport_.read(ring_, slot_offset + sr.recv_offset + at, from, remote, n);
  }
  if (!c.ok())
    return c.status().with_context(fmt::format("consumer {} reading group {} from producer {}", rank_, t.group, t.producer));
  ops.push_back(*c);
  return Status::Ok();
}

Status RelayLane::connect(int relay, const std::string& recv_key) {
  disconnect();
  auto ring = transport_.import_key(fields::string_bytes(recv_key));
  if (!ring.ok())
    return unavailable("relay consumer {}'s receive ring not imported ({})", relay, ring.status().message());
  auto path = transport_.rma_path(*ring);
  if (!path.ok() || *path != RmaPath::kNative) {
    transport_.release_key(*ring).ignore();
    return unavailable("relay consumer {}'s receive ring is not reached natively (shared memory)", relay);
  }
  relay_ = relay;
  remote_ = *ring;
  return Status::Ok();
}

void RelayLane::disconnect() {
  if (relay_ < 0) return;
  transport_.release_key(remote_).ignore();
  relay_ = -1;
  remote_ = RemoteRegion{};
}

std::string RelayLane::why_not(int p) const {
  if (viable(p)) return std::string();
  return relay_ < 0 ? std::string("no relay connected") : fmt::format("consumer {} is not the relay ({} is)", p, relay_);
}

Status RelayLane::post(const Transfer& t, uint64_t at, uint64_t n, uint64_t staging_offset, uint64_t slot_offset,
                       std::vector<Completion>& ops) {
  if (relay_ < 0) return unavailable("consumer {} copying group {} from its relay: none connected", rank_, t.group);
  const SubRead& sr = *t.read;
  auto c = transport_.read(ring_, slot_offset + sr.recv_offset + at, remote_, staging_offset + sr.remote + at, n);
  if (!c.ok())
    return c.status().with_context(fmt::format("consumer {} copying group {} from relay consumer {}", rank_, t.group, relay_));
  ops.push_back(*c);
  return Status::Ok();
}

}  // namespace ferry::engine

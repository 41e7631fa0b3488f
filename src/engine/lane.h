// engine/lane.h — how the bytes of one transfer reach their landing on a consumer from
// one producer (internal). A *lane* is a way to move bytes; each is offered per producer
// and says whether it can reach it (viable / why_not, as tensorpipe's channels say
// isViable / canCommunicateWithRemote), and the attempt's plan (engine/sync_plan.h)
// picks one per transfer from what both ends can do. Three lanes today:
//   * the transport lane (TransportLane, here): Transport::read from the producer's
//     staging ring or, in place, from its source regions, into the receive slot or
//     straight into a param (ParamSet::landing). Push is the producer's side of the
//     same bytes (engine/push_writes.h: Transport::write, then flush).
//   * the CUDA IPC lane (CudaIpcLane, engine/cuda_ipc.h): device-to-device copies from a
//     producer's GPU staging on this host into the consumer's GPU receive ring.
//   * the relay lane (RelayLane, here): a member's copy of a whole group from the receive
//     ring of its host's relay consumer (docs/relay.md), over shared memory; its
//     "producer" is that relay and its "staging" the slot the relay offered.
// A later lane (GPU-direct RMA, say) is a third implementation, chosen per producer: the
// transport answers per imported region whether its reads are native
// (Transport::rma_path), which is what such a lane needs to know.
//
// Threading: connect/post on the consumer's sync thread, disconnect from any thread (a
// peer failure). Errors name the consumer, the group and the producer.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "engine/in_place.h"
#include "ferry/status.h"
#include "ferry/transport.h"

namespace ferry::engine {

struct SubRead;
class ParamSet;

enum class LaneKind : uint8_t {
  kTransport = 0,
  kCudaIpc = 1,
  kRelay = 2,
};
const char* lane_name(LaneKind kind);

// One transfer of an attempt: the bytes of sub-read `read` (engine/schedule.h: where
// they lie at the producer, where they land here) of layer group `group`, moved by lane
// `lane`. `read` points into the consumer's schedule (kept alive by it).
struct Transfer {
  LaneKind lane = LaneKind::kTransport;
  int group = 0;
  int producer = 0;
  const SubRead* read = nullptr;
};

class Lane {
 public:
  virtual ~Lane() = default;
  virtual LaneKind kind() const = 0;
  // Whether this lane reaches producer p now.
  virtual bool viable(int p) const = 0;
  // Why it does not although p offered it ("" when viable, or when p offered nothing).
  virtual std::string why_not(int p) const = 0;
  // Moves bytes [at, at + n) of t.read: from the producer's staging at `staging_offset`
  // (the announced slot's offset in its ring) + read->remote, or from its source region
  // read->region at read->remote (in place); into the receive slot at `slot_offset` +
  // read->recv_offset, or into the param read->param names. An asynchronous lane appends
  // the operation to `ops` (the caller waits); a synchronous one is done when it returns.
  virtual Status post(const Transfer& t, uint64_t at, uint64_t n, uint64_t staging_offset, uint64_t slot_offset,
                      std::vector<Completion>& ops) = 0;
};

// The transport lane of a consumer: reads over its Transport into its receive ring
// (`ring`, registered) and its params (`params`' landings; touched before a read into
// them, so a failure from then on leaves them torn). `transport`, `params` outlive it.
class TransportLane final : public Lane {
 public:
  TransportLane(int rank, Transport& transport, const MemoryRegion& ring, ParamSet& params)
      : rank_(rank), transport_(transport), ring_(ring), params_(params) {}

  // Producer p's staging ring and (pull, in place) its source regions, as imported from
  // its lease; replaces what p had.
  void connect(int p, const RemoteRegion& staging, std::vector<RemoteRegion> regions);
  // Imports the keys of p's lease (its staging key, its source regions' keys) and
  // connects them; how many source regions. The transport's error naming the key and
  // the producer (p is then a candidate for failover).
  Result<size_t> import(int p, const std::string& staging_key, const std::vector<std::string>& region_keys);
  // Producer p's in-place table against its source regions as imported (their lengths):
  // InPlaceTable::check_regions. kCorrupt naming the box when one lies outside its
  // region, kNotFound when p is not connected.
  Status check_in_place(int p, const InPlaceTable& table, const Holdings& holdings) const;
  void disconnect(int p);
  // How reads of p's staging travel (Transport::rma_path); kNotFound when not connected.
  Result<RmaPath> rma_path(int p) const;

  LaneKind kind() const override { return LaneKind::kTransport; }
  bool viable(int p) const override;
  std::string why_not(int p) const override;
  Status post(const Transfer& t, uint64_t at, uint64_t n, uint64_t staging_offset, uint64_t slot_offset,
              std::vector<Completion>& ops) override;

 private:
  struct Remote {
    RemoteRegion staging;
    std::vector<RemoteRegion> regions;
  };
  int rank_;
  Transport& transport_;
  MemoryRegion ring_;
  ParamSet& params_;
  mutable std::mutex mu_;
  std::map<int, Remote> remotes_;
};

// The relay lane of a consumer (ConsumerOptions::relay): copies whole groups into its
// receive ring (`ring`, registered) from the receive ring of the relay consumer it is
// connected to. It owns that ring's import. A transfer's `producer` is ignored (the
// connected relay's); its read covers the group's bytes in the slot (remote and
// recv_offset relative to the relay's offered slot and to ours). Threading: the
// consumer's sync thread only. `transport` outlives it.
class RelayLane final : public Lane {
 public:
  RelayLane(int rank, Transport& transport, const MemoryRegion& ring) : rank_(rank), transport_(transport), ring_(ring) {}
  ~RelayLane() override { disconnect(); }
  RelayLane(const RelayLane&) = delete;
  RelayLane& operator=(const RelayLane&) = delete;

  // Imports relay consumer `relay`'s receive ring from its lease's key, replacing the
  // ring connected before. Copies carried by messages would cost the relay's CPU and
  // could not finish while it is paused, so only a ring the transport maps natively
  // (RmaPath::kNative: shared memory) is taken. kUnavailable saying why otherwise (then
  // nothing is connected).
  Status connect(int relay, const std::string& recv_key);
  // Releases the import (nothing connected).
  void disconnect();
  int relay() const { return relay_; }  // -1: none

  LaneKind kind() const override { return LaneKind::kRelay; }
  bool viable(int p) const override { return relay_ >= 0 && p == relay_; }
  std::string why_not(int p) const override;
  Status post(const Transfer& t, uint64_t at, uint64_t n, uint64_t staging_offset, uint64_t slot_offset,
              std::vector<Completion>& ops) override;

 private:
  int rank_;
  Transport& transport_;
  MemoryRegion ring_;
  int relay_ = -1;
  RemoteRegion remote_;
};

}  // namespace ferry::engine

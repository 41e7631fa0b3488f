#include "simulate/simulate.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <unordered_map>

#include <fmt/format.h>
#include <simgrid/s4u.hpp>
#include <xbt/log.h>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FERRY_HAS_ASAN 1
#endif
#endif
#ifndef FERRY_HAS_ASAN
#define FERRY_HAS_ASAN 0
#endif

namespace ferry::simulate {

Result<Design> parse_design(std::string_view text) {
  if (text == "ferry") return Design::kFerry;
  if (text == "broadcast") return Design::kBroadcast;
  if (text == "sharded-gather") return Design::kShardedGather;
  return invalid_argument("--design: unknown design '{}' (ferry, broadcast, sharded-gather)", text);
}
Result<Mode> parse_mode(std::string_view text) {
  if (text == "pull") return Mode::kPull;
  if (text == "push") return Mode::kPush;
  return invalid_argument("--mode: unknown mode '{}' (pull, push)", text);
}
std::string_view design_name(Design d) {
  return d == Design::kFerry ? "ferry" : d == Design::kBroadcast ? "broadcast" : "sharded-gather";
}
std::string_view mode_name(Mode m) { return m == Mode::kPull ? "pull" : "push"; }

namespace {

namespace sg = simgrid::s4u;

// The platform: one SimGrid host per rank (its GPU; speed = the GPU's copy rate, so
// execute(bytes) takes bytes / rate), one link per direction per GPU into the node's
// NVLink switch, per NIC (or bonded NICs of one GPU) and per leaf switch's uplinks.
// Links exist per direction so that a NIC is full duplex. Routes are added only for the
// pairs of ranks that talk (a full zone of every pair of 384 ranks would be 147k routes).
class Platform {
 public:
  Platform(const ClusterSpec& c, int producers, int consumers) : c_(c), producers_(producers), consumers_(consumers) {}

  Status build() {
    const int t_gpus = c_.trainer.nodes * c_.trainer.gpus_per_node;
    const int i_gpus = c_.inference.nodes * c_.inference.gpus_per_node;
    if (producers_ > t_gpus) {
      return invalid_argument("simulate: {} trainer ranks do not fit on the cluster's {} trainer nodes x {} GPUs = {}",
                              producers_, c_.trainer.nodes, c_.trainer.gpus_per_node, t_gpus);
    }
    if (consumers_ > i_gpus) {
      return invalid_argument(
          "simulate: {} inference ranks do not fit on the cluster's {} inference nodes x {} GPUs = {}", consumers_,
          c_.inference.nodes, c_.inference.gpus_per_node, i_gpus);
    }
    zone_ = sg::create_full_zone("cluster");
    const int n = producers_ + consumers_;
    for (int e = 0; e < n; ++e) {
      const NodeSpec& ns = spec(e);
      hosts_.push_back(zone_->create_host(fmt::format("{}{}", e < producers_ ? "t" : "i", local(e)), ns.device_copy_rate));
      nvl_tx_.push_back(link(fmt::format("nvl-tx-{}", e), ns.nvlink_rate, c_.latency.nvlink));
      nvl_rx_.push_back(link(fmt::format("nvl-rx-{}", e), ns.nvlink_rate, c_.latency.nvlink));
    }
    // NICs: per node, gpus_per_node * nics_per_gpu of them when < 1 per GPU (shared),
    // else one bonded bundle per GPU.
    auto add_nics = [&](bool trainer, const NodeSpec& ns) {
      const int per_node = ns.nics_per_gpu < 1
                               ? static_cast<int>(std::lround(ns.gpus_per_node * ns.nics_per_gpu))
                               : ns.gpus_per_node;
      const double rate = ns.nic_rate * ns.nic_efficiency * std::max(1.0, ns.nics_per_gpu);
      for (int node = 0; node < ns.nodes; ++node) {
        nic_base_.push_back(static_cast<int>(nics_.size()));
        for (int k = 0; k < per_node; ++k) {
          NicUse u;
          u.trainer = trainer;
          u.rate = rate;
          u.name = ns.nics_per_gpu > 1 ? fmt::format("{} node {} gpu {} nics", trainer ? "trainer" : "inference", node, k)
                                       : fmt::format("{} node {} nic {}", trainer ? "trainer" : "inference", node, k);
          const size_t id = nics_.size();
          nics_.push_back(u);
          nic_tx_.push_back(link(fmt::format("nic-tx-{}", id), rate, c_.latency.nic + c_.latency.switch_hop));
          nic_rx_.push_back(link(fmt::format("nic-rx-{}", id), rate, c_.latency.nic));
          node_rate_.resize(nic_base_.size(), 0);
          node_rate_.back() += rate;
        }
      }
    };
    add_nics(true, c_.trainer);
    add_nics(false, c_.inference);
    // Leaf switches over the nodes in order (trainer nodes first): each leaf's uplinks
    // carry its nodes' NIC rate divided by the oversubscription (the spine is non-blocking).
    if (c_.fabric.topology == Topology::kLeafSpine) {
      const int nodes = static_cast<int>(nic_base_.size());
      const int per = c_.fabric.nodes_per_leaf;
      const int leaves = (nodes + per - 1) / per;
      if (leaves > 1) {
        for (int l = 0; l < leaves; ++l) {
          double rate = 0;
          for (int node = l * per; node < std::min(nodes, (l + 1) * per); ++node) rate += node_rate_[node];
          rate /= c_.fabric.oversubscription;
          leaf_up_.push_back(link(fmt::format("leaf-up-{}", l), rate, c_.latency.switch_hop));
          leaf_down_.push_back(link(fmt::format("leaf-down-{}", l), rate, c_.latency.switch_hop));
        }
      }
    }
    return Status::Ok();
  }

  int node(int e) const {  // global node index
    return e < producers_ ? e / c_.trainer.gpus_per_node
                          : c_.trainer.nodes + (e - producers_) / c_.inference.gpus_per_node;
  }
  bool same_node(int a, int b) const { return node(a) == node(b); }
  int nic(int e) const {
    const NodeSpec& ns = spec(e);
    const int gpu = local(e) % ns.gpus_per_node;
    const int k = ns.nics_per_gpu < 1 ? static_cast<int>(gpu * ns.nics_per_gpu + 1e-9) : gpu;
    return nic_base_[static_cast<size_t>(node(e))] + k;
  }

  void need_route(int a, int b) {
    if (a == b) return;
    if (!routes_.insert({a, b}).second) return;
    std::vector<sg::LinkInRoute> links;
    if (same_node(a, b)) {
      links = {sg::LinkInRoute(nvl_tx_[a]), sg::LinkInRoute(nvl_rx_[b])};
    } else {
      links.emplace_back(nic_tx_[nic(a)]);
      const int la = leaf(a), lb = leaf(b);
      if (!leaf_up_.empty() && la != lb) {
        links.emplace_back(leaf_up_[la]);
        links.emplace_back(leaf_down_[lb]);
      }
      links.emplace_back(nic_rx_[nic(b)]);
    }
    zone_->add_route(hosts_[a]->get_netpoint(), hosts_[b]->get_netpoint(), nullptr, nullptr, links, false);
  }
  void seal() { zone_->seal(); }

  // One-way latency of the path a -> b (what a control message takes beside its overhead).
  double latency(int a, int b) const {
    if (same_node(a, b)) return 2 * c_.latency.nvlink;
    const bool spine = c_.fabric.topology == Topology::kLeafSpine && leaf(a) != leaf(b);
    return 2 * c_.latency.nic + c_.latency.switch_hop * (spine ? 3 : 1);
  }

  sg::Host* host(int e) const { return hosts_[static_cast<size_t>(e)]; }
  std::vector<NicUse>& nics() { return nics_; }
  int producers() const { return producers_; }

 private:
  const NodeSpec& spec(int e) const { return e < producers_ ? c_.trainer : c_.inference; }
  int local(int e) const { return e < producers_ ? e : e - producers_; }
  int leaf(int e) const { return node(e) / c_.fabric.nodes_per_leaf; }
  sg::Link* link(const std::string& name, double rate, double latency) {
    return zone_->create_link(name, rate)->set_latency(latency)->seal();
  }

  const ClusterSpec& c_;
  int producers_, consumers_;
  sg::NetZone* zone_ = nullptr;
  std::vector<sg::Host*> hosts_;
  std::vector<sg::Link*> nvl_tx_, nvl_rx_, nic_tx_, nic_rx_, leaf_up_, leaf_down_;
  std::vector<int> nic_base_;     // per global node: its first NIC
  std::vector<double> node_rate_; // per global node: NIC rate out (= in)
  std::vector<NicUse> nics_;
  std::set<std::pair<int, int>> routes_;
};

// Flows as started, for the per-NIC byte counts and the timeline.
struct FlowLog {
  struct Rec {
    sg::CommPtr comm;
    int rx_nic = -1;
    uint64_t bytes = 0;
  };
  std::vector<Rec> recs;
};

std::atomic<bool> g_engine_used{false};

// Everything the actors share. Owned by run_simulation's stack frame; actors only run
// inside Engine::run(), which returns before it goes.
//
// Control messages (announce, release, ready, pushed) are not network flows: 64 bytes
// take microseconds, and as flows they would be most of the simulator's events, each
// re-solving the bandwidth shares of every data flow in flight (the Kimi-K2 sync did not
// finish in minutes that way). A message is its sender's overhead plus the path's
// latency, added where its receiver would see it.
struct Sim {
  const ClusterSpec& c;
  const Workload& w;
  const SimOptions& o;
  Platform& p;
  FlowLog log;
  // Per consumer: when it finished and its phases (seconds).
  std::vector<double> consumer_end;
  std::vector<std::map<std::string, double>> consumer_phases;
  // Serial stages (sharded-gather): transfers left per stage; stage s may start once every
  // earlier stage's are 0.
  std::vector<int64_t> stage_left;
  sg::MutexPtr mutex;  // one lock: actors are cooperative, it only pairs with the waits
  sg::ConditionVariablePtr stage_cv;
  // Per group: transfers per producer and per consumer (indices into GroupWork::transfers).
  std::vector<std::vector<std::vector<uint32_t>>> by_producer, by_consumer;
  // Per consumer, per group in flight: its transfers still in flight, when the first started,
  // and when the first could have started but for the paced order's turns.
  std::vector<std::map<size_t, double>> first_start, first_ready;
  std::vector<std::map<size_t, size_t>> consumer_left;
  std::vector<sg::ConditionVariablePtr> consumer_cv;
  // Relay (Workload::relay_of): per consumer that reads from the producers, the groups it
  // holds (its reads done), for the members that copy them.
  std::vector<std::vector<char>> landed;
  sg::ConditionVariablePtr landed_cv;
  // Per producer: its staging slots and, per group, the transfers still to finish and
  // when it had packed (-1: not yet).
  std::vector<sg::SemaphorePtr> staging;
  std::vector<std::vector<size_t>> producer_left;
  std::vector<std::vector<double>> packed;
  std::vector<sg::ConditionVariablePtr> packed_cv;
  // A paced order (Workload::waves): per producer, per group, per consumer the wave of
  // the read (-1: none); how many of each wave's transfers are still to finish, the wave
  // it serves now and when that wave's turn came (the RELEASE, or the end of the write,
  // that finished the wave before). Empty without pacing.
  struct Gate {
    std::vector<std::vector<int>> wave;  // [group][consumer]
    std::vector<size_t> left;
    size_t at = 0;
    double opened = 0;
  };
  std::vector<Gate> gates;
  sg::ConditionVariablePtr gate_cv;
  size_t wave(int prod, size_t g, int c) const {
    return static_cast<size_t>(gates[static_cast<size_t>(prod)].wave[g][static_cast<size_t>(c)]);
  }

  sg::CommPtr flow(int from, int to, uint64_t bytes) {
    sg::CommPtr comm = sg::Comm::sendto_async(p.host(from), p.host(to), bytes);
    if (!p.same_node(from, to)) {
      p.nics()[static_cast<size_t>(p.nic(from))].bytes_out += bytes;
      p.nics()[static_cast<size_t>(p.nic(to))].bytes_in += bytes;
      log.recs.push_back({comm, p.nic(to), bytes});
    }
    return comm;
  }
  int endpoint_c(int c) const { return w.producers + c; }
  double message(int from, int to) const { return c.overhead.message + p.latency(from, to); }
  void wait_stage(int stage) {
    std::unique_lock<sg::Mutex> lk(*mutex);
    stage_cv->wait(lk, [&] {
      for (int s = 0; s < stage; ++s)
        if (stage_left[static_cast<size_t>(s)] > 0) return false;
      return true;
    });
  }
  // Transfer k of group g (producer -> consumer) is done, as its consumer sees it.
  void consumer_done(int c, size_t g) {
    std::unique_lock<sg::Mutex> lk(*mutex);
    if (--consumer_left[static_cast<size_t>(c)][g] == 0) consumer_cv[static_cast<size_t>(c)]->notify_all();
  }
  // ... and as its producer sees it: the staging slot is free once every reader is done;
  // paced, the next step's readers are served once every reader of this step (of any
  // group) is done.
  void producer_done(int prod, size_t g, int c) {
    std::unique_lock<sg::Mutex> lk(*mutex);
    if (--producer_left[static_cast<size_t>(prod)][g] == 0) staging[static_cast<size_t>(prod)]->release();
    if (--stage_left[static_cast<size_t>(w.groups[g].stage)] == 0) stage_cv->notify_all();
    if (gates.empty()) return;
    Gate& gt = gates[static_cast<size_t>(prod)];
    if (--gt.left[wave(prod, g, c)] > 0) return;
    while (gt.at < gt.left.size() && gt.left[gt.at] == 0) ++gt.at;
    gt.opened = sg::Engine::get_clock();
    gate_cv->notify_all();
  }
};

// One transfer (producer -> consumer, one group), started by its consumer once it holds
// a receive slot for the group (so at most one group of transfers per consumer is
// alive), until both sides see it done. Pull: the producer's ANNOUNCE (after its pack)
// reaches the consumer, which reads, then sends RELEASE. Push: the consumer's READY
// (sent when it got the slot) reaches the producer, which writes once it has packed,
// then sends PUSHED.
void transfer_actor(Sim& s, size_t g, uint32_t k) {
  const Flow& f = s.w.groups[g].transfers[k];
  const int prod = static_cast<int>(f.from), c = static_cast<int>(f.to), me = s.endpoint_c(c);
  const size_t pi = static_cast<size_t>(prod);
  const bool pull = s.o.mode == Mode::kPull;
  const double slot_at = sg::Engine::get_clock();
  {
    std::unique_lock<sg::Mutex> lk(*s.mutex);
    s.packed_cv[pi]->wait(lk, [&] { return s.packed[pi][g] >= 0; });
  }
  {
    const double unpaced = pull ? s.packed[pi][g] + s.message(prod, me) : std::max(s.packed[pi][g], slot_at + s.message(me, prod));
    double& ready = s.first_ready[static_cast<size_t>(c)][g];
    if (ready < 0 || unpaced < ready) ready = unpaced;
  }
  // Paced: the producer serves this reader once its readers of every earlier step are done.
  double turn = s.packed[pi][g];
  if (!s.gates.empty()) {
    std::unique_lock<sg::Mutex> lk(*s.mutex);
    const size_t mine = s.wave(prod, g, c);
    Sim::Gate& gt = s.gates[pi];
    s.gate_cv->wait(lk, [&] { return gt.at >= mine; });
    if (mine > 0) turn = std::max(turn, gt.opened);
  }
  const double start = pull ? turn + s.message(prod, me)                          // ANNOUNCE arrives
                            : std::max(turn, slot_at + s.message(me, prod));       // READY arrives
  if (start > sg::Engine::get_clock()) sg::this_actor::sleep_until(start);
  sg::this_actor::sleep_for(s.c.overhead.read * f.ops);
  double& first = s.first_start[static_cast<size_t>(c)][g];
  if (first < 0) first = sg::Engine::get_clock();
  s.flow(prod, me, f.bytes)->wait();
  if (pull) {
    s.consumer_done(c, g);
    sg::this_actor::sleep_for(s.message(me, prod));  // the RELEASE
    s.producer_done(prod, g, c);
  } else {
    s.producer_done(prod, g, c);
    sg::this_actor::sleep_for(s.message(prod, me));  // the PUSHED
    s.consumer_done(c, g);
  }
}

// The groups of one rank in the order it takes them: the workload's group order, or
// layer order when it has none.
std::vector<size_t> groups_in_order(const std::vector<std::vector<int>>& order, size_t rank, size_t groups) {
  std::vector<size_t> out;
  if (order.empty()) {
    for (size_t g = 0; g < groups; ++g) out.push_back(g);
  } else {
    for (int g : order[rank]) out.push_back(static_cast<size_t>(g));
  }
  return out;
}

// Producer p: per group in its pack order, a free staging slot, the gather
// (sharded-gather), pack; the group's transfers (started by their consumers) hand the
// slot back.
void producer_actor(Sim& s, int p) {
  const size_t pi = static_cast<size_t>(p);
  int stage_seen = -1;
  for (size_t g : groups_in_order(s.w.producer_order, pi, s.w.groups.size())) {
    const GroupWork& gw = s.w.groups[g];
    const auto& mine = s.by_producer[g][pi];
    const uint64_t pack = gw.pack_bytes.empty() ? 0 : gw.pack_bytes[pi];
    if (mine.empty() && pack == 0) continue;
    if (s.w.serial_stages && gw.stage != stage_seen) {
      s.wait_stage(gw.stage);
      stage_seen = gw.stage;
    }
    s.staging[pi]->acquire();
    // The TP all-gather into this rank (sharded-gather): its peers' shards of the group.
    std::vector<sg::CommPtr> in;
    for (const Flow& f : gw.gather)
      if (static_cast<int>(f.to) == p) in.push_back(s.flow(static_cast<int>(f.from), p, f.bytes));
    if (!in.empty()) {
      sg::this_actor::sleep_for(s.c.overhead.collective);
      sg::Comm::wait_all(in);
    }
    sg::this_actor::sleep_for(s.c.overhead.group);
    if (pack > 0) sg::this_actor::execute(static_cast<double>(pack));
    if (mine.empty()) {
      s.staging[pi]->release();
      continue;
    }
    {
      std::unique_lock<sg::Mutex> lk(*s.mutex);
      s.producer_left[pi][g] = mine.size();
      s.packed[pi][g] = sg::Engine::get_clock();
      s.packed_cv[pi]->notify_all();
    }
    sg::this_actor::sleep_for(s.c.overhead.message * static_cast<double>(mine.size()));  // posting the messages
  }
}

// The consumer's unpack worker: a queue of groups, each unpacked on the GPU (execute),
// then its receive slot freed.
struct UnpackQueue {
  sg::SemaphorePtr jobs = sg::Semaphore::create(0);
  sg::SemaphorePtr slots;
  std::vector<uint64_t> bytes;  // FIFO of group bytes
  size_t next = 0;
};

void consumer_actor(Sim& s, int c) {
  const int me = s.endpoint_c(c);
  const size_t ci = static_cast<size_t>(c);
  auto q = std::make_shared<UnpackQueue>();
  const size_t in_flight = static_cast<size_t>(std::max(1, s.w.groups_in_flight));
  q->slots = sg::Semaphore::create(static_cast<unsigned>(s.w.receive_slots) + static_cast<unsigned>(in_flight - 1));
  auto& phase = s.consumer_phases[ci];
  sg::ActorPtr worker = sg::Actor::create(fmt::format("unpack-c{}", c), s.p.host(me), [q, &s] {
    for (;;) {
      q->jobs->acquire();
      if (q->next == q->bytes.size()) return;  // the end marker: no job behind it
      const uint64_t b = q->bytes[q->next++];
      sg::this_actor::sleep_for(s.c.overhead.group);
      if (b > 0) sg::this_actor::execute(static_cast<double>(b));
      q->slots->release();
    }
  });
  double t = sg::Engine::get_clock();
  auto charge = [&](const char* what, double until) {
    phase[what] += until - t;
    t = until;
  };
  // The groups whose reads are posted, oldest first; the oldest lands (and goes to the
  // unpack worker) before more than `in_flight` are.
  std::deque<size_t> window;
  auto land_oldest = [&] {
    const size_t g = window.front();
    window.pop_front();
    {
      std::unique_lock<sg::Mutex> lk(*s.mutex);
      s.consumer_cv[ci]->wait(lk, [&] { return s.consumer_left[ci][g] == 0; });
    }
    const double started = std::max(t, s.first_start[ci][g]);
    charge("wait for producers (gather, pack, messages)", std::clamp(s.first_ready[ci][g], t, started));
    charge("wait for its turn (the paced order)", started);
    charge("transfer", sg::Engine::get_clock());
    s.consumer_left[ci].erase(g);
    s.first_start[ci].erase(g);
    s.first_ready[ci].erase(g);
    if (!s.landed.empty()) {
      std::unique_lock<sg::Mutex> lk(*s.mutex);
      s.landed[ci][g] = 1;
      s.landed_cv->notify_all();
    }
    const GroupWork& gw = s.w.groups[g];
    q->bytes.push_back(gw.unpack_bytes.empty() ? 0 : gw.unpack_bytes[ci]);
    q->jobs->release();
  };
  const int relay = ci < s.w.relay_of.size() ? s.w.relay_of[ci] : -1;
  for (size_t g : groups_in_order(s.w.consumer_order, ci, s.w.groups.size())) {
    if (relay >= 0) {  // a relay member: the group from its relay's receive slot, inside the node
      const uint64_t b = s.w.groups[g].unpack_bytes.empty() ? 0 : s.w.groups[g].unpack_bytes[ci];
      if (b == 0) continue;
      q->slots->acquire();
      charge("wait for a free receive slot (unpack)", sg::Engine::get_clock());
      {
        std::unique_lock<sg::Mutex> lk(*s.mutex);
        s.landed_cv->wait(lk, [&] { return s.landed[static_cast<size_t>(relay)][g] != 0; });
      }
      charge("wait for its relay", sg::Engine::get_clock());
      sg::this_actor::sleep_for(s.message(s.endpoint_c(relay), me));  // the relay's offer
      s.flow(s.endpoint_c(relay), me, b)->wait();
      charge("copy from its relay", sg::Engine::get_clock());
      q->bytes.push_back(b);
      q->jobs->release();
      continue;
    }
    const auto& mine = s.by_consumer[g][ci];
    if (mine.empty()) continue;
    if (window.size() == in_flight) land_oldest();
    q->slots->acquire();
    charge("wait for a free receive slot (unpack)", sg::Engine::get_clock());
    s.consumer_left[ci][g] = mine.size();
    s.first_start[ci][g] = -1;
    s.first_ready[ci][g] = -1;
    for (uint32_t k : mine) sg::Actor::create("transfer", s.p.host(me), [&s, g, k] { transfer_actor(s, g, k); });
    window.push_back(g);
  }
  while (!window.empty()) land_oldest();
  q->jobs->release();  // end marker
  worker->join();
  charge("unpack (after the last transfer)", sg::Engine::get_clock());
  s.consumer_end[ci] = sg::Engine::get_clock();
}

// The broadcast design: per PP stage in series, per group: the root gathers the group's
// full tensors, then broadcasts them in buckets along a chain through every inference
// rank (NCCL's pipelined ring broadcast: every hop carries the whole bucket at once);
// each inference rank then copies out its shard.
void broadcast_actor(Sim& s, std::vector<std::pair<std::string, double>>& phases) {
  std::map<std::string, double> ph;
  double t = sg::Engine::get_clock();
  auto charge = [&](const char* what) {
    const double now = sg::Engine::get_clock();
    ph[what] += now - t;
    t = now;
  };
  std::vector<sg::ExecPtr> unpacks;
  for (const GroupWork& gw : s.w.groups) {
    std::vector<sg::CommPtr> in;
    for (const Flow& f : gw.gather) in.push_back(s.flow(static_cast<int>(f.from), static_cast<int>(f.to), f.bytes));
    if (!in.empty()) {
      sg::this_actor::sleep_for(s.c.overhead.collective);
      sg::Comm::wait_all(in);
    }
    charge("gather on the trainer");
    sg::this_actor::sleep_for(s.c.overhead.collective * gw.tensors);
    charge("collective calls");
    uint64_t left = gw.broadcast_bytes;
    while (left > 0) {
      const uint64_t b = std::min<uint64_t>(left, static_cast<uint64_t>(s.c.overhead.bucket_bytes));
      left -= b;
      std::vector<sg::CommPtr> hops;
      int prev = gw.root;
      for (int c = 0; c < s.w.consumers; ++c) {
        hops.push_back(s.flow(prev, s.endpoint_c(c), b));
        prev = s.endpoint_c(c);
      }
      sg::Comm::wait_all(hops);
    }
    charge("broadcast");
    for (int c = 0; c < s.w.consumers; ++c) {
      const uint64_t b = gw.unpack_bytes.empty() ? 0 : gw.unpack_bytes[static_cast<size_t>(c)];
      if (b > 0) {
        unpacks.push_back(sg::this_actor::exec_init(static_cast<double>(b))->set_host(s.p.host(s.endpoint_c(c))));
        unpacks.back()->start();
      }
    }
  }
  for (auto& e : unpacks) e->wait();
  charge("unpack (after the last broadcast)");
  for (auto& [k, v] : ph) phases.emplace_back(k, v);
}

void quiet_simgrid() {
  xbt_log_control_set("root.thresh:critical");
}

Status claim_engine() {
  if (g_engine_used.exchange(true)) {
    return failed_precondition("simulate: SimGrid's engine runs once per process (a second simulation was asked for)");
  }
  return Status::Ok();
}

std::unique_ptr<sg::Engine> make_engine() {
  quiet_simgrid();
  auto e = std::make_unique<sg::Engine>("ferry-simulate");
  // CM02: max-min fair sharing of each link among its flows, with no latency or bandwidth
  // correction factors (LV08's 0.97 bandwidth and 13.01 latency factors fit TCP over
  // Ethernet of 2008; our rates are payload rates already, see docs/simulation.md).
  sg::Engine::set_config("network/model:CM02");
  // No reverse-direction (ACK) traffic on a link: RDMA reads and writes ack in hardware
  // and every direction is its own link here.
  sg::Engine::set_config("network/crosstraffic:0");
  // No TCP window bound on a flow's rate (gamma / (2 x latency)).
  sg::Engine::set_config("network/TCP-gamma:0");
#if defined(__SANITIZE_ADDRESS__) || FERRY_HAS_ASAN
  // Under AddressSanitizer: actors as threads, which ASan follows (it cannot see the
  // raw context switches between SimGrid's own stacks, and may report false positives).
  sg::Engine::set_config("contexts/factory:thread");
#else
  // Thousands of short actors (one per transfer in flight): small stacks without guard
  // pages keep their mappings cheap (the default 8 MiB stack + guard per actor ran the
  // Kimi-K2 sync into vm.max_map_count).
  sg::Engine::set_config("contexts/stack-size:256");
  sg::Engine::set_config("contexts/guard-size:0");
#endif
  return e;
}

void fill_nic_figures(Platform& p, double seconds, SimResult& r) {
  r.nics = p.nics();
  double best_rx = -1, best_tx = -1;
  for (size_t i = 0; i < r.nics.size(); ++i) {
    const double rx = static_cast<double>(r.nics[i].bytes_in) / r.nics[i].rate;
    const double tx = static_cast<double>(r.nics[i].bytes_out) / r.nics[i].rate;
    if (rx > best_rx) best_rx = rx, r.busiest_rx = i;
    if (tx > best_tx) best_tx = tx, r.busiest_tx = i;
  }
  r.rx_floor_seconds = std::max(0.0, best_rx);
  r.floor_seconds = std::max(r.rx_floor_seconds, std::max(0.0, best_tx));
  (void)seconds;
}

void fill_timeline(const FlowLog& log, const std::vector<NicUse>& nics, double seconds, int bins, SimResult& r) {
  if (seconds <= 0 || bins <= 0) return;
  r.bin_seconds = seconds / bins;
  // The inference NICs that received the most bytes (at most 8).
  std::vector<size_t> order;
  for (size_t i = 0; i < nics.size(); ++i)
    if (!nics[i].trainer && nics[i].bytes_in > 0) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return nics[a].bytes_in > nics[b].bytes_in; });
  if (order.size() > 8) order.resize(8);
  std::unordered_map<int, size_t> row;
  for (size_t k = 0; k < order.size(); ++k) {
    row[static_cast<int>(order[k])] = k;
    r.rx_timeline.emplace_back(nics[order[k]].name, std::vector<double>(static_cast<size_t>(bins), 0.0));
  }
  for (const auto& rec : log.recs) {
    auto it = row.find(rec.rx_nic);
    if (it == row.end()) continue;
    const double a = rec.comm->get_start_time(), b = rec.comm->get_finish_time();
    if (!(b > a)) continue;
    const double rate = static_cast<double>(rec.bytes) / (b - a);
    auto& v = r.rx_timeline[it->second].second;
    for (int k = std::max(0, static_cast<int>(a / r.bin_seconds)); k < bins && k * r.bin_seconds < b; ++k) {
      const double lo = std::max(a, k * r.bin_seconds), hi = std::min(b, (k + 1) * r.bin_seconds);
      if (hi > lo) v[static_cast<size_t>(k)] += rate * (hi - lo) / r.bin_seconds;
    }
  }
  for (size_t k = 0; k < order.size(); ++k)
    for (double& x : r.rx_timeline[k].second) x /= nics[order[k]].rate;
}

}  // namespace

Result<SimResult> run_simulation(const ClusterSpec& cluster, const Workload& w, const SimOptions& o) {
  FERRY_RETURN_IF_ERROR(claim_engine());
  auto engine = make_engine();
  Platform plat(cluster, w.producers, w.consumers);
  FERRY_RETURN_IF_ERROR(plat.build());
  Sim s{cluster, w, o, plat};
  const size_t G = w.groups.size();
  s.by_producer.assign(G, std::vector<std::vector<uint32_t>>(static_cast<size_t>(w.producers)));
  s.by_consumer.assign(G, std::vector<std::vector<uint32_t>>(static_cast<size_t>(w.consumers)));
  int stages = 1;
  for (size_t g = 0; g < G; ++g) {
    const GroupWork& gw = w.groups[g];
    stages = std::max(stages, gw.stage + 1);
    for (uint32_t k = 0; k < gw.transfers.size(); ++k) {
      const Flow& f = gw.transfers[k];
      if (f.from >= static_cast<uint32_t>(w.producers) || f.to >= static_cast<uint32_t>(w.consumers)) {
        return invalid_argument("simulate: group {} transfer {} -> {} names a rank outside {} producers / {} consumers",
                                g, f.from, f.to, w.producers, w.consumers);
      }
      s.by_producer[g][f.from].push_back(k);
      s.by_consumer[g][f.to].push_back(k);
      plat.need_route(static_cast<int>(f.from), w.producers + static_cast<int>(f.to));
    }
    for (const Flow& f : gw.gather) plat.need_route(static_cast<int>(f.from), static_cast<int>(f.to));
    for (size_t c = 0; c < w.relay_of.size(); ++c)
      if (w.relay_of[c] >= 0) plat.need_route(w.producers + w.relay_of[c], w.producers + static_cast<int>(c));
    if (o.design == Design::kBroadcast) {
      int prev = gw.root;
      for (int c = 0; c < w.consumers; ++c) {
        plat.need_route(prev, w.producers + c);
        prev = w.producers + c;
      }
    }
  }
  if (!w.waves.empty() && w.waves.size() != static_cast<size_t>(w.producers))
    return invalid_argument("simulate: waves for {} producers, not {}", w.waves.size(), w.producers);
  for (const auto* ord : {&w.consumer_order, &w.producer_order}) {
    const size_t ranks = static_cast<size_t>(ord == &w.consumer_order ? w.consumers : w.producers);
    if (!ord->empty() && ord->size() != ranks)
      return invalid_argument("simulate: a group order for {} ranks, not {}", ord->size(), ranks);
    for (const auto& groups : *ord)
      for (int g : groups)
        if (g < 0 || static_cast<size_t>(g) >= G)
          return invalid_argument("simulate: group order names group {} of {}", g, G);
  }
  plat.seal();
  s.stage_left.assign(static_cast<size_t>(stages), 0);
  for (const GroupWork& gw : w.groups) s.stage_left[static_cast<size_t>(gw.stage)] += static_cast<int64_t>(gw.transfers.size());
  s.mutex = sg::Mutex::create();
  s.stage_cv = sg::ConditionVariable::create();
  const size_t C = static_cast<size_t>(w.consumers), P = static_cast<size_t>(w.producers);
  s.consumer_end.assign(C, 0);
  s.consumer_phases.resize(C);
  s.first_start.assign(C, {});
  s.first_ready.assign(C, {});
  s.landed_cv = sg::ConditionVariable::create();
  if (!w.relay_of.empty()) {
    if (w.relay_of.size() != C) return invalid_argument("simulate: relays for {} consumers, not {}", w.relay_of.size(), C);
    for (int r : w.relay_of)
      if (r >= static_cast<int>(C) || (r >= 0 && w.relay_of[static_cast<size_t>(r)] >= 0))
        return invalid_argument("simulate: relay {} is not a consumer that reads from the producers", r);
    s.landed.assign(C, std::vector<char>(G, 0));
  }
  s.consumer_left.assign(C, {});
  for (size_t c = 0; c < C; ++c) s.consumer_cv.push_back(sg::ConditionVariable::create());
  for (size_t p = 0; p < P; ++p) s.staging.push_back(sg::Semaphore::create(static_cast<unsigned>(w.staging_slots)));
  s.producer_left.assign(P, std::vector<size_t>(G, 0));
  s.packed.assign(P, std::vector<double>(G, -1));
  for (size_t p = 0; p < P; ++p) s.packed_cv.push_back(sg::ConditionVariable::create());
  s.gate_cv = sg::ConditionVariable::create();
  if (!w.waves.empty()) {
    s.gates.assign(P, Sim::Gate{});
    for (size_t p = 0; p < P; ++p) {
      Sim::Gate& gt = s.gates[p];
      gt.wave.assign(G, std::vector<int>(C, -1));
      gt.left.assign(w.waves[p].size(), 0);
      for (size_t k = 0; k < w.waves[p].size(); ++k) {
        for (const auto& [c, g] : w.waves[p][k]) {
          if (c < 0 || static_cast<size_t>(c) >= C || g < 0 || static_cast<size_t>(g) >= G)
            return invalid_argument("simulate: producer {}'s wave {} names consumer {} group {}", p, k, c, g);
          gt.wave[static_cast<size_t>(g)][static_cast<size_t>(c)] = static_cast<int>(k);
        }
      }
    }
    for (size_t g = 0; g < G; ++g) {
      for (size_t p = 0; p < P; ++p) {
        for (uint32_t k : s.by_producer[g][p]) {
          const int c = static_cast<int>(w.groups[g].transfers[k].to);
          const int wv = s.gates[p].wave[g][static_cast<size_t>(c)];
          if (wv < 0) return invalid_argument("simulate: producer {} serves consumer {} group {} in no wave", p, c, g);
          ++s.gates[p].left[static_cast<size_t>(wv)];
        }
      }
    }
    // Waves with no read from the producers (a relay's members only: their releases come
    // with the relay's) are open from the start.
    for (Sim::Gate& gt : s.gates)
      while (gt.at < gt.left.size() && gt.left[gt.at] == 0) ++gt.at;
  }

  SimResult r;
  std::vector<std::pair<std::string, double>> bcast_phases;
  if (o.design == Design::kBroadcast) {
    sg::Actor::create("broadcast", plat.host(0), [&] { broadcast_actor(s, bcast_phases); });
  } else {
    for (int p = 0; p < w.producers; ++p)
      sg::Actor::create(fmt::format("producer-{}", p), plat.host(p), [&s, p] { producer_actor(s, p); });
    for (int c = 0; c < w.consumers; ++c)
      sg::Actor::create(fmt::format("consumer-{}", c), plat.host(w.producers + c), [&s, c] { consumer_actor(s, c); });
  }
  engine->run();
  r.seconds = sg::Engine::get_clock();
  if (o.design == Design::kBroadcast) {
    r.critical_path = bcast_phases;
  } else {
    // The sync ends when the last consumer holds every group (the producers' last
    // RELEASEs arrive a message later).
    size_t last = 0;
    for (size_t c = 0; c < s.consumer_end.size(); ++c)
      if (s.consumer_end[c] > s.consumer_end[last]) last = c;
    if (!s.consumer_end.empty()) r.seconds = s.consumer_end[last];
    if (!s.consumer_phases.empty()) {
      r.critical_path.emplace_back(fmt::format("(inference rank {})", last), 0.0);
      for (auto& [k, v] : s.consumer_phases[last]) r.critical_path.emplace_back(k, v);
    }
  }
  r.flows = s.log.recs.size();
  if (o.design != Design::kBroadcast) {
    std::unordered_map<int, uint64_t> in, out;
    auto add = [&](const Flow& f) {
      const int a = static_cast<int>(f.from), b = w.producers + static_cast<int>(f.to);
      if (plat.same_node(a, b)) return;
      out[plat.nic(a)] += f.bytes;
      in[plat.nic(b)] += f.bytes;
    };
    auto worst = [&] {
      double x = 0;
      for (auto* m : {&in, &out})
        for (const auto& [n, b] : *m)
          x = std::max(x, static_cast<double>(b) / plat.nics()[static_cast<size_t>(n)].rate);
      in.clear();
      out.clear();
      return x;
    };
    for (const GroupWork& gw : w.groups) {
      for (const Flow& f : gw.transfers) add(f);
      r.lockstep_seconds += worst();
    }
    r.order_lockstep_seconds = r.lockstep_seconds;
    if (!w.consumer_order.empty()) {
      // Step k: every consumer's k-th group at once.
      r.order_lockstep_seconds = 0;
      size_t steps = 0;
      for (const auto& ord : w.consumer_order) steps = std::max(steps, ord.size());
      for (size_t k = 0; k < steps; ++k) {
        for (size_t c = 0; c < C && c < w.consumer_order.size(); ++c) {
          if (k >= w.consumer_order[c].size()) continue;
          const size_t g = static_cast<size_t>(w.consumer_order[c][k]);
          for (uint32_t t : s.by_consumer[g][c]) add(w.groups[g].transfers[t]);
        }
        r.order_lockstep_seconds += worst();
      }
    }
  }
  fill_nic_figures(plat, r.seconds, r);
  fill_timeline(s.log, r.nics, r.seconds, o.timeline_bins, r);
  return r;
}

Result<std::vector<double>> run_rounds(const ClusterSpec& cluster, int producers, int consumers,
                                       const std::vector<std::vector<Flow>>& rounds) {
  FERRY_RETURN_IF_ERROR(claim_engine());
  auto engine = make_engine();
  Platform plat(cluster, producers, consumers);
  FERRY_RETURN_IF_ERROR(plat.build());
  const int n = producers + consumers;
  for (const auto& round : rounds) {
    for (const Flow& f : round) {
      if (static_cast<int>(f.from) >= n || static_cast<int>(f.to) >= n || f.from == f.to)
        return invalid_argument("simulate: flow {} -> {} is not between two of the {} ranks", f.from, f.to, n);
      plat.need_route(static_cast<int>(f.from), static_cast<int>(f.to));
    }
  }
  plat.seal();
  std::vector<double> ends;
  sg::Actor::create("rounds", plat.host(0), [&] {
    for (const auto& round : rounds) {
      std::vector<sg::CommPtr> all;
      for (const Flow& f : round)
        all.push_back(sg::Comm::sendto_async(plat.host(static_cast<int>(f.from)), plat.host(static_cast<int>(f.to)), f.bytes));
      sg::Comm::wait_all(all);
      ends.push_back(sg::Engine::get_clock());
    }
  });
  engine->run();
  return ends;
}

Result<double> run_flows(const ClusterSpec& cluster, int producers, int consumers, const std::vector<Flow>& flows) {
  FERRY_ASSIGN_OR_RETURN(std::vector<double> ends, run_rounds(cluster, producers, consumers, {flows}));
  return ends.back();
}

}  // namespace ferry::simulate

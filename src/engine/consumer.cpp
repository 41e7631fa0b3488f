// Consumer: one per inference rank. See ferry/engine.h for the protocol.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <unistd.h>
#include <xxhash.h>

#include "engine/common.h"
#include "engine/in_place.h"

namespace ferry {

using namespace engine;

struct Consumer::Impl {
  const ModelLoader& loader;
  std::shared_ptr<const RankLoader> rl;
  int rank = 0;
  Transport& tr;
  Store& store;
  ConsumerOptions o;
  Plan plan;
  Routes routes;
  uint64_t routes_hash = 0;
  const PlanRoute* pr = nullptr;
  RouteInputs inputs;
  std::set<int> dead;   // producers excluded from `routes`
  int failed_p = -1;    // the producer whose failure ended the last attempt
  TensorMap loaded;   // param buffers as loaded (what unpack writes)
  TensorMap final_;   // after post-processing, of the last committed sync
  TensorMap work;     // being post-processed (background thread)
  std::vector<int> loader_group_ready_at;  // loader group -> route group after which it is complete
  static constexpr int kSlots = 2;
  uint64_t slot_bytes = 0;
  RegisteredBuffer ring;
  // Zero-copy pull: a piece of a read that unpacks as a plain byte copy (same dtype,
  // contiguous destination, not shared with another unpack) of at least
  // o.direct_min_bytes is read straight into the param's memory, registered with the transport;
  // the rest goes through the receive ring and is unpacked on the background thread.
  // This saves one full copy of almost every byte (routes lay segments out in
  // destination order, so most pieces are contiguous runs of a param).
  struct ParamRegion {
    MemoryRegion region;
    uint64_t offset = 0;  // of the param inside `region`
    std::byte* data = nullptr;
    uint64_t bytes = 0;
  };
  std::map<std::string, ParamRegion> param_regions;  // registered params by name
  std::vector<MemoryRegion> registrations;           // ours to deregister
  // One read (or part of one): recv bytes [recv_offset, +length) of group g, from the
  // producer's staging at Read::offset + (recv_offset - Read::recv_offset), land in the
  // receive slot (param == nullptr) or at param_offset of a param.
  // `region` >= 0: the bytes come from the producer's source region `region` (served in
  // place, see ProducerOptions::source_regions) at `remote`, not from its staging.
  struct SubRead {
    uint32_t read = 0;
    uint64_t recv_offset = 0, length = 0;
    const ParamRegion* param = nullptr;
    uint64_t param_offset = 0;
    int32_t region = -1;
    uint64_t remote = 0;  // region offset (region >= 0) or group staging offset
  };
  std::vector<std::vector<SubRead>> subs;  // per group of `routes` (pull)
  bool subs_stale = true;                  // a producer's in-place table changed
  PlanRoute unpack_route;                  // *pr less the unpacks read straight into params
  std::unique_ptr<Lease> lease;

  struct Peer {
    std::string blob;
    PeerId id = 0;
    RemoteRegion staging;
    bool connected = false;
    InPlaceTable in_place;              // boxes it serves from the trainer's memory
    std::vector<RemoteRegion> regions;  // their source regions (in_place.keys imported)
  };

  std::mutex mu;
  std::condition_variable cv;
  std::vector<Peer> peers;
  std::map<PeerId, int> peer_rank;
  std::map<int, Status> failed;                             // producer -> why
  // (version, group, producer) -> (sender instance, message). Kept even from instances
  // not connected yet (a restarted producer may announce before we re-read its lease);
  // checked against the connected instance when taken.
  std::map<std::tuple<uint64_t, int, int>, std::pair<PeerId, Msg>> inbox;
  std::set<uint64_t> old_hashes;  // routes abandoned during the current sync
  bool switch_routes = false;     // a producer announced other routes for this sync
  bool declare = false;           // tell producers our routes once connected (sync began on failed-over routes)
  // Push: producers sent READY this sync (they may have writes into our receive ring in
  // flight), and the FLUSHED answers to our FAILOVERs: producer -> (version, routes). mu.
  std::set<int> readied;
  std::map<int, std::pair<uint64_t, uint64_t>> flushed_from;
  std::set<uint64_t> dropped_versions;
  // Background thread.
  struct Job {
    uint64_t version;
    int group;
    int slot;  // -1: no data
  };
  std::deque<Job> jobs;
  bool slot_busy[kSlots] = {false, false};
  bool busy = false;
  bool stop = false;
  bool crashed = false;
  Status bg_status;
  bool unpacked_any = false;
  double unpack_seconds = 0, post_seconds = 0;
  std::thread worker;
  ConsumerState st;

  Impl(const ModelLoader& l, int r, Transport& t, Store& s, const ConsumerOptions& opt)
      : loader(l), rank(r), tr(t), store(s), o(opt) {}

  ~Impl() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
      cv.notify_all();
    }
    if (worker.joinable()) worker.join();
    tr.set_message_handler({});
    tr.set_peer_failure_handler({});
    if (lease) lease->release().ignore();
    for (const MemoryRegion& r : registrations) tr.deregister_memory(r).ignore();
  }

  void point(int g, int phase) {
    if (o.test_point) o.test_point(g, phase);
  }

  void on_message(PeerId from, std::span<const std::byte> payload) {
    auto m = decode_msg(payload);
    if (!m.ok()) return;
    std::lock_guard<std::mutex> lk(mu);
    const int p = static_cast<int>(m->rank);
    if (p < 0 || p >= o.num_producers) return;
    auto it = peer_rank.find(from);
    const bool known = it != peer_rank.end() && it->second == p;
    switch (static_cast<MsgType>(m->type)) {
      case MsgType::kAnnounce:
      case MsgType::kPushed:
        if (st.has_version && m->version <= st.version) return;  // stale
        if (inbox.size() > 100000) return;
        inbox[{m->version, m->group, p}] = {from, *m};
        break;
      case MsgType::kRoutes:
        // Kept under group -1 (never awaited): await_any sees its routes and switches.
        if (st.has_version && m->version <= st.version) return;
        if (inbox.size() > 100000) return;
        inbox[{m->version, -1, p}] = {from, *m};
        break;
      case MsgType::kFlushed:
        if (!known) return;
        flushed_from[p] = {m->version, m->routes_hash};
        break;
      case MsgType::kDropped:
        if (!known) return;
        dropped_versions.insert(m->version);
        break;
      default:
        return;
    }
    cv.notify_all();
  }

  void on_peer_failure(PeerId peer, const Status& why) {
    std::lock_guard<std::mutex> lk(mu);
    auto it = peer_rank.find(peer);
    if (it == peer_rank.end()) return;
    Peer& p = peers[static_cast<size_t>(it->second)];
    if (p.id != peer) return;
    p.connected = false;
    failed[it->second] = why;
    cv.notify_all();
  }

  void bg_loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return stop || !jobs.empty(); });
        if (stop) return;
        job = jobs.front();
        jobs.pop_front();
        busy = true;
      }
      Status s;
      double tu = 0, tp = 0;
      if (job.slot >= 0) {
        point(job.group, 3);
        auto t = Clock::now();
        const uint64_t n = pr->groups[static_cast<size_t>(job.group)].recv_bytes;
        s = unpack_group(unpack_route, job.group, std::span<const std::byte>(ring.data + job.slot * slot_bytes, n),
                         loaded);
        if (!s.ok()) s = s.with_context(fmt::format("consumer {} unpack group {}", rank, job.group));
        tu = seconds_since(t);
      }
      {
        std::lock_guard<std::mutex> lk(mu);
        if (job.slot >= 0) {
          slot_busy[job.slot] = false;
          unpacked_any = true;
        }
      }
      if (s.ok()) {
        auto t = Clock::now();
        for (size_t k = 0; k < loader_group_ready_at.size() && s.ok(); ++k) {
          if (loader_group_ready_at[k] == job.group) {
            s = rl->process_weights_after_loading(static_cast<int>(k), work);
            if (!s.ok()) s = s.with_context(fmt::format("consumer {} post-processing {}", rank, rl->groups()[k].name));
          }
        }
        tp = seconds_since(t);
      }
      if (s.ok() && o.after_group) o.after_group(job.version, job.group);
      std::lock_guard<std::mutex> lk(mu);
      unpack_seconds += tu;
      post_seconds += tp;
      if (!s.ok() && bg_status.ok()) bg_status = s;
      busy = false;
      cv.notify_all();
    }
  }

  Status refresh_producers() {
    for (int p = 0; p < o.num_producers; ++p) {
      if (dead.count(p)) continue;  // failed over: not read from
      auto blob = store.get(key_producer(o.job, p));
      if (!blob.ok()) {
        if (blob.status().code() == StatusCode::kNotFound)
          return unavailable("producer {} is not registered (no live lease {})", p, key_producer(o.job, p));
        return blob.status();
      }
      {
        std::lock_guard<std::mutex> lk(mu);
        const Peer& pe = peers[static_cast<size_t>(p)];
        if (pe.connected && pe.blob == *blob) continue;
      }
      FERRY_ASSIGN_OR_RETURN(auto f, decode_fields(*blob, 4));
      auto table = InPlaceTable::decode(f[3], inputs.holdings[static_cast<size_t>(p)].boxes.size());
      if (!table.ok()) return table.status().with_context(fmt::format("in-place table of producer {}", p));
      auto id = tr.connect(string_bytes(f[0]));
      if (!id.ok()) {
        failed_p = p;  // a candidate for failover
        return id.status().with_context(fmt::format("connecting to producer {}", p));
      }
      auto key = tr.import_key(string_bytes(f[1]));
      if (!key.ok()) {
        failed_p = p;
        return key.status().with_context(fmt::format("staging key of producer {}", p));
      }
      std::vector<RemoteRegion> regions;
      if (o.mode == SyncMode::kPull) {
        for (size_t k = 0; k < table->keys.size(); ++k) {
          auto r = tr.import_key(string_bytes(table->keys[k]));
          if (!r.ok()) {
            failed_p = p;
            return r.status().with_context(fmt::format("source region {} key of producer {}", k, p));
          }
          regions.push_back(*r);
        }
      }
      std::lock_guard<std::mutex> lk(mu);
      Peer& pe = peers[static_cast<size_t>(p)];
      pe.blob = *blob;
      pe.id = *id;
      pe.staging = *key;
      pe.connected = true;
      pe.in_place = o.mode == SyncMode::kPull ? std::move(*table) : InPlaceTable{};
      pe.regions = std::move(regions);
      subs_stale = true;
      peer_rank[*id] = p;
      failed.erase(p);
    }
    return Status::Ok();
  }

  void send_to(int p, MsgType type, uint64_t v, int g, uint32_t slot = 0) {
    PeerId id;
    {
      std::lock_guard<std::mutex> lk(mu);
      id = peers[static_cast<size_t>(p)].id;
    }
    Msg m;
    m.type = static_cast<uint8_t>(type);
    m.rank = static_cast<uint32_t>(rank);
    m.group = g;
    m.version = v;
    m.routes_hash = routes_hash;
    m.slot = slot;
    tr.send(id, kTag, encode_msg(m)).status().ignore();
  }

  // Waits for the message (v, g, p) from any producer p in `from`; fails when one of
  // them failed, when we were dropped, or after `timeout`.
  // `none` (polling): return at once with *none = true when nothing is there yet.
  Result<std::pair<int, Msg>> await_any(uint64_t v, int g, const std::set<int>& from, const char* what,
                                        bool* none = nullptr) {
    std::unique_lock<std::mutex> lk(mu);
    const auto deadline = Clock::now() + o.timeout;
    for (;;) {
      for (int p : from) {
        auto it = inbox.find({v, g, p});
        // A message of another attempt (other routes) stays: it may be the next one's.
        if (it == inbox.end() || it->second.second.routes_hash != routes_hash) continue;
        if (it->second.first != peers[static_cast<size_t>(p)].id) continue;  // not the connected instance
        Msg m = it->second.second;
        inbox.erase(it);
        return std::make_pair(p, m);
      }
      // A producer restarted this sync with other routes (failover another consumer
      // started): follow it.
      for (const auto& [key, e] : inbox) {
        if (std::get<0>(key) == v && e.second.routes_hash != routes_hash && !old_hashes.count(e.second.routes_hash)) {
          switch_routes = true;
          return unavailable("consumer {}: producer {} switched routes for sync {}", rank, std::get<2>(key), v);
        }
      }
      for (int p : from) {
        if (auto it = failed.find(p); it != failed.end()) {
          failed_p = p;
          return peer_failed("producer {} failed during sync {} (group {}): {}", p, v, g, it->second.to_string());
        }
      }
      if (crashed) return cancelled("consumer {} crashed (test hook)", rank);
      if (dropped_versions.count(v)) return cancelled("consumer {} was dropped from sync {} by a producer", rank, v);
      if (!bg_status.ok()) return bg_status;
      if (none) {
        *none = true;
        return timeout_error("consumer {}: no {} yet", rank, what);
      }
      if (cv.wait_until(lk, deadline) == std::cv_status::timeout && Clock::now() >= deadline) {
        std::string missing;
        for (int p : from) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
        return timeout_error("consumer {}: no {} from producer(s) {} for version {} group {} within {} ms", rank, what,
                             missing, v, g, o.timeout.count());
      }
    }
  }

  Result<int> acquire_slot(int g) {
    const int s = g % kSlots;
    std::unique_lock<std::mutex> lk(mu);
    if (!cv.wait_for(lk, o.timeout, [&] { return !slot_busy[s] || !bg_status.ok() || crashed; }))
      return timeout_error("consumer {}: receive slot not freed within {} ms", rank, o.timeout.count());
    if (!bg_status.ok()) return bg_status;
    if (crashed) return cancelled("consumer {} crashed (test hook)", rank);
    slot_busy[s] = true;
    return s;
  }

  void enqueue(uint64_t v, int g, int slot) {
    std::lock_guard<std::mutex> lk(mu);
    jobs.push_back(Job{v, g, slot});
    cv.notify_all();
  }

  // Where the bytes of sub-read `sr` of the receive slot `slot` land.
  std::byte* landing(const SubRead& sr, int slot) const {
    if (sr.param) return sr.param->data + sr.param_offset;
    return ring.data + static_cast<uint64_t>(slot) * slot_bytes + sr.recv_offset;
  }

  // The checksum covers producer p's bytes of group g in staging order, wherever they
  // landed (receive slot or params).
  Status verify(int p, int g, const Msg& m, int s, const std::vector<Read>& reads) {
    if (!m.has_checksum) return Status::Ok();
    std::vector<std::pair<uint64_t, const SubRead*>> mine;  // staging offset -> piece
    for (const SubRead& sr : subs[static_cast<size_t>(g)]) {
      const Read& r = reads[sr.read];
      if (static_cast<int>(r.producer) == p) mine.emplace_back(r.offset + (sr.recv_offset - r.recv_offset), &sr);
    }
    std::sort(mine.begin(), mine.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    XXH64_state_t* h = XXH64_createState();
    XXH64_reset(h, 0);
    for (const auto& [offset, sr] : mine) XXH64_update(h, landing(*sr, s), sr->length);
    const uint64_t got = XXH64_digest(h);
    XXH64_freeState(h);
    if (got != m.checksum)
      return corrupt("consumer {}: checksum mismatch on the segment of producer {} in group {} ({}): got {:016x}, sent {:016x}",
                     rank, p, g, routes.group_names[static_cast<size_t>(g)], got, m.checksum);
    return Status::Ok();
  }

  // Which sub-reads post() posts: staged ones (from the slot an announcement named), or
  // in-place ones landing in the receive ring or in params.
  enum PostWhat { kStaged, kInPlaceToRing, kInPlaceToParams };
  Status post(int g, int p, uint64_t base, PostWhat what, const Msg* announce, std::vector<Completion>& ops) {
    const PlanGroup& pg = pr->groups[static_cast<size_t>(g)];
    for (const SubRead& sr : subs[static_cast<size_t>(g)]) {
      if (static_cast<int>(pg.reads[sr.read].producer) != p) continue;
      const PostWhat kind = sr.region < 0 ? kStaged : sr.param ? kInPlaceToParams : kInPlaceToRing;
      if (kind != what) continue;
      FERRY_RETURN_IF_ERROR(post_one(g, p, sr, 0, sr.length, base, announce, ops));
    }
    return Status::Ok();
  }

  // Posts bytes [at, at + n) of sub-read `sr` of producer p in group g.
  Status post_one(int g, int p, const SubRead& sr, uint64_t at, uint64_t n, uint64_t base, const Msg* announce,
                  std::vector<Completion>& ops) {
    RemoteRegion from_region;
    uint64_t remote = (announce ? announce->slot_offset : 0) + sr.remote + at;
    {
      std::lock_guard<std::mutex> lk(mu);
      const Peer& pe = peers[static_cast<size_t>(p)];
      from_region = pe.staging;
      if (sr.region >= 0) {
        from_region = pe.regions[static_cast<size_t>(sr.region)];
        remote = sr.remote + at;
      }
      if (sr.param) unpacked_any = true;  // params change from here on: a failure now leaves us torn
    }
    auto c = sr.param ? tr.read(sr.param->region, sr.param->offset + sr.param_offset + at, from_region, remote, n)
                      : tr.read(ring.region, base + sr.recv_offset + at, from_region, remote, n);
    if (!c.ok()) {
      failed_p = p;
      return c.status().with_context(fmt::format("consumer {} reading group {} from producer {}", rank, g, p));
    }
    ops.push_back(*c);
    return Status::Ok();
  }

  // In-place bytes into params not posted yet, per group: taken lowest group first, a
  // chunk at a time, while the consumer has nothing else to do (see await_working).
  struct Backlog {
    struct Item {
      int p;
      const SubRead* sr;
      uint64_t done;
    };
    std::map<int, std::deque<Item>> by_group;
    bool empty() const { return by_group.empty(); }
  };
  // Over shared memory a read is a copy made by the posting thread: in chunks, so the
  // consumer answers announcements between them.
  static constexpr uint64_t kChunk = 1 << 20;

  // Posts one chunk of the lowest group's backlog into ahead[(group, p)].
  Status work_one(Backlog& b, std::map<std::pair<int, int>, std::vector<Completion>>& ahead) {
    auto it = b.by_group.begin();
    auto& item = it->second.front();
    const uint64_t n = std::min(kChunk, item.sr->length - item.done);
    FERRY_RETURN_IF_ERROR(post_one(it->first, item.p, *item.sr, item.done, n, 0, nullptr, ahead[{it->first, item.p}]));
    item.done += n;
    if (item.done == item.sr->length) {
      it->second.pop_front();
      if (it->second.empty()) b.by_group.erase(it);
    }
    return Status::Ok();
  }

  // await_any for an announcement, working through the backlog while none is there.
  Result<std::pair<int, Msg>> await_working(uint64_t v, int g, const std::set<int>& from, Backlog& b,
                                            std::map<std::pair<int, int>, std::vector<Completion>>& ahead) {
    while (!b.empty()) {
      bool none = false;
      auto r = await_any(v, g, from, "announce", &none);
      if (!none) return r;
      FERRY_RETURN_IF_ERROR(work_one(b, ahead));
    }
    return await_any(v, g, from, "announce");
  }

  Status sync_groups(uint64_t v, SyncReport& rep) {
    FERRY_RETURN_IF_ERROR(refresh_producers());
    {
      std::lock_guard<std::mutex> lk(mu);  // the background thread is idle between attempts
      if (subs_stale) plan_subreads();
    }
    if (declare) {
      declare = false;
      declare_routes(v);
    }
    // Pull. In-place bytes are the trainer's weights of v from the start of the
    // producer's sync v until it ends (after our DONE). So once a producer announced
    // anything of v in this attempt (in_v), its in-place bytes that land in params are
    // read *ahead*, with no handshake, whenever the consumer would otherwise wait for an
    // announcement (a chunk at a time, so staging slots are still released promptly:
    // producers pack group g+2 only once every consumer released group g); in-place
    // bytes that land in the receive ring are read as soon as the group's slot is ours;
    // only staged bytes wait for the group's announcement.
    std::set<int> in_v;
    std::map<std::pair<int, int>, std::vector<Completion>> ahead;  // (group, producer) -> in-place reads posted
    std::map<int, std::vector<Completion>> ops;                     // this group's, per producer
    Backlog backlog;                                                // in-place reads not posted yet
    // On an error return, reads still in flight must land before the next attempt
    // reuses the receive slots (and before params are declared torn).
    struct Drain {
      std::map<std::pair<int, int>, std::vector<Completion>>& ahead;
      std::map<int, std::vector<Completion>>& ops;
      std::chrono::milliseconds limit;
      ~Drain() {
        for (auto& [k, v] : ahead) wait_all(v, limit).ignore();
        for (auto& [k, v] : ops) wait_all(v, limit).ignore();
      }
    } drain{ahead, ops, o.timeout};
    for (int g = 0; g < routes.num_groups(); ++g) {
      const PlanGroup& pg = pr->groups[static_cast<size_t>(g)];
      std::set<int> from;
      for (const Read& r : pg.reads)
        if (r.length) from.insert(static_cast<int>(r.producer));
      if (from.empty()) {
        enqueue(v, g, -1);
        continue;
      }
      FERRY_ASSIGN_OR_RETURN(int s, acquire_slot(g));
      point(g, 0);
      const uint64_t base = static_cast<uint64_t>(s) * slot_bytes;
      std::map<int, Msg> got;
      if (o.mode == SyncMode::kPull) {
        // Staged bytes: read from each producer as soon as it announced, and release it
        // at once (before any in-place bytes are waited for), so that one slow producer
        // never holds another's staging slot and producers pack on while we copy.
        auto tr0 = Clock::now();
        ops.clear();
        for (int p : from) {
          if (in_v.count(p)) FERRY_RETURN_IF_ERROR(post(g, p, base, kInPlaceToRing, nullptr, ops[p]));
        }
        rep.read_seconds += seconds_since(tr0);
        std::set<int> remaining = from;
        bool posted = false;
        while (!remaining.empty()) {
          auto tw = Clock::now();
          FERRY_ASSIGN_OR_RETURN(auto pm, await_working(v, g, remaining, backlog, ahead));
          rep.wait_seconds += seconds_since(tw);
          const int p = pm.first;
          got[p] = pm.second;
          remaining.erase(p);
          auto tr1 = Clock::now();
          std::vector<Completion> staged;
          FERRY_RETURN_IF_ERROR(post(g, p, base, kStaged, &got[p], staged));
          if (!posted) {
            posted = true;
            point(g, 1);
          }
          Status st = wait_all(staged, o.timeout);
          if (!st.ok()) {
            failed_p = p;
            return Status(st.code(),
                          fmt::format("consumer {} reading group {} from producer {}: {}", rank, g, p, st.message()));
          }
          send_to(p, MsgType::kRelease, v, g);
          if (in_v.insert(p).second) {  // p is in sync v: its in-place bytes are the weights of v
            FERRY_RETURN_IF_ERROR(post(g, p, base, kInPlaceToRing, nullptr, ops[p]));
            for (int g2 = g; g2 < routes.num_groups(); ++g2) {
              const PlanGroup& pg2 = pr->groups[static_cast<size_t>(g2)];
              for (const SubRead& sr : subs[static_cast<size_t>(g2)])
                if (sr.region >= 0 && sr.param && static_cast<int>(pg2.reads[sr.read].producer) == p)
                  backlog.by_group[g2].push_back(Backlog::Item{p, &sr, 0});
            }
          }
          rep.read_seconds += seconds_since(tr1);
        }
        // This group's in-place bytes: post what is left of them, wait for all.
        auto tr2 = Clock::now();
        while (!backlog.empty() && backlog.by_group.begin()->first <= g) FERRY_RETURN_IF_ERROR(work_one(backlog, ahead));
        for (int p : from) {
          Status st = wait_all(ops[p], o.timeout);
          if (auto it = ahead.find({g, p}); st.ok() && it != ahead.end()) {
            st = wait_all(it->second, o.timeout);
            ahead.erase(it);
          }
          if (!st.ok()) {
            failed_p = p;
            return Status(st.code(),
                          fmt::format("consumer {} reading group {} from producer {}: {}", rank, g, p, st.message()));
          }
        }
        ops.clear();
        rep.read_seconds += seconds_since(tr2);
      } else {
        for (int p : from) {
          readied.insert(p);
          send_to(p, MsgType::kReady, v, g, static_cast<uint32_t>(s));
        }
        point(g, 1);
        auto tw = Clock::now();
        std::set<int> remaining = from;
        while (!remaining.empty()) {
          FERRY_ASSIGN_OR_RETURN(auto pm, await_any(v, g, remaining, "push"));
          got[pm.first] = pm.second;
          remaining.erase(pm.first);
        }
        rep.wait_seconds += seconds_since(tw);
      }
      for (const Read& r : pg.reads) {
        if (!r.length) continue;
        rep.bytes += r.length;
        rep.bytes_per_peer[static_cast<int>(r.producer)] += r.length;
      }
      for (const SubRead& sr : subs[static_cast<size_t>(g)])
        if (sr.param) rep.direct_bytes += sr.length;
      for (int p : from) FERRY_RETURN_IF_ERROR(verify(p, g, got[p], s, pg.reads));
      point(g, 2);
      enqueue(v, g, s);
    }
    // Drain the background thread.
    std::unique_lock<std::mutex> lk(mu);
    const auto deadline = Clock::now() + o.timeout;
    while ((!jobs.empty() || busy) && bg_status.ok()) {
      if (cv.wait_until(lk, deadline) == std::cv_status::timeout && Clock::now() >= deadline)
        return timeout_error("consumer {}: unpacking did not finish within {} ms", rank, o.timeout.count());
    }
    if (crashed) return cancelled("consumer {} crashed (test hook)", rank);
    return bg_status;
  }

  // Installs routes (only between attempts: the background thread is idle).
  Status apply_routes(Routes r) {
    const PlanRoute& plan_route = r.consumer(static_cast<size_t>(rank));
    for (const auto& g : plan_route.groups) {
      if (g.recv_bytes > slot_bytes)
        return failed_precondition("consumer {}: a group needs {} receive bytes, the ring has {}", rank, g.recv_bytes,
                                   slot_bytes);
    }
    std::map<std::string, int> last_group;
    for (int g = 0; g < r.num_groups(); ++g) {
      for (const UnpackOp& u : plan_route.groups[static_cast<size_t>(g)].unpacks)
        last_group[plan_route.params[u.param].name] = g;
    }
    std::vector<int> ready_at(rl->groups().size(), 0);
    for (const ParamInfo& p : rl->params()) {
      auto it = last_group.find(p.decl.name);
      if (it != last_group.end() && p.group >= 0 && static_cast<size_t>(p.group) < ready_at.size())
        ready_at[static_cast<size_t>(p.group)] = std::max(ready_at[static_cast<size_t>(p.group)], it->second);
    }
    std::lock_guard<std::mutex> lk(mu);
    routes = std::move(r);
    routes_hash = routes.hash();
    pr = &routes.consumer(static_cast<size_t>(rank));
    loader_group_ready_at = std::move(ready_at);
    plan_subreads();
    return Status::Ok();
  }

  // Splits the reads of the current routes into sub-reads (see SubRead) and leaves in
  // unpack_route only the unpacks that still go through the receive ring. Push mode
  // keeps every byte in the ring: producers write into receive slots.
  void plan_subreads() {
    unpack_route = *pr;
    subs.assign(pr->groups.size(), {});
    for (size_t g = 0; g < pr->groups.size(); ++g) {
      const PlanGroup& pg = pr->groups[g];
      PlanGroup& ug = unpack_route.groups[g];
      // Direct candidates: byte copies into a registered param, alone on their bytes.
      struct Direct {
        uint64_t offset, bytes;
        const ParamRegion* param;
        uint64_t param_offset;
      };
      std::vector<Direct> direct;
      std::vector<bool> is_direct(pg.unpacks.size(), false);
      if (o.mode == SyncMode::kPull) {
        std::vector<std::pair<uint64_t, uint64_t>> spans;  // every unpack's recv bytes
        for (const UnpackOp& u : pg.unpacks)
          spans.emplace_back(u.offset, u.offset + static_cast<uint64_t>(u.dst.numel()) * dtype_size(u.src_dtype));
        // shared[k]: another unpack reads some of op k's bytes (one sweep in offset order:
        // an op overlaps an earlier one iff it starts below the earlier ends' maximum).
        std::vector<bool> shared(spans.size(), false);
        {
          std::vector<size_t> order;
          for (size_t k = 0; k < spans.size(); ++k)
            if (spans[k].second > spans[k].first) order.push_back(k);
          std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return spans[a] < spans[b]; });
          uint64_t max_hi = 0;
          size_t max_at = 0;
          for (size_t i = 0; i < order.size(); ++i) {
            const size_t k = order[i];
            if (i > 0 && spans[k].first < max_hi) shared[k] = shared[max_at] = true;
            if (spans[k].second > max_hi) {
              max_hi = spans[k].second;
              max_at = k;
            }
          }
        }
        std::vector<std::pair<uint64_t, uint64_t>> reads;  // recv bytes of each read
        for (const Read& r : pg.reads)
          if (r.length) reads.emplace_back(r.recv_offset, r.recv_offset + r.length);
        std::sort(reads.begin(), reads.end());
        auto in_one_read = [&](uint64_t lo, uint64_t hi) {
          auto it = std::upper_bound(reads.begin(), reads.end(), std::make_pair(lo, UINT64_MAX));
          return it != reads.begin() && std::prev(it)->first <= lo && hi <= std::prev(it)->second;
        };
        for (size_t k = 0; k < pg.unpacks.size(); ++k) {
          const UnpackOp& u = pg.unpacks[k];
          const TensorDecl& d = pr->params[u.param];
          const auto [lo, hi] = spans[k];
          if (u.src_dtype != d.dtype || !u.dst.is_contiguous() || hi - lo < o.direct_min_bytes || hi == lo) continue;
          auto it = param_regions.find(d.name);
          if (it == param_regions.end()) continue;
          const uint64_t at = static_cast<uint64_t>(u.dst.offset) * dtype_size(d.dtype);
          if (u.dst.offset < 0 || at + (hi - lo) > it->second.bytes || shared[k] || !in_one_read(lo, hi)) continue;
          direct.push_back(Direct{lo, hi - lo, &it->second, at});
          is_direct[k] = true;
        }
        std::sort(direct.begin(), direct.end(), [](const Direct& a, const Direct& b) { return a.offset < b.offset; });
      }
      std::vector<UnpackOp> rest;
      for (size_t k = 0; k < pg.unpacks.size(); ++k)
        if (!is_direct[k]) rest.push_back(pg.unpacks[k]);
      ug.unpacks = std::move(rest);
      // In-place runs of each producer in this group (staging coordinates, sorted).
      std::map<uint32_t, std::vector<InPlacePiece>> remote;
      for (const Read& r : pg.reads) {
        if (!r.length || remote.count(r.producer) || r.producer >= peers.size()) continue;
        const Peer& pe = peers[r.producer];
        if (pe.in_place.empty() || pe.regions.size() != pe.in_place.keys.size()) continue;
        remote[r.producer] = in_place_pieces(routes.producers[r.producer].groups[g],
                                             inputs.holdings[r.producer], pe.in_place);
      }
      std::vector<SubRead>& out = subs[g];
      auto emit = [&](const SubRead& x) {
        if (!x.length) return;
        if (!out.empty()) {  // merge with the previous piece when every side continues it
          SubRead& b = out.back();
          if (b.read == x.read && b.recv_offset + b.length == x.recv_offset && b.param == x.param &&
              (!x.param || b.param_offset + b.length == x.param_offset) && b.region == x.region &&
              b.remote + b.length == x.remote) {
            b.length += x.length;
            return;
          }
        }
        out.push_back(x);
      };
      for (size_t i = 0; i < pg.reads.size(); ++i) {
        const Read& r = pg.reads[i];
        if (!r.length) continue;
        const uint64_t lo = r.recv_offset, hi = r.recv_offset + r.length;
        // Cut the read where the local side (param / ring) or the remote side (source
        // region / staging) changes; in recv coordinates.
        std::vector<uint64_t> cuts{lo, hi};
        auto first_local = std::lower_bound(direct.begin(), direct.end(), lo,
                                            [](const Direct& d, uint64_t v) { return d.offset < v; });
        for (auto it = first_local; it != direct.end() && it->offset + it->bytes <= hi; ++it) {
          cuts.push_back(it->offset);
          cuts.push_back(it->offset + it->bytes);
        }
        std::vector<InPlacePiece> runs;  // this read's in-place runs, in recv coordinates
        if (auto rit = remote.find(r.producer); rit != remote.end()) {
          for (const InPlacePiece& x : rit->second) {
            if (x.offset < r.offset || x.offset + x.bytes > r.offset + r.length) continue;
            InPlacePiece y = x;
            y.offset = lo + (x.offset - r.offset);
            runs.push_back(y);
            cuts.push_back(y.offset);
            cuts.push_back(y.offset + y.bytes);
          }
        }
        std::sort(cuts.begin(), cuts.end());
        cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
        auto local = first_local;
        auto run = runs.begin();
        for (size_t k = 0; k + 1 < cuts.size(); ++k) {
          const uint64_t a = cuts[k], b = cuts[k + 1];
          while (local != direct.end() && local->offset + local->bytes <= a) ++local;
          while (run != runs.end() && run->offset + run->bytes <= a) ++run;
          SubRead x{static_cast<uint32_t>(i), a, b - a, nullptr, 0, -1, r.offset + (a - lo)};
          if (local != direct.end() && local->offset <= a && a < local->offset + local->bytes) {
            x.param = local->param;
            x.param_offset = local->param_offset + (a - local->offset);
          }
          if (run != runs.end() && run->offset <= a && a < run->offset + run->bytes) {
            x.region = run->region;
            x.remote = run->region_offset + (a - run->offset);
          }
          emit(x);
        }
      }
    }
    subs_stale = false;
  }

  Status refresh_routes() {
    if (!o.failover) return Status::Ok();
    FERRY_ASSIGN_OR_RETURN(auto d, read_dead(store, o.job));
    if (d == dead) return Status::Ok();
    FERRY_ASSIGN_OR_RETURN(auto r, build_routes_excluding(inputs, d));
    FERRY_RETURN_IF_ERROR(apply_routes(std::move(r)));
    dead = d;
    return Status::Ok();
  }

  // Waits for the background thread to go idle, then resets it for a new attempt.
  void reset_background() {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait_for(lk, o.timeout, [&] { return jobs.empty() && !busy; });
    jobs.clear();
    bg_status = Status::Ok();
    unpack_seconds = post_seconds = 0;
    slot_busy[0] = slot_busy[1] = false;
    work = loaded;
  }

  // After producer failed_p failed: mark it dead and rebuild routes without it, if the
  // remaining producers hold everything. Then ask live producers to restart.
  Status failover(uint64_t v, const Status& why, SyncReport& rep) {
    std::set<int> d = dead;
    d.insert(failed_p);
    {
      std::lock_guard<std::mutex> lk(mu);
      for (const auto& [p, st] : failed) d.insert(p);
    }
    if (auto stored = read_dead(store, o.job); stored.ok()) d.insert(stored->begin(), stored->end());
    auto r = build_routes_excluding(inputs, d);
    if (!r.ok())
      return Status(why.code(), fmt::format("{}; no failover: {}", why.message(), r.status().message()));
    for (int p : d) FERRY_RETURN_IF_ERROR(store.set(key_dead(o.job, p), "1"));
    reset_background();
    FERRY_RETURN_IF_ERROR(apply_routes(std::move(*r)));
    dead = d;
    std::string ds;
    for (int p : d) ds += (ds.empty() ? "" : ",") + std::to_string(p);
    rep.failures.push_back(fmt::format("consumer {}: {}; failover: routes rebuilt without producer(s) {}", rank,
                                       why.to_string(), ds));
    declare_routes(v);
    return Status::Ok();
  }

  // Tells every live producer which routes this consumer reads sync v with (FAILOVER): a
  // producer on other routes restarts the sync with these, and no producer keeps a slot
  // of routes this consumer does not read waiting for it. Needed also when this sync
  // began on failed-over routes (the dead set was already in the store): otherwise
  // producers still on the old routes wait for releases that never come while this
  // consumer waits for announcements of the new ones.
  void declare_routes(uint64_t v) {
    for (int p = 0; p < o.num_producers; ++p) {
      bool ok;
      {
        std::lock_guard<std::mutex> lk(mu);
        ok = !dead.count(p) && peers[static_cast<size_t>(p)].connected && !failed.count(p);
      }
      if (ok) send_to(p, MsgType::kFailover, v, -1);
    }
  }

  // Push, after moving to new routes mid-sync: a producer that we asked to write (READY)
  // under the old routes may still have those writes in flight into our receive ring,
  // where they would land on top of the new attempt's groups. Waits until each of them
  // answered our FAILOVER with FLUSHED (sent once none is left), has failed, or is dead.
  Status wait_flushed(uint64_t v) {
    if (o.mode != SyncMode::kPush) return Status::Ok();
    std::unique_lock<std::mutex> lk(mu);
    const auto deadline = Clock::now() + o.timeout;
    for (int p : readied) {
      while (!dead.count(p) && !failed.count(p) && peers[static_cast<size_t>(p)].connected) {
        auto it = flushed_from.find(p);
        if (it != flushed_from.end() && it->second == std::make_pair(v, routes_hash)) break;
        if (crashed) return cancelled("consumer {} crashed (test hook)", rank);
        if (cv.wait_until(lk, deadline) == std::cv_status::timeout && Clock::now() >= deadline)
          return timeout_error("consumer {}: producer {} did not confirm within {} ms that its writes of abandoned "
                               "routes into this consumer's receive ring ended (sync {})",
                               rank, p, o.timeout.count(), v);
      }
    }
    readied.clear();
    return Status::Ok();
  }

  Result<SyncReport> sync(uint64_t v) {
    const auto t0 = Clock::now();
    readied.clear();
    SyncReport rep;
    rep.version = v;
    if (o.before_sync) o.before_sync(v);
    {
      std::lock_guard<std::mutex> lk(mu);
      // Drop announcements of older versions.
      for (auto it = inbox.begin(); it != inbox.end();) it = std::get<0>(it->first) < v ? inbox.erase(it) : std::next(it);
    }
    reset_background();
    {
      std::lock_guard<std::mutex> lk(mu);
      unpacked_any = false;
    }
    old_hashes.clear();
    const uint64_t previous = routes_hash;
    Status s = refresh_routes().with_context(fmt::format("consumer {} sync {}", rank, v));
    // Routes changed before we began (another participant already failed over this
    // sync): announcements made with the old ones are stale, not a reason to switch.
    if (routes_hash != previous) old_hashes.insert(previous);
    declare = !dead.empty();
    for (int tries = 0; s.ok() || tries > 0; ++tries) {
      failed_p = -1;
      {
        std::lock_guard<std::mutex> lk(mu);
        switch_routes = false;
      }
      s = sync_groups(v, rep);
      if (s.ok() || !o.failover || tries >= 2 * o.num_producers) break;
      bool follow;
      {
        std::lock_guard<std::mutex> lk(mu);
        follow = switch_routes;
      }
      if (follow) {
        const uint64_t before = routes_hash;
        reset_background();
        Status f = refresh_routes();
        if (!f.ok() || routes_hash == before) {
          if (!f.ok()) s = f;
          break;
        }
        old_hashes.insert(before);
        rep.failures.push_back(fmt::format("consumer {}: followed producers to routes without a failed producer", rank));
        declare_routes(v);
        if (Status w = wait_flushed(v); !w.ok()) {
          s = w;
          break;
        }
        rep.bytes = rep.direct_bytes = 0;
        rep.bytes_per_peer.clear();
        continue;
      }
      if (failed_p < 0) break;
      old_hashes.insert(routes_hash);
      Status f = failover(v, s, rep);
      if (f.ok()) f = wait_flushed(v);
      if (!f.ok()) {
        s = f;
        break;
      }
      rep.bytes = rep.direct_bytes = 0;
      rep.bytes_per_peer.clear();
    }
    std::unique_lock<std::mutex> lk(mu);
    if (!s.ok()) {
      // Let the background thread finish what it holds, then tell producers we gave up.
      cv.wait_for(lk, o.timeout, [&] { return jobs.empty() && !busy; });
      jobs.clear();
      if (unpacked_any) st.torn = true;
      lk.unlock();
      for (int p = 0; p < o.num_producers; ++p) {
        bool ok;
        {
          std::lock_guard<std::mutex> g(mu);
          ok = peers[static_cast<size_t>(p)].connected && !failed.count(p);
        }
        if (ok) send_to(p, MsgType::kAbort, v, -1);
      }
      return s;
    }
    rep.unpack_seconds = unpack_seconds;
    rep.post_seconds = post_seconds;
    final_ = work;
    st.version = v;
    st.has_version = true;
    st.torn = false;
    lk.unlock();
    for (int p = 0; p < o.num_producers; ++p) {
      bool ok;
      {
        std::lock_guard<std::mutex> g(mu);
        ok = peers[static_cast<size_t>(p)].connected && !failed.count(p);
      }
      if (ok) send_to(p, MsgType::kDone, v, -1);
    }
    rep.seconds = seconds_since(t0);
    if (o.after_sync) o.after_sync(v);
    return rep;
  }
};

Consumer::Consumer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Consumer::~Consumer() = default;
Result<SyncReport> Consumer::sync(uint64_t version) { return impl_->sync(version); }
ConsumerState Consumer::state() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->st;
}
const TensorMap& Consumer::params() const { return impl_->final_; }
const Routes& Consumer::routes() const { return impl_->routes; }
int Consumer::rank() const { return impl_->rank; }
void Consumer::simulate_crash() {
  impl_->tr.simulate_crash().ignore();
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->crashed = true;
    impl_->cv.notify_all();
  }
  if (impl_->lease) impl_->lease->release().ignore();
}

Result<std::unique_ptr<Consumer>> Consumer::create(const ModelLoader& loader, int rank, Transport& transport, Store& store,
                                                   const ConsumerOptions& options, TensorMap params) {
  auto impl = std::make_unique<Impl>(loader, rank, transport, store, options);
  Impl& m = *impl;
  if (rank < 0 || rank >= options.num_consumers)
    return invalid_argument("consumer rank {} outside num_consumers {}", rank, options.num_consumers);
  FERRY_ASSIGN_OR_RETURN(m.rl, loader.rank(rank));
  FERRY_RETURN_IF_ERROR(store.wait({key_meta(options.job)}, options.rendezvous_timeout).with_context("engine rendezvous"));
  FERRY_ASSIGN_OR_RETURN(auto meta_text, store.get(key_meta(options.job)));
  FERRY_ASSIGN_OR_RETURN(auto metadata, decode_decls(meta_text));
  auto plan = record_plan(loader, rank, metadata);
  if (!plan.ok()) return plan.status().with_context(fmt::format("consumer {} recording its plan", rank));
  m.plan = std::move(*plan);
  FERRY_RETURN_IF_ERROR(store.set(key_plan(options.job, rank), m.plan.encode()));
  FERRY_ASSIGN_OR_RETURN(m.inputs, rendezvous_inputs(store, options, metadata));
  if (options.failover) {
    FERRY_ASSIGN_OR_RETURN(m.dead, read_dead(store, options.job));
  }
  FERRY_ASSIGN_OR_RETURN(auto routes, build_routes_excluding(m.inputs, m.dead));
  // Receive slots fit any routing: a class reads the same bytes per group whoever sends.
  uint64_t largest = 0;
  for (const auto& g : routes.consumer(static_cast<size_t>(rank)).groups) largest = std::max(largest, g.recv_bytes);
  m.slot_bytes = align_up(std::max<uint64_t>(largest, 64), 64);
  // Param buffers: the caller's (each registered, if large enough to be read into
  // directly), or ours: one arena (zeroed; one registration). Registered in pull mode
  // only: push writes into the receive ring.
  uint64_t arena_bytes = 0;
  for (const ParamInfo& p : m.rl->params()) {
    auto it = params.find(p.decl.name);
    if (it == params.end()) {
      arena_bytes += align_up(shape_numel(p.decl.shape) * dtype_size(p.decl.dtype), 64);
      continue;
    }
    const Tensor& t = it->second;
    if (!t.is_real() || !t.is_contiguous() || t.dtype() != p.decl.dtype || t.shape() != p.decl.shape)
      return invalid_argument("consumer {}: param buffer '{}' must be real, contiguous, {} {}", rank, p.decl.name,
                              dtype_name(p.decl.dtype), shape_str(p.decl.shape));
  }
  std::shared_ptr<std::byte> arena;
  MemoryRegion arena_region;
  if (arena_bytes) {
    arena_bytes = align_up(arena_bytes, 4096);
    void* mem = std::aligned_alloc(4096, arena_bytes);
    if (!mem) return io_error("consumer {}: allocating {} bytes of params", rank, arena_bytes);
    std::memset(mem, 0, arena_bytes);
    arena = std::shared_ptr<std::byte>(static_cast<std::byte*>(mem), [](std::byte* b) { std::free(b); });
    if (options.mode == SyncMode::kPull) {
      auto r = transport.register_memory(mem, arena_bytes);
      if (!r.ok()) return r.status().with_context(fmt::format("consumer {}: registering its params", rank));
      arena_region = *r;
      m.registrations.push_back(*r);
    }
  }
  uint64_t at = 0;
  for (const ParamInfo& p : m.rl->params()) {
    const uint64_t bytes = shape_numel(p.decl.shape) * dtype_size(p.decl.dtype);
    auto it = params.find(p.decl.name);
    if (it == params.end()) {
      Tensor t = Tensor::borrow(arena.get() + at, p.decl.shape, p.decl.dtype, arena, p.decl.name);
      m.loaded.emplace(p.decl.name, t);
      if (options.mode == SyncMode::kPull)
        m.param_regions[p.decl.name] = Impl::ParamRegion{arena_region, at, arena.get() + at, bytes};
      at += align_up(bytes, 64);
      continue;
    }
    const Tensor& t = it->second;
    m.loaded.emplace(p.decl.name, t);
    if (options.mode != SyncMode::kPull || bytes < options.direct_min_bytes || bytes == 0) continue;
    FERRY_ASSIGN_OR_RETURN(void* data, t.data_ptr());
    auto r = transport.register_memory(data, bytes);
    if (!r.ok()) return r.status().with_context(fmt::format("consumer {}: registering param '{}'", rank, p.decl.name));
    m.registrations.push_back(*r);
    m.param_regions[p.decl.name] = Impl::ParamRegion{*r, 0, static_cast<std::byte*>(data), bytes};
  }
  FERRY_RETURN_IF_ERROR(m.apply_routes(std::move(routes)));
  // Padding: the plan's zeros are written once (routes carry only source bytes).
  if (!m.plan.zeros().empty()) {
    Plan zeros_only;
    for (const auto& d : m.plan.params()) FERRY_RETURN_IF_ERROR(zeros_only.declare_param(d).status());
    for (const auto& z : m.plan.zeros()) FERRY_RETURN_IF_ERROR(zeros_only.add_zero(z));
    FERRY_RETURN_IF_ERROR(execute(zeros_only, {}, m.loaded));
  }
  m.final_ = m.loaded;
  FERRY_RETURN_IF_ERROR(m.ring.allocate(transport, m.slot_bytes * Impl::kSlots));
  FERRY_ASSIGN_OR_RETURN(auto key, transport.export_key(m.ring.region));
  m.peers.resize(static_cast<size_t>(options.num_producers));
  Impl* self = impl.get();
  transport.set_message_handler([self](PeerId from, uint32_t tag, std::span<const std::byte> payload) {
    if (tag == kTag) self->on_message(from, payload);
  });
  transport.set_peer_failure_handler([self](PeerId peer, const Status& why) { self->on_peer_failure(peer, why); });
  std::vector<std::string> keys;
  for (int p = 0; p < options.num_producers; ++p) keys.push_back(key_producer(options.job, p));
  FERRY_RETURN_IF_ERROR(store.wait(keys, options.rendezvous_timeout).with_context("waiting for producers"));
  FERRY_RETURN_IF_ERROR(m.refresh_producers());
  m.worker = std::thread([self] { self->bg_loop(); });
  const std::string blob =
      encode_fields({bytes_to_string(transport.address()), bytes_to_string(key), u64_field(m.slot_bytes)});
  FERRY_ASSIGN_OR_RETURN(m.lease, store.hold_lease(key_consumer(options.job, rank), blob, options.lease_ttl));
  return std::unique_ptr<Consumer>(new Consumer(std::move(impl)));
}

}  // namespace ferry

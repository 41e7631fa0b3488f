// The per-attempt sync plan (engine/sync_plan.h) on its own, with no transport: each
// consumer's plan is run through AttemptReads (engine/attempt_reads.h) against fake
// lanes that copy from the producers' staging and source regions, in the order the
// consumer takes them (announcements in producer order, in-place bytes into the slot
// once a producer is in the sync, in-place bytes into params read ahead); push runs the
// producer's plan (its writes to each consumer); CUDA IPC runs the staged bytes through
// a fake IPC lane into a "device" ring. Every consumer must then equal a direct load bit
// for bit, and each lane must have moved exactly the bytes the plan gave it.
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "engine/attempt_reads.h"
#include "engine/in_place.h"
#include "engine/param_set.h"
#include "engine/registered_buffer.h"
#include "engine/schedule.h"
#include "engine/sync_plan.h"
#include "routes_fixture.h"
#include "tools/job_model.h"

namespace ferry::engine {
namespace {

using tools::JobModel;
using tools::make_job_model;
using tools::verify_params;

using testing::cfg;
using testing::ProducerSide;

enum class Way { kStaged, kIntoParams, kInPlace, kPush, kCudaIpc };

struct PlanCase {
  const char* name;
  const char* config;
  const char* trainer;
  const char* inference;
  Way way;
};
void PrintTo(const PlanCase& c, std::ostream* os) { *os << c.name; }

// A lane that copies: staged bytes from the producer's staging of the transfer's group
// (the fake's "announced slot" is the group's own buffer, so staging_offset must be 0),
// in-place bytes from its region; into `slot` (the receive slot) or a param's landing.
class FakeLane final : public Lane {
 public:
  FakeLane(LaneKind kind, const std::vector<ProducerSide>& producers, ParamSet& params, std::vector<std::byte>& slot)
      : kind_(kind), producers_(producers), params_(params), slot_(slot) {}
  LaneKind kind() const override { return kind_; }
  bool viable(int p) const override { return !unreachable_.count(p); }
  std::string why_not(int p) const override { return unreachable_.count(p) ? "unreachable (test)" : ""; }
  Status post(const Transfer& t, uint64_t at, uint64_t n, uint64_t staging_offset, uint64_t slot_offset,
              std::vector<Completion>&) override {
    EXPECT_EQ(t.lane, kind_) << "a transfer posted on the wrong lane";
    EXPECT_EQ(staging_offset, 0u);
    EXPECT_EQ(slot_offset, 0u);
    const SubRead& sr = *t.read;
    EXPECT_LE(at + n, sr.length);
    const ProducerSide& ps = producers_[static_cast<size_t>(t.producer)];
    const std::byte* from = sr.region >= 0 ? ps.region.data() + sr.remote + at
                                           : ps.staging[static_cast<size_t>(t.group)].data() + sr.remote + at;
    if (sr.region < 0) {
      EXPECT_LE(sr.remote + at + n, ps.staging[static_cast<size_t>(t.group)].size());
    }
    std::byte* to = sr.param ? params_.landing(sr).data + at : slot_.data() + slot_offset + sr.recv_offset + at;
    if (!sr.param) {
      EXPECT_LE(sr.recv_offset + at + n, slot_.size());
    }
    std::memcpy(to, from, n);
    moved += n;
    if (sr.region >= 0) moved_in_place += n;
    if (sr.param) moved_into_params += n;
    return Status::Ok();
  }
  std::set<int> unreachable_;
  uint64_t moved = 0, moved_in_place = 0, moved_into_params = 0;

 private:
  LaneKind kind_;
  const std::vector<ProducerSide>& producers_;
  ParamSet& params_;
  std::vector<std::byte>& slot_;
};

Routes build(const JobModel& m, std::vector<Plan>& plans) { return testing::build_job_routes(m, plans); }

void make_producers(const JobModel& m, const Routes& routes, bool in_place, uint64_t seed,
                    std::vector<ProducerSide>& prod) {
  testing::make_producer_sides(m, routes, in_place, seed, 1, prod);
}

class SyncPlanTest : public ::testing::TestWithParam<PlanCase> {};

TEST_P(SyncPlanTest, TransfersThroughFakeLanesMoveEveryByteOfADirectLoad) {
  const PlanCase& k = GetParam();
  auto model = make_job_model(cfg(k.config), k.trainer, k.inference, true, R"({"num_hidden_layers": 2})");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  const JobModel& m = *model;
  std::vector<Plan> plans;
  const Routes routes = build(m, plans);
  const int P = m.trainer.world_size(), C = m.inference.world_size(), G = routes.num_groups();
  const uint64_t seed = 11;
  const bool in_place = k.way == Way::kInPlace || k.way == Way::kPush;
  const uint64_t direct_min = k.way == Way::kIntoParams || k.way == Way::kInPlace || k.way == Way::kPush ? 1024 : UINT64_MAX;
  std::vector<ProducerSide> prod;
  ASSERT_NO_FATAL_FAILURE(make_producers(m, routes, in_place, seed, prod));

  // Every consumer's param set and ParamTable first: push producers plan from them.
  std::vector<std::unique_ptr<ParamSet>> sets;
  std::vector<ParamTable> tables(static_cast<size_t>(C));
  for (int c = 0; c < C; ++c) {
    auto rl = m.loader->rank(c);
    ASSERT_TRUE(rl.ok());
    std::vector<TensorDecl> decls;
    for (const ParamInfo& pi : (*rl)->params()) decls.push_back(pi.decl);
    auto set = ParamSet::create(ParamSetOptions{c, k.way == Way::kPush, direct_min}, decls, {}, host_param_memory());
    ASSERT_TRUE(set.ok()) << set.status().to_string();
    tables[static_cast<size_t>(c)].min_bytes = direct_min;
    for (size_t r = 0; r < (*set)->registrations().size(); ++r)
      tables[static_cast<size_t>(c)].keys.push_back("key" + std::to_string(r));
    tables[static_cast<size_t>(c)].params = (*set)->placements();
    sets.push_back(std::move(*set));
  }
  // Push: every producer's attempt plan, all consumers members.
  std::vector<ProducerAttemptPlan> pplans;
  for (int p = 0; p < P; ++p) {
    ProducerPlanInputs in;
    in.routes = &routes;
    in.routes_hash = routes.fingerprint();
    in.rank = p;
    in.schedule = &prod[static_cast<size_t>(p)].schedule;
    in.members.assign(static_cast<size_t>(C), true);
    in.push = k.way == Way::kPush;
    for (int c = 0; c < C; ++c) {
      in.tables.push_back(&tables[static_cast<size_t>(c)]);
      in.instances.push_back("instance-" + std::to_string(c));
    }
    in.holdings = m.holdings.get();
    in.in_place = &prod[static_cast<size_t>(p)].table;
    pplans.push_back(make_producer_attempt_plan(in));
    // Targets: exactly the consumers whose plan class the group serves.
    for (int g = 0; g < G; ++g) {
      std::vector<int> expect;
      for (int c = 0; c < C; ++c)
        if (prod[static_cast<size_t>(p)].schedule.groups[static_cast<size_t>(g)].served.count(routes.consumer_plan[static_cast<size_t>(c)]))
          expect.push_back(c);
      EXPECT_EQ(pplans.back().groups[static_cast<size_t>(g)].targets, expect) << "producer " << p << " group " << g;
    }
  }

  uint64_t via_ipc = 0, in_place_bytes = 0, into_params = 0;
  for (int c = 0; c < C; ++c) {
    ParamSet& set = *sets[static_cast<size_t>(c)];
    TensorMap params = set.loaded();
    ConsumerScheduleInputs in;
    in.routes = &routes;
    in.rank = c;
    in.direct_min_bytes = direct_min;
    in.params = &set.placements();
    in.holdings = m.holdings.get();
    for (const ProducerSide& ps : prod) in.in_place.push_back(in_place ? &ps.table : nullptr);
    const ConsumerSchedule cs = make_consumer_schedule(in);
    const PlanRoute& plan_route = routes.consumer(static_cast<size_t>(c));
    std::vector<std::byte> slot(consumer_slot_bytes(plan_route)), device_slot(slot.size());
    FakeLane transport(LaneKind::kTransport, prod, set, slot);
    FakeLane ipc(LaneKind::kCudaIpc, prod, set, device_slot);
    const ConsumerAttemptPlan plan =
        make_consumer_attempt_plan(c, cs, k.way == Way::kStaged || k.way == Way::kPush ? nullptr : &ipc);
    EXPECT_EQ(plan.cuda_ipc, k.way == Way::kCudaIpc);
    EXPECT_TRUE(plan.notes.empty());
    ASSERT_EQ(plan.groups.size(), static_cast<size_t>(G));
    uint64_t planned = 0;
    for (const ConsumerGroupSchedule& gs : cs.groups) planned += gs.reads.size();
    if (k.way != Way::kPush) {
      EXPECT_EQ(plan.transfers(), planned);
    }
    // Paced (the rotated order) for the odd consumers: in-place bytes read only as each
    // producer announces each group, none ahead.
    const bool paced = c % 2 == 1;
    AttemptReads reads(plan, transport, &ipc, nullptr, paced, std::chrono::milliseconds(1000));
    for (int g = 0; g < G; ++g) {
      const ConsumerGroupPlan& gp = plan.groups[static_cast<size_t>(g)];
      std::fill(slot.begin(), slot.end(), std::byte{0xCD});
      std::fill(device_slot.begin(), device_slot.end(), std::byte{0xCD});
      std::vector<int> from;
      for (const auto& [p, bytes] : cs.groups[static_cast<size_t>(g)].received_from) from.push_back(p);
      EXPECT_EQ(gp.from, from);
      if (k.way == Way::kPush) {
        // The producers write what their plans say, from staging or their regions, into
        // the slot or straight into the consumer's registered params.
        for (int p : gp.from) {
          for (const PushWrite& w : pplans[static_cast<size_t>(p)].writes_of(c, g)) {
            const ProducerSide& ps = prod[static_cast<size_t>(p)];
            const std::byte* src = w.region >= 0 ? ps.region.data() + w.local
                                                 : ps.staging[static_cast<size_t>(g)].data() + w.local;
            std::byte* dst = w.param_key >= 0
                                 ? static_cast<std::byte*>(set.registrations()[static_cast<size_t>(w.param_key)].base) + w.remote
                                 : slot.data() + w.remote;
            std::memcpy(dst, src, w.length);
            if (w.region >= 0) in_place_bytes += w.length;
            if (w.param_key >= 0) into_params += w.length;
          }
        }
      } else {
        // The consumer's pull order: the slot is ours (in-place bytes into it from
        // producers already in the sync); then each announcement (producer order here),
        // its staged bytes and its in-place bytes at the pace; a backlog chunk between.
        ASSERT_TRUE(reads.begin_group(g, 0).ok());
        for (int p : gp.from) {
          if (!reads.backlog_empty()) {
            EXPECT_FALSE(paced && !reads.backlog_through(g)) << "paced reads ran ahead of group " << g;
            ASSERT_TRUE(reads.work_one().ok());
          }
          std::vector<Completion> staged;
          ASSERT_TRUE(reads.post_staged(g, p, 0, 0, staged).ok());
          EXPECT_TRUE(staged.empty());  // fake lanes are synchronous
          ASSERT_TRUE(reads.announced(g, p, 0).ok());
        }
        while (reads.backlog_through(g)) ASSERT_TRUE(reads.work_one().ok());
        for (int p : gp.from) EXPECT_TRUE(reads.take(g, p).empty());
      }
      const std::vector<std::byte>& landed = plan.cuda_ipc ? device_slot : slot;
      ASSERT_TRUE(unpack_group(cs.unpack, g, std::span<const std::byte>(landed.data(), landed.size()), params).ok());
    }
    EXPECT_TRUE(reads.backlog_empty());
    via_ipc += ipc.moved;
    in_place_bytes += transport.moved_in_place;
    into_params += transport.moved_into_params;
    uint64_t received = 0;
    for (const ConsumerGroupSchedule& gs : cs.groups) received += gs.received;
    if (k.way != Way::kPush) {
      EXPECT_EQ(transport.moved + ipc.moved, received) << "consumer " << c;
    }
    if (k.way == Way::kCudaIpc) {
      EXPECT_EQ(ipc.moved, received);
    }
    auto mismatch = verify_params(m, c, params, seed, 1);
    ASSERT_TRUE(mismatch.ok()) << mismatch.status().to_string();
    EXPECT_FALSE(mismatch->has_value()) << "consumer " << c << ": " << **mismatch;
  }
  // The case's premise holds.
  EXPECT_EQ(via_ipc > 0, k.way == Way::kCudaIpc);
  EXPECT_EQ(in_place_bytes > 0, in_place);
  EXPECT_EQ(into_params > 0, direct_min != UINT64_MAX);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, SyncPlanTest,
    ::testing::Values(PlanCase{"DenseStaged", "llama-3.1-8b.json", "tp=2", "tp=4", Way::kStaged},
                      PlanCase{"DenseIntoParams", "llama-3.1-8b.json", "tp=2", "tp=4", Way::kIntoParams},
                      PlanCase{"DenseInPlace", "llama-3.1-8b.json", "tp=2", "tp=4", Way::kInPlace},
                      PlanCase{"DensePush", "llama-3.1-8b.json", "tp=2", "tp=4", Way::kPush},
                      PlanCase{"DenseCudaIpc", "llama-3.1-8b.json", "tp=2,pp=2", "tp=2,replicas=2", Way::kCudaIpc},
                      PlanCase{"MoeInPlace", "qwen3-30b-a3b.json", "tp=2,pp=2,ep=2", "tp=2,ep=2,replicas=2", Way::kInPlace},
                      PlanCase{"MoePush", "qwen3-30b-a3b.json", "tp=2,dp=2", "tp=2,ep=2", Way::kPush},
                      PlanCase{"MoeCudaIpc", "qwen3-30b-a3b.json", "tp=2,pp=2,ep=2", "tp=2", Way::kCudaIpc},
                      PlanCase{"FsdpIntoParams", "llama-3.1-8b.json", "fsdp=4", "tp=2", Way::kIntoParams},
                      PlanCase{"FsdpPush", "llama-3.1-8b.json", "fsdp=4", "tp=2", Way::kPush}),
    [](const ::testing::TestParamInfo<PlanCase>& i) { return std::string(i.param.name); });

// CUDA IPC is all or nothing per attempt: one producer not mapped (another host, a
// CUDA error) sends every transfer through the transport and says why in the notes; a
// producer serving in place or into params does too (its bytes cannot land in one ring).
TEST(SyncPlan, CudaIpcOnlyWhenEveryProducerIsMappedAndNothingLandsElsewhere) {
  auto model = make_job_model(cfg("llama-3.1-8b.json"), "tp=2", "tp=2", true, R"({"num_hidden_layers": 1})");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  std::vector<Plan> plans;
  const Routes routes = build(*model, plans);
  std::vector<ProducerSide> prod;
  ASSERT_NO_FATAL_FAILURE(make_producers(*model, routes, false, 3, prod));
  auto rl = model->loader->rank(0);
  ASSERT_TRUE(rl.ok());
  std::vector<TensorDecl> decls;
  for (const ParamInfo& pi : (*rl)->params()) decls.push_back(pi.decl);
  for (uint64_t direct_min : {UINT64_MAX, uint64_t{0}}) {
    auto set = ParamSet::create(ParamSetOptions{0, false, direct_min}, decls, {}, host_param_memory());
    ASSERT_TRUE(set.ok());
    ConsumerScheduleInputs in;
    in.routes = &routes;
    in.direct_min_bytes = direct_min;
    in.params = &(*set)->placements();
    in.holdings = model->holdings.get();
    in.in_place.assign(prod.size(), nullptr);
    const ConsumerSchedule cs = make_consumer_schedule(in);
    std::vector<std::byte> slot(16);
    FakeLane ipc(LaneKind::kCudaIpc, prod, **set, slot);
    EXPECT_EQ(make_consumer_attempt_plan(0, cs, &ipc).cuda_ipc, direct_min == UINT64_MAX);
    EXPECT_FALSE(make_consumer_attempt_plan(0, cs, nullptr).cuda_ipc);
    ipc.unreachable_.insert(1);
    const ConsumerAttemptPlan plan = make_consumer_attempt_plan(0, cs, &ipc);
    EXPECT_FALSE(plan.cuda_ipc);
    ASSERT_EQ(plan.notes.size(), 1u);
    EXPECT_NE(plan.notes[0].find("producer 1"), std::string::npos) << plan.notes[0];
    EXPECT_NE(plan.notes[0].find("unreachable (test)"), std::string::npos) << plan.notes[0];
    for (const ConsumerGroupPlan& g : plan.groups)
      for (const auto& [p, ts] : g.staged)
        for (const Transfer& t : ts) EXPECT_EQ(t.lane, LaneKind::kTransport);
  }
}

// The relay lane's copy and the patch reads are transfers of the plan too: a replica
// of consumer 0's plan class that copies every group whole from consumer 0's slot (the
// relay's offer) by its relay lane ends up with a direct load's params, and each
// producer's patch read covers exactly its segment of the group (posting one of the
// segment's length lands the dense bytes; a longer one is refused).
TEST(SyncPlan, RelayCopiesAndPatchReadsArePlannedTransfers) {
  auto model = make_job_model(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2", true, R"({"num_hidden_layers": 2})");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  const JobModel& m = *model;
  std::vector<Plan> plans;
  const Routes routes = build(m, plans);
  ASSERT_EQ(routes.consumer_plan[0], routes.consumer_plan[2]);  // replicas: one plan class
  std::vector<ProducerSide> prod;
  ASSERT_NO_FATAL_FAILURE(make_producers(m, routes, false, 5, prod));
  const PlanRoute& route = routes.consumer(0);
  std::vector<std::unique_ptr<ParamSet>> sets;
  std::vector<ConsumerSchedule> schedules;
  for (int c : {0, 2}) {
    auto rl = m.loader->rank(c);
    ASSERT_TRUE(rl.ok());
    std::vector<TensorDecl> decls;
    for (const ParamInfo& pi : (*rl)->params()) decls.push_back(pi.decl);
    auto set = ParamSet::create(ParamSetOptions{c, false, UINT64_MAX}, decls, {}, host_param_memory());
    ASSERT_TRUE(set.ok()) << set.status().to_string();
    ConsumerScheduleInputs in;
    in.routes = &routes;
    in.rank = c;
    in.direct_min_bytes = UINT64_MAX;
    in.params = &(*set)->placements();
    in.holdings = m.holdings.get();
    in.in_place.assign(prod.size(), nullptr);
    schedules.push_back(make_consumer_schedule(in));
    sets.push_back(std::move(*set));
  }
  std::vector<std::byte> relay_slot(consumer_slot_bytes(route)), member_slot(relay_slot.size());
  FakeLane relay_transport(LaneKind::kTransport, prod, *sets[0], relay_slot);
  // The member's relay lane copies from the relay's slot (its "staging").
  class FakeRelayLane final : public Lane {
   public:
    FakeRelayLane(const std::vector<std::byte>& from, std::vector<std::byte>& to) : from_(from), to_(to) {}
    LaneKind kind() const override { return LaneKind::kRelay; }
    bool viable(int) const override { return true; }
    std::string why_not(int) const override { return ""; }
    Status post(const Transfer& t, uint64_t at, uint64_t n, uint64_t offered, uint64_t slot_offset,
                std::vector<Completion>&) override {
      EXPECT_EQ(t.lane, LaneKind::kRelay);
      EXPECT_LE(offered + t.read->remote + at + n, from_.size());
      std::memcpy(to_.data() + slot_offset + t.read->recv_offset + at, from_.data() + offered + t.read->remote + at, n);
      moved += n;
      return Status::Ok();
    }
    uint64_t moved = 0;

   private:
    const std::vector<std::byte>& from_;
    std::vector<std::byte>& to_;
  } relay_lane(relay_slot, member_slot);
  FakeLane member_transport(LaneKind::kTransport, prod, *sets[1], member_slot);
  const ConsumerAttemptPlan relay_plan = make_consumer_attempt_plan(0, schedules[0], nullptr, &route, nullptr);
  const ConsumerAttemptPlan member_plan = make_consumer_attempt_plan(2, schedules[1], nullptr, &route, &relay_lane);
  AttemptReads relay_reads(relay_plan, relay_transport, nullptr, nullptr, false, std::chrono::milliseconds(1000));
  AttemptReads member_reads(member_plan, member_transport, nullptr, &relay_lane, false, std::chrono::milliseconds(1000));
  TensorMap relay_params = sets[0]->loaded(), member_params = sets[1]->loaded();
  uint64_t slot_bytes = 0;
  for (int g = 0; g < routes.num_groups(); ++g) {
    const ConsumerGroupPlan& gp = member_plan.groups[static_cast<size_t>(g)];
    EXPECT_FALSE(relay_reads.relayed(g));  // (no relay lane)
    ASSERT_EQ(member_reads.relayed(g), !gp.from.empty());
    if (gp.from.empty()) continue;
    std::fill(relay_slot.begin(), relay_slot.end(), std::byte{0xCD});
    std::fill(member_slot.begin(), member_slot.end(), std::byte{0xAB});
    for (int p : gp.from) {
      std::vector<Completion> ops;
      ASSERT_TRUE(relay_reads.post_staged(g, p, 0, 0, ops).ok());
    }
    std::vector<Completion> ops;
    ASSERT_TRUE(member_reads.post_relayed(g, 0, 0, ops).ok());
    slot_bytes += route.groups[static_cast<size_t>(g)].recv_bytes;
    ASSERT_TRUE(unpack_group(schedules[0].unpack, g, relay_slot, relay_params).ok());
    ASSERT_TRUE(unpack_group(schedules[1].unpack, g, member_slot, member_params).ok());
    // Patch reads: one per producer whose segment is one read, covering it exactly.
    std::fill(member_slot.begin(), member_slot.end(), std::byte{0xAB});
    for (int p : gp.from) {
      const Read* r = single_read_from(route.groups[static_cast<size_t>(g)], static_cast<uint32_t>(p));
      ASSERT_EQ(gp.patch.count(p), r ? 1u : 0u);
      if (!r) continue;
      const SubRead& pr = gp.patch.at(p)->read;
      EXPECT_EQ(pr.recv_offset, r->recv_offset);
      EXPECT_EQ(pr.length, r->length);
      EXPECT_EQ(pr.remote, r->offset);
      std::vector<Completion> patch;
      EXPECT_EQ(member_reads.post_patch(g, p, 0, r->length + 1, 0, patch).code(), StatusCode::kOutOfRange);
      ASSERT_TRUE(member_reads.post_patch(g, p, 0, r->length, 0, patch).ok());
      EXPECT_EQ(std::memcmp(member_slot.data() + r->recv_offset, relay_slot.data() + r->recv_offset, r->length), 0)
          << "group " << g << " producer " << p;
    }
  }
  EXPECT_EQ(relay_lane.moved, slot_bytes);
  for (int c : {0, 2}) {
    auto mismatch = verify_params(m, c, c == 0 ? relay_params : member_params, 5, 1);
    ASSERT_TRUE(mismatch.ok()) << mismatch.status().to_string();
    EXPECT_FALSE(mismatch->has_value()) << "consumer " << c << ": " << **mismatch;
  }
}

// A producer's plan reuses the push writes of a consumer instance it already planned
// under the same routes, and rebuilds them for a new instance or new routes; members
// alone are targets.
TEST(SyncPlan, ProducerPlanReusesWritesOfUnchangedInstancesAndTargetsMembersOnly) {
  auto model = make_job_model(cfg("llama-3.1-8b.json"), "tp=2", "tp=2,replicas=2", true, R"({"num_hidden_layers": 1})");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  std::vector<Plan> plans;
  const Routes routes = build(*model, plans);
  std::vector<ProducerSide> prod;
  ASSERT_NO_FATAL_FAILURE(make_producers(*model, routes, false, 3, prod));
  const ParamTable table;  // no registered params: every write lands in the slot
  ProducerPlanInputs in;
  in.routes = &routes;
  in.routes_hash = routes.fingerprint();
  in.rank = 0;
  in.schedule = &prod[0].schedule;
  in.members = {true, true, false, true};
  in.push = true;
  in.tables = {&table, &table, nullptr, &table};
  in.instances = {"a", "b", "", "d"};
  in.holdings = model->holdings.get();
  const ProducerAttemptPlan first = make_producer_attempt_plan(in);
  EXPECT_EQ(first.writes.size(), 3u);
  EXPECT_FALSE(first.writes.count(2));
  for (const ProducerGroupPlan& g : first.groups)
    for (int c : g.targets) EXPECT_NE(c, 2);
  EXPECT_FALSE(first.writes_of(0, 0).empty());
  EXPECT_TRUE(first.writes_of(2, 0).empty());
  EXPECT_GT(first.heap_bytes(), 0u);
  in.instances[1] = "b2";  // consumer 1 restarted
  in.previous = &first;
  const ProducerAttemptPlan second = make_producer_attempt_plan(in);
  EXPECT_EQ(second.writes.at(0).by_group, first.writes.at(0).by_group);  // reused
  EXPECT_NE(second.writes.at(1).by_group, first.writes.at(1).by_group);  // rebuilt
  EXPECT_EQ(*second.writes.at(1).by_group, *first.writes.at(1).by_group);
  in.routes_hash ^= 1;  // other routes: nothing reused
  const ProducerAttemptPlan third = make_producer_attempt_plan(in);
  EXPECT_NE(third.writes.at(0).by_group, second.writes.at(0).by_group);
}

}  // namespace
}  // namespace ferry::engine

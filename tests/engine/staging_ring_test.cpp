// The producer's StagingRing (engine/staging_ring.h) on its own, with no transport: its
// memory from plain heap memory (HeapRingMemory). Every group of every producer of a
// dense, an MoE and an FSDP job is packed, and every byte of every slot is checked
// against what the schedule says, computed independently from the synthetic weights
// (synthetic_tensor) and the pack list: packed bytes hold their elements, every other
// byte (in-place runs, padding, the slot's tail) is left as it was. Checksums are checked
// against a SegmentHash over the same spans of those expected bytes. Then slot reuse,
// the errors, and (StagingRingDevice, label emulated-cuda) the GPU paths; and the
// DeltaEncoder's patches over the ring's slots and kept copy.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <set>

#include <fmt/format.h>

#include "delta/patch.h"
#include "engine/cuda_ipc.h"
#include "engine/delta_encoder.h"
#include "engine/memory.h"
#include "engine/registered_buffer.h"
#include "engine/schedule.h"
#include "engine/staging_ring.h"
#include "ferry/device.h"
#include "routes_fixture.h"
#include "tools/job_model.h"

namespace ferry::engine {
namespace {

using tools::JobModel;
using tools::make_job_model;

constexpr uint64_t kSeed = 7, kVersion = 3;
constexpr std::byte kUntouched{0xEE};

using testing::cfg;

Routes build(const JobModel& m) {
  std::vector<Plan> plans;
  return testing::build_job_routes(m, plans);
}

uint64_t box_bytes(const Tensor& t) { return static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype()); }

// A trainer rank whose weights lie in one source region (the trainer's own memory):
// every group's boxes of a SyntheticSource copied there once, materialize() borrowing
// them. `where` records each box's offset in the region.
class RegionSource final : public WeightSource {
 public:
  RegionSource(const JobModel& m, int rank) : synthetic_(m.metadata, m.holdings, rank, kSeed) {
    synthetic_.set_version(kVersion);
    const int groups = Groups(m.metadata).size();
    std::vector<std::vector<LocalBox>> tmp;
    uint64_t bytes = 0;
    for (int g = 0; g < groups; ++g) {
      auto b = synthetic_.materialize(g);
      EXPECT_TRUE(b.ok()) << b.status().to_string();
      for (const LocalBox& lb : *b) bytes += align_up(box_bytes(lb.data), 64);
      tmp.push_back(std::move(*b));
    }
    region_.resize(bytes + 64);
    uint64_t at = 0;
    for (const auto& group : tmp) {
      std::vector<LocalBox>& out = boxes_.emplace_back();
      for (const LocalBox& lb : group) {
        Tensor t = Tensor::borrow(region_.data() + at, lb.data.shape(), lb.data.dtype());
        EXPECT_TRUE(t.copy_(lb.data).ok());
        out.push_back(LocalBox{lb.box, t});
        where[lb.box] = at;
        at += align_up(box_bytes(lb.data), 64);
      }
    }
  }
  const std::vector<TensorDecl>& metadata() const override { return synthetic_.metadata(); }
  int rank() const override { return synthetic_.rank(); }
  int world_size() const override { return synthetic_.world_size(); }
  Result<Holdings> holdings(int rank) const override { return synthetic_.holdings(rank); }
  Result<std::vector<LocalBox>> materialize(int group) override { return boxes_[static_cast<size_t>(group)]; }

  MemoryRegion region() const { return MemoryRegion{42, const_cast<std::byte*>(region_.data()), region_.size()}; }
  const std::byte* data() const { return region_.data(); }
  std::map<uint32_t, uint64_t> where;

 private:
  SyntheticSource synthetic_;
  std::vector<std::byte> region_;
  std::vector<std::vector<LocalBox>> boxes_;
};

// What the schedule says group `g`'s staging holds, from the weights themselves: each
// pack op's elements (its layout over the box, row-major) read from the full synthetic
// tensor at box start + index; nullopt for bytes no pack op writes.
std::vector<std::optional<std::byte>> expected_staging(const ProducerGroupSchedule& gs, const Holdings& h,
                                                       std::map<uint32_t, Tensor>& full) {
  std::vector<std::optional<std::byte>> out(gs.pack.staging_bytes);
  for (const PackOp& op : gs.pack.packs) {
    const HeldBox& hb = h.boxes[op.box];
    const TensorDecl& d = h.tensors[hb.tensor];
    if (!full.count(hb.tensor)) full.emplace(hb.tensor, synthetic_tensor(kSeed, kVersion, d));
    const auto* src = static_cast<const std::byte*>(*full.at(hb.tensor).data_ptr());
    const uint64_t es = dtype_size(d.dtype);
    const size_t nd = op.src.shape.size();
    std::vector<int64_t> idx(nd, 0);
    for (int64_t k = 0; k < op.src.numel(); ++k) {
      int64_t local = op.src.offset;  // flat index into the box (row-major over its size)
      for (size_t i = 0; i < nd; ++i) local += idx[i] * op.src.strides[i];
      int64_t flat = 0;  // the same element in the full tensor
      for (size_t i = 0, n = hb.box.size.size(); i < n; ++i) {
        int64_t below = 1;
        for (size_t j = i + 1; j < n; ++j) below *= hb.box.size[j];
        flat = flat * d.shape[i] + hb.box.start[i] + (local / below) % hb.box.size[i];
      }
      for (uint64_t b = 0; b < es; ++b) {
        auto& slot = out[op.offset + static_cast<uint64_t>(k) * es + b];
        EXPECT_FALSE(slot.has_value()) << "pack ops overlap at staging byte " << op.offset + k * es + b;
        slot = src[static_cast<uint64_t>(flat) * es + b];
      }
      for (size_t i = nd; i-- > 0;) {
        if (++idx[i] < op.src.shape[i]) break;
        idx[i] = 0;
      }
    }
  }
  return out;
}

struct RingCase {
  const char* name;
  const char* config;
  const char* trainer;
  const char* inference;
  bool in_place;  // each producer's weights in one source region, served in place
};

class StagingRingTest : public ::testing::TestWithParam<RingCase> {};

TEST_P(StagingRingTest, PacksEverySlotAsTheScheduleSays) {
  const RingCase& k = GetParam();
  auto model = make_job_model(cfg(k.config), k.trainer, k.inference, true, R"({"num_hidden_layers": 2})");
  ASSERT_TRUE(model.ok()) << model.status().to_string();
  const JobModel& m = *model;
  const Routes routes = build(m);
  uint64_t packed_bytes = 0, in_place_bytes = 0;
  for (int p = 0; p < m.trainer.world_size(); ++p) {
    SCOPED_TRACE("producer " + std::to_string(p));
    const Holdings& h = (*m.holdings)[static_cast<size_t>(p)];
    RegionSource source(m, p);
    HeapRingMemory memory;
    StagingRingOptions o;
    o.rank = p;
    o.slot_bytes = producer_slot_bytes(routes, p, m.metadata, *m.holdings, true);
    o.slots = 2;
    o.direct_min_bytes = 64;
    if (k.in_place) o.source_regions = {source.region()};
    {
      auto ring = StagingRing::create(memory, source, h, o);
      ASSERT_TRUE(ring.ok()) << ring.status().to_string();
      StagingRing& r = **ring;
      EXPECT_EQ(memory.live(), 1u);
      EXPECT_EQ(r.host_bytes(), registered_bytes(o.slot_bytes * 2));
      EXPECT_EQ(r.host_key(), fmt::format("heap:{}:{}", r.host_region().id, r.host_bytes()));
      EXPECT_TRUE(r.cuda_ipc().empty());
      // The in-place table: every box where the source put it, in the one region.
      ASSERT_EQ(r.in_place().empty(), !k.in_place);
      if (k.in_place) {
        ASSERT_EQ(r.in_place().boxes.size(), h.boxes.size());
        EXPECT_EQ(r.in_place().min_bytes, 64u);
        for (size_t b = 0; b < h.boxes.size(); ++b) {
          EXPECT_EQ(r.in_place().boxes[b].region, 0) << "box " << b;
          EXPECT_EQ(r.in_place().boxes[b].offset, source.where.at(static_cast<uint32_t>(b))) << "box " << b;
        }
        EXPECT_EQ(r.region(0).base, source.region().base);
      }
      EXPECT_EQ(r.region(-1).base, r.host_region().base);
      auto sched = make_producer_schedule(routes, p, h, r.in_place(), r.slot_bytes());
      ASSERT_TRUE(sched.ok()) << sched.status().to_string();
      std::map<uint32_t, Tensor> full;
      for (int g = 0; g < routes.num_groups(); ++g) {
        SCOPED_TRACE("group " + std::to_string(g));
        const ProducerGroupSchedule& gs = sched->groups[static_cast<size_t>(g)];
        const size_t s = static_cast<size_t>(g) % 2;
        std::span<std::byte> slot = r.slot(s);
        ASSERT_EQ(slot.size(), r.slot_bytes());
        ASSERT_EQ(slot.data(), static_cast<std::byte*>(r.host_region().base) + r.slot_offset(s));
        std::fill(slot.begin(), slot.end(), kUntouched);
        auto boxes = source.materialize(g);
        ASSERT_TRUE(boxes.ok());
        auto sums = r.pack(*sched, g, s, *boxes);
        ASSERT_TRUE(sums.ok()) << sums.status().to_string();
        const auto want = expected_staging(gs, h, full);
        for (uint64_t i = 0; i < slot.size(); ++i) {
          const std::byte expect = i < want.size() && want[i] ? *want[i] : kUntouched;
          ASSERT_EQ(slot[i], expect) << "slot " << s << " byte " << i << " of " << gs.pack.staging_bytes;
          if (i < want.size() && want[i]) ++packed_bytes;
        }
        // In-place runs are not packed: their staging bytes stay as they were.
        for (const InPlacePiece& x : gs.in_place) {
          in_place_bytes += x.bytes;
          for (uint64_t i = x.offset; i < x.offset + x.bytes; ++i) ASSERT_FALSE(want[i].has_value()) << i;
        }
        // Checksums: per plan class over its spans, of the expected bytes (staging) and
        // of the source region (in place).
        ASSERT_EQ(sums->size(), gs.checksum_spans.size());
        for (const auto& [cls, spans] : gs.checksum_spans) {
          std::vector<std::byte> bytes;
          for (const SegmentSpan& x : spans) {
            for (uint64_t i = 0; i < x.bytes; ++i)
              bytes.push_back(x.region < 0 ? *want[x.offset + i] : source.data()[x.offset + i]);
          }
          SegmentHash independent;
          independent.update(bytes.data(), bytes.size());
          EXPECT_EQ(sums->at(cls), independent.digest()) << "plan class " << cls;
        }
      }
    }
    EXPECT_EQ(memory.live(), 0u) << "the ring gives its memory back";
  }
  EXPECT_GT(packed_bytes, 0u);
  if (k.in_place) {
    EXPECT_GT(in_place_bytes, 0u);
  }
  if (!k.in_place) {
    EXPECT_EQ(in_place_bytes, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Jobs, StagingRingTest,
    ::testing::Values(RingCase{"Dense", "llama-3.1-8b.json", "tp=2", "tp=4", false},
                      RingCase{"DenseInPlace", "llama-3.1-8b.json", "tp=2", "tp=4", true},
                      RingCase{"MoeInPlace", "qwen3-30b-a3b.json", "tp=2,pp=2,ep=2", "tp=2,ep=2,replicas=2", true},
                      RingCase{"Fsdp", "llama-3.1-8b.json", "fsdp=4", "tp=2", false}),
    [](const ::testing::TestParamInfo<RingCase>& i) { return std::string(i.param.name); });

// One small job's producer 0 with its ring and schedule, for the tests below.
struct OneProducer {
  Result<JobModel> model = make_job_model(cfg("llama-3.1-8b.json"), "tp=2", "tp=2", true, R"({"num_hidden_layers": 1})");
  Routes routes;
  std::unique_ptr<RegionSource> source;
  HeapRingMemory memory;
  std::unique_ptr<StagingRing> ring;
  ProducerSchedule schedule;

  Status start(bool in_place, Device staging_device = Device{}, uint64_t kept_bytes = 0) {
    if (!model.ok()) return model.status();
    routes = build(*model);
    source = std::make_unique<RegionSource>(*model, 0);
    StagingRingOptions o;
    o.slot_bytes = producer_slot_bytes(routes, 0, model->metadata, *model->holdings, false);
    o.slots = 2;
    o.staging_device = staging_device;
    if (in_place) o.source_regions = {source->region()};
    o.kept_bytes = kept_bytes;
    FERRY_ASSIGN_OR_RETURN(ring, StagingRing::create(memory, *source, holdings(), o));
    FERRY_ASSIGN_OR_RETURN(schedule, make_producer_schedule(routes, 0, holdings(), ring->in_place(), ring->slot_bytes()));
    return Status::Ok();
  }
  const Holdings& holdings() const { return (*model->holdings)[0]; }
  // The first box of group g that its pack list packs (not served in place).
  size_t packed_box(int g, const std::vector<LocalBox>& boxes) const {
    for (size_t i = 0; i < boxes.size(); ++i) {
      for (const PackOp& op : schedule.groups[static_cast<size_t>(g)].pack.packs)
        if (op.box == boxes[i].box) return i;
    }
    ADD_FAILURE() << "group " << g << " packs nothing";
    return 0;
  }
  std::string name_of(const LocalBox& lb) const { return holdings().tensors[holdings().boxes[lb.box].tensor].name; }
};

// Slots are reused group after group: each pack leaves its slot holding that group, and
// the other slot as it was.
TEST(StagingRing, ReusesSlotsWithoutTouchingTheOthers) {
  OneProducer k;
  ASSERT_TRUE(k.start(false).ok());
  std::map<uint32_t, Tensor> full;
  for (int round = 0; round < 2; ++round) {
    for (int g = 0; g < k.routes.num_groups(); ++g) {
      const size_t s = static_cast<size_t>(g + round) % 2;
      const std::vector<std::byte> other(k.ring->slot(1 - s).begin(), k.ring->slot(1 - s).end());
      auto boxes = k.source->materialize(g);
      ASSERT_TRUE(boxes.ok());
      auto sums = k.ring->pack(k.schedule, g, s, *boxes);
      ASSERT_TRUE(sums.ok()) << sums.status().to_string();
      const auto want = expected_staging(k.schedule.groups[static_cast<size_t>(g)], k.holdings(), full);
      for (size_t i = 0; i < want.size(); ++i) {
        if (want[i]) {
          ASSERT_EQ(k.ring->slot(s)[i], *want[i]) << "round " << round << " group " << g << " byte " << i;
        }
      }
      EXPECT_TRUE(std::equal(other.begin(), other.end(), k.ring->slot(1 - s).begin()))
          << "packing slot " << s << " changed slot " << 1 - s;
    }
  }
}

// The producer's DeltaEncoder (engine/delta_encoder.h) over a real ring's slots and kept
// copy: the first pack of a group is dense and kept; the next, with a few elements
// changed, is a patch against the kept version that turns that version's bytes into the
// new ones, while the kept copy takes the new dense bytes; new routes keep no base; every
// delta_full_every-th sync is dense; with delta off nothing is kept or patched.
TEST(DeltaEncoder, PatchesAgainstTheKeptVersionAndKeepsTheNewOne) {
  OneProducer k;
  ASSERT_TRUE(k.start(false).ok());
  const ProducerRoute& route = k.routes.producers[0];
  OneProducer kk;
  ASSERT_TRUE(kk.start(false, Device{}, kept_copy_bytes(route)).ok());
  EngineOptions eo;
  eo.delta = true;
  eo.delta_full_every = 3;
  DeltaEncoder enc(*kk.ring, eo);
  enc.install(route);
  int g = -1;  // a group with bytes
  for (int i = 0; i < k.routes.num_groups() && g < 0; ++i)
    if (route.groups[static_cast<size_t>(i)].staging_bytes > 0) g = i;
  ASSERT_GE(g, 0);
  const ProducerGroup& grp = route.groups[static_cast<size_t>(g)];
  const size_t s = 1;
  std::span<std::byte> slot = kk.ring->slot(s);
  auto fill = [&](uint64_t v) {  // version v's "packed" bytes; v changes one byte in 4096
    for (uint64_t i = 0; i < grp.staging_bytes; ++i)
      slot[i] = std::byte(static_cast<uint8_t>((i * 131) ^ (i % 4096 == 7 ? v : 0)));
  };
  auto dense = [&] { return std::vector<std::byte>(slot.begin(), slot.begin() + static_cast<long>(grp.staging_bytes)); };
  enc.begin_sync();
  fill(1);
  const std::vector<std::byte> v1 = dense();
  DeltaPack first = enc.pack(g, s, 1, grp);
  EXPECT_FALSE(first.base);  // nothing kept yet: dense
  EXPECT_TRUE(first.patch_bytes.empty());
  enc.begin_sync();
  fill(2);
  const std::vector<std::byte> v2 = dense();
  DeltaPack second = enc.pack(g, s, 2, grp);
  ASSERT_EQ(second.base, std::optional<uint64_t>(1));
  EXPECT_GT(second.compared, 0u);
  EXPECT_GT(second.changed, 0u);
  EXPECT_LT(second.changed, second.compared / 100);
  EXPECT_EQ(second.dense_offset, kk.ring->kept_offset());  // the group's dense bytes: the kept copy
  for (const Segment& seg : grp.segments) {
    if (seg.bytes == 0) continue;
    auto pb = second.bytes_for(seg.plan);
    ASSERT_TRUE(pb) << "segment of class " << seg.plan << " went dense";
    EXPECT_LT(*pb, seg.bytes / 10);
    std::vector<std::byte> target(v1.begin() + static_cast<long>(seg.offset), v1.begin() + static_cast<long>(seg.offset + seg.bytes));
    ASSERT_TRUE(delta::apply_patch(target, {slot.data() + seg.offset, *pb}).ok());
    EXPECT_TRUE(std::equal(target.begin(), target.end(), v2.begin() + static_cast<long>(seg.offset)));
    EXPECT_TRUE(std::equal(target.begin(), target.end(), kk.ring->kept().data() + seg.offset));  // kept: v2 dense
  }
  enc.begin_sync();  // the third sync: dense only (delta_full_every 3)
  fill(3);
  EXPECT_FALSE(enc.pack(g, s, 3, grp).base);
  enc.begin_sync();
  fill(4);
  EXPECT_EQ(enc.pack(g, s, 4, grp).base, std::optional<uint64_t>(3));
  enc.install(route);  // new routes: nothing kept is a base under them
  enc.begin_sync();
  fill(5);
  EXPECT_FALSE(enc.pack(g, s, 5, grp).base);

  DeltaEncoder off(*k.ring, EngineOptions{});
  off.install(route);
  for (uint64_t v = 1; v <= 2; ++v) {
    off.begin_sync();
    const DeltaPack p = off.pack(g, s, v, grp);
    EXPECT_FALSE(p.base);
    EXPECT_EQ(p.compared, 0u);
  }
}

// Plan classes sent dense (every consumer of theirs in the attempt on the producer's host,
// EngineOptions::delta_same_host off): their segments are not encoded but still kept, so
// the kept copy stays one version; a group whose every class goes dense is neither
// encoded nor kept, and holds no base after (its next pack is dense).
TEST(DeltaEncoder, ClassesSentDenseAreNotEncoded) {
  OneProducer k;
  ASSERT_TRUE(k.start(false, Device{}, 0).ok());
  const ProducerRoute& route = k.routes.producers[0];
  OneProducer kk;
  ASSERT_TRUE(kk.start(false, Device{}, kept_copy_bytes(route)).ok());
  EngineOptions eo;
  eo.delta = true;
  DeltaEncoder enc(*kk.ring, eo);
  enc.install(route);
  int g = -1;  // a group with segments of two classes
  std::set<uint32_t> classes;
  for (int i = 0; i < k.routes.num_groups() && g < 0; ++i) {
    std::set<uint32_t> here;
    for (const Segment& seg : route.groups[static_cast<size_t>(i)].segments)
      if (seg.bytes > 0) here.insert(seg.plan);
    if (here.size() >= 2) {
      g = i;
      classes = here;
    }
  }
  ASSERT_GE(g, 0) << "tp=2 -> tp=2: a group read by both inference ranks";
  const ProducerGroup& grp = route.groups[static_cast<size_t>(g)];
  const uint32_t local = *classes.begin(), remote = *classes.rbegin();
  const size_t s = 0;
  std::span<std::byte> slot = kk.ring->slot(s);
  auto fill = [&](uint64_t v) {
    for (uint64_t i = 0; i < grp.staging_bytes; ++i)
      slot[i] = std::byte(static_cast<uint8_t>((i * 131) ^ (i % 4096 == 7 ? v : 0)));
  };
  // The attempt's rule: class `local`'s consumers on this host, the others elsewhere.
  const std::vector<uint32_t>& plan_of = k.routes.consumer_plan;
  const std::vector<bool> members(plan_of.size(), true);
  std::vector<bool> here(plan_of.size(), false);
  for (size_t c = 0; c < plan_of.size(); ++c) here[c] = plan_of[c] == local;
  enc.begin_sync();
  enc.begin_attempt(plan_of, members, here);
  fill(1);
  EXPECT_FALSE(enc.pack(g, s, 1, grp).base);
  enc.begin_sync();
  fill(2);
  const std::vector<std::byte> v2(slot.begin(), slot.begin() + static_cast<long>(grp.staging_bytes));
  const DeltaPack mixed = enc.pack(g, s, 2, grp);
  ASSERT_EQ(mixed.base, std::optional<uint64_t>(1));
  EXPECT_FALSE(mixed.bytes_for(local)) << "class " << local << " goes dense";
  EXPECT_TRUE(mixed.bytes_for(remote)) << "class " << remote << " is patched";
  const std::byte* kept = kk.ring->kept().data() + kept_layout(route)[static_cast<size_t>(g)];
  for (const Segment& seg : grp.segments)  // every class kept: the kept copy is version 2
    EXPECT_TRUE(std::equal(v2.begin() + static_cast<long>(seg.offset), v2.begin() + static_cast<long>(seg.offset + seg.bytes),
                           kept + seg.offset))
        << "class " << seg.plan;
  // Every class dense: nothing compared, the kept copy untouched, no base afterwards.
  enc.begin_sync();
  enc.set_dense_classes(classes);
  fill(3);
  const DeltaPack all = enc.pack(g, s, 3, grp);
  EXPECT_FALSE(all.base);
  EXPECT_EQ(all.compared, 0u);
  for (const Segment& seg : grp.segments)
    EXPECT_TRUE(std::equal(v2.begin() + static_cast<long>(seg.offset), v2.begin() + static_cast<long>(seg.offset + seg.bytes),
                           kept + seg.offset))
        << "class " << seg.plan << ": the kept copy is not written";
  enc.begin_sync();
  enc.set_dense_classes({});
  fill(4);
  EXPECT_FALSE(enc.pack(g, s, 4, grp).base) << "version 3 was never kept: dense, and kept again";
  enc.begin_sync();
  fill(5);
  EXPECT_EQ(enc.pack(g, s, 5, grp).base, std::optional<uint64_t>(4));
  // With delta_same_host every class on this host is patched all the same.
  EngineOptions same = eo;
  same.delta_same_host = true;
  DeltaEncoder everywhere(*kk.ring, same);
  everywhere.install(route);
  for (uint64_t v = 6; v <= 7; ++v) {
    everywhere.begin_sync();
    everywhere.begin_attempt(plan_of, members, std::vector<bool>(plan_of.size(), true));
    fill(v);
    const DeltaPack p = everywhere.pack(g, s, v, grp);
    if (v == 7) {
      EXPECT_TRUE(p.bytes_for(local));
      EXPECT_TRUE(p.bytes_for(remote));
    }
  }
}

TEST(StagingRing, RefusesSlotsAndGroupsOutOfRange) {
  OneProducer k;
  ASSERT_TRUE(k.start(false).ok());
  auto boxes = k.source->materialize(0);
  ASSERT_TRUE(boxes.ok());
  auto slot = k.ring->pack(k.schedule, 0, 2, *boxes);
  ASSERT_FALSE(slot.ok());
  EXPECT_EQ(slot.status().code(), StatusCode::kOutOfRange);
  EXPECT_NE(slot.status().message().find("staging slot 2 of 2"), std::string::npos) << slot.status().to_string();
  for (int g : {-1, k.routes.num_groups()}) {
    auto group = k.ring->pack(k.schedule, g, 0, *boxes);
    ASSERT_FALSE(group.ok());
    EXPECT_EQ(group.status().code(), StatusCode::kOutOfRange);
    EXPECT_NE(group.status().message().find(fmt::format("producer 0: pack group {} of {}", g, k.routes.num_groups())),
              std::string::npos)
        << group.status().to_string();
  }
  // A ring of no slots is refused at create.
  HeapRingMemory memory;
  StagingRingOptions o;
  o.rank = 3;
  o.slot_bytes = 4096;
  auto none = StagingRing::create(memory, *k.source, k.holdings(), o);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("producer 3"), std::string::npos) << none.status().to_string();
  EXPECT_EQ(memory.live(), 0u);
}

// A materialized tensor of the wrong shape or dtype is refused, naming the tensor.
TEST(StagingRing, RefusesATensorOfTheWrongShapeOrDtypeNamingIt) {
  OneProducer k;
  ASSERT_TRUE(k.start(false).ok());
  const int g = k.routes.num_groups() - 1;
  for (bool shape : {true, false}) {
    SCOPED_TRACE(shape ? "shape" : "dtype");
    auto boxes = k.source->materialize(g);
    ASSERT_TRUE(boxes.ok());
    LocalBox& lb = (*boxes)[k.packed_box(g, *boxes)];
    Shape s = lb.data.shape();
    if (shape) s[0] += 1;
    const DType dt = shape ? lb.data.dtype() : (lb.data.dtype() == DType::kF32 ? DType::kBF16 : DType::kF32);
    lb.data = Tensor::empty(s, dt);
    auto sums = k.ring->pack(k.schedule, g, 0, *boxes);
    ASSERT_FALSE(sums.ok());
    EXPECT_EQ(sums.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(sums.status().message().find("'" + k.name_of(lb) + "'"), std::string::npos) << sums.status().to_string();
    EXPECT_NE(sums.status().message().find(fmt::format("producer 0 pack group {}", g)), std::string::npos)
        << sums.status().to_string();
  }
}

// In place: boxes served from the source region must stay where create() found them.
TEST(StagingRing, RefusesAnInPlaceBoxThatMovedNamingIt) {
  OneProducer k;
  ASSERT_TRUE(k.start(true).ok());
  ASSERT_FALSE(k.ring->in_place().empty());
  auto boxes = k.source->materialize(0);
  ASSERT_TRUE(boxes.ok());
  ASSERT_FALSE(boxes->empty());
  LocalBox& lb = boxes->front();
  Tensor copy = Tensor::empty(lb.data.shape(), lb.data.dtype());
  ASSERT_TRUE(copy.copy_(lb.data).ok());
  lb.data = copy;
  auto sums = k.ring->pack(k.schedule, 0, 0, *boxes);
  ASSERT_FALSE(sums.ok());
  EXPECT_EQ(sums.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(sums.status().message().find("'" + k.name_of(lb) + "'"), std::string::npos) << sums.status().to_string();
  EXPECT_NE(sums.status().message().find("moved since create()"), std::string::npos) << sums.status().to_string();
}

// --- GPU paths (need a CUDA device; label emulated-cuda runs them on the CPU) ---------

// Group g's boxes copied to cuda:0 memory.
Result<std::vector<LocalBox>> on_gpu(const std::vector<LocalBox>& boxes) {
  std::vector<LocalBox> out;
  for (const LocalBox& lb : boxes) {
    FERRY_ASSIGN_OR_RETURN(auto mem, device_alloc(Device::cuda(0), box_bytes(lb.data)));
    FERRY_ASSIGN_OR_RETURN(std::byte * host, lb.data.data_ptr());
    FERRY_RETURN_IF_ERROR(device_memcpy(mem.get(), host, box_bytes(lb.data)));
    out.push_back(LocalBox{lb.box, Tensor::borrow_device(mem.get(), lb.data.shape(), lb.data.dtype(), Device::cuda(0), mem)});
  }
  return out;
}

// Boxes in GPU memory, host staging: a kernel packs them into the (host) slot.
TEST(StagingRingDevice, PacksGpuBoxesIntoHostStaging) {
  if (!cuda_status().usable()) GTEST_SKIP() << "needs a CUDA device; " << cuda_status().detail;
  OneProducer k;
  ASSERT_TRUE(k.start(false).ok());
  std::map<uint32_t, Tensor> full;
  for (int g = 0; g < k.routes.num_groups(); ++g) {
    auto host = k.source->materialize(g);
    ASSERT_TRUE(host.ok());
    auto boxes = on_gpu(*host);
    ASSERT_TRUE(boxes.ok()) << boxes.status().to_string();
    auto sums = k.ring->pack(k.schedule, g, 0, *boxes);
    ASSERT_TRUE(sums.ok()) << sums.status().to_string();
    auto on_host = k.ring->pack(k.schedule, g, 1, *host);
    ASSERT_TRUE(on_host.ok()) << on_host.status().to_string();
    EXPECT_EQ(*sums, *on_host) << "group " << g;
    const auto want = expected_staging(k.schedule.groups[static_cast<size_t>(g)], k.holdings(), full);
    for (size_t i = 0; i < want.size(); ++i) {
      if (want[i]) {
        ASSERT_EQ(k.ring->slot(0)[i], *want[i]) << "group " << g << " byte " << i;
      }
    }
  }
}

// GPU staging: packed on the device, copied to the host slot, the GPU ring exported for
// CUDA IPC (in this process, map_cuda_ipc gives the ring itself).
TEST(StagingRingDevice, StagesOnTheDeviceAndExportsIt) {
  if (!cuda_status().usable()) GTEST_SKIP() << "needs a CUDA device; " << cuda_status().detail;
  OneProducer k;
  ASSERT_TRUE(k.start(false, Device::cuda(0)).ok());
  auto e = decode_cuda_ipc(k.ring->cuda_ipc());
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  EXPECT_EQ(e->device, 0);
  // The slots (the host ring's registration may round up; a delta kept area stays on the host).
  EXPECT_EQ(e->bytes, static_cast<uint64_t>(k.ring->slots()) * k.ring->slot_bytes());
  EXPECT_EQ(e->process, process_token());
  auto mapped = map_cuda_ipc(*e, Device::cuda(0));
  ASSERT_TRUE(mapped.ok()) << mapped.status().to_string();
  std::map<uint32_t, Tensor> full;
  for (int g = 0; g < k.routes.num_groups(); ++g) {
    auto host = k.source->materialize(g);
    ASSERT_TRUE(host.ok());
    // Boxes off the staging device are refused, naming it.
    auto off = k.ring->pack(k.schedule, g, 1, *host);
    ASSERT_FALSE(off.ok());
    EXPECT_EQ(off.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(off.status().message().find("not on the staging device cuda:0"), std::string::npos)
        << off.status().to_string();
    auto boxes = on_gpu(*host);
    ASSERT_TRUE(boxes.ok()) << boxes.status().to_string();
    const size_t s = static_cast<size_t>(g) % 2;
    auto sums = k.ring->pack(k.schedule, g, s, *boxes);
    ASSERT_TRUE(sums.ok()) << sums.status().to_string();
    const auto want = expected_staging(k.schedule.groups[static_cast<size_t>(g)], k.holdings(), full);
    std::vector<std::byte> device(want.size());
    ASSERT_TRUE(device_memcpy(device.data(), mapped->get() + k.ring->slot_offset(s), device.size()).ok());
    for (size_t i = 0; i < want.size(); ++i) {
      if (!want[i]) continue;
      ASSERT_EQ(k.ring->slot(s)[i], *want[i]) << "group " << g << " byte " << i;
      ASSERT_EQ(device[i], *want[i]) << "group " << g << " byte " << i << " of the GPU ring";
    }
  }
}

}  // namespace
}  // namespace ferry::engine

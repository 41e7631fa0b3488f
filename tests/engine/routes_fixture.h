// Shared by the engine parts' tests that move bytes without a transport (schedule_test,
// sync_plan_test): a job's routes from its loader's recorded plans, and each producer's
// version-1 weights laid out as the trainer's own memory (one source region) with its
// schedule and its staging packed per group.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/in_place.h"
#include "engine/registered_buffer.h"
#include "engine/schedule.h"
#include "tools/job_model.h"
#include "test_paths.h"

namespace ferry::engine::testing {

inline std::string cfg(const char* name) { return std::string(FERRY_SOURCE_DIR) + "/configs/" + name; }

// Routes of the job from every consumer's plan, recorded into `plans`.
inline Routes build_job_routes(const tools::JobModel& m, std::vector<Plan>& plans) {
  for (int c = 0; c < m.inference.world_size(); ++c) {
    auto p = record_plan(*m.loader, c, m.metadata);
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    plans.push_back(std::move(*p));
  }
  RouterInput in;
  in.metadata = m.metadata;
  in.producers = *m.holdings;
  for (const Plan& p : plans) in.consumers.push_back(&p);
  auto r = build_routes(in);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return std::move(*r);
}

// One producer's weights of `version`, each group's boxes copied into one source region
// (the trainer's own memory when served in place), its schedule, and its staging packed
// per group.
struct ProducerSide {
  std::vector<std::byte> region;
  std::vector<std::vector<LocalBox>> boxes;  // per group, borrowing `region`
  InPlaceTable table;                        // empty unless served in place
  ProducerSchedule schedule;
  std::vector<std::vector<std::byte>> staging;  // per group
};

// Every producer of the job (ASSERTs inside: call under ASSERT_NO_FATAL_FAILURE).
inline void make_producer_sides(const tools::JobModel& m, const Routes& routes, bool in_place, uint64_t seed,
                                uint64_t version, std::vector<ProducerSide>& prod) {
  const int P = m.trainer.world_size(), G = routes.num_groups();
  prod.resize(static_cast<size_t>(P));
  for (int p = 0; p < P; ++p) {
    ProducerSide& ps = prod[static_cast<size_t>(p)];
    SyntheticSource src(m.metadata, m.holdings, p, seed);
    src.set_version(version);
    const Holdings& h = (*m.holdings)[static_cast<size_t>(p)];
    std::vector<std::vector<LocalBox>> tmp(static_cast<size_t>(G));
    uint64_t bytes = 0;
    for (int g = 0; g < G; ++g) {
      auto b = src.materialize(g);
      ASSERT_TRUE(b.ok()) << b.status().to_string();
      tmp[static_cast<size_t>(g)] = std::move(*b);
      for (const LocalBox& lb : tmp[static_cast<size_t>(g)])
        bytes += align_up(static_cast<uint64_t>(lb.data.numel()) * dtype_size(lb.data.dtype()), 64);
    }
    ps.region.resize(bytes + 64);
    ps.boxes.resize(static_cast<size_t>(G));
    ps.table.min_bytes = 64;
    ps.table.boxes.resize(h.boxes.size());
    uint64_t at = 0;
    for (int g = 0; g < G; ++g) {
      for (const LocalBox& lb : tmp[static_cast<size_t>(g)]) {
        Tensor t = Tensor::borrow(ps.region.data() + at, lb.data.shape(), lb.data.dtype());
        ASSERT_TRUE(t.copy_(lb.data).ok());
        ps.boxes[static_cast<size_t>(g)].push_back(LocalBox{lb.box, t});
        ps.table.boxes[lb.box] = InPlaceTable::At{0, at};
        at += align_up(static_cast<uint64_t>(lb.data.numel()) * dtype_size(lb.data.dtype()), 64);
      }
    }
    if (in_place) {
      ps.table.keys = {"region0"};
    } else {
      ps.table = InPlaceTable{};
    }
    const uint64_t slot = producer_slot_bytes(routes, p, m.metadata, *m.holdings, true);
    auto s = make_producer_schedule(routes, p, h, ps.table, slot);
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    ps.schedule = std::move(*s);
    ps.staging.resize(static_cast<size_t>(G));
    for (int g = 0; g < G; ++g) {
      const ProducerGroupSchedule& gs = ps.schedule.groups[static_cast<size_t>(g)];
      ASSERT_LE(gs.pack.staging_bytes, slot) << "producer " << p << " group " << g;
      ps.staging[static_cast<size_t>(g)].assign(gs.pack.staging_bytes, std::byte{0xEE});
      ASSERT_TRUE(pack_group(gs.pack, static_cast<uint32_t>(p), g, h, ps.boxes[static_cast<size_t>(g)],
                             ps.staging[static_cast<size_t>(g)])
                      .ok());
      if (!in_place) {
        EXPECT_TRUE(gs.in_place.empty());
      }
    }
  }
}

}  // namespace ferry::engine::testing

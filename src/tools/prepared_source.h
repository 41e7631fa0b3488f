// tools/prepared_source.h — a trainer rank whose weights already sit in memory (internal):
// one synthetic version at fixed addresses, written before each sync (set_data_version:
// the optimizer step, outside the timed window), so materialize() costs what a real
// trainer's does (nothing). `ferry bench`'s producers (served in place from a transport
// region) and `ferry demo --prepare-weights`'s (ordinary memory) use it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/registered_buffer.h"
#include "ferry/source.h"
#include "ferry/transport.h"
#include "tools/job_model.h"

namespace ferry::tools {

// With `in_place`, the weights live in one region allocated through the producer's
// transport (a trainer that allocates its parameters through ferry) and the producer
// serves from it in place; else in ordinary memory. Either way the rank holds its shard
// once, plus one group of the synthetic generator while it writes a version.
class PreparedSource final : public WeightSource {
 public:
  // Version 1 written. Errors: the region's allocation, the generator's.
  static Result<std::unique_ptr<PreparedSource>> create(const JobModel& m, int rank, uint64_t seed, Transport* in_place,
                                                        const SyntheticChanges& changes);
  const std::vector<TensorDecl>& metadata() const override { return metadata_; }
  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(holdings_->size()); }
  Result<Holdings> holdings(int rank) const override;
  Result<std::vector<LocalBox>> materialize(int group) override;
  // Writes data version d over the weights, group by group (the generator's buffers of
  // one group at a time); nothing when d is already there.
  Status set_data_version(uint64_t d);
  // The in-place region (ProducerOptions::source_regions), if any.
  std::vector<MemoryRegion> regions() const;
  uint64_t held_bytes() const { return held_; }

 private:
  PreparedSource(const JobModel& m, int rank, uint64_t seed);
  std::vector<TensorDecl> metadata_;
  std::shared_ptr<const std::vector<Holdings>> holdings_;
  int rank_ = 0;
  uint64_t current_ = 0;
  uint64_t held_ = 0;
  SyntheticSource generator_;
  engine::RegisteredBuffer region_;
  std::vector<std::vector<LocalBox>> live_;  // per group, in the generator's order
};

}  // namespace ferry::tools

// source/checkpoint_sources.h — the WeightSources of a trainer rank that serves a
// safetensors checkpoint (`ferry serve`, ferry.serve in Python; internal): the
// checkpoint's bytes as they lie in the files, or every box copied once onto a GPU.
// Built only with the io module (safetensors).
#pragma once

#include <memory>
#include <vector>

#include "ferry/device.h"
#include "ferry/safetensors.h"
#include "ferry/source.h"

namespace ferry {

// A trainer rank's holdings of a checkpoint it holds whole (memory-mapped, or read into
// owned memory): each box is a view of the file's bytes; contiguous ones are served in
// place from there (the files are the producer's source regions), the rest packed.
// `metadata` and `holdings` (every rank's, by rank) must outlive the source.
class CheckpointSource final : public WeightSource {
 public:
  CheckpointSource(const std::vector<TensorDecl>& metadata, const std::vector<Holdings>& holdings, SafetensorsDir dir,
                   int rank);
  const std::vector<TensorDecl>& metadata() const override { return metadata_; }
  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(holdings_.size()); }
  Result<Holdings> holdings(int rank) const override;
  // kNotFound (from the checkpoint) for a held tensor the files lack.
  Result<std::vector<LocalBox>> materialize(int group) override;

 private:
  const std::vector<TensorDecl>& metadata_;
  const std::vector<Holdings>& holdings_;
  SafetensorsDir dir_;
  Groups groups_;
  int rank_;
};

// A trainer rank whose weights are in GPU memory (serve --device cuda:N): every box of
// `host`'s holdings copied once, contiguous, onto `device` by make(); materialize
// returns those device tensors (packed there by a kernel, never served in place).
// `host` must outlive the source (metadata and holdings are its).
class DeviceCopySource final : public WeightSource {
 public:
  // Errors: `host`'s materialize, or an allocation or copy on `device` (naming the
  // tensor and the device).
  static Result<std::unique_ptr<DeviceCopySource>> make(WeightSource& host, Device device, int groups);
  const std::vector<TensorDecl>& metadata() const override { return host_.metadata(); }
  int rank() const override { return host_.rank(); }
  int world_size() const override { return host_.world_size(); }
  Result<Holdings> holdings(int rank) const override { return host_.holdings(rank); }
  Result<std::vector<LocalBox>> materialize(int group) override;

 private:
  explicit DeviceCopySource(WeightSource& host) : host_(host) {}
  WeightSource& host_;
  std::vector<std::vector<LocalBox>> by_group_;
};

}  // namespace ferry

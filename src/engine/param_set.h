// engine/param_set.h — where a consumer's bytes land (internal): its param buffers (the
// caller's, or one arena of its own), their registrations with the transport, the
// placement of every param that reads and writes may land in directly, the plan's zero
// padding, which version the params hold (begin / finish / abort / torn), and under the
// shadow commit policy the second buffer set syncs land in (commit / discard).
//
// Landing addresses live here and nowhere else: the schedule (engine/schedule.h) names a
// direct landing by its placement (registration index, offset, bytes: ParamTable::Param,
// what a push consumer's lease carries), never by address, and `landing()` turns that
// into memory. So the second buffer set (ParamSetOptions::shadow: a shadow the sync lands
// in while the live params serve) is a change here, not in the schedule, the lease or the
// producers: placements name the *landing* set, which is the shadow under that policy.
//
// Threading: create/destroy, write_padding, begin/retry/finish/abort on the consumer's
// sync thread; `touch()` and `state()` from any thread; `work()` belongs to whichever
// thread runs the attempt's unpack and post-processing (one at a time, as the consumer
// hands them over). Errors: Status naming the consumer rank and the param.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "engine/commit_rule.h"
#include "engine/in_place.h"
#include "engine/schedule.h"
#include "ferry/device.h"
#include "ferry/engine.h"
#include "ferry/plan.h"
#include "ferry/transport.h"

namespace ferry::engine {

// Where a ParamSet's memory comes from and how peers reach it: the consumer's transport,
// or plain host memory (tests, tools that move no bytes).
class ParamMemory {
 public:
  virtual ~ParamMemory() = default;
  // `bytes` of memory that peers on the host write by plain copy (push): registered.
  virtual Result<MemoryRegion> allocate(uint64_t bytes) = 0;
  // Registers the caller's `bytes` at `base` (kept alive by the caller).
  virtual Result<MemoryRegion> register_memory(void* base, uint64_t bytes) = 0;
  // Undoes either; memory from allocate() is freed.
  virtual void release(const MemoryRegion& region) = 0;
};

// The transport's memory (Transport::allocate_memory / register_memory /
// deregister_memory). `t` outlives the returned object.
std::unique_ptr<ParamMemory> transport_param_memory(Transport& t);
// Plain host memory, registered with nobody (regions have id 0): for the schedule's and
// the param set's tests, and tools that land bytes without a transport.
std::unique_ptr<ParamMemory> host_param_memory();

struct ParamSetOptions {
  int rank = 0;             // for messages
  bool push = false;        // producers write into the arena: allocated by ParamMemory
  uint64_t direct_min_bytes = 0;  // the caller's params at least this large are registered
  // CommitPolicy::kShadow: syncs land in a second set of buffers (one arena on the host,
  // one on the params' GPU), registered and placed; the live params (the caller's, or an
  // arena of the set's own) change only at commit(). With no caller params, in pull mode,
  // on the host, the two sets swap roles at commit (a flip); otherwise commit copies.
  // In push both sets are then the transport's memory, and producers learn per sync
  // which one to write (published_sets(), landing_index()).
  bool shadow = false;
  // CommitPolicy::kGroups: syncs land in a bounded shadow laid out per routes
  // (set_group_shadow), each layer group's params made live by commit_at as the
  // consumer's background thread completes them. Nothing is landed in directly: the
  // live params are not registered.
  bool groups = false;
  // Pull: the set's own arena (and under a flip its shadow) is the transport's memory
  // (ParamMemory::allocate), which peers on this host read natively (a joiner's
  // catch-up), and which goes with the set; false: heap memory registered in place (it
  // outlives the set through the views' keep-alive). Push: always the transport's.
  bool own_in_transport = false;
};

class ParamSet final : public CommitTarget {
 public:
  // `decls`: the params as loaded, in declaration order. `caller`: the caller's buffers
  // by name (real, contiguous, of the declared dtype and shape; host or one CUDA
  // device); every other param gets room in one zeroed, registered arena. kInvalidArgument
  // for a buffer that does not match (naming it), the memory's error otherwise.
  static Result<std::unique_ptr<ParamSet>> create(const ParamSetOptions& opts, const std::vector<TensorDecl>& decls,
                                                  const TensorMap& caller, std::unique_ptr<ParamMemory> memory);
  ~ParamSet() override;
  ParamSet(const ParamSet&) = delete;
  ParamSet& operator=(const ParamSet&) = delete;

  // Writes the plan's zeros (padding, never read from a source) into the buffers, per
  // place (host, GPU); then the committed view is the buffers as they are. Once, before
  // the first sync.
  Status write_padding(const Plan& plan);

  // The params that may be landed in directly (registered host memory), by name: what
  // the schedule's direct sub-reads point to, and a push consumer's ParamTable::params.
  const std::map<std::string, ParamTable::Param>& placements() const { return placements_; }
  // The registered regions syncs land in; ParamTable::Param::key indexes them (exported
  // for push). Under shadow: the shadow's.
  const std::vector<MemoryRegion>& registrations() const { return landing_; }
  // Under a flip, the two sets as a push consumer publishes them once (its lease's
  // ParamTable::keys and other_keys, laid out alike), and which of them syncs land in
  // now (0 or 1; it alternates at each commit: READY carries it). Without a flip: the
  // one set, and 0.
  const std::vector<MemoryRegion>& published_set(int i) const { return published_[i & 1]; }
  int landing_index() const { return landing_index_; }

  // Where `bytes` at `at` of placement `p` land: the region, the offset inside it, the
  // memory. `p` is one of placements() (a sub-read of a schedule built from them).
  struct Landing {
    MemoryRegion region;
    uint64_t offset = 0;
    std::byte* data = nullptr;
  };
  Landing landing(const ParamTable::Param& p, uint64_t at) const;
  // The same for a direct sub-read (sr.param set).
  Landing landing(const SubRead& sr) const;

  // Buffers as loaded (what unpack writes: the shadow under that policy), the attempt's
  // view (what post-processing writes and may replace), and the view of the last
  // committed version (the live params).
  const TensorMap& loaded() const { return loaded_; }
  TensorMap& work() { return work_; }
  const TensorMap& committed() const { return committed_; }
  // The live buffers as loaded: under groups and a shadow flip each holds the committed
  // version's unpacked bytes, also where post-processing replaced the param in
  // committed() (a delta patch's base).
  const TensorMap& live() const { return live_; }

  // The CUDA device of the caller's GPU params (one per rank), if any, and whether every
  // param is there (then the receive ring may be on the device too).
  const std::optional<Device>& device() const { return device_; }
  bool all_on_device() const { return all_on_device_; }

  // The caller's buffers passed to create still where the set writes them: each one is
  // in `current` at the same device and address (torch's `p.data = new` re-binds a
  // param). kFailedPrecondition naming the param otherwise; names not passed at create
  // are ignored.
  Status check_rebound(const TensorMap& current) const;

  uint64_t own_bytes() const { return own_bytes_; }  // the arena, 0 when the caller gave every buffer
  uint64_t registered_bytes() const;                 // every registration (arena included)
  uint64_t shadow_bytes() const { return shadow_bytes_; }  // the shadow set (host and device), 0 without
  bool shadow() const { return opts_.shadow; }
  bool flips() const { return flips_; }  // commit() is a flip of the two sets, not a copy

  // Versions. begin(v): a sync of v starts, nothing of it written yet (a received,
  // uncommitted version is dropped); retry(): a new attempt of the same sync (the
  // attempt's view back to the buffers); touch(): the buffers change from now on (a
  // failure now leaves them torn, in place); finish(v): v is complete: committed (the
  // attempt's view becomes the committed one), or under shadow received, waiting for
  // commit(); abort(): the sync failed, torn if anything was touched in place (never
  // under shadow). state(): what the params hold.
  void begin(uint64_t version);
  void retry();
  void touch();
  void finish(uint64_t version);
  void abort();
  bool torn() const;
  ConsumerState state() const;
  bool groups() const { return opts_.groups; }
  // Shadow: makes the received version the live one in one step (a flip, or a copy of
  // each shadow buffer into its live buffer: host memcpy, device to device on a GPU; a
  // param post-processing replaced is taken as it is). The version it committed.
  // kFailedPrecondition naming the consumer when nothing is received; a device copy's
  // error (the live params are then torn, the only way a commit can fail half way).
  Result<uint64_t> commit() override;
  std::optional<uint64_t> received_version() const override { return state().received; }
  // Shadow: drops the received version. kFailedPrecondition when there is none.
  Status discard();

  // --- The live params as replicas read them (Consumer::catch_up, docs/elastic.md;
  // param_set_serving.cpp) ---
  // Where every live host param lies in registered memory, in each set that can be live:
  // two under a flip (sets[0] and sets[1], laid out alike: a Param's key and offset name
  // the same place in either), else one. What is not registered yet (the caller's
  // smaller buffers, the live params under the shadow copy and groups policies) is
  // registered now, once; the layout is fixed for the set's life. kUnimplemented when a
  // param is on a GPU (a catch-up moves host memory only); the memory's error.
  struct ServingLayout {
    std::vector<MemoryRegion> sets[2];  // sets[1] empty unless flips()
    std::map<std::string, ParamTable::Param> params;
  };
  Result<const ServingLayout*> serving_layout();
  // Which set of serving_layout() the live params lie in now (0; under a flip, 0 or 1).
  int live_set() const { return flips_ ? landing_index_ ^ 1 : 0; }
  // A joiner's catch-up, between syncs: catch_up_begin() marks the live buffers written
  // from now on (they receive a version's unpacked bytes, as a sync's unpack writes
  // them) and makes the attempt's view over them (post-processing runs on work());
  // catch_up_finish(v): v is whole and live (committed() is the view); catch_up_abort():
  // the catch-up failed, which leaves the params torn once catch_up_begin() ran (under
  // every policy: the live buffers were written), and as they were otherwise.
  void catch_up_begin();
  void catch_up_finish(uint64_t version);
  void catch_up_abort();

  // Groups (ParamSetOptions::groups). set_group_shadow: the routes' layout (`params`: the
  // plan route's params, which `layout` indexes); loaded() then views each written param
  // in the shadow, which grows to the layout's size (it never shrinks: routes that change
  // back need no new memory). Between attempts only. kInvalidArgument for a param the
  // set does not have; the allocation's error.
  Status set_group_shadow(GroupShadow layout, const std::vector<TensorDecl>& params) override;
  // On the thread running the attempt's unpack and post-processing. open_at(i): before
  // the layer group at position i of the order is unpacked, the params whose room opens
  // there and that the sync does not write whole (the plan's padding) are filled from the
  // live params, so that what the sync does not write is what the live params hold.
  // commit_at(i): after its post-processing, the params layout.commits[i] names are made
  // live: copied from the shadow (or from the tensor post-processing replaced one with)
  // into the live buffers; a param post-processing made anew (another dtype or shape
  // than the live one, or a name of its own) is taken as it is, into committed() at
  // finish(). A copy's error (that group then torn).
  Status open_at(int position) override;
  Status commit_at(int position) override;
  const GroupShadow& group_shadow() const override { return group_shadow_; }

 private:
  ParamSet(const ParamSetOptions& opts, std::unique_ptr<ParamMemory> memory);
  // A commit's copy into a live buffer; its failure marks the params torn (the params
  // copied before it already hold the new version).
  Status copy_live(const Tensor& to, const Tensor& from, const std::string& name);

  ParamSetOptions opts_;
  std::unique_ptr<ParamMemory> memory_;
  std::vector<MemoryRegion> registrations_;  // ours to release
  // What placements index: the set syncs land in (registrations_ without shadow), and
  // under a flip the other set's, laid out alike (swapped at commit).
  std::vector<MemoryRegion> landing_, other_;
  std::vector<MemoryRegion> published_[2];  // landing_ and other_ as created (fixed)
  int landing_index_ = 0;                   // which of published_ landing_ is
  TensorMap live_;  // shadow: the live buffers (committed_ views them until post-processing replaces one)
  std::shared_ptr<std::byte> shadow_arena_, shadow_device_;
  uint64_t shadow_bytes_ = 0;
  // Groups: the layout, each shadow's capacity, and the params the layout indexes (by
  // position: names).
  GroupShadow group_shadow_;
  uint64_t group_host_capacity_ = 0, group_device_capacity_ = 0;
  std::vector<std::string> group_names_;
  TensorMap made_anew_;  // groups: post-processing's own tensors, taken into committed_ at finish
  std::set<std::string> written_whole_;  // groups: params every sync writes whole (write_padding's plan)
  bool committed_some_ = false;  // groups: this sync made a group live (mu_)
  bool catching_up_ = false;     // catch_up_begin() and no finish yet: catch_up_abort() leaves the live params torn (mu_)
  std::optional<ServingLayout> serving_;  // serving_layout(), once made
  bool flips_ = false;
  std::map<std::string, ParamTable::Param> placements_;
  std::shared_ptr<std::byte> arena_;
  uint64_t own_bytes_ = 0;
  std::optional<Device> device_;
  bool all_on_device_ = false;
  TensorMap given_;  // the caller's buffers of declared params, as passed to create
  TensorMap loaded_, work_, committed_;
  mutable std::mutex mu_;  // touched_, held_
  bool touched_ = false;
  ConsumerState held_;  // (held_.received: shadow, a version received and not committed)
};

}  // namespace ferry::engine

// ferry/targets.h — one job, several targets (../shared/DESIGN.md "Targets",
// docs/targets.md): the model, a draft/MTP model, LoRA adapters, each with its own plan,
// its own versions and its own reports; and, for adapters, a slot table whose versions
// every rank of a switch group makes live together.
//
// A target is an engine job of its own under the job's name (target_job): its producers
// and consumers are a Producer and a Consumer per rank (each over a Transport of its own:
// a transport has one message handler), its keys lie apart from the other targets', and
// nothing of one target's sync waits for another's. The main model is the job itself.
//
// Threading: agree_switch blocks the calling thread (store round trips, bounded by its
// timeout). AdapterSlots: sync() from one thread at a time (the rank's sync thread);
// acquire() and slots() from any thread, at any time, also during sync().
// Errors: Status/Result as everywhere in the core; nothing here throws.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/engine.h"
#include "ferry/status.h"
#include "ferry/store.h"
#include "ferry/tensor.h"
#include "ferry/transport.h"

namespace ferry {

// The engine job name of target `target` of job `job`: "{job}#{target}", so that every
// store key of the target lies under its own prefix ("{job}#draft/..."), apart from the
// job's and the other targets'. An empty `target` is the main model: `job` itself.
// kInvalidArgument for a target name other than [A-Za-z0-9_.-], 1 to 64 bytes.
Result<std::string> target_job(std::string_view job, std::string_view target);

// --- one version switched on every rank of a group at once ----------------------------

// What every rank of a switch group does with one version: make it live (kSwitch), keep
// the live version because every rank received the same bytes it already serves (kKeep:
// the version is unchanged), or keep the live version because some rank did not receive
// it whole, or did not say so in time (kAbort).
enum class SwitchDecision : uint8_t { kSwitch, kKeep, kAbort };
const char* switch_decision_name(SwitchDecision d);  // "switch", "keep", "abort"

// One rank's word on a version: received whole (`ready`) or not (`why` says what failed),
// and whether its bytes differ from what it serves (`changed`; a rank serving nothing yet
// says changed).
struct SwitchVote {
  bool ready = false;
  bool changed = true;
  std::string why;
};

// The decision for version `version` of job `job` that every rank of `group` (consumer
// ranks, `rank` among them) follows. Each rank writes its vote once
// ({job}/switch/{version}/vote/{rank}); the decision ({job}/switch/{version}/decision) is
// written by compare-set, once, by the first rank that sees a vote not ready (kAbort),
// every vote ready (kSwitch, or kKeep when no rank changed), or `timeout` pass without
// every vote (kAbort); every rank returns that one decision, a rank that votes after it
// was made too. So no two ranks of the group decide differently, and a rank that died
// before voting makes the others abort after `timeout`, not switch without it. A version
// is decided once: a version that was aborted is synced again under a new number. The
// keys expire after `keep` (at least 4x `timeout`). Errors: kInvalidArgument (rank not
// in group, an empty group, a negative rank), the store's when no decision could be read
// within `timeout` (this rank must then keep what it serves and say so: the others may
// have switched).
Result<SwitchDecision> agree_switch(Store& store, std::string_view job, uint64_t version, int rank,
                                    const std::vector<int>& group, const SwitchVote& vote,
                                    std::chrono::milliseconds timeout,
                                    std::chrono::milliseconds keep = std::chrono::hours(1));

// --- adapters: a slot table ------------------------------------------------------------

struct AdapterSlotOptions {
  // The adapter's name; a slot serving version v of it is named "{adapter}@{v}" (engines
  // key their prefix caches by adapter name, so a new version must not reuse the old
  // one's name). [A-Za-z0-9_.-], 1 to 64 bytes.
  std::string adapter;
  // Slots, at least 2: one serving and one to fill; more let readers that still hold
  // older versions keep them while newer ones land.
  int slots = 2;
  // The consumer ranks that switch versions together (this rank among them): an engine
  // instance's ranks. Empty: every consumer of the job (ConsumerOptions::num_consumers).
  std::vector<int> switch_group;
  // How long a rank waits for the group's votes before it aborts the version.
  std::chrono::milliseconds switch_timeout{30000};
  // How long a sync waits, once the version is received, for a reader to let go of a
  // slot when every slot but the serving one is held (a reader still on an older
  // version); then the rank votes not ready and the group keeps what it serves.
  std::chrono::milliseconds slot_wait{5000};
};

// One rank's adapter slots: the adapter target's Consumer lands each version in buffers of
// its own, which no reader sees; the version is then copied into a slot that is neither
// serving nor held by a reader, and the switch group decides (agree_switch) whether every
// rank makes it the serving slot. A failed sync, on any rank of the group, leaves the
// previous version serving on every rank; readers hold a slot through a Lease, and a slot
// held by a reader is never written.
class AdapterSlots final {
 public:
  // `model`: the adapter's recorded plan on this rank (only the adapter's tensors move).
  // `options.commit` must be CommitPolicy::kInPlace (the slots make versions live here).
  // Errors: kInvalidArgument (the options above), the Consumer's.
  static Result<std::unique_ptr<AdapterSlots>> create(ConsumerModel model, int rank, Transport& transport,
                                                      Store& store, const ConsumerOptions& options,
                                                      const AdapterSlotOptions& slots);
  ~AdapterSlots();
  AdapterSlots(const AdapterSlots&) = delete;
  AdapterSlots& operator=(const AdapterSlots&) = delete;

  struct SlotState {
    int slot = 0;
    std::string name;                 // "{adapter}@{version}"; empty: nothing in it
    std::optional<uint64_t> version;  // what it holds
    bool serving = false;
    int readers = 0;                  // leases held on it now
  };
  // A reader's hold on the serving slot as it was when acquired: its params stay that one
  // version, whole, for as long as the lease lives (later versions land in other slots).
  // Movable, not copyable; release by destruction. Must not outlive the AdapterSlots.
  class Lease {
   public:
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();
    const std::string& name() const;
    uint64_t version() const;
    const TensorMap& params() const;
    int slot() const;

   private:
    friend class AdapterSlots;
    struct Held;
    explicit Lease(Held* held);
    Held* held_ = nullptr;
  };

  struct Report {
    SyncReport sync;                  // the adapter consumer's sync (bytes, stages, failures)
    SwitchDecision decision = SwitchDecision::kAbort;
    bool unchanged = false;           // this rank's bytes equal what it served
    std::string serving;              // the serving slot's name after it ("" if none)
    int slot = -1;                    // the slot filled (-1: none was free, or the sync failed)
    bool ok() const { return decision != SwitchDecision::kAbort; }
  };
  // Receives version `version` into a free slot and switches with the group. Returns a
  // report whatever the decision (kAbort: the sync's or the vote's reason in
  // sync.status / sync.failures); errors only when the decision could not be read
  // (agree_switch's), from a second concurrent call (kFailedPrecondition), or for a
  // version at or below the last one decided (kInvalidArgument: a version is decided
  // once, so a rollback is synced under a new number).
  Result<Report> sync(uint64_t version);
  // The serving slot, held; nullopt before any version switched.
  std::optional<Lease> acquire() const;
  std::vector<SlotState> slots() const;
  Consumer& consumer();  // the adapter target's consumer (its report, state, leave())

  struct Impl;

 private:
  explicit AdapterSlots(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What each inference rank 0..num_consumers-1 of adapter target job `job` serves, as its
// AdapterSlots recorded after its last decision ({job}/adapter/serving/{rank}):
// "{adapter}@{version}", or nullopt for a rank that serves none yet. (committed_versions
// of the same job says what each rank's adapter consumer received, which an aborted or
// kept version leaves ahead of what it serves.) Errors: the store's.
Result<std::vector<std::optional<std::string>>> adapter_serving(Store& store, std::string_view job,
                                                                 int num_consumers);

}  // namespace ferry

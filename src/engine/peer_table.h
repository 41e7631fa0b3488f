// engine/peer_table.h — the ranks of the other side a rank knows (a producer its
// consumers, a consumer its producers): per rank the instance its lease named when this
// rank connected to it and that connection, and by connection the rank it was made for.
// One peer type (PeerLink) for both sides; each side adds what it imports from a peer's
// lease (PeerTable<Peer> with Peer deriving from PeerLink). Its size is the other side's
// and may change between syncs (resize). Internal.
//
// Threading: not thread-safe; its owner's mutex guards it (the transport's handlers read
// it under that mutex too).
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ferry/transport.h"

namespace ferry::engine {

struct PeerLink {
  std::string instance;  // the lease (its instance part) this rank connected with
  PeerId id = 0;
  bool connected = false;
};

template <typename Peer>
class PeerTable {
 public:
  void resize(int n) { peers_.resize(static_cast<size_t>(n)); }
  int size() const { return static_cast<int>(peers_.size()); }
  Peer& operator[](int r) { return peers_[static_cast<size_t>(r)]; }
  const Peer& operator[](int r) const { return peers_[static_cast<size_t>(r)]; }
  auto begin() { return peers_.begin(); }
  auto end() { return peers_.end(); }
  auto begin() const { return peers_.begin(); }
  auto end() const { return peers_.end(); }

  // Whether connection `id` was made to rank r (by this rank; a later instance of r has
  // another): a message that names r as its sender is r's only then.
  bool made_for(PeerId id, int r) const {
    auto it = rank_of_.find(id);
    return it != rank_of_.end() && it->second == r;
  }
  // The rank connection `id` was made for, if any.
  std::optional<int> rank_of(PeerId id) const {
    auto it = rank_of_.find(id);
    return it == rank_of_.end() ? std::nullopt : std::optional<int>(it->second);
  }
  // Whether rank r is connected with the instance `instance` names (nothing to redo).
  bool current(int r, const std::string& instance) const {
    const Peer& p = (*this)[r];
    return p.connected && p.instance == instance;
  }
  // Rank r is connected now, to `instance` by `id`. false (nothing changed) when `id`
  // failed before this was called (fail() of an id not known yet).
  bool adopt(int r, std::string instance, PeerId id) {
    if (failed_early_.count(id)) return false;
    Peer& p = (*this)[r];
    p.instance = std::move(instance);
    p.id = id;
    p.connected = true;
    rank_of_[id] = r;
    return true;
  }
  // The transport reported connection `id` failed: the rank whose current connection it
  // was (now not connected), or nullopt: a stale connection of an earlier instance, or
  // one not adopted yet (which adopt() then refuses).
  std::optional<int> fail(PeerId id) {
    auto it = rank_of_.find(id);
    if (it == rank_of_.end()) {
      failed_early_.insert(id);
      return std::nullopt;
    }
    Peer& p = (*this)[it->second];
    if (p.id != id) return std::nullopt;
    p.connected = false;
    return it->second;
  }

 private:
  std::vector<Peer> peers_;
  std::map<PeerId, int> rank_of_;   // every connection made -> the rank it was made for
  std::set<PeerId> failed_early_;   // failed before adopt() mapped them
};

}  // namespace ferry::engine

// engine/replica_server.h — a consumer's live params served to the joiners of its plan
// class, and a joiner's side of the same exchange (Consumer::catch_up, docs/elastic.md;
// internal).
//
// A joiner (a new instance of an inference rank) reads the live version straight from
// the registered live params of a replica that holds it, as the serving table that
// replica published in the store says ({job}/serving/consumer/{c}: a ParamTable). The
// replica answers each ask with an offer and a *hold*: its live params stay unchanged
// until the joiner's DONE (answered intact), the joiner's failure, or close() gives the
// hold up when the replica's own next sync or commit cannot wait longer (the DONE is then
// answered revoked and the joiner discards what it read). Readers of the replica's params
// in its process see one version throughout: nothing of theirs is written while a hold
// lasts.
//
// Threading: every method is thread-safe (one lock of its own). Asks come on the
// transport's handler thread, which must not wait on the store or on a connection: they
// are queued and answered by the server's own thread (it connects to the joiner from its
// lease through `connect`, then replies through `send`). `connect` and `send` are called
// on that thread without the server's lock held.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "engine/clock.h"
#include "engine/protocol.h"
#include "ferry/status.h"
#include "ferry/transport.h"

namespace ferry::engine {

// The catch-up tree (docs/elastic.md): with `holders` replicas holding the version, the
// joiner at index `i` of the joiners (by rank) is at place p = holders + i of (holders,
// joiners) and reads from place p - n, n the largest of holders, 2 holders, 4 holders...
// not above p. Each round [n, 2n) reads from the places [0, n) that hold the version by
// then, one joiner each: the sources double every round. `holders` > 0.
size_t catch_up_parent(size_t holders, size_t i);

class ReplicaServer {
 public:
  // connect(c): the connection to consumer c's live instance (its lease's address).
  using Connect = std::function<Result<PeerId>(int consumer)>;
  using Send = std::function<Status(PeerId, const Replica&)>;
  // `rank` and `plan` (the hash of this consumer's plan: an ask of another plan class is
  // refused) go into every answer.
  ReplicaServer(int rank, uint64_t plan, Connect connect, Send send);
  ~ReplicaServer();  // stops its thread (queued asks are dropped; the joiners time out or see the failure)
  ReplicaServer(const ReplicaServer&) = delete;
  ReplicaServer& operator=(const ReplicaServer&) = delete;

  // --- As the source ---
  // Open for asks of `version`: the live params hold it, laid out as set `set` of the
  // serving table whose hash is `table`.
  void serve(uint64_t version, uint8_t set, uint64_t table);
  // Closed to new asks (refused) and, within `bound`, every hold given ended; the holds
  // still there are given up (their DONE is answered revoked). The joiners' ranks given up.
  std::vector<int> close(Clock::duration bound);
  // Holds given and not ended (tests).
  size_t holds() const;
  // The serving table's hash the last serve() named (0: never served).
  uint64_t table() const;

  // --- Either role ---
  // A Replica message (the transport's handler thread): asks and DONEs are queued for
  // the server's thread, answers kept for await_answer.
  void on_message(PeerId from, const Replica& m);
  // A peer's connection failed: its holds end; a joiner waiting for its answer stops.
  void peer_failed(PeerId peer, const Status& why);

  // --- As the joiner ---
  // Forgets the answers from `peer` (before a new ask).
  void forget(PeerId peer);
  // The next answer from `peer` of one of `kinds`; kPeerFailed when its connection
  // failed; kTimeout at `deadline`; `stop()` not ok (checked every 50 ms) returns that.
  Result<Replica> await_answer(PeerId peer, std::initializer_list<uint8_t> kinds, Clock::time_point deadline,
                               const std::function<Status()>& stop);

 private:
  void loop();
  void answer(PeerId from, const Replica& m);

  const int rank_;
  const uint64_t plan_;
  Connect connect_;
  Send send_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::deque<std::pair<PeerId, Replica>> queue_;
  // Serving: open for `version` (set, table), or closed.
  bool open_ = false;
  uint64_t version_ = 0, table_ = 0;
  uint8_t set_ = 0;
  std::map<PeerId, int> holds_;  // joiner instance -> its rank
  // Joining: the answers not taken yet, and the peers whose connection failed (why).
  std::map<PeerId, std::deque<Replica>> answers_;
  std::map<PeerId, Status> failed_;
  std::thread thread_;  // last: started once the rest is set up
};

}  // namespace ferry::engine

// Zero-copy serving (ProducerOptions::source_regions): a producer whose weights live in
// transport regions publishes where each held box is, and then neither packs nor
// stages the pieces of those boxes that are contiguous runs of at least `min_bytes`:
// consumers read them straight from the trainer's memory. Producer and consumers derive
// the same pieces from the same routes and table (in_place_pieces), so nothing per
// sync crosses the wire.
//
// Push zero copy, the other way round: a consumer whose params are registered with its
// transport publishes where each of them is (ParamTable, in its lease), so that a
// producer derives from the same routes the same reads-into-params the consumer's
// schedule has (make_consumer_schedule over the table) and writes those bytes straight
// into the params instead of the receive ring.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/route.h"
#include "ferry/source.h"
#include "ferry/status.h"
#include "ferry/transport.h"

namespace ferry::engine {

struct InPlaceTable {
  static constexpr uint64_t kMaxRegions = 4096;
  struct At {
    int32_t region = -1;  // index into keys; -1: not in place
    uint64_t offset = 0;  // byte offset of the box's data inside that region
  };
  uint64_t min_bytes = 0;
  std::vector<std::string> keys;  // exported remote keys of the source regions
  std::vector<At> boxes;          // per held box (Holdings::boxes order)

  bool empty() const { return keys.empty(); }
  std::string encode() const;  // "" for an empty table
  // Bounds-checked against what the consumer knows of the producer, its `holdings`: one
  // entry per held box, each naming a region of the table or none, and each box in place
  // lying at an offset from which its bytes (numel x dtype size) do not overflow. Every
  // failure is kCorrupt naming the box.
  static Result<InPlaceTable> decode(std::string_view bytes, const Holdings& holdings);
  // Once the regions are imported (their lengths known): every box in place lies inside
  // its region, [offset, offset + its bytes) within [0, length). kCorrupt naming the box
  // and the region otherwise. A consumer reads pieces of boxes at offsets derived from
  // this table (in_place_pieces): without it, a box past its region failed the sync only
  // at its read (the transport's range check), mid-sync, after earlier groups landed.
  Status check_regions(const std::vector<RemoteRegion>& regions, const Holdings& holdings) const;
};

// Where a consumer's registered params lie (ConsumerLease::params): per param name, the
// index of its registration in `keys` (exported remote keys) and its byte offset and
// size there; `min_bytes` is the consumer's ConsumerOptions::direct_min_bytes. What
// make_consumer_schedule needs to find the same direct runs on the producer's side.
struct ParamTable {
  static constexpr uint64_t kMaxRegions = 1u << 20;
  struct Param {
    uint32_t key = 0;
    uint64_t offset = 0, bytes = 0;
  };
  uint64_t min_bytes = 0;
  std::vector<std::string> keys;
  std::map<std::string, Param> params;
  // A consumer that commits by a flip in push (CommitPolicy::kShadow, its own params):
  // the keys of its second set, laid out as `keys` (a Param's key and offset name the
  // same place in either set); READY says which set a sync lands in. Empty otherwise.
  std::vector<std::string> other_keys;

  bool empty() const { return keys.empty(); }
  std::string encode() const;  // "" for an empty table
  // Bounds-checked: every key index names a key, offset + bytes does not overflow.
  static Result<ParamTable> decode(std::string_view bytes);
};

// A run of group staging bytes [offset, offset + bytes) that the producer serves from
// region `region` at `region_offset` instead.
struct InPlacePiece {
  uint64_t offset = 0, bytes = 0;
  int32_t region = -1;
  uint64_t region_offset = 0;
};

// The pieces of `group` served in place, sorted by offset, disjoint: the pack ops whose
// box is in place, whose source is contiguous within the box and at least min_bytes,
// and that pack the box's own dtype (a converting pack is staged).
std::vector<InPlacePiece> in_place_pieces(const ProducerGroup& group, const Holdings& holdings,
                                          const InPlaceTable& table);

}  // namespace ferry::engine

// route/router_parts.h — what build_routes' passes share (internal to src/route/): a
// tensor's holders and disjoint pieces, the cuts of one plan class and their layouts,
// the regions a producer quantises, and the op sinks that merge and elide packs and
// unpacks. router.cpp runs the passes; pieces.cpp builds pieces, re-expresses layouts
// and makes quantisation regions.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ferry/route.h"
#include "route/op_digest.h"
#include "route/tiles.h"

namespace ferry::route_detail {

// One producer's box of a tensor.
struct Holder {
  Box box;
  uint32_t producer = 0;
  uint32_t box_index = 0;  // into the producer's Holdings::boxes
};

// A disjoint piece of a tensor and the holders whose box contains it.
struct TensorPiece {
  Box box;
  std::vector<uint32_t> holders;  // indices into the tensor's Holder list, by producer
  bool refined = false;           // some holder's box is larger than the piece
  int64_t flat_lo = 0, flat_hi = 0;  // row-major flat range the piece spans (inclusive)
};

struct TensorInfo {
  std::vector<Holder> holders;
  std::vector<TensorPiece> pieces;
  std::vector<MapPiece> map;  // compose_layout pieces (local contiguous roots)
  bool pieces_built = false;
  int first_holder = -1;       // producer whose view of the tensor was seen first
  const TensorDecl* first_decl = nullptr;  // and that view
  // Pieces by flat_lo (ties by index) and the widest flat extent of one: the pieces a
  // copy's flat range [lo, hi] can touch start within [lo - widest, hi].
  std::vector<uint32_t> by_flat;
  int64_t widest_flat = 0;
};

// A cut piece of one copy of one plan class. Its layouts are a row of the LayoutPool:
// millions of cuts at fsdp=N holding two Layouts (four heap vectors) each were what
// routing spent its time and memory on.
struct Cut {
  uint32_t plan = 0;
  uint32_t param = 0;
  uint32_t tensor = 0;
  uint32_t piece = 0;
  int32_t group = 0;
  uint32_t producer = 0;
  uint32_t box = 0;  // producer's box index
  DType wire = DType::kBF16;  // what staging holds: the source's dtype, or the param's
  bool sole = false;          // its piece has one holder
  uint64_t bytes = 0;
  uint64_t cost = 0;  // bytes x consumers of the plan class
  int64_t dst_offset = 0;
  uint64_t layouts = 0;  // its row in the LayoutPool
  int32_t region = -1;   // a region a producer quantises (ClassCuts::regions), not a piece
};

// A vector kept in fixed blocks: growing it never moves, nor touches again, what it
// holds (a doubling vector of millions of cuts copied and page-faulted all of them at
// every doubling).
template <typename T>
class Blocks {
 public:
  static constexpr size_t kBits = 14;
  void push_back(const T& x) {
    if (blocks_.empty() || blocks_.back().size() == (size_t{1} << kBits)) {
      blocks_.emplace_back();
      blocks_.back().reserve(size_t{1} << kBits);
    }
    blocks_.back().push_back(x);
    ++size_;
  }
  size_t size() const { return size_; }
  T& operator[](size_t i) { return blocks_[i >> kBits][i & ((size_t{1} << kBits) - 1)]; }
  const T& operator[](size_t i) const { return blocks_[i >> kBits][i & ((size_t{1} << kBits) - 1)]; }

 private:
  std::vector<std::vector<T>> blocks_;
  size_t size_ = 0;
};

// The src (piece-local, then holder-local) and dst layouts of every cut, one row each in
// one flat vector: [ndim, src offset, dst offset, shape x ndim, src strides x ndim, dst
// strides x ndim], in blocks that never move. add() coalesces the pair as
// coalesce_layouts() does, without allocating (scratch reused).
class LayoutPool {
 public:
  uint64_t add(const Shape& shape, const Shape& src_strides, int64_t src_offset, const Shape& dst_strides,
               int64_t dst_offset) {
    sh_.clear();
    a_.clear();
    b_.clear();
    bool empty = false;
    for (int64_t n : shape) empty |= n == 0;
    if (empty) {
      sh_.push_back(0);
      a_.push_back(1);
      b_.push_back(1);
    } else {
      for (size_t d = 0; d < shape.size(); ++d) {
        const int64_t n = shape[d];
        if (n == 1) continue;
        if (!sh_.empty() && a_.back() == src_strides[d] * n && b_.back() == dst_strides[d] * n) {
          sh_.back() *= n;
          a_.back() = src_strides[d];
          b_.back() = dst_strides[d];
        } else {
          sh_.push_back(n);
          a_.push_back(src_strides[d]);
          b_.push_back(dst_strides[d]);
        }
      }
    }
    const size_t row = 3 + 3 * sh_.size();
    if (blocks_.empty() || blocks_.back().size() + row > std::max(kBlock, row)) {
      blocks_.emplace_back();
      blocks_.back().reserve(std::max(kBlock, row));
    }
    std::vector<int64_t>& v = blocks_.back();
    const uint64_t at = (blocks_.size() - 1) << 32 | v.size();
    v.push_back(static_cast<int64_t>(sh_.size()));
    v.push_back(src_offset);
    v.push_back(dst_offset);
    v.insert(v.end(), sh_.begin(), sh_.end());
    v.insert(v.end(), a_.begin(), a_.end());
    v.insert(v.end(), b_.begin(), b_.end());
    return at;
  }
  int64_t numel(uint64_t at) const {
    const int64_t* r = row(at);
    int64_t n = 1;
    for (int64_t k = 0; k < r[0]; ++k) n *= r[3 + k];
    return n;
  }
  Layout src(uint64_t at) const { return layout(at, 1, 1); }
  Layout dst(uint64_t at) const { return layout(at, 2, 2); }
  // A rebased src of the same shape.
  void set_src(uint64_t at, const Layout& l) {
    int64_t* r = row(at);
    r[1] = l.offset;
    std::copy(l.strides.begin(), l.strides.end(), r + 3 + r[0]);
  }

 private:
  static constexpr size_t kBlock = size_t{1} << 16;  // int64s per block
  const int64_t* row(uint64_t at) const { return blocks_[at >> 32].data() + (at & 0xffffffffu); }
  int64_t* row(uint64_t at) { return blocks_[at >> 32].data() + (at & 0xffffffffu); }
  Layout layout(uint64_t at, size_t offset_field, size_t strides_block) const {
    const int64_t* r = row(at);
    const auto nd = static_cast<size_t>(r[0]);
    const int64_t* base = r + 3;
    Layout l;
    l.shape.assign(base, base + nd);
    l.strides.assign(base + strides_block * nd, base + (strides_block + 1) * nd);
    l.offset = r[offset_field];
    return l;
  }
  std::vector<std::vector<int64_t>> blocks_;
  Shape sh_, a_, b_;
};

// A region of a param a producer quantises (RouterOptions::quantize_on): its box, the
// producers that hold every element of it, and the param's cuts that land in it (their
// layouts stay in the class's pool; ClassCuts::quant_cuts).
struct QuantRegion {
  TileRegion box;
  uint32_t param = 0, scale = 0;         // in the class's route (PlanRoute::params)
  int64_t batch = 0, rows = 0, cols = 0;  // the param as [batch, rows, cols]
  DType dtype = DType::kBF16;  // the param's dtype in the plan
  uint8_t format = 0;
  uint32_t block = 128;
  std::vector<uint32_t> producers;
  std::vector<uint32_t> cuts;  // into ClassCuts::quant_cuts
};

// One plan class's cuts, their layouts and the bytes they carry (built on one thread).
struct ClassCuts {
  Blocks<Cut> cuts;
  LayoutPool pool;
  uint64_t bytes = 0;
  Status status;
  std::vector<QuantRegion> regions;
  std::vector<Cut> quant_cuts;  // cuts of producer-quantised params, replaced by their regions
  uint64_t quantized = 0, on_producer = 0;
};
// A cut: its plan class above kCutBits, its index in the class's cuts below.
using CutRef = uint64_t;
constexpr unsigned kCutBits = 40;
constexpr uint64_t kCutMask = (uint64_t{1} << kCutBits) - 1;

// The routing threads options ask for (RouterOptions::threads; 0: the machine's, up to 16).
int router_threads(const RouterOptions& options);

// Re-expresses dims of a copy's src layout along the source's own dims where a dim runs
// over whole rows of the source, so that compose_layout cuts by rows instead of row by
// row; src and dst are split alike (pieces.cpp).
void unflatten(Layout& src, Layout& dst, const Shape& radix);

// A layout over a piece's local row-major space, re-expressed over a holder box that
// contains the piece.
Layout rebase(const Layout& l, const Box& piece, const Box& holder);

inline uint64_t align_up(uint64_t x, uint64_t a) { return a <= 1 ? x : (x + a - 1) / a * a; }

// Merges `op` into `p` where both are contiguous runs that continue each other on both
// sides (the staging or receive bytes and the box or param); true if it did.
bool merge_op(PackOp& p, const PackOp& op, uint64_t es);
bool merge_op(UnpackOp& p, const UnpackOp& op, uint64_t es);

// One group's ops as a segment's cuts arrive: appended to `ops` (merged with the
// previous op of the same segment where they continue each other), or, where the group's
// ops are elided (ops == nullptr), merged alike and only counted and digested.
template <typename Op>
class OpSink {
 public:
  explicit OpSink(std::vector<Op>* ops = nullptr) : ops_(ops) {}
  void begin_segment() { first_ = ops_ ? ops_->size() : count_; }
  void push(Op op, uint64_t es) {
    if (ops_) {
      if (ops_->size() > first_ && merge_op(ops_->back(), op, es)) return;
      ops_->push_back(std::move(op));
      return;
    }
    if (count_ > first_ && merge_op(last_, op, es)) return;
    if (count_) digest_ = digest_op(digest_, last_);
    last_ = std::move(op);
    ++count_;
  }
  // An elided group's count and digest (both 0 where the ops were made).
  std::pair<uint64_t, uint64_t> finish() {
    if (ops_ || !count_) return {0, 0};
    return {count_, digest_op(digest_, last_)};
  }

 private:
  std::vector<Op>* ops_;
  Op last_{};
  uint64_t count_ = 0, digest_ = 0;
  size_t first_ = 0;
};

// The dtype a piece crosses the wire in: the param's where the producer converts (both
// floating, the param's elements narrower), else the source's.
DType wire_dtype(DType source, DType param, const RouterOptions& options);

bool same_decl(const TensorDecl& a, const TensorDecl& b);
std::string decl_str(const TensorDecl& d);  // "bf16 [4096, 4096]"

// Producer-side quantisation of one plan class (RouterOptions::quantize_on): for each
// param the plan keeps block-quantised whose every tile some producer holds whole, its
// cuts are replaced by regions and the class's route gets the param as e4m3 plus its
// scales. The rest stay dense, for the consumer to quantise.
void quantize_class(const Plan& plan, uint64_t weight, const std::vector<TensorInfo>& tensors, ClassCuts& out,
                    PlanRoute& route);

// The quant op of region `r` of class `cc` as producer `p` packs it at staging `offset`.
Result<QuantOp> quant_op(const ClassCuts& cc, const QuantRegion& r, uint32_t p, uint64_t offset,
                         const std::vector<TensorInfo>& tensors);

// Builds the disjoint pieces of a tensor from its holders.
Status build_pieces(const TensorDecl& decl, TensorInfo& ti);

}  // namespace ferry::route_detail

// ferry/route.h — the Router (shared/DESIGN.md §5): from the trainer's metadata, every
// producer's holdings and every consumer's ShardPlan, decide who sends what.
//
// Algorithm (docs/routing.md):
//   1. Consumers with identical plans (the same rank of different inference replicas)
//      share one *plan class*: routed once, weighted by how many consumers share it.
//   2. Each tensor's holder boxes become disjoint *pieces* (a box held by several
//      producers — DP replicas — is one piece with a holder set; partially overlapping
//      boxes are refined into disjoint cells). Every plan copy is cut by the pieces it
//      touches with compose_layout(); an element held by nobody is an error naming the
//      tensor.
//   3. Each cut piece gets one holder: greedy, largest (bytes x sharing consumers)
//      first, to the least-loaded holder of its box.
//   4. Per producer, per group, per plan class: one staging *segment* (64-byte aligned)
//      with that class's pieces packed back to back in destination order (param,
//      destination offset). A consumer reads whole segments and unpacks them.
// Bytes moved are exactly the source bytes each consumer's plan reads (no padding is
// moved; segments hold no gaps).
//
// Routes are values: deterministic for the same inputs, serialisable (versioned,
// bounds-checked decoding) and hashable.
// Threading: build_routes is a pure function (it runs on RouterOptions::threads threads of
// its own and returns when they are done); Routes are immutable after building.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/plan.h"
#include "ferry/source.h"
#include "ferry/status.h"
#include "ferry/tensor.h"

namespace ferry {

// Producer p copies `src` (a layout over its held box `box` — a contiguous tensor of
// the box's shape) to its group staging buffer at byte `offset`, contiguously in src's
// row-major order, as `dtype`: the box's own dtype, or a narrower float dtype the
// producer converts to (RouterOptions::convert_on).
struct PackOp {
  uint32_t box = 0;  // index into the producer's Holdings::boxes
  DType dtype = DType::kBF16;  // in staging
  uint64_t offset = 0;
  Layout src;
  friend bool operator==(const PackOp&, const PackOp&) = default;
};

// Bytes [offset, offset + bytes) of a producer's group staging are read by every
// consumer of plan class `plan`.
struct Segment {
  uint32_t plan = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  friend bool operator==(const Segment&, const Segment&) = default;
};

// Producer-side block quantisation (RouterOptions::quantize_on, issue 29). A *region* is
// a box of one consumer param, aligned to its quantisation tiles, whose every element one
// producer holds: it fills the region in the param's dtype from its boxes (FillOps), runs
// the same quantiser as the consumer would (fp8_block_quantize) and stages the e4m3
// values, row-major, then the region's tile scales, row-major (QuantOp::bytes()).
struct FillOp {
  uint32_t box = 0;  // index into the producer's Holdings::boxes
  Layout src;        // over the held box's row-major space
  Layout dst;        // over the region's row-major space [batch, rows, cols]; src's shape
  friend bool operator==(const FillOp&, const FillOp&) = default;
};

struct QuantOp {
  uint64_t offset = 0;         // in staging
  DType dtype = DType::kBF16;  // the region before quantising: the param's dtype in the plan
  uint8_t format = 0;          // BlockQuantize::format (Fp8Scales)
  uint32_t block = 128;        // tile columns; tile rows the same, or 1 under MXFP8
  Shape region;                // [batch, rows, cols]
  std::vector<FillOp> fills;   // disjoint, covering the region
  uint64_t numel() const;
  uint64_t tiles() const;
  uint64_t bytes() const;  // numel() e4m3 values + tiles() scales
  friend bool operator==(const QuantOp&, const QuantOp&) = default;
};

struct ProducerGroup {
  uint64_t staging_bytes = 0;
  std::vector<Segment> segments;
  std::vector<PackOp> packs;
  // Regions this producer quantises, in staging among its segments' packs. Never elided
  // (RouterOptions::packs_of): every rank makes every producer's few.
  std::vector<QuantOp> quants;
  // Where the router made no packs for this group (RouterOptions::packs_of: another
  // rank's), how many it has and their digest instead; zero where `packs` holds them.
  uint64_t elided_packs = 0;
  uint64_t elided_digest = 0;
  friend bool operator==(const ProducerGroup&, const ProducerGroup&) = default;
};

struct ProducerRoute {
  std::vector<ProducerGroup> groups;  // one per group
  friend bool operator==(const ProducerRoute&, const ProducerRoute&) = default;
};

// A consumer reads `length` bytes at `offset` of producer `producer`'s group staging
// into its group receive buffer at `recv_offset`.
struct Read {
  uint32_t producer = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t recv_offset = 0;
  friend bool operator==(const Read&, const Read&) = default;
};

// dst.numel() elements of dtype `src_dtype` stored contiguously at byte `offset` of the
// receive buffer go to param `param` (index into PlanRoute::params) at `dst`, converted
// to the param's dtype.
struct UnpackOp {
  uint32_t param = 0;
  DType src_dtype = DType::kBF16;
  uint64_t offset = 0;
  Layout dst;
  friend bool operator==(const UnpackOp&, const UnpackOp&) = default;
};

struct PlanGroup {
  uint64_t recv_bytes = 0;
  std::vector<Read> reads;
  std::vector<UnpackOp> unpacks;
  uint64_t elided_unpacks = 0;  // as ProducerGroup::elided_packs (RouterOptions::unpacks_of)
  uint64_t elided_digest = 0;
  friend bool operator==(const PlanGroup&, const PlanGroup&) = default;
};

// A param of a plan class that producers quantise: params[param] is e4m3 (the plan's
// dtype, `loaded`, is what the producers quantise from) and params[scale] holds its tile
// scales (appended after the plan's params). The consumer receives them as they stay.
struct QuantizedParam {
  uint32_t param = 0, scale = 0;
  uint8_t format = 0;
  uint32_t block = 128;
  DType loaded = DType::kBF16;
  friend bool operator==(const QuantizedParam&, const QuantizedParam&) = default;
};

// The route of one plan class (shared by every consumer whose plan it is).
struct PlanRoute {
  uint64_t plan_hash = 0;
  std::vector<TensorDecl> params;  // the plan's params (+ the scales of `quantized`)
  std::vector<PlanGroup> groups;   // one per group
  std::vector<QuantizedParam> quantized;  // by param
  friend bool operator==(const PlanRoute&, const PlanRoute&) = default;
};

// Figures of a routing (not serialised).
struct RouteStats {
  uint64_t bytes_min = 0;        // sum over consumers of the bytes their plan reads, in the
                                 // wire's dtype (the param's where the producer converts)
  uint64_t bytes_moved = 0;      // sum over consumers of the bytes they read
  uint64_t num_reads = 0;        // over consumers and groups
  uint64_t num_pack_ops = 0;
  uint64_t num_unpack_ops = 0;   // over plan classes
  uint64_t num_pieces = 0;       // cut pieces (before merging)
  uint64_t num_plan_classes = 0;
  uint64_t max_staging_bytes = 0;  // largest one producer's staging for one group
  std::vector<uint64_t> producer_bytes;  // sent, counting every consumer that reads
  std::vector<uint64_t> consumer_bytes;  // received
  uint64_t max_producer_bytes = 0;
  uint64_t max_consumer_bytes = 0;
  uint64_t holders = 0;              // producers that hold anything
  double mean_producer_bytes = 0;    // over holders
  uint64_t max_sole_holder_bytes = 0;  // most bytes a producer must send as the only holder
  double balance_bound = 0;          // max(mean, max_sole_holder_bytes)
  double balance = 0;                // max_producer_bytes / balance_bound (1 when nothing moves)
  // A tighter lower bound that respects who can hold what: producers linked by holding a
  // common piece form a component (under Megatron PP: a stage); its bytes can only be
  // sent by its own producers, so max over components of bytes / producers (and the
  // sole-holder maximum) bounds the busiest producer of any assignment.
  double component_bound = 0;
  // Params the plans keep block-quantised (Plan::quantized), over plan classes, and
  // those the producers quantise (RouterOptions::quantize_on); the rest the consumer does.
  uint64_t quantized_params = 0;
  uint64_t quantized_on_producer = 0;
  uint64_t quant_regions = 0;
};

class Routes {
 public:
  // Version 1: every op present. Version 2 (written only where some group's ops were
  // elided) adds each group's elided count and digest. Version 3 (only where producers
  // quantise) adds each producer group's quant ops and each plan's quantized params.
  static constexpr uint32_t kEncodingVersion = 3;
  static constexpr uint64_t kMaxCount = 1u << 28;
  static constexpr uint64_t kMaxRank = 16;

  std::vector<std::string> group_names;
  std::vector<ProducerRoute> producers;  // per trainer rank
  std::vector<PlanRoute> plans;          // per plan class
  std::vector<uint32_t> consumer_plan;   // per inference rank: its plan class
  RouteStats stats;                      // filled by build_routes; empty after decode

  int num_groups() const { return static_cast<int>(group_names.size()); }
  const PlanRoute& consumer(size_t c) const { return plans[consumer_plan[c]]; }

  std::string encode() const;
  // Bounds-checked decoding of untrusted bytes; validates every offset against the
  // buffers it names (see validate()).
  static Result<Routes> decode(std::span<const std::byte> bytes);
  static Result<Routes> decode(std::string_view bytes);
  uint64_t hash() const;  // xxHash64 of encode()
  // What every rank of a job agrees on whichever ops it kept (RouterOptions::packs_of):
  // a hash of everything but the ops, and of each group's op count and digest (made from
  // its ops where present, else the elided ones). Routes that differ only in which ops
  // were elided have the same fingerprint; routes that differ in any op do not.
  uint64_t fingerprint() const;
  bool has_packs(size_t producer) const;  // none of its groups' packs elided
  bool has_unpacks(size_t plan) const;    // likewise for a plan class's unpacks
  // Internal consistency: indices in range, packs and segments inside staging, reads
  // inside the producer's staging and the receive buffer, unpacks inside the receive
  // buffer and their params.
  Status validate() const;

  // Structure equality (stats ignored).
  friend bool operator==(const Routes& a, const Routes& b) {
    return a.group_names == b.group_names && a.producers == b.producers && a.plans == b.plans &&
           a.consumer_plan == b.consumer_plan;
  }
};

struct RouterInput {
  std::vector<TensorDecl> metadata;        // every tensor (WeightSource::metadata)
  std::vector<Holdings> producers;         // per trainer rank (WeightSource::holdings)
  std::vector<const Plan*> consumers;      // per inference rank (not owned; canonical plans)
};

// Where a float dtype conversion that shrinks the bytes runs (a source of fp32 master
// weights read into bf16 params, bf16 into fp8): on the producer as it packs, so the wire
// carries the param's dtype and the piece can land in the param directly (the default),
// or on the consumer as it unpacks (the wire carries the source's dtype; for comparison).
// Both run strided_copy's conversion: the params' bits are the same either way. A
// producer converting cannot serve that piece from the trainer's memory in place.
// Every rank of a job must use the same choice (it changes the routes).
enum class ConvertOn : uint8_t { kProducer, kConsumer };
std::string_view convert_on_name(ConvertOn c);
std::optional<ConvertOn> parse_convert_on(std::string_view name);  // "producer" | "consumer"

// Where the block quantisation a plan asks for (Plan::quantized) runs: on the consumer
// after the dense values land (post-processing, as loaded), or on a producer wherever
// one producer holds every element of each of a param's tiles, so that FP8 values and
// scales cross the wire (about half the bytes of bf16). A param some tile of which no
// producer holds whole, that has zero padding, or that is fed from more than one layer
// group stays with the consumer. The bits are the same either way.
enum class QuantizeOn : uint8_t { kConsumer, kProducer };
std::string_view quantize_on_name(QuantizeOn q);
std::optional<QuantizeOn> parse_quantize_on(std::string_view name);  // "consumer" | "producer"
// A region's elements, at most: a producer fills one region at a time in a scratch buffer
// of the param's dtype (64 MiB of bf16).
inline constexpr uint64_t kMaxQuantRegionElements = uint64_t{1} << 25;

struct RouterOptions {
  uint64_t segment_alignment = 64;
  ConvertOn convert_on = ConvertOn::kProducer;
  QuantizeOn quantize_on = QuantizeOn::kConsumer;
  // Threads that build the routes (plan classes, producers and tensors split among them);
  // 0: the hardware's, at most 16. The routes are the same for any count.
  int threads = 0;
  // Whose packs and unpacks to make; segments, reads and stats are always every rank's.
  // A rank needs its own ops, and the other side's only to derive the reads its peers
  // derive (in-place serving, push into params). At fsdp=4096 -> tp=8 the job's ops are
  // 9.3 million, a GiB that every rank would build and hold. Groups left out keep their
  // op count and digest (ProducerGroup::elided_packs): Routes::fingerprint() is the same.
  static constexpr int kEveryRank = -1, kNoRank = -2;
  int packs_of = kEveryRank;    // a producer rank, kEveryRank or kNoRank
  int unpacks_of = kEveryRank;  // a consumer rank (its plan class's unpacks), kEveryRank or kNoRank
};

// Errors (each names the tensor): a tensor the metadata lists twice; holdings of a
// tensor the metadata lacks; holders that disagree with each other or the metadata on
// dtype or shape; a box outside its tensor; overlapping boxes within one producer; a
// plan that reads a tensor the metadata lacks (or with another dtype or shape); source
// elements a plan reads that no producer holds.
// RouterOptions::packs_of or unpacks_of naming no rank is kInvalidArgument.
// Also refuses, before any piece is cut, inputs whose routing cost (RoutingCost below,
// from the holdings' boxes) exceeds kMaxRouteGroups or kMaxRoutePieces.
Result<Routes> build_routes(const RouterInput& input, const RouterOptions& options = {});

// ---------------------------------------------------------------------------------------
// What routing costs, known before anything is built (count_held_boxes in source.h
// gives the boxes of a trainer layout without making its holdings). The router's work
// and memory grow with three counts: the held boxes (every trainer rank's), the route
// groups (every producer and every plan class has one per layer group, even an empty
// one, and every rank of a job holds every route group, if not every op), and the cut
// pieces, at most about one per box and plan class reading it (estimated as boxes x plan classes: an
// upper estimate, ~1.7x the pieces of Llama-3.1-8B under fsdp=4096 -> tp=8).
struct RoutingCost {
  uint64_t producers = 0;
  uint64_t plan_classes = 0;  // at most the inference engine size (replicas share one)
  uint64_t groups = 0;        // layer groups (Groups::size)
  uint64_t held_boxes = 0;
  // Whether every op is made (RouterOptions::packs_of / unpacks_of = kEveryRank); false:
  // none, as `ferry plan` builds them (an engine rank makes its own few, or one side's).
  bool every_op = true;

  uint64_t route_groups() const;
  uint64_t pieces() const;  // the estimate: held_boxes x plan_classes
  // Predicted peak memory of building the routes (holdings, pieces, routes), bytes.
  uint64_t bytes() const;
  // "1000000 producers x 35 groups, 1997568 held boxes, ~15980544 pieces: ~8.1 GiB"
  std::string to_string() const;
};
// Route groups: (10^6 producers + classes) x 35 groups would be ~2 GiB of empty groups
// held by every rank of the job before a single piece; 2^24 still allows fsdp=131072
// over a 126-layer model. Pieces: 2^27 is ~55 GiB of routes.
inline constexpr uint64_t kMaxRouteGroups = uint64_t{1} << 24;
inline constexpr uint64_t kMaxRoutePieces = uint64_t{1} << 27;
// InvalidArgument saying what the routing would need (the counts and bytes()) and
// which bound it exceeds: route_groups() over kMaxRouteGroups, pieces() over
// kMaxRoutePieces, or bytes() over `memory_budget` (0: no memory bound; `ferry plan`
// passes the machine's MemAvailable).
Status check_routing_cost(const RoutingCost& cost, uint64_t memory_budget = 0);

// ---------------------------------------------------------------------------------------
// Which side can block-quantise a param (issue 29), decided from the routes alone.
//
// A consumer that keeps a param block-quantised (FP8 with a scale per block x block tile
// of its last two dims, leading dims each on their own: LoaderOptions::quantize) gets
// it bit for bit the same whichever side runs the quantiser, as long as that side sees
// every element of each tile: a producer can, for a param whose every tile's elements
// all reach the consumer from that one producer; a tile split between producers (a
// block straddling two trainer ranks' boxes) leaves the param to the consumer. What
// `ferry plan --quantize` reports (the bytes either way); the engine still quantises on
// the consumer.

struct BlockQuantizeFormat {
  int64_t block = 128;       // tiles of block_rows x block of the last two dims
  int64_t block_rows = 128;  // (1 for MXFP8's runs of a row)
  uint32_t value_bytes = 1;  // FP8
  uint32_t scale_bytes = 4;  // fp32 inverse scales (vLLM/DeepSeek weight_scale_inv); E8M0: 1
};

struct QuantizeSide {
  uint32_t plan = 0, param = 0;  // plan class, index into PlanRoute::params
  std::string name;
  uint64_t consumers = 0;        // of the plan class
  bool on_producer = false;      // every tile from one producer
  uint64_t tiles = 0, tiles_split = 0;
  // Per consumer: what the wire carries today (the routes' dtype) and with the producer
  // quantising (values of the elements the routes carry + the scales of tiles they reach).
  uint64_t bytes_dense = 0, bytes_quantized = 0;
};

// One entry per quantised param of each plan class (`quantized[k]`: indices into
// routes.plans[k].params), in that order. Errors: a list per plan class missing, an
// index out of range, a param that is not a float matrix, an unpack outside every read.
Result<std::vector<QuantizeSide>> quantize_sides(const Routes& routes,
                                                 const std::vector<std::vector<uint32_t>>& quantized,
                                                 const BlockQuantizeFormat& format = {});

// ---------------------------------------------------------------------------------------
// Executing routes (in process: tests, the engine's pack/unpack steps).

// Packs group `group` of `producer`: `boxes` from WeightSource::materialize(group).
// `staging` must hold ProducerGroup::staging_bytes. Checks every op against its box;
// an op of another (float) dtype than its box converts as it packs.
// Boxes in CUDA memory (contiguous, one device) are packed there by one kernel launch
// that writes into `staging`, which must then be visible to that device
// (register_host_for_cuda, ferry/device.h).
Status pack_group(const Routes& routes, uint32_t producer, int group, const Holdings& holdings,
                  const std::vector<LocalBox>& boxes, std::span<std::byte> staging);
// The same for one group's route `group_route` (of `producer`, layer group `group`), e.g.
// one with the packs another path serves removed.
Status pack_group(const ProducerGroup& group_route, uint32_t producer, int group, const Holdings& holdings,
                  const std::vector<LocalBox>& boxes, std::span<std::byte> staging);
// The group's packs alone (pack_group runs them, then quantize_group): into `staging`
// where it is device memory (ProducerOptions::staging_device), whose quant ops then run
// into the host staging it is copied to.
Status pack_group_packs(const ProducerGroup& group_route, uint32_t producer, int group, const Holdings& holdings,
                        const std::vector<LocalBox>& boxes, std::span<std::byte> staging);
// The group's quant ops alone (pack_group runs them after its packs), into `staging` in
// host memory: each region filled from the boxes, converted to the param's dtype as an
// unpack would, and quantised by the code a consumer's FP8 post-processing runs; a
// region whose boxes are all in one GPU's memory is filled and quantised there (the copy
// and FP8 kernels, the host's bits) and copied into staging. For a caller whose packs
// wrote device staging.
Status quantize_group(const ProducerGroup& group_route, uint32_t producer, int group, const Holdings& holdings,
                      const std::vector<LocalBox>& boxes, std::span<std::byte> staging);
// Unpacks a received group buffer (PlanGroup::recv_bytes) into real params (by name,
// contiguous, declared dtype and shape). Params in CUDA memory (one device) are written
// by one kernel launch reading `recv`, which must be visible to that device; a dtype
// conversion (float dtypes, StridedCopy::src_dtype in ferry/device.h) runs in that kernel.
Status unpack_group(const PlanRoute& plan, int group, std::span<const std::byte> recv, const TensorMap& params);
// The inverse of unpack_group over received bytes [lo, hi) of group `group`: writes into
// `recv` what unpack_group would have read there to leave the (host) params as they are
// now, converting back to the wire's dtype (exact unless the unpack widened nothing it
// can narrow back: a delta's content hash is what proves it). Unpacks outside [lo, hi)
// are skipped; one straddling a bound is kInvalidArgument, as is a param in GPU memory.
Status gather_group(const PlanRoute& plan, int group, uint64_t lo, uint64_t hi, const TensorMap& params,
                    std::span<std::byte> recv);

}  // namespace ferry

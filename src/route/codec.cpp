// Routes: encoding, bounds-checked decoding, validation, hashing; pack/unpack executors.
#include <algorithm>
#include <cstring>
#include <optional>
#include <unordered_map>
#include <vector>

#define XXH_STATIC_LINKING_ONLY  // XXH64_state_t on the stack
#include <xxhash.h>

#include "ferry/device.h"
#include "ferry/route.h"
#include "route/op_digest.h"
#include "route/tiles.h"

namespace ferry {

namespace {

constexpr char kMagic[4] = {'F', 'R', 'R', 'T'};

class Writer {
 public:
  void u64(uint64_t v) {
    while (v >= 0x80) {
      s_.push_back(static_cast<char>((v & 0x7f) | 0x80));
      v >>= 7;
    }
    s_.push_back(static_cast<char>(v));
  }
  void i64(int64_t v) { u64((static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63)); }
  void fixed64(uint64_t v) {
    for (int i = 0; i < 8; ++i) s_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  void str(const std::string& v) {
    u64(v.size());
    s_ += v;
  }
  void layout(const Layout& l) {
    u64(l.shape.size());
    for (int64_t x : l.shape) i64(x);
    for (int64_t x : l.strides) i64(x);
    i64(l.offset);
  }
  void raw(const char* p, size_t n) { s_.append(p, n); }
  std::string take() { return std::move(s_); }

 private:
  std::string s_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> b) : p_(b.data()), end_(b.data() + b.size()) {}
  bool ok() const { return ok_; }
  size_t left() const { return static_cast<size_t>(end_ - p_); }
  uint64_t u64() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ == end_) return fail();
      const uint8_t b = static_cast<uint8_t>(*p_++);
      if (shift == 63 && b > 1) return fail();
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    return fail();
  }
  int64_t i64() {
    const uint64_t u = u64();
    return static_cast<int64_t>((u >> 1) ^ (~(u & 1) + 1));
  }
  uint64_t fixed64() {
    if (left() < 8) return fail();
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p_[i])) << (8 * i);
    p_ += 8;
    return v;
  }
  // A count of items that take at least `min_bytes` each.
  uint64_t count(uint64_t min_bytes = 1) {
    const uint64_t n = u64();
    if (!ok_ || n > Routes::kMaxCount || n > left() / std::max<uint64_t>(min_bytes, 1)) return fail();
    return n;
  }
  std::string str() {
    const uint64_t n = u64();
    if (!ok_ || n > left() || n > 4096) {
      fail();
      return {};
    }
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }
  Layout layout() {
    Layout l;
    const uint64_t nd = u64();
    if (!ok_ || nd > Routes::kMaxRank) {
      fail();
      return l;
    }
    l.shape.resize(nd);
    l.strides.resize(nd);
    for (auto& x : l.shape) x = i64();
    for (auto& x : l.strides) x = i64();
    l.offset = i64();
    return l;
  }
  DType dtype() {
    const uint64_t v = u64();
    if (v >= static_cast<uint64_t>(kNumDTypes)) {
      fail();
      return DType::kBF16;
    }
    return static_cast<DType>(v);
  }
  bool magic() {
    if (left() < 4 || std::memcmp(p_, kMagic, 4) != 0) {
      fail();
      return false;
    }
    p_ += 4;
    return true;
  }
  uint64_t fail() {
    ok_ = false;
    p_ = end_;
    return 0;
  }

 private:
  const std::byte* p_;
  const std::byte* end_;
  bool ok_ = true;
};

// numel and flat range of a layout, false on overflow or a negative size.
bool layout_range(const Layout& l, int64_t& numel, int64_t& lo, int64_t& hi) {
  if (l.shape.size() != l.strides.size() || l.shape.size() > Routes::kMaxRank) return false;
  numel = 1;
  for (int64_t s : l.shape) {
    if (s < 0 || (s != 0 && __builtin_mul_overflow(numel, s, &numel))) return false;
  }
  lo = hi = l.offset;
  if (numel == 0) return true;
  for (size_t k = 0; k < l.shape.size(); ++k) {
    int64_t span = 0;
    if (__builtin_mul_overflow(l.shape[k] - 1, l.strides[k], &span)) return false;
    if (span < 0) {
      if (__builtin_add_overflow(lo, span, &lo)) return false;
    } else if (__builtin_add_overflow(hi, span, &hi)) {
      return false;
    }
  }
  return true;
}

// [offset, offset + numel * es) within [0, limit).
bool bytes_within(uint64_t offset, int64_t numel, uint64_t es, uint64_t limit) {
  uint64_t n = 0, end = 0;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel), es, &n)) return false;
  if (__builtin_add_overflow(offset, n, &end)) return false;
  return end <= limit;
}

}  // namespace

namespace {

// Everything of `r` but the ops, in encoding order after the version; each group's ops
// as `packs(w, group)` / `unpacks(w, group)` write them (encode: the ops; fingerprint:
// their count and digest, flushing the writer).
template <typename Packs, typename Unpacks>
// `quant`: version 3's fields (the plans' quantized params; each group's quant ops
// unless `quant_ops_in_packs`, where `packs` digests them with the packs).
void write_routes(Writer& w, const Routes& r, bool quant, Packs&& packs, Unpacks&& unpacks,
                  bool quant_ops_in_packs = false) {
  w.u64(r.group_names.size());
  for (const auto& g : r.group_names) w.str(g);
  w.u64(r.producers.size());
  for (const auto& p : r.producers) {
    w.u64(p.groups.size());
    for (const auto& g : p.groups) {
      w.u64(g.staging_bytes);
      w.u64(g.segments.size());
      for (const auto& s : g.segments) {
        w.u64(s.plan);
        w.u64(s.offset);
        w.u64(s.bytes);
      }
      packs(w, g);
      if (quant && !quant_ops_in_packs) {
        w.u64(g.quants.size());
        for (const QuantOp& q : g.quants) {
          w.u64(q.offset);
          w.u64(static_cast<uint64_t>(q.dtype));
          w.u64(q.format);
          w.u64(q.block);
          w.u64(q.region.size());
          for (int64_t x : q.region) w.i64(x);
          w.u64(q.fills.size());
          for (const FillOp& f : q.fills) {
            w.u64(f.box);
            w.layout(f.src);
            w.layout(f.dst);
          }
        }
      }
    }
  }
  w.u64(r.plans.size());
  for (const auto& pr : r.plans) {
    w.fixed64(pr.plan_hash);
    w.u64(pr.params.size());
    for (const auto& d : pr.params) {
      w.str(d.name);
      w.u64(static_cast<uint64_t>(d.dtype));
      w.u64(d.shape.size());
      for (int64_t x : d.shape) w.i64(x);
    }
    if (quant) {
      w.u64(pr.quantized.size());
      for (const QuantizedParam& q : pr.quantized) {
        w.u64(q.param);
        w.u64(q.scale);
        w.u64(q.format);
        w.u64(q.block);
        w.u64(static_cast<uint64_t>(q.loaded));
      }
    }
    w.u64(pr.groups.size());
    for (const auto& g : pr.groups) {
      w.u64(g.recv_bytes);
      w.u64(g.reads.size());
      for (const auto& rd : g.reads) {
        w.u64(rd.producer);
        w.u64(rd.offset);
        w.u64(rd.length);
        w.u64(rd.recv_offset);
      }
      unpacks(w, g);
    }
  }
  w.u64(r.consumer_plan.size());
  for (uint32_t c : r.consumer_plan) w.u64(c);
}

// Whether `r` needs version 3: some producer quantises.
bool has_quant(const Routes& r) {
  for (const auto& p : r.producers)
    for (const auto& g : p.groups)
      if (!g.quants.empty()) return true;
  for (const auto& pr : r.plans)
    if (!pr.quantized.empty()) return true;
  return false;
}

}  // namespace

uint64_t QuantOp::numel() const {
  uint64_t n = 1;
  for (int64_t x : region) n *= static_cast<uint64_t>(std::max<int64_t>(x, 0));
  return region.empty() ? 0 : n;
}

uint64_t QuantOp::tiles() const {
  if (region.size() != 3 || block == 0) return 0;
  const auto b = static_cast<int64_t>(block);
  return static_cast<uint64_t>(
      batch::fp8_num_tiles(region[0], region[1], region[2], batch::fp8_tile_rows(format, b), b));
}

uint64_t QuantOp::bytes() const { return numel() + tiles() * batch::fp8_scale_bytes(format); }

std::string Routes::encode() const {
  const bool quant = has_quant(*this);
  bool elided = false;
  for (const auto& p : producers)
    for (const auto& g : p.groups) elided |= g.elided_packs != 0;
  for (const auto& pr : plans)
    for (const auto& g : pr.groups) elided |= g.elided_unpacks != 0;
  Writer w;
  w.raw(kMagic, 4);
  w.u64(quant ? 3 : elided ? 2 : 1);
  write_routes(
      w, *this, quant,
      [&](Writer& out, const ProducerGroup& g) {
        out.u64(g.packs.size());
        for (const auto& op : g.packs) {
          out.u64(op.box);
          out.u64(static_cast<uint64_t>(op.dtype));
          out.u64(op.offset);
          out.layout(op.src);
        }
        if (elided || quant) {
          out.u64(g.elided_packs);
          out.fixed64(g.elided_digest);
        }
      },
      [&](Writer& out, const PlanGroup& g) {
        out.u64(g.unpacks.size());
        for (const auto& op : g.unpacks) {
          out.u64(op.param);
          out.u64(static_cast<uint64_t>(op.src_dtype));
          out.u64(op.offset);
          out.layout(op.dst);
        }
        if (elided || quant) {
          out.u64(g.elided_unpacks);
          out.fixed64(g.elided_digest);
        }
      });
  return w.take();
}

Result<Routes> Routes::decode(std::string_view bytes) {
  return decode(std::span<const std::byte>(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()));
}

Result<Routes> Routes::decode(std::span<const std::byte> bytes) {
  Reader r(bytes);
  if (!r.magic()) return corrupt("routes: bad magic (not a ferry routes blob)");
  const uint64_t version = r.u64();
  if (!r.ok() || version < 1 || version > kEncodingVersion) {
    return corrupt("routes: unsupported encoding version {} (this build reads 1 to {})", version, kEncodingVersion);
  }
  const bool elided = version >= 2;
  const bool quant = version >= 3;
  Routes out;
  auto u32 = [&](uint64_t v) -> uint32_t {
    if (v > 0xffffffffu) r.fail();
    return static_cast<uint32_t>(v);
  };
  const uint64_t ng = r.count();
  for (uint64_t i = 0; i < ng && r.ok(); ++i) out.group_names.push_back(r.str());
  const uint64_t np = r.count();
  out.producers.resize(np);
  for (auto& p : out.producers) {
    const uint64_t g = r.count();
    p.groups.resize(g);
    for (auto& pg : p.groups) {
      pg.staging_bytes = r.u64();
      const uint64_t ns = r.count(3);
      pg.segments.resize(ns);
      for (auto& s : pg.segments) {
        s.plan = u32(r.u64());
        s.offset = r.u64();
        s.bytes = r.u64();
      }
      const uint64_t nk = r.count(4);
      pg.packs.resize(nk);
      for (auto& op : pg.packs) {
        op.box = u32(r.u64());
        op.dtype = r.dtype();
        op.offset = r.u64();
        op.src = r.layout();
      }
      if (elided) {
        pg.elided_packs = r.u64();
        pg.elided_digest = r.fixed64();
      }
      if (quant) {
        const uint64_t nq = r.count(7);
        pg.quants.resize(nq);
        for (auto& q : pg.quants) {
          q.offset = r.u64();
          q.dtype = r.dtype();
          const uint64_t f = r.u64(), b = r.u64();
          if (f > 255 || b > 0xffffffffu) r.fail();
          q.format = static_cast<uint8_t>(f);
          q.block = static_cast<uint32_t>(b);
          const uint64_t nd = r.u64();
          if (nd > kMaxRank) r.fail();
          if (!r.ok()) break;
          q.region.resize(nd);
          for (auto& x : q.region) x = r.i64();
          const uint64_t nf = r.count(7);
          q.fills.resize(nf);
          for (auto& fo : q.fills) {
            fo.box = u32(r.u64());
            fo.src = r.layout();
            fo.dst = r.layout();
          }
          if (!r.ok()) break;
        }
      }
      if (!r.ok()) break;
    }
    if (!r.ok()) break;
  }
  const uint64_t nplans = r.ok() ? r.count(9) : 0;
  out.plans.resize(nplans);
  for (auto& pr : out.plans) {
    pr.plan_hash = r.fixed64();
    const uint64_t nparams = r.count(3);
    pr.params.resize(nparams);
    for (auto& d : pr.params) {
      d.name = r.str();
      d.dtype = r.dtype();
      const uint64_t nd = r.u64();
      if (nd > kMaxRank) r.fail();
      if (!r.ok()) break;
      d.shape.resize(nd);
      for (auto& x : d.shape) x = r.i64();
    }
    if (quant && r.ok()) {
      const uint64_t nq = r.count(5);
      pr.quantized.resize(nq);
      for (auto& q : pr.quantized) {
        q.param = u32(r.u64());
        q.scale = u32(r.u64());
        const uint64_t f = r.u64(), b = r.u64();
        if (f > 255 || b > 0xffffffffu) r.fail();
        q.format = static_cast<uint8_t>(f);
        q.block = static_cast<uint32_t>(b);
        q.loaded = r.dtype();
      }
    }
    const uint64_t g = r.count();
    pr.groups.resize(g);
    for (auto& cg : pr.groups) {
      cg.recv_bytes = r.u64();
      const uint64_t nr = r.count(4);
      cg.reads.resize(nr);
      for (auto& rd : cg.reads) {
        rd.producer = u32(r.u64());
        rd.offset = r.u64();
        rd.length = r.u64();
        rd.recv_offset = r.u64();
      }
      const uint64_t nu = r.count(4);
      cg.unpacks.resize(nu);
      for (auto& op : cg.unpacks) {
        op.param = u32(r.u64());
        op.src_dtype = r.dtype();
        op.offset = r.u64();
        op.dst = r.layout();
      }
      if (elided) {
        cg.elided_unpacks = r.u64();
        cg.elided_digest = r.fixed64();
      }
      if (!r.ok()) break;
    }
    if (!r.ok()) break;
  }
  const uint64_t nc = r.ok() ? r.count() : 0;
  out.consumer_plan.resize(nc);
  for (auto& c : out.consumer_plan) c = u32(r.u64());
  if (!r.ok()) return corrupt("routes: truncated or malformed encoding");
  if (r.left() != 0) return corrupt("routes: {} trailing bytes after the encoding", r.left());
  FERRY_RETURN_IF_ERROR(out.validate().with_context("routes"));
  return out;
}

uint64_t Routes::hash() const {
  const std::string e = encode();
  return XXH64(e.data(), e.size(), 0);
}

uint64_t Routes::fingerprint() const {
  // Everything but the ops as encode() writes it, a group at a time into one streaming
  // hash; each group's ops as their count and digest.
  XXH64_state_t state;
  XXH64_reset(&state, 0);
  auto flush = [&](Writer& w) {
    const std::string b = w.take();
    XXH64_update(&state, b.data(), b.size());
    w = Writer();
  };
  Writer w;
  w.raw(kMagic, 4);
  write_routes(
      w, *this, has_quant(*this),
      [&](Writer& out, const ProducerGroup& g) {
        const auto [n, d] = route_detail::group_digest(g);
        out.u64(n);
        out.fixed64(d);
        flush(out);
      },
      [&](Writer& out, const PlanGroup& g) {
        uint64_t d = 0;
        for (const UnpackOp& op : g.unpacks) d = route_detail::digest_op(d, op);
        out.u64(g.elided_unpacks ? g.elided_unpacks : g.unpacks.size());
        out.fixed64(g.elided_unpacks ? g.elided_digest : d);
        flush(out);
      },
      true);
  flush(w);
  return XXH64_digest(&state);
}

bool Routes::has_packs(size_t producer) const {
  if (producer >= producers.size()) return false;
  for (const ProducerGroup& g : producers[producer].groups)
    if (g.elided_packs) return false;
  return true;
}

bool Routes::has_unpacks(size_t plan) const {
  if (plan >= plans.size()) return false;
  for (const PlanGroup& g : plans[plan].groups)
    if (g.elided_unpacks) return false;
  return true;
}

Status Routes::validate() const {
  const size_t G = group_names.size();
  for (size_t p = 0; p < producers.size(); ++p) {
    const auto& pr = producers[p];
    if (pr.groups.size() != G) return corrupt("producer {} has {} groups, expected {}", p, pr.groups.size(), G);
    for (size_t g = 0; g < G; ++g) {
      const ProducerGroup& pg = pr.groups[g];
      for (const Segment& s : pg.segments) {
        if (s.plan >= plans.size()) return corrupt("producer {} group {}: segment for plan {} of {}", p, g, s.plan, plans.size());
        if (!bytes_within(s.offset, static_cast<int64_t>(s.bytes), 1, pg.staging_bytes)) {
          return out_of_range("producer {} group {}: segment at {} (+{}) outside staging of {} bytes", p, g, s.offset,
                              s.bytes, pg.staging_bytes);
        }
      }
      if (pg.elided_packs && (!pg.packs.empty() || !pg.quants.empty())) {
        return corrupt("producer {} group {}: {} packs, {} quant ops and {} elided ones", p, g, pg.packs.size(),
                       pg.quants.size(), pg.elided_packs);
      }
      for (const PackOp& op : pg.packs) {
        int64_t n, lo, hi;
        if (!layout_range(op.src, n, lo, hi) || lo < 0) {
          return corrupt("producer {} group {}: malformed pack layout {}", p, g, op.src.to_string());
        }
        if (!bytes_within(op.offset, n, dtype_size(op.dtype), pg.staging_bytes)) {
          return out_of_range("producer {} group {}: pack at {} ({} elements) outside staging of {} bytes", p, g,
                              op.offset, n, pg.staging_bytes);
        }
      }
      for (const QuantOp& q : pg.quants) {
        int64_t rn = 1;
        bool bad = q.region.size() != 3 || q.block == 0 || q.format > 2 || !is_floating(q.dtype);
        for (int64_t x : q.region) bad |= x <= 0 || x > (int64_t{1} << 40) || __builtin_mul_overflow(rn, x, &rn);
        if (bad || rn > (int64_t{1} << 40)) {
          return corrupt("producer {} group {}: malformed quant op (region {}, block {}, format {})", p, g,
                         shape_str(q.region), q.block, q.format);
        }
        if (!bytes_within(q.offset, static_cast<int64_t>(q.bytes()), 1, pg.staging_bytes)) {
          return out_of_range("producer {} group {}: quant op at {} ({} bytes) outside staging of {} bytes", p, g,
                              q.offset, q.bytes(), pg.staging_bytes);
        }
        int64_t filled = 0;
        for (const FillOp& f : q.fills) {
          int64_t n, lo, hi, dn, dlo, dhi;
          if (!layout_range(f.src, n, lo, hi) || lo < 0 || !layout_range(f.dst, dn, dlo, dhi) ||
              f.src.shape != f.dst.shape || (dn > 0 && (dlo < 0 || dhi >= rn)) ||
              __builtin_add_overflow(filled, dn, &filled)) {
            return corrupt("producer {} group {}: quant op at {}: malformed fill {} -> {}", p, g, q.offset,
                           f.src.to_string(), f.dst.to_string());
          }
        }
        if (filled != rn) {
          return corrupt("producer {} group {}: quant op at {} fills {} of its region's {} elements", p, g, q.offset,
                         filled, rn);
        }
      }
    }
  }
  for (size_t k = 0; k < plans.size(); ++k) {
    const PlanRoute& pr = plans[k];
    if (pr.groups.size() != G) return corrupt("plan {} has {} groups, expected {}", k, pr.groups.size(), G);
    std::vector<int64_t> numel(pr.params.size());
    for (size_t i = 0; i < pr.params.size(); ++i) {
      int64_t n = 1;
      for (int64_t s : pr.params[i].shape) {
        if (s < 0 || (s != 0 && __builtin_mul_overflow(n, s, &n))) return corrupt("plan {}: param {} has a bad shape", k, i);
      }
      numel[i] = n;
    }
    for (size_t g = 0; g < G; ++g) {
      const PlanGroup& cg = pr.groups[g];
      for (const Read& rd : cg.reads) {
        if (rd.producer >= producers.size()) {
          return corrupt("plan {} group {}: read from producer {} of {}", k, g, rd.producer, producers.size());
        }
        if (!bytes_within(rd.offset, static_cast<int64_t>(rd.length), 1, producers[rd.producer].groups[g].staging_bytes)) {
          return out_of_range("plan {} group {}: read of {} bytes at {} outside producer {}'s staging of {} bytes", k, g,
                              rd.length, rd.offset, rd.producer, producers[rd.producer].groups[g].staging_bytes);
        }
        if (!bytes_within(rd.recv_offset, static_cast<int64_t>(rd.length), 1, cg.recv_bytes)) {
          return out_of_range("plan {} group {}: read into {} (+{}) outside the {}-byte receive buffer", k, g,
                              rd.recv_offset, rd.length, cg.recv_bytes);
        }
      }
      if (cg.elided_unpacks && !cg.unpacks.empty()) {
        return corrupt("plan {} group {}: {} unpacks and {} elided ones", k, g, cg.unpacks.size(), cg.elided_unpacks);
      }
      for (const UnpackOp& op : cg.unpacks) {
        if (op.param >= pr.params.size()) return corrupt("plan {} group {}: unpack into param {} of {}", k, g, op.param, pr.params.size());
        int64_t n, lo, hi;
        if (!layout_range(op.dst, n, lo, hi)) return corrupt("plan {} group {}: malformed unpack layout", k, g);
        const TensorDecl& d = pr.params[op.param];
        if (n > 0 && (lo < 0 || hi >= numel[op.param])) {
          return out_of_range("plan {} group {}: unpack {} outside param '{}' {}", k, g, op.dst.to_string(), d.name,
                              shape_str(d.shape));
        }
        if (!bytes_within(op.offset, n, dtype_size(op.src_dtype), cg.recv_bytes)) {
          return out_of_range("plan {} group {}: unpack of '{}' reads past the {}-byte receive buffer", k, g, d.name,
                              cg.recv_bytes);
        }
        if (op.src_dtype != d.dtype && !(is_floating(op.src_dtype) && is_floating(d.dtype))) {
          return invalid_argument("plan {} group {}: can't convert {} into param '{}' of {}", k, g,
                                  dtype_name(op.src_dtype), d.name, dtype_name(d.dtype));
        }
      }
    }
  }
  for (size_t k = 0; k < plans.size(); ++k) {
    const PlanRoute& pr = plans[k];
    for (const QuantizedParam& q : pr.quantized) {
      if (q.param >= pr.params.size() || q.scale >= pr.params.size() || q.param == q.scale || q.format > 2 ||
          q.block == 0 || !is_floating(q.loaded)) {
        return corrupt("plan {}: malformed quantized param {} (scales {})", k, q.param, q.scale);
      }
      const TensorDecl& d = pr.params[q.param];
      const TensorDecl& s = pr.params[q.scale];
      if (d.dtype != DType::kF8E4M3 || d.shape.size() < 2 || s.dtype != route_detail::scale_dtype(q.format) ||
          s.shape != route_detail::scale_shape(d.shape, q.format, q.block)) {
        return corrupt("plan {}: quantized param '{}' is {} {} with scales '{}' {} {}", k, d.name, dtype_name(d.dtype),
                       shape_str(d.shape), s.name, dtype_name(s.dtype), shape_str(s.shape));
      }
    }
  }
  for (size_t c = 0; c < consumer_plan.size(); ++c) {
    if (consumer_plan[c] >= plans.size()) return corrupt("consumer {} has plan {} of {}", c, consumer_plan[c], plans.size());
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// Executors

namespace {

// Copies the elements `sel` selects — a layout over the row-major index space of a box
// of shape `box` — from a view of that box with strides `strides` whose element 0 is at
// `src` (a trainer's own tensor: a row range of a fused weight, a column range, ...),
// into `dst`, contiguous, converted from `dt` to `out_dt`. Runs of `sel` are cut at the
// box's rows and each piece is copied as one strided run of the view (a memcpy when its
// rows are contiguous and nothing converts).
void gather_from_view(const std::byte* src, const Shape& strides, const Shape& box, Layout sel, DType dt,
                      DType out_dt, std::byte* dst) {
  const uint64_t es = dtype_size(dt), out_es = dtype_size(out_dt);
  if (sel.numel() == 0) return;
  if (box.empty()) {  // 0-d: one element
    strided_copy(src, Layout{{1}, {1}, 0}, dt, dst, Layout{{1}, {1}, 0}, out_dt);
    return;
  }
  const Shape box_strides = contiguous_strides(box);
  const int64_t row = box.back();
  const int64_t row_stride = strides.back();
  auto memory_of = [&](int64_t flat) {
    int64_t m = 0;
    for (size_t k = 0; k < box.size(); ++k) {
      const int64_t i = flat / box_strides[k];
      flat -= i * box_strides[k];
      m += i * strides[k];
    }
    return m;
  };
  coalesce_layout(sel);
  const size_t nd = sel.shape.size();
  const int64_t inner = nd ? sel.shape.back() : 1;
  const int64_t inner_stride = nd ? sel.strides.back() : 1;
  Shape idx(nd > 0 ? nd - 1 : 0, 0);
  for (;;) {
    int64_t f = sel.offset;
    for (size_t k = 0; k + 1 < nd; ++k) f += idx[k] * sel.strides[k];
    if (inner_stride == 1) {
      for (int64_t n = inner; n > 0;) {
        const int64_t len = std::min(n, row - f % row);
        strided_copy(src, Layout{{len}, {row_stride}, memory_of(f)}, dt, dst, Layout{{len}, {1}, 0}, out_dt);
        dst += static_cast<uint64_t>(len) * out_es;
        f += len;
        n -= len;
      }
    } else {
      for (int64_t j = 0; j < inner; ++j, dst += out_es) {
        const std::byte* at = src + memory_of(f + j * inner_stride) * static_cast<int64_t>(es);
        if (out_dt == dt) {
          std::memcpy(dst, at, es);
        } else {
          strided_copy(at, Layout{{1}, {1}, 0}, dt, dst, Layout{{1}, {1}, 0}, out_dt);
        }
      }
    }
    size_t k = idx.size();
    while (k > 0 && ++idx[k - 1] == sel.shape[k - 1]) idx[--k] = 0;
    if (k == 0) return;
  }
}

// The materialized tensor of held box `box` (`by_box`: LocalBox::box -> its data): a real
// tensor of the box's shape and its tensor's dtype, else an error naming the tensor.
Result<const Tensor*> box_tensor(const std::unordered_map<uint32_t, const Tensor*>& by_box, const Holdings& holdings,
                                 uint32_t box, uint32_t producer, int group) {
  if (box >= holdings.boxes.size()) return out_of_range("pack: box {} of {} held", box, holdings.boxes.size());
  const HeldBox& hb = holdings.boxes[box];
  const TensorDecl& d = holdings.tensors[hb.tensor];
  auto it = by_box.find(box);
  if (it == by_box.end()) {
    return not_found("pack: producer {} group {}: box {} of tensor '{}' was not materialized", producer, group,
                     hb.box.to_string(), d.name);
  }
  const Tensor& t = *it->second;
  if (!t.is_real() || t.shape() != hb.box.size || t.dtype() != d.dtype) {
    return invalid_argument("pack: tensor '{}' box {}: materialized {} but the routes need a real {} {}", d.name,
                            hb.box.to_string(), t.describe(), dtype_name(d.dtype), shape_str(hb.box.size));
  }
  return &t;
}

}  // namespace

Status pack_group(const Routes& routes, uint32_t producer, int group, const Holdings& holdings,
                  const std::vector<LocalBox>& boxes, std::span<std::byte> staging) {
  if (producer >= routes.producers.size()) return out_of_range("pack: producer {} of {}", producer, routes.producers.size());
  if (group < 0 || group >= routes.num_groups()) return out_of_range("pack: group {} of {}", group, routes.num_groups());
  return pack_group(routes.producers[producer].groups[static_cast<size_t>(group)], producer, group, holdings, boxes,
                    staging);
}

Status pack_group(const ProducerGroup& pg, uint32_t producer, int group, const Holdings& holdings,
                  const std::vector<LocalBox>& boxes, std::span<std::byte> staging) {
  FERRY_RETURN_IF_ERROR(pack_group_packs(pg, producer, group, holdings, boxes, staging));
  return quantize_group(pg, producer, group, holdings, boxes, staging);
}

Status pack_group_packs(const ProducerGroup& pg, uint32_t producer, int group, const Holdings& holdings,
                        const std::vector<LocalBox>& boxes, std::span<std::byte> staging) {
  if (staging.size() < pg.staging_bytes) {
    return out_of_range("pack: producer {} group {} needs {} staging bytes, got {}", producer, group, pg.staging_bytes,
                        staging.size());
  }
  std::unordered_map<uint32_t, const Tensor*> by_box;
  for (const LocalBox& lb : boxes) by_box[lb.box] = &lb.data;
  std::optional<Device> on_device;  // boxes in GPU memory: packed in one batch there
  std::vector<StridedCopy> device_packs;
  for (const PackOp& op : pg.packs) {
    FERRY_ASSIGN_OR_RETURN(const Tensor* held, box_tensor(by_box, holdings, op.box, producer, group));
    const Tensor& t = *held;
    const HeldBox& hb = holdings.boxes[op.box];
    const TensorDecl& d = holdings.tensors[hb.tensor];
    // Staging holds the box's dtype, or a float dtype the pack converts to (the router's
    // convert_on); anything else is routes built over other metadata.
    if (op.dtype != d.dtype && !(is_floating(op.dtype) && is_floating(d.dtype))) {
      return invalid_argument("pack: tensor '{}' is {}; can't pack it as {}", d.name, dtype_name(d.dtype),
                              dtype_name(op.dtype));
    }
    int64_t n, lo, hi;
    if (!layout_range(op.src, n, lo, hi) || (n > 0 && (lo < 0 || hi >= t.numel()))) {
      return out_of_range("pack: layout {} outside box {} of tensor '{}'", op.src.to_string(), hb.box.to_string(), d.name);
    }
    if (!bytes_within(op.offset, n, dtype_size(op.dtype), staging.size())) {
      return out_of_range("pack: tensor '{}' at {} overflows staging", d.name, op.offset);
    }
    if (!t.device().is_host()) {
      // In GPU memory: packed by a kernel with the others of this group, below.
      if (!t.is_contiguous()) {
        return invalid_argument("pack: tensor '{}' box {} is a strided view in {} memory; materialize it contiguous",
                                d.name, hb.box.to_string(), device_str(t.device()));
      }
      if (on_device && t.device() != *on_device) {
        return invalid_argument("pack: producer {} group {}: boxes on {} and {}; one GPU per rank", producer, group,
                                device_str(*on_device), device_str(t.device()));
      }
      on_device = t.device();
      FERRY_ASSIGN_OR_RETURN(std::byte * dev, t.device_ptr());
      std::optional<DType> from;
      if (op.dtype != d.dtype) from = d.dtype;
      device_packs.push_back({dev, op.src, staging.data() + op.offset, Layout::contiguous(op.src.shape), op.dtype, from});
      continue;
    }
    FERRY_ASSIGN_OR_RETURN(std::byte * src, t.data_ptr());
    if (t.is_contiguous()) {
      strided_copy(src, op.src, d.dtype, staging.data() + op.offset, Layout::contiguous(op.src.shape), op.dtype);
    } else {
      gather_from_view(src, t.strides(), hb.box.size, op.src, d.dtype, op.dtype, staging.data() + op.offset);
    }
  }
  if (!device_packs.empty()) {
    Status st = copy_batch(*on_device, device_packs);
    if (!st.ok()) return st.with_context(fmt::format("pack: producer {} group {} on {}", producer, group, device_str(*on_device)));
  }
  return Status::Ok();
}


Status quantize_group(const ProducerGroup& pg, uint32_t producer, int group, const Holdings& holdings,
                      const std::vector<LocalBox>& boxes, std::span<std::byte> staging) {
  if (pg.quants.empty()) return Status::Ok();
  std::unordered_map<uint32_t, const Tensor*> by_box;
  for (const LocalBox& lb : boxes) by_box[lb.box] = &lb.data;
  std::unordered_map<uint32_t, std::vector<std::byte>> on_host;  // GPU boxes, copied once each
  // Regions this producer quantises: filled in the param's dtype, with the conversion a
  // consumer's unpack would run, then quantised by the code the consumer's hook runs.
  std::vector<std::byte> scratch, gathered;
  std::shared_ptr<std::byte> on_device;  // device scratch: the region, then its values and scales
  size_t on_device_bytes = 0;
  for (const QuantOp& q : pg.quants) {
    if (q.region.size() != 3 || !bytes_within(q.offset, static_cast<int64_t>(q.bytes()), 1, staging.size())) {
      return out_of_range("pack: producer {} group {}: quant op at {} overflows staging", producer, group, q.offset);
    }
    const uint64_t numel = q.numel();
    // A fill's box, checked: a real float tensor, the fill inside it and inside the region.
    auto checked_fill = [&](const FillOp& f) -> Result<const Tensor*> {
      FERRY_ASSIGN_OR_RETURN(const Tensor* held, box_tensor(by_box, holdings, f.box, producer, group));
      const HeldBox& hb = holdings.boxes[f.box];
      const TensorDecl& d = holdings.tensors[hb.tensor];
      if (!is_floating(d.dtype)) return invalid_argument("pack: tensor '{}' is {}; can't quantise it", d.name, dtype_name(d.dtype));
      int64_t n, lo, hi, dn, dlo, dhi;
      if (!layout_range(f.src, n, lo, hi) || (n > 0 && (lo < 0 || hi >= held->numel())) ||
          !layout_range(f.dst, dn, dlo, dhi) || dn != n || (n > 0 && (dlo < 0 || static_cast<uint64_t>(dhi) >= numel))) {
        return out_of_range("pack: quant fill {} -> {} outside box {} of tensor '{}' or its region {}",
                            f.src.to_string(), f.dst.to_string(), hb.box.to_string(), d.name, shape_str(q.region));
      }
      return held;
    };
    // Every box of the region in one GPU's memory (contiguous): filled by one copy kernel
    // and quantised by the device kernel (the host's arithmetic: fp8_blocks.h) into device
    // scratch, then copied into staging.
    std::optional<Device> gpu;
    bool all_gpu = !q.fills.empty();
    for (const FillOp& f : q.fills) {
      auto it = by_box.find(f.box);
      const Tensor* t = it == by_box.end() ? nullptr : it->second;
      if (!t || !t->device().is_cuda() || !t->is_contiguous() || (gpu && t->device() != *gpu)) {
        all_gpu = false;
        break;
      }
      gpu = t->device();
    }
    if (all_gpu) {
      // [region][values][scales], each 256-byte aligned (the kernels' stores stay aligned).
      auto aligned = [](size_t b) { return (b + 255) / 256 * 256; };
      const size_t region_bytes = numel * dtype_size(q.dtype), scale_bytes = q.bytes() - numel;
      const size_t need = aligned(region_bytes) + aligned(numel) + scale_bytes;
      if (need > on_device_bytes) {
        FERRY_ASSIGN_OR_RETURN(on_device, device_alloc(*gpu, need));
        on_device_bytes = need;
      }
      std::byte* region = on_device.get();
      std::byte* values = region + aligned(region_bytes);
      std::byte* scales = values + aligned(numel);
      std::vector<StridedCopy> fills;
      for (const FillOp& f : q.fills) {
        FERRY_ASSIGN_OR_RETURN(const Tensor* held, checked_fill(f));
        const TensorDecl& d = holdings.tensors[holdings.boxes[f.box].tensor];
        FERRY_ASSIGN_OR_RETURN(std::byte * dev, held->device_ptr());
        std::optional<DType> from;
        if (d.dtype != q.dtype) from = d.dtype;
        fills.push_back({dev, f.src, region, f.dst, q.dtype, from});
      }
      Status st = copy_batch(*gpu, fills);
      if (st.ok()) {
        st = fp8_block_quantize(*gpu, region, q.dtype, q.region[0], q.region[1], q.region[2], q.block, values,
                                scales, nullptr, static_cast<Fp8Scales>(q.format));
      }
      if (st.ok()) st = device_memcpy(staging.data() + q.offset, values, numel);
      if (st.ok()) st = device_memcpy(staging.data() + q.offset + numel, scales, scale_bytes);
      if (!st.ok()) {
        return st.with_context(fmt::format("pack: producer {} group {}: quantising a region on {}", producer, group,
                                           device_str(*gpu)));
      }
      continue;
    }
    scratch.assign(numel * dtype_size(q.dtype), std::byte{0});
    for (const FillOp& f : q.fills) {
      FERRY_ASSIGN_OR_RETURN(const Tensor* held, checked_fill(f));
      const Tensor& t = *held;
      const HeldBox& hb = holdings.boxes[f.box];
      const TensorDecl& d = holdings.tensors[hb.tensor];
      const std::byte* src = nullptr;
      if (!t.device().is_host()) {
        // In GPU memory beside boxes elsewhere (a region fed from host and device): quantised
        // on the host from a copy of the box.
        if (!t.is_contiguous()) {
          return invalid_argument("pack: tensor '{}' box {} is a strided view in {} memory; materialize it contiguous",
                                  d.name, hb.box.to_string(), device_str(t.device()));
        }
        auto [at, fresh] = on_host.try_emplace(f.box);
        if (fresh) {
          at->second.resize(static_cast<size_t>(t.numel()) * dtype_size(d.dtype));
          FERRY_ASSIGN_OR_RETURN(std::byte * dev, t.device_ptr());
          Status st = device_memcpy(at->second.data(), dev, at->second.size());
          if (!st.ok()) return st.with_context(fmt::format("pack: copying '{}' from {} to quantise it", d.name, device_str(t.device())));
        }
        src = at->second.data();
      } else {
        FERRY_ASSIGN_OR_RETURN(std::byte * host, t.data_ptr());
        src = host;
      }
      if (!t.device().is_host() || t.is_contiguous()) {
        strided_copy(src, f.src, d.dtype, scratch.data(), f.dst, q.dtype);
      } else {
        gathered.resize(static_cast<size_t>(f.src.numel()) * dtype_size(q.dtype));
        gather_from_view(src, t.strides(), hb.box.size, f.src, d.dtype, q.dtype, gathered.data());
        strided_copy(gathered.data(), Layout::contiguous(f.src.shape), q.dtype, scratch.data(), f.dst, q.dtype);
      }
    }
    std::byte* values = staging.data() + q.offset;
    Status st = fp8_block_quantize(Device::host(), scratch.data(), q.dtype, q.region[0], q.region[1], q.region[2],
                                   q.block, values, values + numel, nullptr, static_cast<Fp8Scales>(q.format));
    if (!st.ok()) return st.with_context(fmt::format("pack: producer {} group {}: quantising a region", producer, group));
  }
  return Status::Ok();
}

namespace {

// An unpack op checked against its plan and a receive buffer of `recv_bytes` (`what`:
// "unpack" or "gather", naming the caller in errors): its param, its destination inside
// that param, its bytes inside the buffer. Its element count.
Result<int64_t> checked_unpack(const char* what, const PlanRoute& plan, const UnpackOp& op, uint64_t recv_bytes) {
  if (op.param >= plan.params.size()) return out_of_range("{}: param {} of {}", what, op.param, plan.params.size());
  const TensorDecl& d = plan.params[op.param];
  int64_t n, lo, hi;
  if (!layout_range(op.dst, n, lo, hi) || (n > 0 && (lo < 0 || hi >= shape_numel(d.shape)))) {
    return out_of_range("{}: layout {} outside param '{}' {}", what, op.dst.to_string(), d.name, shape_str(d.shape));
  }
  if (!bytes_within(op.offset, n, dtype_size(op.src_dtype), recv_bytes)) {
    return out_of_range("{}: param '{}' lies past the receive buffer", what, d.name);
  }
  return n;
}

// The caller's tensor for plan param `d`: present, real, contiguous, of its dtype and shape.
Result<const Tensor*> plan_param(const char* what, const TensorMap& params, const TensorDecl& d) {
  auto it = params.find(d.name);
  if (it == params.end()) return not_found("{}: param '{}' is missing", what, d.name);
  const Tensor& t = it->second;
  if (!t.is_real() || !t.is_contiguous() || t.shape() != d.shape || t.dtype() != d.dtype) {
    return invalid_argument("{}: param '{}' is {}, the plan declares a contiguous {} {}", what, d.name, t.describe(),
                            dtype_name(d.dtype), shape_str(d.shape));
  }
  return &t;
}

}  // namespace

Status unpack_group(const PlanRoute& plan, int group, std::span<const std::byte> recv, const TensorMap& params) {
  if (group < 0 || static_cast<size_t>(group) >= plan.groups.size()) {
    return out_of_range("unpack: group {} of {}", group, plan.groups.size());
  }
  const PlanGroup& cg = plan.groups[static_cast<size_t>(group)];
  if (recv.size() < cg.recv_bytes) {
    return out_of_range("unpack: group {} needs {} received bytes, got {}", group, cg.recv_bytes, recv.size());
  }
  std::vector<std::byte*> base(plan.params.size(), nullptr);
  std::vector<Device> where(plan.params.size());
  std::optional<Device> on_device;  // params in GPU memory: unpacked in one batch there
  std::vector<StridedCopy> device_unpacks;
  for (const UnpackOp& op : cg.unpacks) {
    FERRY_RETURN_IF_ERROR(checked_unpack("unpack", plan, op, recv.size()).status());
    const TensorDecl& d = plan.params[op.param];
    if (!base[op.param]) {
      FERRY_ASSIGN_OR_RETURN(const Tensor* tp, plan_param("unpack", params, d));
      const Tensor& t = *tp;
      if (!t.device().is_host()) {
        if (on_device && t.device() != *on_device) {
          return invalid_argument("unpack: group {}: params on {} and {}; one GPU per rank", group,
                                  device_str(*on_device), device_str(t.device()));
        }
        on_device = t.device();
      }
      where[op.param] = t.device();
      FERRY_ASSIGN_OR_RETURN(base[op.param], t.device_ptr());
    }
    if (!where[op.param].is_host()) {
      // A dtype conversion (float dtypes) runs in the unpack kernel, as strided_copy would.
      std::optional<DType> from;
      if (op.src_dtype != d.dtype) from = op.src_dtype;
      device_unpacks.push_back(
          {recv.data() + op.offset, Layout::contiguous(op.dst.shape), base[op.param], op.dst, d.dtype, from});
      continue;
    }
    strided_copy(recv.data() + op.offset, Layout::contiguous(op.dst.shape), op.src_dtype, base[op.param], op.dst, d.dtype);
  }
  if (!device_unpacks.empty()) {
    Status st = copy_batch(*on_device, device_unpacks);
    if (!st.ok()) return st.with_context(fmt::format("unpack: group {} on {}", group, device_str(*on_device)));
  }
  return Status::Ok();
}

Status gather_group(const PlanRoute& plan, int group, uint64_t lo, uint64_t hi, const TensorMap& params,
                    std::span<std::byte> recv) {
  if (group < 0 || static_cast<size_t>(group) >= plan.groups.size()) {
    return out_of_range("gather: group {} of {}", group, plan.groups.size());
  }
  const PlanGroup& cg = plan.groups[static_cast<size_t>(group)];
  if (lo > hi || hi > cg.recv_bytes || recv.size() < cg.recv_bytes) {
    return out_of_range("gather: bytes [{}, {}) of group {} ({} received bytes, a buffer of {})", lo, hi, group,
                        cg.recv_bytes, recv.size());
  }
  for (const UnpackOp& op : cg.unpacks) {
    FERRY_ASSIGN_OR_RETURN(const int64_t n, checked_unpack("gather", plan, op, recv.size()));
    const TensorDecl& d = plan.params[op.param];
    const uint64_t end = op.offset + static_cast<uint64_t>(n) * dtype_size(op.src_dtype);
    if (end <= lo || op.offset >= hi) continue;  // another producer's bytes
    if (op.offset < lo || end > hi) {
      return invalid_argument("gather: param '{}' bytes [{}, {}) straddle [{}, {})", d.name, op.offset, end, lo, hi);
    }
    FERRY_ASSIGN_OR_RETURN(const Tensor* tp, plan_param("gather", params, d));
    const Tensor& t = *tp;
    if (!t.device().is_host()) return invalid_argument("gather: param '{}' is on {}: host params only", d.name, device_str(t.device()));
    FERRY_ASSIGN_OR_RETURN(std::byte * b, t.device_ptr());
    strided_copy(b, op.dst, d.dtype, recv.data() + op.offset, Layout::contiguous(op.dst.shape), op.src_dtype);
  }
  return Status::Ok();
}

}  // namespace ferry

// Routes: the wire format (encoding, bounds-checked decoding, validation, hashing). What
// runs the routes' packs, quantisation and unpacks is route/execute.cpp.
#include <algorithm>
#include <cstring>
#include <optional>
#include <unordered_map>
#include <vector>

#define XXH_STATIC_LINKING_ONLY  // XXH64_state_t on the stack
#include <xxhash.h>

#include "ferry/device.h"
#include "ferry/route.h"
#include "route/bounds.h"
#include "route/op_digest.h"
#include "route/tiles.h"

namespace ferry {

using route_bounds::bytes_within;
using route_bounds::layout_range;

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

}  // namespace ferry

// build_routes' building blocks (route/router_parts.h): a tensor's disjoint pieces from
// its holders' boxes, layouts re-expressed along a source's dims or over a holder's box,
// op merging, and the regions a producer quantises.
#include <algorithm>
#include <array>
#include <numeric>

#include "common/parallel.h"
#include "route/router_parts.h"

namespace ferry::route_detail {

namespace {

int64_t flat_of(const Shape& idx, const Shape& strides) {
  int64_t f = 0;
  for (size_t k = 0; k < idx.size(); ++k) f += idx[k] * strides[k];
  return f;
}

Shape unravel(int64_t p, const Shape& radix) {
  Shape q(radix.size());
  for (size_t j = radix.size(); j-- > 0;) {
    q[j] = p % radix[j];
    p /= radix[j];
  }
  return q;
}

bool is_run(const Layout& l) { return l.ndim() == 1 && (l.strides[0] == 1 || l.shape[0] == 1); }

bool is_scalar_like(const Layout& l) { return l.numel() == 1; }

// The producers holding a tensor piece, sorted.
std::vector<uint32_t> producers_of(const TensorInfo& ti, const TensorPiece& piece) {
  std::vector<uint32_t> out;
  out.reserve(piece.holders.size());
  for (uint32_t h : piece.holders) out.push_back(ti.holders[h].producer);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace

int router_threads(const RouterOptions& options) {
  if (options.threads > 0) return options.threads;
  return default_threads(16);
}

// Re-expresses dims of a copy's src layout along the source's own dims where a dim runs
// over whole rows of the source (stride = a dim's row-major stride, size a multiple of
// that dim), so that compose_layout cuts by rows instead of row by row. Exact for any
// choice (a dim of size n = a*b and stride s is the pair [a, b] with strides [s*b, s]);
// src and dst are split alike.
void unflatten(Layout& src, Layout& dst, const Shape& radix) {
  if (radix.size() < 2) return;
  const Shape P = contiguous_strides(radix);
  Layout s2{{}, {}, src.offset}, d2{{}, {}, dst.offset};
  for (size_t k = 0; k < src.shape.size(); ++k) {
    int64_t n = src.shape[k], ss = src.strides[k], ds = dst.strides[k];
    std::vector<std::array<int64_t, 3>> inner;  // innermost first
    while (true) {
      int j = -1;
      for (size_t q = radix.size(); q-- > 1;) {
        if (P[q] == ss && radix[q] > 1) {
          j = static_cast<int>(q);
          break;
        }
      }
      if (j < 1) break;
      const int64_t r = radix[static_cast<size_t>(j)];
      if (n <= r || n % r != 0 || (src.offset / P[static_cast<size_t>(j)]) % r != 0) break;
      inner.push_back({r, ss, ds});
      n /= r;
      ss *= r;
      ds *= r;
    }
    s2.shape.push_back(n);
    s2.strides.push_back(ss);
    d2.shape.push_back(n);
    d2.strides.push_back(ds);
    for (size_t i = inner.size(); i-- > 0;) {
      s2.shape.push_back(inner[i][0]);
      s2.strides.push_back(inner[i][1]);
      d2.shape.push_back(inner[i][0]);
      d2.strides.push_back(inner[i][2]);
    }
  }
  src = std::move(s2);
  dst = std::move(d2);
}

// A layout over a piece's local row-major space, re-expressed over a holder box that
// contains the piece (every element it touches lies in the piece).
Layout rebase(const Layout& l, const Box& piece, const Box& holder) {
  const Shape& ps = piece.size;
  const Shape hs = contiguous_strides(holder.size);
  auto to_holder = [&](const Shape& q) {
    int64_t f = 0;
    for (size_t j = 0; j < q.size(); ++j) f += (q[j] + piece.start[j] - holder.start[j]) * hs[j];
    return f;
  };
  Layout out;
  out.shape = l.shape;
  out.strides.assign(l.shape.size(), 0);
  if (ps.empty()) {  // 0-d
    out.offset = 0;
    return out;
  }
  const Shape q0 = unravel(l.offset, ps);
  out.offset = to_holder(q0);
  for (size_t k = 0; k < l.shape.size(); ++k) {
    if (l.shape[k] <= 1) continue;
    const Shape q1 = unravel(l.offset + l.strides[k], ps);
    out.strides[k] = to_holder(q1) - out.offset;
  }
  return out;
}

// Merges `op` into `p` where both are contiguous runs that continue each other on both
// sides (the staging or receive bytes and the box or param); true if it did.
bool merge_op(PackOp& p, const PackOp& op, uint64_t es) {
  if (p.box == op.box && p.dtype == op.dtype && (is_run(p.src) || is_scalar_like(p.src)) &&
      (is_run(op.src) || is_scalar_like(op.src)) && p.src.numel() > 0) {
    const int64_t pn = p.src.numel();
    if (p.src.offset + pn == op.src.offset && p.offset + static_cast<uint64_t>(pn) * es == op.offset) {
      p.src = Layout{{pn + op.src.numel()}, {1}, p.src.offset};
      return true;
    }
  }
  return false;
}

bool merge_op(UnpackOp& p, const UnpackOp& op, uint64_t es) {
  if (p.param == op.param && p.src_dtype == op.src_dtype && (is_run(p.dst) || is_scalar_like(p.dst)) &&
      (is_run(op.dst) || is_scalar_like(op.dst)) && p.dst.numel() > 0) {
    const int64_t pn = p.dst.numel();
    if (p.dst.offset + pn == op.dst.offset && p.offset + static_cast<uint64_t>(pn) * es == op.offset) {
      p.dst = Layout{{pn + op.dst.numel()}, {1}, p.dst.offset};
      return true;
    }
  }
  return false;
}

// The dtype a piece crosses the wire in: the param's where the producer converts (both
// floating, the param's elements narrower: fp32 masters kept as bf16 send half the
// bytes), else the source's. Either side converts with the same strided_copy, so the
// bits are the same wherever it runs.
DType wire_dtype(DType source, DType param, const RouterOptions& options) {
  if (options.convert_on == ConvertOn::kProducer && source != param && is_floating(source) && is_floating(param) &&
      dtype_size(param) < dtype_size(source))
    return param;
  return source;
}

bool same_decl(const TensorDecl& a, const TensorDecl& b) { return a.dtype == b.dtype && a.shape == b.shape; }

std::string decl_str(const TensorDecl& d) { return fmt::format("{} {}", dtype_name(d.dtype), shape_str(d.shape)); }

// Producer-side quantisation of one plan class (RouterOptions::quantize_on): for each
// param the plan keeps block-quantised whose every tile some producer holds whole, its
// cuts are replaced by regions (tile-aligned boxes each one producer set holds) and the
// class's route gets the param as e4m3 plus its scales. The rest stay dense, for the
// consumer to quantise.
void quantize_class(const Plan& plan, uint64_t weight, const std::vector<TensorInfo>& tensors,
                    ClassCuts& out, PlanRoute& route) {
  std::vector<std::vector<size_t>> cuts_of(plan.params().size());
  for (size_t j = 0; j < out.cuts.size(); ++j) cuts_of[out.cuts[j].param].push_back(j);
  std::vector<bool> padded(plan.params().size(), false);
  for (const Zero& z : plan.zeros()) padded[z.param] = true;
  std::vector<bool> dropped(out.cuts.size(), false);
  std::vector<Cut> region_cuts;
  for (const BlockQuantize& bq : plan.quantized()) {
    ++out.quantized;
    const TensorDecl& d = plan.params()[bq.param];
    const std::vector<size_t>& mine = cuts_of[bq.param];
    if (mine.empty() || padded[bq.param]) continue;
    bool ok = true;
    for (size_t j : mine) ok &= out.cuts[j].group == out.cuts[mine[0]].group;
    if (!ok) continue;
    // Each tile: the producers that hold every element of it (interned sets).
    const int64_t trows = batch::fp8_tile_rows(bq.format, bq.block);
    TileGrid grid(d.shape, trows, bq.block);
    std::vector<std::vector<uint32_t>> sets;
    std::map<std::vector<uint32_t>, int32_t> set_id;
    std::map<std::pair<int32_t, int32_t>, int32_t> meets;
    auto intern = [&](std::vector<uint32_t> s) {
      auto [it, fresh] = set_id.emplace(s, static_cast<int32_t>(sets.size()));
      if (fresh) sets.push_back(std::move(s));
      return it->second;
    };
    auto meet = [&](int32_t a, int32_t b) {
      const auto key = std::minmax(a, b);
      auto it = meets.find(key);
      if (it != meets.end()) return it->second;
      std::vector<uint32_t> both;
      std::set_intersection(sets[a].begin(), sets[a].end(), sets[b].begin(), sets[b].end(), std::back_inserter(both));
      const int32_t id = intern(std::move(both));
      meets.emplace(key, id);
      return id;
    };
    struct TileBox {
      int64_t b0 = INT64_MAX, b1 = -1, r0 = INT64_MAX, r1 = -1, c0 = INT64_MAX, c1 = -1;
    };
    std::vector<TileBox> bounds(mine.size());
    for (size_t i = 0; i < mine.size(); ++i) {
      const Cut& c = out.cuts[mine[i]];
      const TensorInfo& ti = tensors[c.tensor];
      const int32_t id = intern(producers_of(ti, ti.pieces[c.piece]));
      TileBox& tb = bounds[i];
      mark_layout(grid, out.pool.dst(c.layouts),
                                [&](int32_t& t, int64_t b, int64_t br, int64_t bc0, int64_t bc1) {
                                  t = t == TileGrid::kNone ? id : (t == id ? id : meet(t, id));
                                  tb.b0 = std::min(tb.b0, b), tb.b1 = std::max(tb.b1, b);
                                  tb.r0 = std::min(tb.r0, br), tb.r1 = std::max(tb.r1, br);
                                  tb.c0 = std::min(tb.c0, bc0), tb.c1 = std::max(tb.c1, bc1 - 1);
                                });
    }
    for (int64_t b = 0; b < grid.batch() && ok; ++b)
      for (int64_t br = 0; br < grid.tile_rows() && ok; ++br)
        for (const TileGrid::Run& run : grid.runs(b, br))
          ok &= run.id >= 0 && !sets[static_cast<size_t>(run.id)].empty();
    if (!ok) continue;
    ++out.on_producer;
    // The param becomes e4m3 in this class's route; its scales are appended.
    const uint32_t scale = static_cast<uint32_t>(route.params.size());
    route.params[bq.param].dtype = DType::kF8E4M3;
    route.params.push_back(TensorDecl{bq.scale_name, scale_dtype(bq.format),
                                      scale_shape(d.shape, bq.format, bq.block)});
    route.quantized.push_back(QuantizedParam{bq.param, scale, bq.format, bq.block, d.dtype});
    const Cut& first = out.cuts[mine[0]];
    for (size_t j : mine) {
      dropped[j] = true;
      out.bytes -= out.cuts[j].bytes;
    }
    const uint32_t qbase = static_cast<uint32_t>(out.quant_cuts.size());
    for (size_t j : mine) out.quant_cuts.push_back(out.cuts[j]);
    for (const TileRegion& box : tile_regions(grid, kMaxQuantRegionElements)) {
      QuantRegion qr;
      qr.box = box;
      qr.param = bq.param;
      qr.scale = scale;
      qr.batch = grid.batch();
      qr.rows = grid.rows();
      qr.cols = grid.cols();
      qr.dtype = d.dtype;
      qr.format = bq.format;
      qr.block = bq.block;
      qr.producers = sets[static_cast<size_t>(box.id)];
      const int64_t tb0 = box.b0, tb1 = box.b0 + box.nb - 1, tr0 = box.r0 / trows, tr1 = (box.r0 + box.nr - 1) / trows;
      const int64_t tc0 = box.c0 / bq.block, tc1 = (box.c0 + box.nc - 1) / bq.block;
      for (size_t i = 0; i < mine.size(); ++i) {
        const TileBox& tb = bounds[i];
        if (tb.b1 >= tb0 && tb.b0 <= tb1 && tb.r1 >= tr0 && tb.r0 <= tr1 && tb.c1 >= tc0 && tb.c0 <= tc1) {
          qr.cuts.push_back(qbase + static_cast<uint32_t>(i));
        }
      }
      QuantOp probe;  // its byte count
      probe.format = bq.format;
      probe.block = bq.block;
      probe.region = {box.nb, box.nr, box.nc};
      Cut rc = first;
      rc.region = static_cast<int32_t>(out.regions.size());
      rc.wire = DType::kF8E4M3;
      rc.bytes = probe.bytes();
      rc.cost = rc.bytes * weight;
      rc.dst_offset = (box.b0 * grid.rows() + box.r0) * grid.cols() + box.c0;
      rc.layouts = 0;
      out.bytes += rc.bytes;
      region_cuts.push_back(rc);
      out.regions.push_back(std::move(qr));
    }
  }
  if (region_cuts.empty()) return;
  Blocks<Cut> kept;
  for (size_t j = 0; j < out.cuts.size(); ++j)
    if (!dropped[j]) kept.push_back(out.cuts[j]);
  for (const Cut& c : region_cuts) kept.push_back(c);
  out.cuts = std::move(kept);
}

// The quant op of region `r` of class `cc` as producer `p` packs it at staging `offset`:
// each of the param's cuts in the region, from p's box of its piece, into the region.
Result<QuantOp> quant_op(const ClassCuts& cc, const QuantRegion& r, uint32_t p, uint64_t offset,
                         const std::vector<TensorInfo>& tensors) {
  QuantOp op;
  op.offset = offset;
  op.dtype = r.dtype;
  op.format = r.format;
  op.block = r.block;
  op.region = {r.box.nb, r.box.nr, r.box.nc};
  const std::vector<MapPiece> region{
      MapPiece{Shape{r.box.b0, r.box.r0, r.box.c0}, Layout::contiguous(op.region), 0}};
  // A region of whole rows (and whole matrices where it spans several) is a flat range.
  const bool whole_rows = r.box.c0 == 0 && r.box.nc == r.cols && (r.box.nb == 1 || (r.box.r0 == 0 && r.box.nr == r.rows));
  const int64_t region_lo = (r.box.b0 * r.rows + r.box.r0) * r.cols;
  const int64_t region_hi = region_lo + static_cast<int64_t>(r.box.numel());
  for (uint32_t j : r.cuts) {
    const Cut& qc = cc.quant_cuts[j];
    // dst indexes the param's flat space: the param as [batch, rows, cols]. (A cut is a
    // candidate by its tiles' bounding box: it may touch no element of the region.)
    Layout dst = cc.pool.dst(qc.layouts);
    Layout src = cc.pool.src(qc.layouts);
    std::vector<MapPiece> in_region;
    const int64_t lo = dst.min_offset(), hi = dst.max_offset();
    if (dst.numel() > 0 && whole_rows && lo >= region_lo && hi < region_hi) {
      // The cut lies in a region of whole rows: the region's own flat space is the param's,
      // shifted (most cuts: a region is a param's or an expert's whole matrix).
      in_region.push_back(MapPiece{Shape(dst.shape.size(), 0), Layout{dst.shape, dst.strides, dst.offset - region_lo}, 0});
    } else {
      // Runs over whole rows re-expressed along the param's dims first, so that composing
      // cuts them by the region's rows and columns, not row by row.
      unflatten(dst, src, Shape{r.batch, r.rows, r.cols});
      compose_layout_each(dst, Shape{r.batch, r.rows, r.cols}, region, nullptr,
                          [&](const MapPiece& m) { in_region.push_back(m); });
    }
    if (in_region.empty()) continue;
    const TensorInfo& ti = tensors[qc.tensor];
    const TensorPiece& piece = ti.pieces[qc.piece];
    const Holder* holder = nullptr;
    for (uint32_t h : piece.holders) {
      if (ti.holders[h].producer == p) {
        holder = &ti.holders[h];
        break;
      }
    }
    if (!holder) return internal_error("quantising a region: producer {} holds no box of a piece it was given", p);
    if (piece.refined && holder->box != piece.box) src = rebase(src, piece.box, holder->box);
    for (const MapPiece& m : in_region) {
      op.fills.push_back(FillOp{holder->box_index, Layout{m.root.shape, src.strides, src.offset_of(m.start)}, m.root});
    }
  }
  return op;
}

// Builds the disjoint pieces of a tensor from its holders.
Status build_pieces(const TensorDecl& decl, TensorInfo& ti) {
  ti.pieces_built = true;
  auto& hs = ti.holders;
  // Distinct boxes, each with its holders.
  std::vector<uint32_t> order(hs.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    if (hs[a].box != hs[b].box) return hs[a].box < hs[b].box;
    return hs[a].producer < hs[b].producer;
  });
  std::vector<TensorPiece> distinct;
  for (uint32_t i : order) {
    if (distinct.empty() || distinct.back().box != hs[i].box) distinct.push_back(TensorPiece{hs[i].box, {}, false});
    distinct.back().holders.push_back(i);
  }
  // Partial overlaps between distinct boxes? (sorted by start, so a sweep on dim 0).
  bool partial = false;
  for (size_t i = 0; i < distinct.size() && !partial; ++i) {
    for (size_t j = i + 1; j < distinct.size(); ++j) {
      const Box& a = distinct[i].box;
      const Box& b = distinct[j].box;
      if (!a.start.empty() && b.start[0] >= a.start[0] + a.size[0]) break;
      if (a.intersects(b)) {
        partial = true;
        break;
      }
    }
  }
  if (!partial) {
    ti.pieces = std::move(distinct);
  } else {
    // Refine into the grid of every box edge; keep cells some box holds.
    const size_t nd = decl.shape.size();
    std::vector<std::vector<int64_t>> cuts(nd);
    for (const auto& d : distinct) {
      for (size_t k = 0; k < nd; ++k) {
        cuts[k].push_back(d.box.start[k]);
        cuts[k].push_back(d.box.start[k] + d.box.size[k]);
      }
    }
    uint64_t cells = 1;
    for (auto& c : cuts) {
      std::sort(c.begin(), c.end());
      c.erase(std::unique(c.begin(), c.end()), c.end());
      cells *= c.size() - 1;
    }
    if (cells > (1u << 20)) {
      return invalid_argument("tensor '{}': its {} holder boxes overlap in too complex a pattern ({} cells)",
                              decl.name, distinct.size(), cells);
    }
    Shape idx(nd, 0);
    for (uint64_t c = 0; c < cells; ++c) {
      Box cell{Shape(nd), Shape(nd)};
      for (size_t k = 0; k < nd; ++k) {
        cell.start[k] = cuts[k][static_cast<size_t>(idx[k])];
        cell.size[k] = cuts[k][static_cast<size_t>(idx[k]) + 1] - cell.start[k];
      }
      TensorPiece p{cell, {}, false};
      for (const auto& d : distinct) {
        if (d.box.contains(cell)) {
          p.holders.insert(p.holders.end(), d.holders.begin(), d.holders.end());
          if (d.box != cell) p.refined = true;
        }
      }
      if (!p.holders.empty()) {
        std::sort(p.holders.begin(), p.holders.end(),
                  [&](uint32_t a, uint32_t b) { return hs[a].producer < hs[b].producer; });
        ti.pieces.push_back(std::move(p));
      }
      for (size_t k = nd; k-- > 0;) {
        if (++idx[k] < static_cast<int64_t>(cuts[k].size()) - 1) break;
        idx[k] = 0;
      }
    }
  }
  const Shape strides = contiguous_strides(decl.shape);
  ti.map.reserve(ti.pieces.size());
  for (auto& p : ti.pieces) {
    Shape last(p.box.start.size());
    for (size_t k = 0; k < last.size(); ++k) last[k] = p.box.start[k] + p.box.size[k] - 1;
    p.flat_lo = flat_of(p.box.start, strides);
    p.flat_hi = flat_of(last, strides);
    ti.map.push_back(MapPiece{p.box.start, Layout::contiguous(p.box.size), 0});
    ti.widest_flat = std::max(ti.widest_flat, p.flat_hi - p.flat_lo);
  }
  ti.by_flat.resize(ti.pieces.size());
  std::iota(ti.by_flat.begin(), ti.by_flat.end(), 0);
  std::stable_sort(ti.by_flat.begin(), ti.by_flat.end(),
                   [&](uint32_t a, uint32_t b) { return ti.pieces[a].flat_lo < ti.pieces[b].flat_lo; });
  return Status::Ok();
}

}  // namespace ferry::route_detail

// Router unit tests: errors (each naming the tensor), sharing and balance, segments,
// encoding (round trip, truncation, corruption).
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <tuple>

#include "ferry/device.h"
#include "route/synthetic_model.h"

namespace ferry {
namespace {

TensorDecl decl(std::string name, Shape shape, DType dt = DType::kBF16) { return TensorDecl{std::move(name), dt, std::move(shape)}; }

// A plan that copies the whole of `d` into a param of the same shape.
Plan whole_plan(const TensorDecl& d, const std::string& param = "p") {
  Recorder rec;
  EXPECT_TRUE(Tensor::param(param, d.shape, d.dtype).copy_(Tensor::source(d.name, d.shape, d.dtype)).ok());
  return rec.finish().value();
}

Holdings hold(const TensorDecl& d, std::vector<Box> boxes) {
  Holdings h;
  for (auto& b : boxes) EXPECT_TRUE(h.add(d, b).ok());
  return h;
}

Result<Routes> route(std::vector<TensorDecl> meta, std::vector<Holdings> prod, const std::vector<Plan>& plans) {
  RouterInput in;
  in.metadata = std::move(meta);
  in.producers = std::move(prod);
  for (const auto& p : plans) in.consumers.push_back(&p);
  return build_routes(in);
}

void expect_error(const Result<Routes>& r, const std::string& needle) {
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().to_string();
}

// Issue 30: fsdp=1000000 ran for minutes. What routing costs is predicted from counts
// known before anything is built, and refused when out of bounds, saying what it needs.
TEST(Router, RoutingCostOutOfBoundsIsRefusedSayingWhatItNeeds) {
  RoutingCost fsdp_million{1000000, 8, 34, 1899008};
  Status s = check_routing_cost(fsdp_million);
  ASSERT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("needs 34000272 route groups"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("the limit is 16777216 route groups"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("1899008 held boxes"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("GiB to route"), std::string::npos) << s.to_string();
  RoutingCost fsdp_4096{4096, 8, 34, 962560};  // Llama-3.1-8B -> tp=8: routed in seconds
  EXPECT_TRUE(check_routing_cost(fsdp_4096).ok());
  RoutingCost pieces{64, 2048, 2, 1 << 17};  // 2^28 pieces
  Status p = check_routing_cost(pieces);
  ASSERT_EQ(p.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(p.message().find("the limit is 134217728 pieces"), std::string::npos) << p.to_string();
  Status m = check_routing_cost(fsdp_4096, uint64_t{1} << 30);  // 1 GiB available
  ASSERT_EQ(m.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(m.message().find("GiB of memory and 1.0 GiB is available"), std::string::npos) << m.to_string();
  EXPECT_TRUE(check_routing_cost(fsdp_4096, uint64_t{64} << 30).ok());
  // Routes without ops (ferry plan's) need less than half: 2 GiB is enough for them only.
  RoutingCost no_ops = fsdp_4096;
  no_ops.every_op = false;
  EXPECT_LT(no_ops.bytes() * 2, fsdp_4096.bytes());
  EXPECT_TRUE(check_routing_cost(no_ops, uint64_t{2} << 30).ok());
  EXPECT_FALSE(check_routing_cost(fsdp_4096, uint64_t{2} << 30).ok());
}

// build_routes itself refuses such inputs before cutting (the engine routes what ranks
// publish): 2^20 producers over 17 layer groups are 17.8M route groups.
TEST(Router, BuildRoutesRefusesTooManyRouteGroupsBeforeCutting) {
  std::vector<TensorDecl> meta;
  for (int l = 0; l < 17; ++l) meta.push_back(decl(fmt::format("model.layers.{}.w", l), {4}));
  std::vector<Holdings> prod(size_t{1} << 20);
  for (const auto& d : meta) ASSERT_TRUE(prod[0].add(d, full_box(d.shape)).ok());
  auto r = route(meta, std::move(prod), {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("route groups"), std::string::npos) << r.status().to_string();
}

TEST(Router, ErrorTensorNobodyHolds) {
  const auto w = decl("model.layers.0.mlp.down_proj.weight", {4, 6});
  expect_error(route({w}, {Holdings{}}, {whole_plan(w)}), "'model.layers.0.mlp.down_proj.weight'");
  // Partly held: the missing elements are named by tensor.
  auto r = route({w}, {hold(w, {Box{{0, 0}, {4, 3}}})}, {whole_plan(w)});
  expect_error(r, "'model.layers.0.mlp.down_proj.weight'");
  EXPECT_NE(r.status().message().find("held by no producer"), std::string::npos);
}

TEST(Router, ErrorHoldersDisagree) {
  const auto w = decl("model.norm.weight", {8});
  Holdings a = hold(w, {full_box({8})});
  Holdings b = hold(decl("model.norm.weight", {8}, DType::kF32), {full_box({8})});
  expect_error(route({w}, {a, b}, {whole_plan(w)}), "holders disagree on tensor 'model.norm.weight'");
  Holdings c = hold(decl("model.norm.weight", {9}), {full_box({9})});
  expect_error(route({w}, {a, c}, {whole_plan(w)}), "holders disagree on tensor 'model.norm.weight'");
  // A single holder that disagrees with the metadata.
  expect_error(route({w}, {b}, {whole_plan(w)}), "holders disagree on tensor 'model.norm.weight'");
}

TEST(Router, ErrorOverlapWithinOneRank) {
  const auto w = decl("model.layers.1.self_attn.qkv_proj.weight", {12, 4});
  Holdings h = hold(w, {Box{{0, 0}, {6, 4}}, Box{{4, 0}, {8, 4}}});
  expect_error(route({w}, {h}, {whole_plan(w)}), "overlapping boxes");
  expect_error(route({w}, {h}, {whole_plan(w)}), "'model.layers.1.self_attn.qkv_proj.weight'");
  // Touching boxes are fine.
  Holdings ok = hold(w, {Box{{0, 0}, {6, 4}}, Box{{6, 0}, {6, 4}}});
  EXPECT_TRUE(route({w}, {ok}, {whole_plan(w)}).ok());
}

TEST(Router, ErrorPlanReadsUnknownTensor) {
  const auto w = decl("model.norm.weight", {8});
  const auto other = decl("lm_head.weight", {8, 2});
  expect_error(route({w}, {hold(w, {full_box({8})})}, {whole_plan(other)}), "'lm_head.weight', which the metadata lacks");
  // And one with another shape than the metadata.
  expect_error(route({w}, {hold(w, {full_box({8})})}, {whole_plan(decl("model.norm.weight", {4}))}),
               "'model.norm.weight'");
}

TEST(Router, ErrorHoldingsOfUnknownTensorAndBadBoxes) {
  const auto w = decl("model.norm.weight", {8});
  const auto x = decl("model.extra", {8});
  expect_error(route({w}, {hold(w, {full_box({8})}), hold(x, {full_box({8})})}, {whole_plan(w)}), "'model.extra'");
  Holdings bad;
  bad.tensors.push_back(w);
  bad.boxes.push_back(HeldBox{0, Box{{4}, {8}}});
  expect_error(route({w}, {bad}, {whole_plan(w)}), "outside tensor 'model.norm.weight'");
  expect_error(route({w, w}, {}, {}), "twice");
}

// Two DP replicas hold the same rows; four consumers (two plans x two replicas) read
// everything. Bytes split evenly, replicas of one consumer rank use the same holder.
TEST(Router, SharingAndBalance) {
  const auto w = decl("model.layers.0.mlp.up_proj.weight", {8, 4});
  const auto v = decl("model.layers.0.mlp.gate_proj.weight", {8, 4});
  std::vector<Holdings> prod(2);
  for (auto& h : prod) {
    ASSERT_TRUE(h.add(w, full_box({8, 4})).ok());
    ASSERT_TRUE(h.add(v, full_box({8, 4})).ok());
  }
  Plan p0, p1;
  {
    Recorder rec;
    ASSERT_TRUE(Tensor::param("a", {8, 4}, DType::kBF16).copy_(Tensor::source(w.name, w.shape, w.dtype)).ok());
    p0 = rec.finish().value();
  }
  {
    Recorder rec;
    ASSERT_TRUE(Tensor::param("b", {8, 4}, DType::kBF16).copy_(Tensor::source(v.name, v.shape, v.dtype)).ok());
    p1 = rec.finish().value();
  }
  std::vector<Plan> plans = {p0, p1, p0, p1};
  auto r = route({w, v}, prod, plans);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->stats.num_plan_classes, 2u);
  EXPECT_EQ(r->consumer_plan, (std::vector<uint32_t>{0, 1, 0, 1}));
  EXPECT_EQ(r->stats.producer_bytes, (std::vector<uint64_t>{128, 128}));
  EXPECT_EQ(r->stats.bytes_moved, 256u);
  EXPECT_EQ(r->stats.bytes_min, 256u);
  EXPECT_DOUBLE_EQ(r->stats.balance, 1.0);
  // Each producer packs one segment for one plan class, read by two consumers.
  for (const auto& pr : r->producers) {
    ASSERT_EQ(pr.groups[1].segments.size(), 1u);
    EXPECT_EQ(pr.groups[1].segments[0].offset % 64, 0u);
  }
}

TEST(Router, SegmentsAlignedAndInDestinationOrder) {
  // One producer holds three tensors; one consumer reads them into params declared in
  // reverse order; segments per plan class are 64-byte aligned.
  std::vector<TensorDecl> meta = {decl("model.layers.0.a", {3}), decl("model.layers.0.b", {5}),
                                  decl("model.layers.0.c", {7})};
  Holdings h;
  for (const auto& d : meta) ASSERT_TRUE(h.add(d, full_box(d.shape)).ok());
  Plan p, q;
  {
    Recorder rec;
    for (int i = 2; i >= 0; --i) {
      const auto& d = meta[static_cast<size_t>(i)];
      ASSERT_TRUE(Tensor::param("p" + std::to_string(i), d.shape, DType::kF32).copy_(Tensor::source(d.name, d.shape, d.dtype)).ok());
    }
    p = rec.finish().value();
  }
  {
    Recorder rec;
    ASSERT_TRUE(Tensor::param("x", {7}, DType::kBF16).copy_(Tensor::source(meta[2].name, {7}, DType::kBF16)).ok());
    q = rec.finish().value();
  }
  auto r = route(meta, {h}, {p, q});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const auto& pg = r->producers[0].groups[1];
  ASSERT_EQ(pg.segments.size(), 2u);
  EXPECT_EQ(pg.segments[0].offset, 0u);
  EXPECT_EQ(pg.segments[0].bytes, 30u);
  EXPECT_EQ(pg.segments[1].offset, 64u);
  EXPECT_EQ(pg.segments[1].bytes, 14u);
  EXPECT_EQ(pg.staging_bytes, 78u);
  // Destination order: the plan's params are p2, p1, p0 (declaration order); unpacks follow.
  const auto& ug = r->plans[0].groups[1];
  ASSERT_EQ(ug.unpacks.size(), 3u);
  for (size_t i = 0; i + 1 < ug.unpacks.size(); ++i) EXPECT_LT(ug.unpacks[i].param, ug.unpacks[i + 1].param);
  EXPECT_EQ(ug.unpacks[0].src_dtype, DType::kBF16);  // converted to f32 on unpack
}

// A small MoE model under tp=2,pp=2,ep=2 routed to 4 consumers (tp=2, ep=2, two replicas).
struct MoeJob {
  std::vector<TensorDecl> meta;
  std::vector<Holdings> holdings;
  std::vector<Plan> plans;
  RouterInput input() const {
    RouterInput in;
    in.metadata = meta;
    in.producers = holdings;
    for (const auto& p : plans) in.consumers.push_back(&p);
    return in;
  }
};
MoeJob moe_job() {
  testing::ModelSpec m;
  m.experts = 4;
  MoeJob j;
  j.meta = testing::make_metadata(m);
  j.holdings = make_holdings(j.meta, TrainerLayout::parse("tp=2,pp=2,ep=2,etp=1").value(), {m.q_rows(), m.kv_rows()})
                   .value()
                   .ranks;
  testing::InferSpec is{2, 1, 2, true};
  for (int c = 0; c < is.world(); ++c) j.plans.push_back(testing::record_synthetic_plan(m, j.meta, is, c).value());
  return j;
}

TEST(Router, EncodingRejectsCorruption) {
  const MoeJob j = moe_job();
  auto r = build_routes(j.input());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const std::string e = r->encode();
  ASSERT_TRUE(Routes::decode(e).ok());
  // Every truncation fails cleanly.
  for (size_t n = 0; n < e.size(); n += std::max<size_t>(1, e.size() / 300)) {
    EXPECT_FALSE(Routes::decode(std::string_view(e.data(), n)).ok()) << n;
  }
  // Byte flips either fail or decode to something that validates.
  testing::Rng rng(5);
  for (int i = 0; i < 2000; ++i) {
    std::string x = e;
    x[static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(x.size()) - 1))] ^= static_cast<char>(1 << rng.uniform(0, 7));
    auto d = Routes::decode(x);
    if (d.ok()) {
      EXPECT_TRUE(d->validate().ok());
    }
  }
  EXPECT_FALSE(Routes::decode(std::string("FRRT\x02")).ok());
  EXPECT_FALSE(Routes::decode(e + "x").ok());
}

// A rank's own routes (RouterOptions::packs_of / unpacks_of): the fingerprint agrees with
// the whole routes' and tells any changed op apart; ranks that name nobody are refused;
// a group with ops and elided ops both is corrupt; the elided encoding is bounds-checked.
TEST(Router, OwnRoutesFingerprintAndRefusals) {
  const MoeJob j = moe_job();
  const RouterInput in = j.input();
  auto whole = build_routes(in);
  ASSERT_TRUE(whole.ok()) << whole.status().to_string();
  auto own = build_routes(in, RouterOptions{.packs_of = 1, .unpacks_of = 2});
  ASSERT_TRUE(own.ok()) << own.status().to_string();
  EXPECT_EQ(own->fingerprint(), whole->fingerprint());
  EXPECT_NE(own->encode(), whole->encode());
  EXPECT_TRUE(own->has_packs(1));
  EXPECT_FALSE(own->has_packs(0));
  EXPECT_TRUE(own->has_unpacks(own->consumer_plan[2]));

  // Any op changed, in a kept group or as an elided digest, changes the fingerprint.
  Routes changed = *whole;
  for (auto& g : changed.producers[0].groups) {
    if (g.packs.empty()) continue;
    g.packs.back().offset += 1;
    break;
  }
  EXPECT_NE(changed.fingerprint(), whole->fingerprint());
  Routes digest = *own;
  for (auto& g : digest.producers[0].groups) {
    if (!g.elided_packs) continue;
    g.elided_digest ^= 1;
    break;
  }
  EXPECT_NE(digest.fingerprint(), whole->fingerprint());

  for (auto [p, c] : {std::pair{8, 0}, std::pair{0, 4}, std::pair{-3, 0}, std::pair{0, -3}}) {
    auto bad = build_routes(in, RouterOptions{.packs_of = p, .unpacks_of = c});
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument) << bad.status().to_string();
  }

  Routes both = *own;
  for (auto& g : both.producers[0].groups) {
    if (!g.elided_packs) continue;
    g.packs.push_back(PackOp{});
    break;
  }
  EXPECT_FALSE(both.validate().ok());

  const std::string e = own->encode();
  auto d = Routes::decode(e);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_TRUE(*d == *own);
  for (size_t n = 0; n < e.size(); n += std::max<size_t>(1, e.size() / 200)) {
    EXPECT_FALSE(Routes::decode(std::string_view(e.data(), n)).ok()) << n;
  }
}

TEST(Router, PackAndUnpackCheckTheirBuffers) {
  const auto w = decl("model.norm.weight", {8});
  auto r = route({w}, {hold(w, {full_box({8})})}, {whole_plan(w)});
  ASSERT_TRUE(r.ok());
  std::vector<std::byte> small(4);
  EXPECT_FALSE(pack_group(*r, 0, r->num_groups() - 1, hold(w, {full_box({8})}), {}, small).ok());
  std::vector<std::byte> staging(16);
  auto st = pack_group(*r, 0, r->num_groups() - 1, hold(w, {full_box({8})}), {}, staging);
  EXPECT_NE(st.message().find("'model.norm.weight'"), std::string::npos) << st.to_string();
  TensorMap params;
  params.emplace("p", Tensor::empty({8}, DType::kF32, "p"));
  EXPECT_FALSE(unpack_group(r->plans[0], r->num_groups() - 1, staging, params).ok());  // wrong dtype
}

// A box materialised as a strided view of the trainer's own tensor (a column range; a
// column range of a transposed storage) packs the same bytes as a contiguous copy,
// for plans that read it in order and transposed.
TEST(Router, PackReadsStridedViewsOfTheTrainersTensor) {
  const auto w = decl("model.layers.0.mlp.down_proj.weight", {6, 8}, DType::kF32);
  const Box box{{0, 2}, {6, 4}};
  Recorder rec1;
  const Tensor src = Tensor::source(w.name, w.shape, w.dtype).narrow(1, 2, 4);
  ASSERT_TRUE(Tensor::param("p", {6, 4}, w.dtype).copy_(src).ok());
  const Plan in_order = rec1.finish().value();
  Recorder rec2;
  ASSERT_TRUE(Tensor::param("q", {4, 6}, w.dtype).copy_(src.t()).ok());
  const Plan transposed = rec2.finish().value();
  const Holdings h = hold(w, {box});
  auto r = route({w}, {h}, {in_order, transposed});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const int g = 1;  // layer 0
  ASSERT_GT(r->producers[0].groups[g].staging_bytes, 0u);

  // The trainer's tensor: element (i, j) = 100 i + j; row-major, and stored transposed.
  Tensor full = Tensor::empty({6, 8}, DType::kF32);
  Tensor full_t = Tensor::empty({8, 6}, DType::kF32);
  auto* f = reinterpret_cast<float*>(full.data_ptr().value());
  auto* ft = reinterpret_cast<float*>(full_t.data_ptr().value());
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 8; ++j) f[i * 8 + j] = ft[j * 6 + i] = static_cast<float>(100 * i + j);
  const Tensor contiguous = full.narrow(1, 2, 4).clone();
  const Tensor column_range = Tensor::borrow_strided(f, 48, Layout{{6, 4}, {8, 1}, 2}, DType::kF32);
  const Tensor of_transposed = Tensor::borrow_strided(ft, 48, Layout{{6, 4}, {1, 6}, 12}, DType::kF32);
  ASSERT_TRUE(column_range.ok() && of_transposed.ok());
  EXPECT_FALSE(column_range.is_contiguous());
  const size_t n = r->producers[0].groups[g].staging_bytes;
  std::vector<std::byte> want(n), got1(n), got2(n);
  ASSERT_TRUE(pack_group(*r, 0, g, h, {LocalBox{0, contiguous}}, want).ok());
  ASSERT_TRUE(pack_group(*r, 0, g, h, {LocalBox{0, column_range}}, got1).ok());
  ASSERT_TRUE(pack_group(*r, 0, g, h, {LocalBox{0, of_transposed}}, got2).ok());
  EXPECT_EQ(want, got1);
  EXPECT_EQ(want, got2);
  // The views stay inside their storage.
  EXPECT_TRUE(Tensor::borrow_strided(f, 46, Layout{{6, 4}, {8, 1}, 2}, DType::kF32).ok());  // last element: 45
  EXPECT_FALSE(Tensor::borrow_strided(f, 45, Layout{{6, 4}, {8, 1}, 2}, DType::kF32).ok());
  EXPECT_FALSE(Tensor::borrow_strided(f, 48, Layout{{6, 4}, {-8, 1}, 42}, DType::kF32).ok());
}

// Issue 29: fp32 master weights read into bf16 params. Converted on the producer (the
// default), the wire carries bf16 (half the bytes) and the unpacks are plain byte copies;
// converted on the consumer, fp32. The params' bits are the same either way and equal a
// direct copy, for values that round (ties, NaN, infinities, subnormals), for boxes that
// are strided views of the trainer's tensor, and for a transposed read.
TEST(Router, Fp32SourcesIntoBf16ParamsConvertOnTheProducer) {
  const auto w = decl("model.layers.0.mlp.down_proj.weight", {6, 8}, DType::kF32);
  Recorder rec1;
  const Tensor src = Tensor::source(w.name, w.shape, w.dtype);
  ASSERT_TRUE(Tensor::param("p", {6, 8}, DType::kBF16).copy_(src).ok());
  const Plan in_order = rec1.finish().value();
  Recorder rec2;
  ASSERT_TRUE(Tensor::param("q", {8, 6}, DType::kBF16).copy_(src.t()).ok());
  const Plan transposed = rec2.finish().value();
  // Two trainer ranks, each a column half (a strided view of a row-major tensor).
  const Holdings h0 = hold(w, {Box{{0, 0}, {6, 4}}}), h1 = hold(w, {Box{{0, 4}, {6, 4}}});
  Tensor full = Tensor::empty({6, 8}, DType::kF32);
  auto* f = reinterpret_cast<float*>(full.data_ptr().value());
  const float special[] = {1.0f + 0x1p-8f, 1.0f + 0x3p-8f, -0.0f, std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                           0x1p-130f, 3.4e38f};
  for (int i = 0; i < 48; ++i) f[i] = i < 8 ? special[i] : static_cast<float>(i) * 1.00390625f - 17.3f;
  auto params_after = [&](ConvertOn where, uint64_t& moved) {
    RouterInput in;
    in.metadata = {w};
    in.producers = {h0, h1};
    in.consumers = {&in_order, &transposed};
    RouterOptions o;
    o.convert_on = where;
    auto r = build_routes(in, o);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    moved = r->stats.bytes_moved;
    EXPECT_EQ(r->stats.bytes_min, moved);
    const int g = 1;  // layer 0
    std::vector<std::vector<std::byte>> staging;
    for (uint32_t p = 0; p < 2; ++p) {
      const Tensor view = Tensor::borrow_strided(f, 48, Layout{{6, 4}, {8, 1}, 4 * p}, DType::kF32);
      staging.emplace_back(r->producers[p].groups[g].staging_bytes);
      for (const PackOp& op : r->producers[p].groups[g].packs)
        EXPECT_EQ(op.dtype, where == ConvertOn::kProducer ? DType::kBF16 : DType::kF32);
      Status st = pack_group(*r, p, g, p ? h1 : h0, {LocalBox{0, view}}, staging.back());
      EXPECT_TRUE(st.ok()) << st.to_string();
    }
    std::vector<Tensor> out;
    for (size_t c = 0; c < 2; ++c) {
      const PlanGroup& cg = r->consumer(c).groups[g];
      std::vector<std::byte> recv(cg.recv_bytes);
      for (const Read& rd : cg.reads)
        std::memcpy(recv.data() + rd.recv_offset, staging[rd.producer].data() + rd.offset, rd.length);
      TensorMap params;
      const char* name = c ? "q" : "p";
      params.emplace(name, Tensor::empty(c ? Shape{8, 6} : Shape{6, 8}, DType::kBF16, name));
      Status st = unpack_group(r->consumer(c), g, recv, params);
      EXPECT_TRUE(st.ok()) << st.to_string();
      out.push_back(params.at(name));
    }
    return out;
  };
  uint64_t on_producer = 0, on_consumer = 0;
  const auto a = params_after(ConvertOn::kProducer, on_producer);
  const auto b = params_after(ConvertOn::kConsumer, on_consumer);
  EXPECT_EQ(on_producer, 2u * 48 * 2);  // two consumers, 48 bf16 elements each
  EXPECT_EQ(on_consumer, 2u * 48 * 4);
  Tensor want = Tensor::empty({6, 8}, DType::kBF16);
  ASSERT_TRUE(want.copy_(full).ok());
  Tensor want_t = Tensor::empty({8, 6}, DType::kBF16);
  ASSERT_TRUE(want_t.copy_(full.t()).ok());
  auto bytes = [](const Tensor& t) {
    const auto* p = t.data_ptr().value();
    return std::vector<std::byte>(p, p + t.numel() * 2);
  };
  EXPECT_EQ(bytes(a[0]), bytes(want));
  EXPECT_EQ(bytes(a[1]), bytes(want_t));
  EXPECT_EQ(bytes(b[0]), bytes(want));
  EXPECT_EQ(bytes(b[1]), bytes(want_t));
}

// Conversion only where it shrinks the bytes between float dtypes: bf16 into an fp32
// param widens on the consumer; an integer never converts on the producer.
TEST(Router, ProducersConvertOnlyToNarrowerFloats) {
  for (auto [from, to, wire] : {std::tuple{DType::kBF16, DType::kF32, DType::kBF16},
                                std::tuple{DType::kF32, DType::kF16, DType::kF16},
                                std::tuple{DType::kF32, DType::kF8E4M3, DType::kF8E4M3},
                                std::tuple{DType::kBF16, DType::kBF16, DType::kBF16}}) {
    const auto w = decl("model.norm.weight", {8}, from);
    Recorder rec;
    ASSERT_TRUE(Tensor::param("p", {8}, to).copy_(Tensor::source(w.name, w.shape, from)).ok());
    const Plan plan = rec.finish().value();
    auto r = route({w}, {hold(w, {full_box({8})})}, {plan});
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    const int g = r->num_groups() - 1;
    ASSERT_EQ(r->producers[0].groups[g].packs.size(), 1u);
    EXPECT_EQ(r->producers[0].groups[g].packs[0].dtype, wire) << dtype_name(from) << " -> " << dtype_name(to);
    EXPECT_EQ(r->plans[0].groups[g].unpacks[0].src_dtype, wire);
    EXPECT_EQ(r->stats.bytes_moved, 8 * dtype_size(wire));
  }
  EXPECT_EQ(parse_convert_on("producer"), ConvertOn::kProducer);
  EXPECT_EQ(parse_convert_on("consumer"), ConvertOn::kConsumer);
  EXPECT_FALSE(parse_convert_on("trainer").has_value());
}

// quantize_sides (issue 29) against a brute-force oracle: every element of the param
// mapped to the producer whose read carries it, then each 128x128 tile (leading dims each
// on their own) checked for a single producer. Random matrices (and a batch of three),
// cut between two or three producers at random rows or columns (128-aligned or not), some
// boxes held by two DP replicas (the router balances pieces between them), read whole,
// transposed or as a fused param of two sources.
TEST(Router, QuantizeSidesAgreesWithAnElementOracle) {
  std::mt19937 rng(29);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  int on_producer = 0, on_consumer = 0;
  for (int trial = 0; trial < 60; ++trial) {
    SCOPED_TRACE(trial);
    const bool batched = trial % 5 == 4;
    const int64_t rows = pick(1, 3) * 64 + pick(0, 1) * pick(1, 100), cols = pick(1, 4) * 64 + pick(0, 1) * pick(1, 60);
    const Shape shape = batched ? Shape{3, rows, cols} : Shape{rows, cols};
    const size_t nd = shape.size();
    std::vector<TensorDecl> meta = {decl("model.layers.0.a.weight", shape)};
    const int kind = static_cast<int>(pick(0, 2));  // 0 whole, 1 transposed, 2 fused with a second source
    if (kind == 2) meta.push_back(decl("model.layers.0.b.weight", shape));
    // Producers: the (first) tensor cut along one dim at a random point into two boxes;
    // with `replicas`, both boxes are also held by a second pair of producers.
    const int dim = static_cast<int>(nd) - 1 - static_cast<int>(pick(0, 1));
    const int64_t extent = shape[static_cast<size_t>(dim)];
    std::vector<int64_t> aligned;  // cuts on a tile boundary
    for (int64_t c = 128; c < extent; c += 128) aligned.push_back(c);
    const int64_t cut = !aligned.empty() && pick(0, 1) ? aligned[static_cast<size_t>(pick(0, static_cast<int64_t>(aligned.size()) - 1))]
                                                       : pick(1, extent - 1);
    const bool replicas = pick(0, 2) == 0;
    std::vector<Holdings> prod;
    for (int r = 0; r < (replicas ? 2 : 1); ++r) {
      for (int part = 0; part < 2; ++part) {
        Box b = full_box(shape);
        b.start[static_cast<size_t>(dim)] = part ? cut : 0;
        b.size[static_cast<size_t>(dim)] = part ? extent - cut : cut;
        Holdings h;
        ASSERT_TRUE(h.add(meta[0], b).ok());
        if (kind == 2 && part == 0) {
          ASSERT_TRUE(h.add(meta[1], full_box(shape)).ok());
        }
        prod.push_back(std::move(h));
      }
    }
    // The consumer's param: a, a^T, or [a ; b] along the rows.
    Recorder rec;
    const Tensor a = Tensor::source(meta[0].name, shape, DType::kBF16);
    Shape pshape = shape;
    if (kind == 1) std::swap(pshape[nd - 1], pshape[nd - 2]);
    if (kind == 2) pshape[nd - 2] *= 2;
    const Tensor p = Tensor::param("p", pshape, DType::kBF16);
    if (kind == 0) {
      ASSERT_TRUE(p.copy_(a).ok());
    }
    if (kind == 1) {
      ASSERT_TRUE(p.copy_(a.transpose(static_cast<int>(nd) - 2, static_cast<int>(nd) - 1)).ok());
    }
    if (kind == 2) {
      ASSERT_TRUE(p.narrow(static_cast<int>(nd) - 2, 0, shape[nd - 2]).copy_(a).ok());
      ASSERT_TRUE(p.narrow(static_cast<int>(nd) - 2, shape[nd - 2], shape[nd - 2])
                      .copy_(Tensor::source(meta[1].name, shape, DType::kBF16))
                      .ok());
    }
    const Plan plan = rec.finish().value();
    auto r = route(meta, prod, {plan});
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    // Square 128x128 tiles (fp32 scales) and MXFP8's 1x32 runs of a row (E8M0 scales).
    for (const BlockQuantizeFormat& format : {BlockQuantizeFormat{}, BlockQuantizeFormat{32, 1, 1, 1}}) {
    SCOPED_TRACE(format.block_rows);
    auto sides = quantize_sides(*r, {{0}}, format);
    ASSERT_TRUE(sides.ok()) << sides.status().to_string();
    ASSERT_EQ(sides->size(), 1u);
    const QuantizeSide& q = (*sides)[0];

    // The oracle: the producer of every element, then of every tile.
    const int64_t n = shape_numel(pshape), R = pshape[nd - 2], C = pshape[nd - 1];
    std::vector<int> owner(static_cast<size_t>(n), -1);
    for (const PlanGroup& g : r->plans[0].groups) {
      for (const UnpackOp& u : g.unpacks) {
        int producer = -1;
        for (const Read& rd : g.reads)
          if (u.offset >= rd.recv_offset && u.offset < rd.recv_offset + rd.length) producer = static_cast<int>(rd.producer);
        ASSERT_GE(producer, 0);
        std::vector<int64_t> idx(u.dst.shape.size(), 0);
        for (int64_t e = 0; e < u.dst.numel(); ++e) {
          int64_t f = u.dst.offset;
          for (size_t k = 0; k < idx.size(); ++k) f += idx[k] * u.dst.strides[k];
          ASSERT_EQ(owner[static_cast<size_t>(f)], -1) << "an element written twice";
          owner[static_cast<size_t>(f)] = producer;
          for (size_t k = idx.size(); k-- > 0;) {
            if (++idx[k] < u.dst.shape[k]) break;
            idx[k] = 0;
          }
        }
      }
    }
    const int64_t tr_step = format.block_rows, tc_step = format.block;
    uint64_t tiles = 0, split = 0;
    for (int64_t b = 0; b < n / (R * C); ++b)
      for (int64_t tr = 0; tr < R; tr += tr_step)
        for (int64_t tc = 0; tc < C; tc += tc_step) {
          ++tiles;
          std::set<int> seen;
          for (int64_t i = tr; i < std::min(R, tr + tr_step); ++i)
            for (int64_t j = tc; j < std::min(C, tc + tc_step); ++j) seen.insert(owner[static_cast<size_t>(b * R * C + i * C + j)]);
          if (seen.size() > 1) ++split;
        }
    EXPECT_EQ(q.tiles, tiles);
    EXPECT_EQ(q.tiles_split, split);
    EXPECT_EQ(q.on_producer, split == 0);
    EXPECT_EQ(q.bytes_dense, static_cast<uint64_t>(n) * 2);
    EXPECT_EQ(q.bytes_quantized, static_cast<uint64_t>(n) + tiles * format.scale_bytes);
    if (format.block_rows > 1) (q.on_producer ? on_producer : on_consumer)++;
    }
  }
  // Both outcomes were exercised.
  EXPECT_GT(on_producer, 5);
  EXPECT_GT(on_consumer, 5);
  EXPECT_FALSE(quantize_sides(Routes{}, {{0}}).ok());  // a list per plan class
}

// Boxes and params that say they live on cuda:0, with no usable CUDA device here: pack
// and unpack fail naming the device and why, without touching the (fake) pointers; a
// strided view in GPU memory and a dtype conversion into a GPU param are refused naming
// the tensor. (Where a device is present, SyncsFromGpuMemoryIntoGpuMemory in the engine
// tests runs the kernels.)
TEST(Router, PackAndUnpackOfGpuTensorsWithoutADeviceFailNamingIt) {
  if (cuda_status().usable()) GTEST_SKIP() << "a CUDA device is here";
  const auto w = decl("model.layers.0.mlp.down_proj.weight", {6, 8}, DType::kF32);
  const Holdings h = hold(w, {full_box({6, 8})});
  auto r = route({w}, {h}, {whole_plan(w)});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const int g = 1;
  void* fake = reinterpret_cast<void*>(uintptr_t{0x10000});
  const size_t n = r->producers[0].groups[g].staging_bytes;
  std::vector<std::byte> staging(n);
  Status st = pack_group(*r, 0, g, h, {LocalBox{0, Tensor::borrow_device(fake, {6, 8}, DType::kF32, Device::cuda(0))}},
                         staging);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
  EXPECT_NE(st.message().find("cuda:0"), std::string::npos) << st.to_string();
  const Tensor view = Tensor::borrow_device(fake, {8, 6}, DType::kF32, Device::cuda(0)).t();
  st = pack_group(*r, 0, g, h, {LocalBox{0, view}}, staging);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("materialize it contiguous"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find(w.name), std::string::npos) << st.to_string();

  TensorMap params;
  params.emplace("p", Tensor::borrow_device(fake, {6, 8}, DType::kF32, Device::cuda(0), nullptr, "p"));
  st = unpack_group(r->plans[0], g, staging, params);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
  EXPECT_NE(st.message().find("unpack: group 1 on cuda:0"), std::string::npos) << st.to_string();
  // The plan's param is bf16 from an f32 source: the conversion runs in the unpack
  // kernel too, so it reaches the device (and fails there the same way).
  Recorder rec;
  ASSERT_TRUE(Tensor::param("q", {6, 8}, DType::kBF16).copy_(Tensor::source(w.name, w.shape, w.dtype)).ok());
  const Plan converting = rec.finish().value();
  auto rc = route({w}, {h}, {converting});
  ASSERT_TRUE(rc.ok()) << rc.status().to_string();
  TensorMap qp;
  qp.emplace("q", Tensor::borrow_device(fake, {6, 8}, DType::kBF16, Device::cuda(0), nullptr, "q"));
  std::vector<std::byte> recv(rc->plans[0].groups[g].recv_bytes);
  st = unpack_group(rc->plans[0], g, recv, qp);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
  EXPECT_NE(st.message().find("unpack: group 1 on cuda:0"), std::string::npos) << st.to_string();
}

}  // namespace
}  // namespace ferry

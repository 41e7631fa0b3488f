// The consumer's param set (engine/param_set.h) on its own, with no transport: which
// params get room in the arena and which are the caller's, which are placed for direct
// landing and where a landing lies, the plan's padding, the version state (begin /
// touch / finish / abort), and that every registration is released.
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "engine/param_set.h"
#include "engine/registered_buffer.h"
#include "engine/schedule.h"

namespace ferry::engine {
namespace {

// Host memory that counts what it handed out and what came back.
class CountingMemory final : public ParamMemory {
 public:
  struct Counts {
    int allocated = 0, registered = 0, released = 0;
    std::set<void*> live;
  };
  explicit CountingMemory(Counts& c) : c_(c), host_(host_param_memory()) {}
  Result<MemoryRegion> allocate(uint64_t bytes) override {
    auto r = host_->allocate(bytes);
    if (r.ok()) {
      ++c_.allocated;
      r->id = next_++;
      c_.live.insert(r->base);
    }
    return r;
  }
  Result<MemoryRegion> register_memory(void* base, uint64_t bytes) override {
    if (fail_register_) return io_error("refused (test)");
    ++c_.registered;
    c_.live.insert(base);
    return MemoryRegion{next_++, base, bytes, MemoryKind::kHost};
  }
  void release(const MemoryRegion& r) override {
    ++c_.released;
    c_.live.erase(r.base);
    host_->release(r);
  }
  bool fail_register_ = false;

 private:
  Counts& c_;
  std::unique_ptr<ParamMemory> host_;
  uint64_t next_ = 1;
};

std::vector<TensorDecl> decls() {
  return {TensorDecl{"a", DType::kF32, {4, 8}}, TensorDecl{"b", DType::kBF16, {3}}, TensorDecl{"c", DType::kF32, {64}}};
}

TEST(ParamSet, ParamsTheCallerDidNotPassGetZeroedRoomInOneRegisteredArena) {
  CountingMemory::Counts n;
  {
    auto set = ParamSet::create(ParamSetOptions{3, false, 0}, decls(), {}, std::make_unique<CountingMemory>(n));
    ASSERT_TRUE(set.ok()) << set.status().to_string();
    const ParamSet& s = **set;
    EXPECT_EQ(n.registered, 1);  // pull: our aligned memory, registered once
    EXPECT_EQ(n.allocated, 0);
    ASSERT_EQ(s.registrations().size(), 1u);
    EXPECT_EQ(s.own_bytes(), 4096u);  // 128 + 64 (b, aligned) + 256 bytes, rounded to a page
    EXPECT_EQ(s.registered_bytes(), 4096u);
    ASSERT_EQ(s.placements().size(), 3u);
    EXPECT_EQ(s.placements().at("a").offset, 0u);
    EXPECT_EQ(s.placements().at("b").offset, 128u);
    EXPECT_EQ(s.placements().at("c").offset, 192u);
    EXPECT_EQ(s.placements().at("c").bytes, 256u);
    for (const auto& [name, p] : s.placements()) {
      EXPECT_EQ(p.key, 0u) << name;
      const ParamSet::Landing l = s.landing(p, 4);
      auto data = s.loaded().at(name).data_ptr();
      ASSERT_TRUE(data.ok());
      EXPECT_EQ(l.data, static_cast<std::byte*>(*data) + 4) << name;
      EXPECT_EQ(l.offset, p.offset + 4) << name;
      EXPECT_EQ(l.region.id, s.registrations()[0].id);
      for (uint64_t k = 0; k < p.bytes; ++k) ASSERT_EQ(static_cast<const std::byte*>(*data)[k], std::byte{0}) << name;
    }
    EXPECT_EQ(s.loaded().at("b").shape(), (Shape{3}));
    EXPECT_EQ(s.loaded().at("b").dtype(), DType::kBF16);
    EXPECT_FALSE(s.device().has_value());
    EXPECT_FALSE(s.all_on_device());
  }
  EXPECT_EQ(n.released, 1);
  EXPECT_TRUE(n.live.empty());
}

TEST(ParamSet, PushArenaIsTheMemorysOwnAllocation) {
  CountingMemory::Counts n;
  {
    auto set = ParamSet::create(ParamSetOptions{0, true, 0}, decls(), {}, std::make_unique<CountingMemory>(n));
    ASSERT_TRUE(set.ok()) << set.status().to_string();
    EXPECT_EQ(n.allocated, 1);  // producers write into it: the transport's own memory
    EXPECT_EQ(n.registered, 0);
    auto data = (*set)->loaded().at("a").data_ptr();
    ASSERT_TRUE(data.ok());
    EXPECT_EQ(*data, (*set)->registrations()[0].base);
  }
  EXPECT_EQ(n.released, 1);
  EXPECT_TRUE(n.live.empty());
}

TEST(ParamSet, CallerBuffersAreRegisteredOnlyFromDirectMinBytes) {
  CountingMemory::Counts n;
  TensorMap caller;
  caller.emplace("a", Tensor::empty({4, 8}, DType::kF32, "a"));  // 128 bytes
  caller.emplace("c", Tensor::empty({64}, DType::kF32, "c"));    // 256 bytes
  {
    auto set = ParamSet::create(ParamSetOptions{0, false, 200}, decls(), caller, std::make_unique<CountingMemory>(n));
    ASSERT_TRUE(set.ok()) << set.status().to_string();
    const ParamSet& s = **set;
    // "b" in the arena (registration 0, always placed), "c" registered alone, "a" too small.
    EXPECT_EQ(n.registered, 2);
    ASSERT_EQ(s.placements().size(), 2u);
    EXPECT_FALSE(s.placements().count("a"));
    EXPECT_EQ(s.placements().at("b").key, 0u);
    const ParamTable::Param& c = s.placements().at("c");
    EXPECT_EQ(c.key, 1u);
    EXPECT_EQ(c.offset, 0u);
    EXPECT_EQ(s.landing(c, 8).data, static_cast<std::byte*>(*caller.at("c").data_ptr()) + 8);
    // The caller's buffers are the ones loaded into.
    EXPECT_EQ(*s.loaded().at("a").data_ptr(), *caller.at("a").data_ptr());
    EXPECT_EQ(s.own_bytes(), 4096u);
    // A sub-read naming the placement lands where landing(placement) says.
    SubRead sr;
    sr.param = &c;
    sr.param_offset = 16;
    EXPECT_EQ(s.landing(sr).data, s.landing(c, 16).data);
  }
  EXPECT_EQ(n.released, 2);
  EXPECT_TRUE(n.live.empty());
}

TEST(ParamSet, CallerBufferThatDoesNotMatchIsRefusedNamingIt) {
  for (const Tensor& bad : {Tensor::empty({4, 8}, DType::kBF16, "a"), Tensor::empty({8, 4}, DType::kF32, "a"),
                            Tensor::empty({8, 4}, DType::kF32, "a").t()}) {
    CountingMemory::Counts n;
    TensorMap caller{{"a", bad}};
    auto set = ParamSet::create(ParamSetOptions{5, false, 0}, decls(), caller, std::make_unique<CountingMemory>(n));
    ASSERT_FALSE(set.ok());
    EXPECT_EQ(set.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(set.status().message().find("consumer 5"), std::string::npos) << set.status().message();
    EXPECT_NE(set.status().message().find("'a'"), std::string::npos) << set.status().message();
    EXPECT_EQ(n.registered + n.allocated, 0) << "refused before any memory was taken";
  }
}

TEST(ParamSet, ARegistrationFailureNamesTheParamAndReleasesWhatWasTaken) {
  CountingMemory::Counts n;
  auto memory = std::make_unique<CountingMemory>(n);
  memory->fail_register_ = true;
  TensorMap caller{{"c", Tensor::empty({64}, DType::kF32, "c")}};
  auto set = ParamSet::create(ParamSetOptions{2, true, 0}, decls(), caller, std::move(memory));
  ASSERT_FALSE(set.ok());
  EXPECT_NE(set.status().message().find("registering param 'c'"), std::string::npos) << set.status().message();
  EXPECT_EQ(n.allocated, 1);  // the push arena came first
  EXPECT_EQ(n.released, 1);   // and went back with the failed set
  EXPECT_TRUE(n.live.empty());
}

TEST(ParamSet, PaddingIsWrittenOnceAndIsTheCommittedView) {
  Plan plan;
  ASSERT_TRUE(plan.declare_param(TensorDecl{"c", DType::kF32, {64}}).ok());
  Layout tail;
  tail.shape = {16};
  tail.strides = {1};
  tail.offset = 48;
  ASSERT_TRUE(plan.add_zero(Zero{0, tail}).ok());
  TensorMap caller{{"c", Tensor::empty({64}, DType::kF32, "c")}};
  auto* c = reinterpret_cast<float*>(*caller.at("c").data_ptr());
  for (int i = 0; i < 64; ++i) c[i] = 1.0f;
  auto set = ParamSet::create(ParamSetOptions{0, false, 0}, decls(), caller, host_param_memory());
  ASSERT_TRUE(set.ok()) << set.status().to_string();
  ASSERT_TRUE((*set)->write_padding(plan).ok());
  for (int i = 0; i < 64; ++i) EXPECT_EQ(c[i], i < 48 ? 1.0f : 0.0f) << i;
  EXPECT_EQ(*(*set)->committed().at("c").data_ptr(), static_cast<void*>(c));
}

TEST(ParamSet, VersionsTornOnlyWhenTouchedAndCommittedViewMovesAtFinish) {
  auto set = ParamSet::create(ParamSetOptions{0, false, 0}, decls(), {}, host_param_memory());
  ASSERT_TRUE(set.ok()) << set.status().to_string();
  ParamSet& s = **set;
  EXPECT_FALSE(s.state().has_version);
  // A failed sync that wrote nothing: still nothing held, not torn.
  s.begin(1);
  s.abort();
  EXPECT_FALSE(s.state().torn);
  EXPECT_FALSE(s.state().has_version);
  // A sync that commits: post-processing may replace a param in the attempt's view; the
  // committed view follows only at finish.
  s.begin(1);
  const Tensor replaced = Tensor::empty({3}, DType::kBF16, "b");
  s.work()["b"] = replaced;
  EXPECT_NE(*s.committed().at("b").data_ptr(), *replaced.data_ptr());
  s.touch();
  s.finish(1);
  EXPECT_EQ(*s.committed().at("b").data_ptr(), *replaced.data_ptr());
  EXPECT_EQ(s.state().version, 1u);
  EXPECT_TRUE(s.state().has_version);
  EXPECT_FALSE(s.state().torn);
  // A new sync starts from the buffers again, not from the last post-processed view.
  s.begin(2);
  EXPECT_EQ(*s.work().at("b").data_ptr(), *s.loaded().at("b").data_ptr());
  // Touched, then failed: torn, still version 1.
  s.touch();
  s.abort();
  EXPECT_TRUE(s.torn());
  EXPECT_EQ(s.state().version, 1u);
  // A retry resets the attempt's view; a later commit clears torn.
  s.begin(3);
  s.work()["b"] = replaced;
  s.retry();
  EXPECT_EQ(*s.work().at("b").data_ptr(), *s.loaded().at("b").data_ptr());
  s.finish(3);
  EXPECT_FALSE(s.torn());
  EXPECT_EQ(s.state().version, 3u);
}

}  // namespace
}  // namespace ferry::engine

namespace ferry::engine {
namespace {

TEST(ParamSet, ARebindingOfACallerBufferIsRefusedNamingIt) {
  TensorMap caller{{"c", Tensor::empty({64}, DType::kF32, "c")}};
  auto set = ParamSet::create(ParamSetOptions{4, false, 0}, decls(), caller, host_param_memory());
  ASSERT_TRUE(set.ok()) << set.status().to_string();
  EXPECT_TRUE((*set)->check_rebound(caller).ok());
  TensorMap extra = caller;
  extra.emplace("not_a_param", Tensor::empty({2}, DType::kF32, "x"));
  EXPECT_TRUE((*set)->check_rebound(extra).ok()) << "names not passed at create are ignored";
  TensorMap moved{{"c", Tensor::empty({64}, DType::kF32, "c")}};
  Status s = (*set)->check_rebound(moved);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("consumer 4: param 'c' was re-bound"), std::string::npos) << s.message();
  s = (*set)->check_rebound({});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("'c' passed to create is no longer among the params"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace ferry::engine

namespace ferry::engine {
namespace {

// Writes `byte` into every byte a sync of the set would land: each loaded (landing)
// buffer, through its placement where it has one (as the transport lane does).
void land(ParamSet& s, std::byte byte) {
  for (const auto& [name, t] : s.loaded()) {
    auto data = t.data_ptr();
    ASSERT_TRUE(data.ok());
    std::memset(*data, static_cast<int>(byte), static_cast<size_t>(t.numel()) * dtype_size(t.dtype()));
    if (auto p = s.placements().find(name); p != s.placements().end()) {
      EXPECT_EQ(s.landing(p->second, 0).data, static_cast<std::byte*>(*data)) << name;
    }
  }
}

// Every byte of the committed view equals `byte`.
bool committed_is(const ParamSet& s, std::byte byte) {
  for (const auto& [name, t] : s.committed()) {
    auto data = t.data_ptr();
    if (!data.ok()) return false;
    for (int64_t k = 0; k < t.numel() * static_cast<int64_t>(dtype_size(t.dtype())); ++k)
      if (static_cast<const std::byte*>(*data)[k] != byte) return false;
  }
  return true;
}

// Shadow: a sync lands beside the live params; finish() only receives; commit() makes it
// live (a flip when the set owns both, pull); abort and discard leave the live params.
TEST(ParamSetShadow, LandsBesideTheLiveParamsAndCommitsByAFlipWhenItOwnsBoth) {
  CountingMemory::Counts n;
  {
    auto set = ParamSet::create(ParamSetOptions{2, false, 0, true}, decls(), {}, std::make_unique<CountingMemory>(n));
    ASSERT_TRUE(set.ok()) << set.status().to_string();
    ParamSet& s = **set;
    EXPECT_TRUE(s.flips());
    EXPECT_EQ(s.shadow_bytes(), 4096u);
    EXPECT_EQ(n.registered, 2);  // both sets (they swap roles)
    EXPECT_EQ(s.registrations().size(), 1u);
    EXPECT_EQ(s.registered_bytes(), 4096u);  // the live arena; the shadow is extra
    ASSERT_TRUE(s.write_padding(Plan()).ok());
    EXPECT_TRUE(committed_is(s, std::byte{0}));
    // Version 1 lands in the shadow; the live params stay zero until commit.
    s.begin(1);
    land(s, std::byte{1});
    s.touch();
    s.finish(1);
    EXPECT_TRUE(committed_is(s, std::byte{0}));
    EXPECT_EQ(s.state().received, std::optional<uint64_t>(1));
    EXPECT_FALSE(s.state().has_version);
    const void* landing_before = s.registrations()[0].base;
    auto v = s.commit();
    ASSERT_TRUE(v.ok()) << v.status().to_string();
    EXPECT_EQ(*v, 1u);
    EXPECT_TRUE(committed_is(s, std::byte{1}));
    EXPECT_NE(s.registrations()[0].base, landing_before);  // flipped: the next sync lands in the old live set
    EXPECT_EQ(s.state().version, 1u);
    EXPECT_FALSE(s.state().received.has_value());
    EXPECT_EQ(s.commit().status().code(), StatusCode::kFailedPrecondition);  // nothing received
    // Version 2 fails half way: the live params stay version 1, not torn.
    s.begin(2);
    land(s, std::byte{2});
    s.touch();
    s.abort();
    EXPECT_FALSE(s.torn());
    EXPECT_TRUE(committed_is(s, std::byte{1}));
    // Version 3 received and discarded: live stays 1; version 4 received and committed.
    s.begin(3);
    land(s, std::byte{3});
    s.finish(3);
    ASSERT_TRUE(s.discard().ok());
    EXPECT_EQ(s.discard().code(), StatusCode::kFailedPrecondition);
    EXPECT_TRUE(committed_is(s, std::byte{1}));
    s.begin(4);
    land(s, std::byte{4});
    s.finish(4);
    ASSERT_TRUE(s.commit().ok());
    EXPECT_TRUE(committed_is(s, std::byte{4}));
    EXPECT_EQ(s.state().version, 4u);
  }
  EXPECT_EQ(n.released, 2);
  EXPECT_TRUE(n.live.empty());
}

// Shadow with the caller's buffers: the caller's memory is never landed in (nor
// registered); commit copies into it; a param post-processing replaced is taken as it is.
TEST(ParamSetShadow, CommitsIntoTheCallersBuffersByACopy) {
  CountingMemory::Counts n;
  TensorMap caller;
  caller.emplace("a", Tensor::empty({4, 8}, DType::kF32, "a"));
  caller.emplace("c", Tensor::empty({64}, DType::kF32, "c"));
  for (auto& [name, t] : caller) ASSERT_TRUE(t.zero_().ok());
  auto set = ParamSet::create(ParamSetOptions{0, false, 0, true}, decls(), caller, std::make_unique<CountingMemory>(n));
  ASSERT_TRUE(set.ok()) << set.status().to_string();
  ParamSet& s = **set;
  EXPECT_FALSE(s.flips());
  EXPECT_EQ(n.registered, 1);  // the shadow only: "b"'s live arena and the caller's buffers are landed in by nobody
  ASSERT_EQ(s.placements().size(), 3u);
  for (const auto& [name, p] : s.placements()) {
    auto given = caller.find(name);
    if (given == caller.end()) continue;
    EXPECT_NE(s.landing(p, 0).data, *given->second.data_ptr()) << name;
  }
  s.begin(7);
  land(s, std::byte{7});
  s.finish(7);
  EXPECT_EQ(static_cast<const std::byte*>(*caller.at("a").data_ptr())[0], std::byte{0});
  // Post-processing replaced "c" with a tensor of its own.
  Tensor replaced = Tensor::empty({64}, DType::kF32, "c");
  ASSERT_TRUE(replaced.zero_().ok());
  s.work()["c"] = replaced;
  ASSERT_TRUE(s.commit().ok());
  EXPECT_TRUE(committed_is(s, std::byte{0}) == false);
  EXPECT_EQ(*s.committed().at("a").data_ptr(), *caller.at("a").data_ptr());  // the caller's buffer, now version 7
  for (int k = 0; k < 128; ++k) ASSERT_EQ(static_cast<const std::byte*>(*caller.at("a").data_ptr())[k], std::byte{7});
  EXPECT_EQ(*s.committed().at("c").data_ptr(), *replaced.data_ptr());
  EXPECT_EQ(static_cast<const std::byte*>(*caller.at("c").data_ptr())[0], std::byte{0});  // not copied over
}

// Push under shadow with its own params: both sets are the transport's memory (producers
// write into whichever READY names), published once as two sets laid out alike; commit
// flips them and the landing index alternates. With the caller's params, push commits by
// a copy (one published set: the shadow).
TEST(ParamSetShadow, PushFlipsTwoPublishedSetsAndCopiesIntoTheCallers) {
  {
    CountingMemory::Counts n;
    auto set = ParamSet::create(ParamSetOptions{0, true, 0, true}, decls(), {}, std::make_unique<CountingMemory>(n));
    ASSERT_TRUE(set.ok()) << set.status().to_string();
    ParamSet& s = **set;
    EXPECT_TRUE(s.flips());
    EXPECT_EQ(n.allocated, 2);  // both sets, written by producers on the host by plain copy
    ASSERT_EQ(s.published_set(0).size(), 1u);
    ASSERT_EQ(s.published_set(1).size(), 1u);
    EXPECT_NE(s.published_set(0)[0].base, s.published_set(1)[0].base);
    EXPECT_EQ(s.published_set(0)[0].length, s.published_set(1)[0].length);  // laid out alike
    ASSERT_TRUE(s.write_padding(Plan()).ok());
    for (int v = 1; v <= 4; ++v) {
      SCOPED_TRACE(v);
      const int landing = s.landing_index();
      EXPECT_EQ(landing, (v - 1) % 2);
      EXPECT_EQ(s.registrations()[0].base, s.published_set(landing)[0].base);  // syncs land in the named set
      EXPECT_EQ(*s.loaded().at("a").data_ptr(), s.published_set(landing)[0].base);
      s.begin(static_cast<uint64_t>(v));
      land(s, std::byte(static_cast<uint8_t>(v)));
      s.touch();
      s.finish(static_cast<uint64_t>(v));
      EXPECT_TRUE(committed_is(s, std::byte(static_cast<uint8_t>(v - 1))));  // the live set untouched
      ASSERT_TRUE(s.commit().ok());
      EXPECT_TRUE(committed_is(s, std::byte(static_cast<uint8_t>(v))));
      EXPECT_EQ(*s.committed().at("a").data_ptr(), s.published_set(landing)[0].base);  // flipped, not copied
      EXPECT_EQ(s.landing_index(), 1 - landing);
    }
    // A discard does not flip: the next sync lands in the same set again.
    const int before = s.landing_index();
    s.begin(5);
    land(s, std::byte{5});
    s.finish(5);
    ASSERT_TRUE(s.discard().ok());
    EXPECT_EQ(s.landing_index(), before);
    EXPECT_TRUE(committed_is(s, std::byte{4}));
  }
  {
    CountingMemory::Counts n;
    TensorMap caller;
    caller.emplace("a", Tensor::empty({4, 8}, DType::kF32, "a"));
    ASSERT_TRUE(caller.at("a").zero_().ok());
    auto set = ParamSet::create(ParamSetOptions{0, true, 0, true}, decls(), caller, std::make_unique<CountingMemory>(n));
    ASSERT_TRUE(set.ok()) << set.status().to_string();
    ParamSet& s = **set;
    EXPECT_FALSE(s.flips());
    EXPECT_EQ(n.allocated, 1);  // the shadow only
    EXPECT_TRUE(s.published_set(1).empty());
    EXPECT_EQ(s.landing_index(), 0);
    s.begin(1);
    land(s, std::byte{9});
    s.finish(1);
    ASSERT_TRUE(s.commit().ok());
    EXPECT_TRUE(committed_is(s, std::byte{9}));
    EXPECT_EQ(*s.committed().at("a").data_ptr(), *caller.at("a").data_ptr());  // copied into the caller's
    EXPECT_EQ(s.landing_index(), 0);
  }
}

// Groups (the bounded shadow): each layer group's params land in their room of a shadow
// the size of the groups in flight, and go live at commit_at while the others stay; a
// failed sync leaves the groups it committed new and the rest old (mixed, not torn); a
// param post-processing replaced is copied into the live buffer, one it made anew is
// taken at finish.
TEST(ParamSetGroups, EachGroupGoesLiveWholeFromABoundedShadow) {
  CountingMemory::Counts n;
  auto set = ParamSet::create(ParamSetOptions{1, false, 0, false, true}, decls(), {}, std::make_unique<CountingMemory>(n));
  ASSERT_TRUE(set.ok()) << set.status().to_string();
  ParamSet& s = **set;
  EXPECT_TRUE(s.placements().empty());  // nothing is landed in directly
  ASSERT_TRUE(s.write_padding(Plan()).ok());
  // Group 0 writes a (unit 0), group 1 writes b and c (unit 1): a's room is free again
  // by the time b and c open.
  PlanRoute pr;
  pr.params = decls();
  pr.groups.resize(2);
  pr.groups[0].unpacks.emplace_back().param = 0;
  pr.groups[1].unpacks.emplace_back().param = 1;
  pr.groups[1].unpacks.emplace_back().param = 2;
  const GroupShadow layout = group_shadow_layout(pr, nullptr, {{"a", 0}, {"b", 1}, {"c", 1}}, {});
  EXPECT_EQ(layout.host_bytes, 64u + 256u);  // b and c at once; a shares b's room
  ASSERT_TRUE(s.set_group_shadow(layout, pr.params).ok());
  EXPECT_EQ(s.shadow_bytes(), 4096u);
  auto fill = [&](const char* name, std::byte b) {
    const Tensor& t = s.work().at(name);
    std::memset(*t.data_ptr(), static_cast<int>(b), static_cast<size_t>(t.numel()) * dtype_size(t.dtype()));
  };
  auto live_is = [&](const char* name, std::byte b) {
    const Tensor& t = s.committed().at(name);
    const auto* d = static_cast<const std::byte*>(*t.data_ptr());
    for (int64_t k = 0; k < t.numel() * static_cast<int64_t>(dtype_size(t.dtype())); ++k)
      if (d[k] != b) return false;
    return true;
  };
  s.begin(1);
  ASSERT_TRUE(s.open_at(0).ok());
  fill("a", std::byte{1});
  EXPECT_TRUE(committed_is(s, std::byte{0}));
  ASSERT_TRUE(s.commit_at(0).ok());
  EXPECT_TRUE(live_is("a", std::byte{1}));
  EXPECT_TRUE(live_is("b", std::byte{0}) && live_is("c", std::byte{0}));
  ASSERT_TRUE(s.open_at(1).ok());
  fill("b", std::byte{1});  // (in a's old room: the live a stays)
  fill("c", std::byte{1});
  EXPECT_TRUE(live_is("a", std::byte{1}) && live_is("b", std::byte{0}));
  ASSERT_TRUE(s.commit_at(1).ok());
  s.finish(1);
  EXPECT_TRUE(committed_is(s, std::byte{1}));
  EXPECT_EQ(s.state().version, 1u);
  EXPECT_FALSE(s.state().mixed);
  // Version 2 fails after group 0 went live: a is 2, b and c are 1; mixed, not torn.
  s.begin(2);
  ASSERT_TRUE(s.open_at(0).ok());
  const Tensor& room = s.work().at("a");
  EXPECT_EQ(static_cast<const std::byte*>(*room.data_ptr())[5], std::byte{1});  // filled from the live a
  fill("a", std::byte{2});
  ASSERT_TRUE(s.commit_at(0).ok());
  ASSERT_TRUE(s.open_at(1).ok());
  fill("b", std::byte{2});
  s.abort();
  EXPECT_FALSE(s.torn());
  EXPECT_TRUE(s.state().mixed);
  EXPECT_EQ(s.state().version, 1u);
  EXPECT_TRUE(live_is("a", std::byte{2}) && live_is("b", std::byte{1}) && live_is("c", std::byte{1}));
  // Version 3: post-processing replaces a (copied into the live buffer, which stays where
  // it was) and makes a tensor of its own (taken at finish).
  const void* live_a = *s.committed().at("a").data_ptr();
  s.begin(3);
  ASSERT_TRUE(s.open_at(0).ok());
  Tensor replaced = Tensor::empty({4, 8}, DType::kF32, "a");
  std::memset(*replaced.data_ptr(), 3, 128);
  s.work().insert_or_assign("a", replaced);
  Tensor own = Tensor::empty({2}, DType::kF32, "a_scale");
  s.work().insert_or_assign("a_scale", own);
  ASSERT_TRUE(s.commit_at(0).ok());
  EXPECT_TRUE(live_is("a", std::byte{3}));
  EXPECT_EQ(*s.committed().at("a").data_ptr(), live_a);
  EXPECT_EQ(s.committed().count("a_scale"), 0u);
  ASSERT_TRUE(s.open_at(1).ok());
  fill("b", std::byte{3});
  fill("c", std::byte{3});
  ASSERT_TRUE(s.commit_at(1).ok());
  s.finish(3);
  EXPECT_TRUE(live_is("a", std::byte{3}) && live_is("b", std::byte{3}) && live_is("c", std::byte{3}));
  EXPECT_EQ(s.committed().count("a_scale"), 1u);
  EXPECT_FALSE(s.state().mixed);
  EXPECT_EQ(s.state().version, 3u);
}

}  // namespace
}  // namespace ferry::engine

// Tests for io/safetensors: round trips, borrowing, shards, and every validation error.
#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "ferry/safetensors.h"
#include "io/mapping_guard.h"
#include "test_paths.h"
#include "sanitizers.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;

// A per-test temporary folder, removed afterwards.
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "ferry-io-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

  // Writes raw bytes to `name` and returns the path.
  std::string write_raw(const std::string& name, const std::string& bytes) const {
    const std::string p = path(name);
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }
  // A file with header length `n` (default: the JSON's size), the JSON, then `data`.
  std::string write_crafted(const std::string& json, size_t data_bytes, std::optional<uint64_t> n = std::nullopt) const {
    return write_raw("crafted.safetensors", crafted(json, data_bytes, n));
  }
  static std::string crafted(const std::string& json, size_t data_bytes, std::optional<uint64_t> n = std::nullopt) {
    std::string out(8, '\0');
    const uint64_t len = n.value_or(json.size());
    for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((len >> (8 * i)) & 0xff);
    out += json;
    for (size_t i = 0; i < data_bytes; ++i) out += static_cast<char>(i & 0xff);
    return out;
  }
  // Opens the crafted file and expects kCorrupt with exactly "PATH: message".
  void expect_corrupt(const std::string& json, size_t data_bytes, const std::string& message,
                      std::optional<uint64_t> n = std::nullopt) {
    const std::string p = write_crafted(json, data_bytes, n);
    auto f = SafetensorsFile::open(p);
    ASSERT_FALSE(f.ok()) << json;
    EXPECT_EQ(f.status().code(), StatusCode::kCorrupt) << f.status().to_string();
    EXPECT_EQ(f.status().message(), p + ": " + message);
    // The pure parser says the same, without the path.
    const std::string bytes = crafted(json, data_bytes, n);
    auto h = parse_safetensors_header(std::as_bytes(std::span(bytes.data(), bytes.size())));
    ASSERT_FALSE(h.ok());
    EXPECT_EQ(h.status().message(), message);
  }
  // Like expect_corrupt, for messages whose tail comes from the JSON library.
  void expect_corrupt_prefix(const std::string& json, size_t data_bytes, const std::string& prefix) {
    const std::string p = write_crafted(json, data_bytes);
    auto f = SafetensorsFile::open(p);
    ASSERT_FALSE(f.ok()) << json;
    EXPECT_EQ(f.status().code(), StatusCode::kCorrupt) << f.status().to_string();
    EXPECT_TRUE(f.status().message().starts_with(p + ": " + prefix)) << f.status().message();
  }
  std::vector<std::string> files_in_dir() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

  std::string dir_;
};

// A real tensor filled with deterministic bytes valid for its dtype.
Tensor filled(Shape shape, DType dtype, uint32_t seed) {
  Tensor t = Tensor::empty(std::move(shape), dtype);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  std::mt19937 rng(seed);
  std::byte* p = *t.data_ptr();
  for (int64_t i = 0; i < t.nbytes(); ++i) {
    uint8_t b = static_cast<uint8_t>(rng());
    if (dtype == DType::kBool) b &= 1;
    p[i] = static_cast<std::byte>(b);
  }
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  auto eq = a.equal(b);
  EXPECT_TRUE(eq.ok()) << eq.status().to_string();
  return eq.ok() && *eq;
}

const DType kAllDTypes[] = {DType::kBF16, DType::kF16, DType::kF32, DType::kF8E4M3, DType::kF8E5M2, DType::kI8,
                            DType::kI16,  DType::kI32, DType::kI64, DType::kU8,     DType::kBool};

// ---------------------------------------------------------------------------------------
// Round trips

TEST_F(SafetensorsTest, RoundTripEveryDTypeAndShape) {
  const std::vector<Shape> shapes = {{}, {0}, {3, 0, 2}, {1}, {7}, {2, 3, 5}};
  std::vector<SafetensorsEntry> entries;
  uint32_t seed = 1;
  for (DType d : kAllDTypes) {
    for (size_t s = 0; s < shapes.size(); ++s) {
      entries.push_back({fmt::format("t.{}.{}", dtype_name(d), s), filled(shapes[s], d, seed++)});
    }
  }
  const std::string p = path("all.safetensors");
  ASSERT_TRUE(write_safetensors(p, entries, {{"format", "pt"}}).ok());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->size(), entries.size());
  EXPECT_EQ(f->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  for (const auto& e : entries) {
    auto t = f->get(e.name);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    EXPECT_EQ(t->dtype(), e.tensor.dtype()) << e.name;
    EXPECT_EQ(t->shape(), e.tensor.shape()) << e.name;
    EXPECT_EQ(t->name(), e.name);
    EXPECT_TRUE(t->is_real());
    EXPECT_TRUE(same_bytes(*t, e.tensor)) << e.name;
  }
  // Every tensor is aligned for its dtype (the reference order: larger dtypes first).
  for (const auto& e : f->tensors()) {
    const auto addr = reinterpret_cast<uintptr_t>(*e.tensor.data_ptr());
    EXPECT_EQ(addr % dtype_size(e.tensor.dtype()), 0u) << e.name;
  }
}

TEST_F(SafetensorsTest, RoundTripLargeTensor) {
  Tensor big = filled({1024, 4096}, DType::kBF16, 7);  // 8 MiB
  Tensor small = filled({3}, DType::kF32, 8);
  const std::string p = path("big.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"big", big}, {"small", small}}).ok());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_TRUE(same_bytes(*f->get("big"), big));
  EXPECT_TRUE(same_bytes(*f->get("small"), small));
  EXPECT_EQ(fs::file_size(p), 8 + f->header().header_size + 1024 * 4096 * 2 + 12);
}

// A checkpoint truncated while open (as a trainer rewriting it under `ferry check`): the
// default access read it whole, so its tensors keep their bytes; a mapped one would
// raise SIGBUS on the first touch of a page past the new end.
TEST_F(SafetensorsTest, TruncatedAfterOpenKeepsItsBytes) {
  const Tensor big = filled({256, 1024}, DType::kF32, 7);  // 1 MiB: pages never touched by open
  const std::string p = path("trunc.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"big", big}}).ok());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  fs::resize_file(p, 16);
  auto t = f->get("big");
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(same_bytes(*t, big));
  // Opening the truncated file now is an error naming it.
  auto again = SafetensorsFile::open(p);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find(p), std::string::npos) << again.status().to_string();
}

// The same under kMap, watched by a TruncationGuard (what `ferry serve` does): the touch
// of a page past the new end is an exit with the guard's status and a message naming the
// file and the byte, not SIGBUS; a SIGBUS anywhere else still takes the default action.
#if FERRY_TEST_ASAN
// The guard's own SIGBUS handling is what the next test checks: under ASan (make asan)
// the sanitizer must not take SIGBUS first (its default handle_sigbus=1 reports "BUS"
// and exits 1 before the guard runs).
extern "C" const char* __asan_default_options() { return "handle_sigbus=0"; }
#endif

TEST_F(SafetensorsTest, MappedAndTruncatedUnderAGuardIsAnErrorExit) {
  const Tensor big = filled({256, 1024}, DType::kF32, 7);  // 1 MiB
  const std::string p = path("guarded.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"big", big}}).ok());
  const auto touch_after_truncation = [&] {
    auto f = SafetensorsFile::open(p, SafetensorsAccess::kMap);
    if (!f.ok()) std::_Exit(90);
    auto guard = io::TruncationGuard::watch(f->bytes().data(), f->bytes().size(), "mapped " + p + " was truncated", 3);
    if (!guard.ok()) std::_Exit(91);
    fs::resize_file(p, 16);
    const volatile std::byte* last = f->bytes().data() + f->bytes().size() - 1;
    (void)*last;
    std::_Exit(92);
  };
  EXPECT_EXIT(touch_after_truncation(), ::testing::ExitedWithCode(3),
              "mapped .*guarded.safetensors was truncated \\(byte [0-9]+ of the [0-9]+ mapped\\)");
  const auto elsewhere = [] {
    static const std::byte watched[4096] = {};
    auto guard = io::TruncationGuard::watch(watched, sizeof(watched), "not this", 3);
    if (!guard.ok()) std::_Exit(91);
    ::raise(SIGBUS);
    std::_Exit(92);
  };
  EXPECT_EXIT(elsewhere(), ::testing::KilledBySignal(SIGBUS), "");
}

// kMap serves the same bytes without a copy (for callers that rule truncation out).
TEST_F(SafetensorsTest, MappedAccessServesTheSameBytes) {
  const Tensor t = filled({64, 33}, DType::kBF16, 3);
  const std::string p = path("map.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"t", t}}).ok());
  auto f = SafetensorsFile::open(p, SafetensorsAccess::kMap);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  auto got = f->get("t");
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(got->is_read_only());
  EXPECT_TRUE(same_bytes(*got, t));
}

TEST_F(SafetensorsTest, NonContiguousTensorsAreWrittenContiguous) {
  Tensor base = filled({4, 6}, DType::kF32, 3);
  Tensor tr = base.t();                  // [6, 4], strided
  Tensor sl = base.slice(1, 1, 6, 2);    // [4, 3], strided
  Tensor nar = base.narrow(0, 1, 2);     // contiguous with an offset
  ASSERT_FALSE(tr.is_contiguous());
  const std::string p = path("views.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"tr", tr}, {"sl", sl}, {"nar", nar}}).ok());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  for (const auto& [name, want] : std::vector<std::pair<std::string, Tensor>>{{"tr", tr}, {"sl", sl}, {"nar", nar}}) {
    Tensor got = *f->get(name);
    EXPECT_EQ(got.shape(), want.shape()) << name;
    EXPECT_TRUE(got.is_contiguous());
    EXPECT_EQ(*got.to_vector(), *want.to_vector()) << name;
  }
  EXPECT_EQ(fs::file_size(p), 8 + f->header().header_size + (24 + 12 + 12) * 4);
}

TEST_F(SafetensorsTest, WriterMatchesReferenceBytes) {
  // What the reference (Rust/Python safetensors) writes for
  // save_file({"b": zeros(2, int8), "a": zeros(1, 2, float32)}, metadata={"format": "pt"}):
  // __metadata__ first, then by dtype size (F32 before I8), compact JSON, padded to 8.
  Tensor a = Tensor::empty({1, 2}, DType::kF32);
  Tensor b = Tensor::empty({2}, DType::kI8);
  std::vector<size_t> order;
  auto h = encode_safetensors_header({{"b", b}, {"a", a}}, {{"format", "pt"}}, &order);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  std::string json =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"I8","shape":[2],"data_offsets":[8,10]}})";
  json.append((8 - json.size() % 8) % 8, ' ');
  EXPECT_EQ(*h, crafted(json, 0));
  EXPECT_EQ(order, (std::vector<size_t>{1, 0}));

  const std::string p = path("ref.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"b", b}, {"a", a}}, {{"format", "pt"}}).ok());
  std::ifstream in(p, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(bytes, crafted(json, 0) + std::string(10, '\0'));
}

TEST_F(SafetensorsTest, HeaderIsPaddedToEightAndNamesAreEscaped) {
  const std::string name = "we\"ird\\name\n\xc3\xa9";
  const std::string p = path("pad.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{name, filled({3}, DType::kU8, 1)}}, {{"k\"", "v\x01"}}).ok());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->header().header_size % 8, 0u);
  EXPECT_TRUE(f->contains(name));
  EXPECT_EQ(f->metadata().at("k\""), "v\x01");
}

TEST_F(SafetensorsTest, EmptyFileWithNoTensors) {
  const std::string p = path("empty.safetensors");
  ASSERT_TRUE(write_safetensors(p, {}).ok());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->size(), 0u);
  EXPECT_TRUE(f->metadata().empty());
  EXPECT_EQ(fs::file_size(p), 16u);  // "{}" padded to 8
}

TEST_F(SafetensorsTest, OverwriteReplacesTheFile) {
  const std::string p = path("w.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"x", filled({100}, DType::kF32, 1)}}).ok());
  Tensor y = filled({2}, DType::kI64, 2);
  ASSERT_TRUE(write_safetensors(p, {{"y", y}}).ok());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok());
  EXPECT_FALSE(f->contains("x"));
  EXPECT_TRUE(same_bytes(*f->get("y"), y));
  EXPECT_EQ(files_in_dir(), std::vector<std::string>{"w.safetensors"});
}

TEST_F(SafetensorsTest, RewritingAFileFromItsOwnTensors) {
  // The new file is renamed over the old one; the old mapping (old inode) stays valid.
  Tensor a = filled({16}, DType::kF16, 1);
  const std::string p = path("self.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"a", a}}).ok());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok());
  std::vector<SafetensorsEntry> entries = f->tensors();
  entries.push_back({"b", f->get("a")->narrow(0, 0, 4)});
  ASSERT_TRUE(write_safetensors(p, entries, {{"rev", "2"}}).ok());
  auto g = SafetensorsFile::open(p);
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_TRUE(same_bytes(*g->get("a"), a));
  EXPECT_TRUE(same_bytes(*g->get("b"), a.narrow(0, 0, 4)));
  EXPECT_TRUE(same_bytes(*f->get("a"), a));
  EXPECT_EQ(g->metadata().at("rev"), "2");
}

// ---------------------------------------------------------------------------------------
// Reading: borrowing, lookup, file order

TEST_F(SafetensorsTest, ViewsOutliveTheReader) {
  Tensor w = filled({8, 4}, DType::kF32, 5);
  const std::string p = path("keep.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"w", w}}).ok());
  Tensor view;
  {
    auto f = SafetensorsFile::open(p);
    ASSERT_TRUE(f.ok());
    view = f->get("w")->narrow(0, 2, 3).t();
    SafetensorsFile copy = *f;  // copies share the mapping too
    (void)copy;
  }
  // The file object is gone; the view still holds the mapping. Even removing the file
  // does not unmap it.
  fs::remove(p);
  EXPECT_EQ(*view.to_vector(), *w.narrow(0, 2, 3).t().to_vector());
  EXPECT_TRUE(same_bytes(view.contiguous(), w.narrow(0, 2, 3).t().contiguous()));
}

TEST_F(SafetensorsTest, TensorsAreInFileOrderAndLookupWorks) {
  const std::string p = path("order.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"c", filled({2}, DType::kI8, 1)},
                                    {"b", filled({2}, DType::kF32, 2)},
                                    {"a", filled({2}, DType::kI8, 3)}})
                  .ok());
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok());
  std::vector<std::string> names;
  for (const auto& e : f->tensors()) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"b", "a", "c"}));
  EXPECT_EQ(f->header().tensors[1].begin, 8u);
  EXPECT_NE(f->find("a"), nullptr);
  EXPECT_EQ(f->find("zz"), nullptr);
  auto missing = f->get("zz");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(), "tensor 'zz' is not in " + p);
  EXPECT_EQ(f->path(), p);
}

TEST_F(SafetensorsTest, ReadsUnalignedThirdPartyFiles) {
  // A header whose length is not a multiple of 8: the F32 data starts at file offset
  // 8 + 61, unaligned. Reads go through memcpy-based element access.
  const std::string json = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}     )";
  ASSERT_NE((8 + json.size()) % 4, 0u);
  std::string bytes = crafted(json, 0);
  const float v[2] = {1.5f, -2.0f};
  bytes.append(reinterpret_cast<const char*>(v), sizeof(v));
  const std::string p = write_raw("unaligned.safetensors", bytes);
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(*f->get("x")->to_vector(), (std::vector<double>{1.5, -2.0}));
  EXPECT_EQ(*f->get("x")->clone().to_vector(), (std::vector<double>{1.5, -2.0}));
}

TEST_F(SafetensorsTest, ZeroSizedTensorsAnywhereAreValid) {
  // Empty tensors at the start, between two tensors, and at the very end.
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},)"
                 R"("b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                 R"("c":{"dtype":"U8","shape":[0],"data_offsets":[3,3]}})",
                 3, "byte buffer has a hole: bytes [2, 3) before tensor 'c' belong to no tensor (after tensor 'b')");
  const std::string p = write_crafted(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},)"
                                      R"("b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                                      R"("m":{"dtype":"I32","shape":[0, 5],"data_offsets":[2,2]},)"
                                      R"("c":{"dtype":"U8","shape":[1],"data_offsets":[2,3]},)"
                                      R"("z":{"dtype":"BF16","shape":[3, 0],"data_offsets":[3,3]}})",
                                      3);
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  std::vector<std::string> names;
  for (const auto& e : f->tensors()) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"a", "b", "m", "c", "z"}));
  EXPECT_EQ(f->get("z")->shape(), (Shape{3, 0}));
}

TEST_F(SafetensorsTest, NullMetadataAndExtraFieldsAreAccepted) {
  const std::string p = write_crafted(
      R"({"__metadata__":null,"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"extra":true}})", 2);
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_TRUE(f->metadata().empty());
  EXPECT_EQ(f->size(), 1u);
}

TEST_F(SafetensorsTest, OpenErrors) {
  auto missing = SafetensorsFile::open(path("nope.safetensors"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(), path("nope.safetensors") + ": no such file");
  auto d = SafetensorsFile::open(dir_);
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(d.status().message(), dir_ + ": not a regular file");
}

// ---------------------------------------------------------------------------------------
// Directory of shards

TEST_F(SafetensorsTest, DirectoryOfShards) {
  Tensor a = filled({4}, DType::kBF16, 1), b = filled({2, 2}, DType::kF32, 2), c = filled({3}, DType::kI8, 3);
  ASSERT_TRUE(write_safetensors(path("model-00002-of-00002.safetensors"), {{"c", c}}).ok());
  ASSERT_TRUE(write_safetensors(path("model-00001-of-00002.safetensors"), {{"a", a}, {"b", b}}).ok());
  write_raw("model.safetensors.index.json", "{}");
  write_raw("README.md", "not a checkpoint");
  fs::create_directory(path("sub.safetensors"));  // a folder, ignored

  auto d = SafetensorsDir::open(dir_);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->dir(), dir_);
  ASSERT_EQ(d->files().size(), 2u);
  EXPECT_EQ(d->files()[0].path(), path("model-00001-of-00002.safetensors"));
  std::vector<std::string> names;
  for (const auto& e : d->tensors()) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"b", "a", "c"}));
  EXPECT_EQ(d->size(), 3u);
  EXPECT_TRUE(same_bytes(*d->get("a"), a));
  EXPECT_TRUE(same_bytes(*d->get("c"), c));
  EXPECT_TRUE(d->contains("b"));
  EXPECT_EQ(d->find("x"), nullptr);
  EXPECT_EQ(d->file_of("c")->path(), path("model-00002-of-00002.safetensors"));
  EXPECT_EQ(d->file_of("x"), nullptr);
  auto missing = d->get("x");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(), "tensor 'x' is not in any *.safetensors file of " + dir_);

  // Tensors outlive the dir object.
  Tensor keep = *d->get("b");
  d = SafetensorsDir::open(dir_);
  EXPECT_TRUE(same_bytes(keep, b));
}

TEST_F(SafetensorsTest, DirectoryDuplicateTensorNamesBothFiles) {
  ASSERT_TRUE(write_safetensors(path("a.safetensors"), {{"x", filled({1}, DType::kU8, 1)}}).ok());
  ASSERT_TRUE(write_safetensors(path("b.safetensors"), {{"y", filled({1}, DType::kU8, 1)},
                                                         {"x", filled({1}, DType::kU8, 1)}})
                  .ok());
  auto d = SafetensorsDir::open(dir_);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(d.status().message(),
            "tensor 'x' appears in both '" + path("a.safetensors") + "' and '" + path("b.safetensors") + "'");
}

TEST_F(SafetensorsTest, DirectoryErrors) {
  auto empty = SafetensorsDir::open(dir_);
  EXPECT_EQ(empty.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(empty.status().message(), dir_ + ": no *.safetensors files");

  auto missing = SafetensorsDir::open(path("nope"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(missing.status().message(), path("nope") + ": no such directory");

  const std::string file = write_raw("x.safetensors", "short");
  auto notdir = SafetensorsDir::open(file);
  EXPECT_EQ(notdir.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(notdir.status().message(), file + ": not a directory");

  // A corrupt shard: its error, prefixed with its path.
  auto bad = SafetensorsDir::open(dir_);
  EXPECT_EQ(bad.status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(bad.status().message(), file + ": file is 5 bytes, too short for the 8-byte header length");
}

// ---------------------------------------------------------------------------------------
// Writer errors

TEST_F(SafetensorsTest, WriterErrorsLeaveNothingBehind) {
  Tensor ok = filled({2}, DType::kF32, 1);
  struct Case {
    std::vector<SafetensorsEntry> entries;
    std::map<std::string, std::string> metadata;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{{"w", Tensor::source("model.w", {2}, DType::kF32)}},
       {},
       "write_safetensors: tensor 'w' is recording (source 'model.w' [2] bf16): it has no bytes to write"},
      {{{"a", ok}, {"a", ok}}, {}, "write_safetensors: tensor 'a' appears twice"},
      {{{"", ok}}, {}, "write_safetensors: tensor 0 has an empty name"},
      {{{"__metadata__", ok}}, {}, "write_safetensors: '__metadata__' is not a tensor name"},
      {{{"bad\xff", ok}}, {}, "write_safetensors: tensor 0 has a name that is not valid UTF-8"},
      {{{"a", ok}}, {{"k", "\xc0\xaf"}}, "write_safetensors: __metadata__ entry is not valid UTF-8"},
  };
  for (const auto& c : cases) {
    Status st = write_safetensors(path("out.safetensors"), c.entries, c.metadata);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    // The recording describe() text is the tensor module's; compare the stable part.
    if (c.message.find("recording") != std::string::npos) {
      EXPECT_TRUE(st.message().starts_with("write_safetensors: tensor 'w' is recording (source 'model.w'"))
          << st.message();
      EXPECT_TRUE(st.message().ends_with("): it has no bytes to write")) << st.message();
    } else {
      EXPECT_EQ(st.message(), c.message);
    }
  }
  Status err = write_safetensors(path("out.safetensors"), {{"e", Tensor::error(invalid_argument("boom"))}});
  EXPECT_EQ(err.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(err.message(), "write_safetensors: tensor 'e': boom");
  Status undef = write_safetensors(path("out.safetensors"), {{"u", Tensor()}});
  EXPECT_FALSE(undef.ok());
  EXPECT_TRUE(undef.message().starts_with("write_safetensors: tensor 'u'")) << undef.message();

  // Nothing was written for any of them.
  EXPECT_TRUE(files_in_dir().empty());

  // The OS refusing: a missing folder.
  Status io = write_safetensors(path("nope/out.safetensors"), {{"a", ok}});
  EXPECT_EQ(io.code(), StatusCode::kIoError);
  EXPECT_TRUE(io.message().starts_with("write_safetensors: " + path("nope/out.safetensors") + ": create "))
      << io.message();
  EXPECT_TRUE(files_in_dir().empty());
}

TEST_F(SafetensorsTest, FailedRenameRemovesTheTemporaryFile) {
  // The destination is a non-empty folder: rename fails after the data is written.
  fs::create_directories(path("dest.safetensors/x"));
  Status st = write_safetensors(path("dest.safetensors"), {{"a", filled({4}, DType::kI16, 1)}});
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_TRUE(st.message().starts_with("write_safetensors: " + path("dest.safetensors") + ": rename "))
      << st.message();
  EXPECT_EQ(files_in_dir(), std::vector<std::string>{"dest.safetensors"});
}

// ---------------------------------------------------------------------------------------
// Validation errors, each with its message

TEST_F(SafetensorsTest, ErrorTruncatedFile) {
  for (size_t n : {0, 1, 7}) {
    const std::string p = write_raw("short.safetensors", std::string(n, '\x01'));
    auto f = SafetensorsFile::open(p);
    EXPECT_EQ(f.status().code(), StatusCode::kCorrupt);
    EXPECT_EQ(f.status().message(), fmt::format("{}: file is {} bytes, too short for the 8-byte header length", p, n));
  }
}

TEST_F(SafetensorsTest, ErrorHeaderLongerThanFile) {
  expect_corrupt("{}", 0, "header length 100 exceeds the 2 bytes after the length field (truncated file?)", 100);
  // A valid file cut short in its header.
  Tensor t = filled({4}, DType::kF32, 1);
  const std::string p = path("cut.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"t", t}}).ok());
  const auto full = fs::file_size(p);
  fs::resize_file(p, 20);
  auto f = SafetensorsFile::open(p);
  EXPECT_EQ(f.status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(f.status().message(), fmt::format("{}: header length {} exceeds the 12 bytes after the length field "
                                              "(truncated file?)",
                                              p, full - 16 - 8));
}

TEST_F(SafetensorsTest, ErrorTruncatedData) {
  // A valid file cut short in its byte buffer: the last tensor is out of range.
  Tensor t = filled({4}, DType::kF32, 1);
  const std::string p = path("cut.safetensors");
  ASSERT_TRUE(write_safetensors(p, {{"t", t}}).ok());
  fs::resize_file(p, fs::file_size(p) - 3);
  auto f = SafetensorsFile::open(p);
  EXPECT_EQ(f.status().code(), StatusCode::kCorrupt);
  EXPECT_EQ(f.status().message(),
            p + ": tensor 't': data_offsets [0, 16] are out of range: the byte buffer holds 13 bytes");
}

TEST_F(SafetensorsTest, ErrorHeaderTooBig) {
  expect_corrupt("{}", 0, "header length 100000001 exceeds the limit of 100000000 bytes", 100'000'001);
  expect_corrupt("{}", 0, "header length 18446744073709551615 exceeds the limit of 100000000 bytes", UINT64_MAX);
}

TEST_F(SafetensorsTest, ErrorNotJson) {
  // The text after "column N: " is nlohmann-json's; check ours and the position.
  expect_corrupt_prefix("{\"a\":", 0, "header is not valid JSON: parse error at line 1, column 6: syntax error");
  expect_corrupt_prefix("", 0, "header is not valid JSON: parse error at line 1, column 1: syntax error");
  expect_corrupt_prefix("{} x", 0, "header is not valid JSON: parse error at line 1, column 4: syntax error");
  expect_corrupt_prefix("{\"a\":1,}", 0, "header is not valid JSON: parse error at line 1, column 8: syntax error");
  // Invalid UTF-8 inside a string.
  const std::string bad = crafted("{\"\xff\":1}", 0);
  const auto h = parse_safetensors_header(std::as_bytes(std::span(bad.data(), bad.size())));
  EXPECT_EQ(h.status().code(), StatusCode::kCorrupt);
  EXPECT_TRUE(h.status().message().starts_with("header is not valid JSON: parse error at line 1, column 3: "))
      << h.status().message();
}

TEST_F(SafetensorsTest, ErrorNotAnObject) {
  expect_corrupt("[1, 2]", 0, "header is not a JSON object (got array)");
  expect_corrupt("\"x\"", 0, "header is not a JSON object (got string \"x\")");
  expect_corrupt("null", 0, "header is not a JSON object (got null)");
  expect_corrupt("12", 0, "header is not a JSON object (got number 12)");
}

TEST_F(SafetensorsTest, ErrorDuplicateName) {
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                 R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                 2, "tensor 'a' appears twice in the header");
}

TEST_F(SafetensorsTest, ErrorEntryNotObject) {
  expect_corrupt(R"({"a":[1]})", 0, "tensor 'a': entry is not a JSON object (got array)");
  expect_corrupt(R"({"a":"F32"})", 0, "tensor 'a': entry is not a JSON object (got string \"F32\")");
}

TEST_F(SafetensorsTest, ErrorMissingFields) {
  expect_corrupt(R"({"a":{"shape":[1],"data_offsets":[0,1]}})", 1, "tensor 'a': missing 'dtype'");
  expect_corrupt(R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", 1, "tensor 'a': missing 'shape'");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[1]}})", 1, "tensor 'a': missing 'data_offsets'");
}

TEST_F(SafetensorsTest, ErrorWrongTypedFields) {
  expect_corrupt(R"({"a":{"dtype":4,"shape":[1],"data_offsets":[0,1]}})", 1,
                 "tensor 'a': 'dtype' is not a string (got number 4)");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":1,"data_offsets":[0,1]}})", 1,
                 "tensor 'a': 'shape' is not an array (got number 1)");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":{},"data_offsets":[0,1]}})", 1,
                 "tensor 'a': 'shape' is not an array (got object)");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":["1"],"data_offsets":[0,1]}})", 1,
                 "tensor 'a': shape entry 0 is not a non-negative integer (got string \"1\")");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":"0,1"}})", 1,
                 "tensor 'a': 'data_offsets' is not an array of 2 integers (got string \"0,1\")");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", 1,
                 "tensor 'a': 'data_offsets' is not an array of 2 integers (got array of 3)");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", 1,
                 "tensor 'a': 'data_offsets' is not an array of 2 integers (got array of 1)");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,null]}})", 1,
                 "tensor 'a': data_offsets entry 1 is not a non-negative integer (got null)");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[-1,1]}})", 1,
                 "tensor 'a': data_offsets entry 0 is not a non-negative integer (got number -1)");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1.0]}})", 1,
                 "tensor 'a': data_offsets entry 1 is not a non-negative integer (got number 1)");
}

TEST_F(SafetensorsTest, ErrorUnknownDType) {
  const std::string known = "BF16, F16, F32, F8_E4M3, F8_E5M2, I8, I16, I32, I64, U8, BOOL";
  expect_corrupt(R"({"model.w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8,
                 "tensor 'model.w': unknown dtype 'F64' (ferry reads " + known + ")");
  // torch spellings are not safetensors dtypes
  expect_corrupt(R"({"model.w":{"dtype":"bfloat16","shape":[1],"data_offsets":[0,2]}})", 2,
                 "tensor 'model.w': unknown dtype 'bfloat16' (ferry reads " + known + ")");
  expect_corrupt(R"({"model.w":{"dtype":"bf16","shape":[1],"data_offsets":[0,2]}})", 2,
                 "tensor 'model.w': unknown dtype 'bf16' (ferry reads " + known + ")");
}

TEST_F(SafetensorsTest, ErrorBadShapeEntries) {
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[2,-1],"data_offsets":[0,2]}})", 2,
                 "tensor 'a': shape entry 1 is not a non-negative integer (got number -1)");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[2.5],"data_offsets":[0,2]}})", 2,
                 "tensor 'a': shape entry 0 is not a non-negative integer (got number 2.5)");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}})", 2,
                 "tensor 'a': shape entry 0 is not a non-negative integer (got number 2)");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[true],"data_offsets":[0,2]}})", 2,
                 "tensor 'a': shape entry 0 is not a non-negative integer (got boolean)");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,2]}})", 2,
                 "tensor 'a': shape entry 0 is 9223372036854775808, more than 2^63 - 1");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,2]}})", 2,
                 "tensor 'a': shape entry 0 is not a non-negative integer (got number 1.8446744073709552e+19)");
}

TEST_F(SafetensorsTest, ErrorOffsetsReversed) {
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,2]}})", 4,
                 "tensor 'a': data_offsets [4, 2] are reversed (begin > end)");
}

TEST_F(SafetensorsTest, ErrorOffsetsOutOfRange) {
  expect_corrupt(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 12,
                 "tensor 'a': data_offsets [0, 16] are out of range: the byte buffer holds 12 bytes");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[18446744073709551615,18446744073709551615]}})",
                 0,
                 "tensor 'a': data_offsets [18446744073709551615, 18446744073709551615] are out of range: the "
                 "byte buffer holds 0 bytes");
}

TEST_F(SafetensorsTest, ErrorOverlap) {
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})",
                 12, "tensor 'b': data_offsets [4, 12] overlap tensor 'a' at [0, 8]");
  // Identical ranges.
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"I16","shape":[4],"data_offsets":[0,8]}})",
                 8, "tensor 'b': data_offsets [0, 8] overlap tensor 'a' at [0, 8]");
  // An empty tensor inside another one.
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"U8","shape":[0],"data_offsets":[3,3]}})",
                 8, "tensor 'b': data_offsets [3, 3] overlap tensor 'a' at [0, 8]");
}

TEST_F(SafetensorsTest, ErrorHoles) {
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                 R"("b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})",
                 10, "byte buffer has a hole: bytes [4, 6) before tensor 'b' belong to no tensor (after tensor 'a')");
  expect_corrupt(R"({"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6,
                 "byte buffer has a hole: bytes [0, 2) before tensor 'b' belong to no tensor");
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 7,
                 "byte buffer has 3 trailing bytes [4, 7) that belong to no tensor (after tensor 'a')");
  expect_corrupt(R"({})", 5, "byte buffer has 5 trailing bytes [0, 5) that belong to no tensor");
}

TEST_F(SafetensorsTest, ErrorSizeMismatch) {
  expect_corrupt(R"({"model.norm.weight":{"dtype":"BF16","shape":[4],"data_offsets":[0,10]}})", 10,
                 "tensor 'model.norm.weight': data_offsets [0, 10] hold 10 bytes but shape [4] x BF16 needs 8");
  expect_corrupt(R"({"a":{"dtype":"I64","shape":[],"data_offsets":[0,4]}})", 4,
                 "tensor 'a': data_offsets [0, 4] hold 4 bytes but shape [] x I64 needs 8");
}

TEST_F(SafetensorsTest, ErrorNumelOverflow) {
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}})", 0,
                 "tensor 'a': shape [4294967296, 4294967296, 16] has too many elements (the product overflows 64 "
                 "bits)");
  // Overflow hidden behind a zero is still refused (layout strides would overflow).
  expect_corrupt(R"({"a":{"dtype":"U8","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}})", 0,
                 "tensor 'a': shape [0, 4294967296, 4294967296] has too many elements (the product overflows 64 "
                 "bits)");
  // Within 64 bits, but past what a tensor may span (2^56, a zero size counted as one):
  // the fuzzer's input that the reader accepted and Tensor::borrow then refused.
  expect_corrupt(R"({"w":{"dtype":"U8","shape":[4294,12972,4694967296,0],"data_offsets":[0,0]}})", 0,
                 "tensor 'w': shape [4294, 12972, 4694967296, 0] spans 261517979089379328 elements (a zero size "
                 "counted as one), more than a tensor's 2^56");
  // numel fits but numel x dtype size does not.
  expect_corrupt(R"({"a":{"dtype":"I64","shape":[4611686018427387904],"data_offsets":[0,0]}})", 0,
                 "tensor 'a': shape [4611686018427387904] x I64 needs more than 2^64 bytes");
}

TEST_F(SafetensorsTest, ErrorBadMetadata) {
  expect_corrupt(R"({"__metadata__":[1]})", 0, "__metadata__ is not a JSON object (got array)");
  expect_corrupt(R"({"__metadata__":"pt"})", 0, "__metadata__ is not a JSON object (got string \"pt\")");
  expect_corrupt(R"({"__metadata__":{"format":"pt","step":3}})", 0,
                 "__metadata__ entry 'step' is not a string (got number 3)");
  expect_corrupt(R"({"__metadata__":{"format":{"a":"b"}}})", 0,
                 "__metadata__ entry 'format' is not a string (got object)");
}

// The fuzz seeds stay what their names say: valid_* open, bad_* are refused.
TEST(SafetensorsSeeds, FuzzSeedsAreWhatTheySay) {
  const fs::path seeds = fs::path(FERRY_SOURCE_DIR) / "fuzz/seeds/fuzz_safetensors_header";
  int n = 0;
  for (const auto& e : fs::directory_iterator(seeds)) {
    const std::string name = e.path().filename().string();
    auto f = SafetensorsFile::open(e.path().string());
    if (name.starts_with("valid_")) {
      EXPECT_TRUE(f.ok()) << name << ": " << f.status().to_string();
    } else {
      EXPECT_EQ(f.status().code(), StatusCode::kCorrupt) << name << ": " << f.status().to_string();
    }
    ++n;
  }
  EXPECT_GE(n, 10);
}

}  // namespace
}  // namespace ferry

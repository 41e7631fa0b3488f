// Property test: random chains of view ops on random shapes. The same chain runs on a
// recording source (recorded into a plan, replayed by the executor) and on a real
// tensor whose elements are their own flat index (the index-tracing oracle); the
// parameter buffers must be bit-identical.
#include <algorithm>
#include <numeric>
#include <cstdio>
#include <random>

#include <gtest/gtest.h>

#include "ferry/plan.h"

namespace ferry {
namespace {

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  int64_t uniform(int64_t lo, int64_t hi) {  // inclusive
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen);
  }
  bool coin(double p = 0.5) { return std::bernoulli_distribution(p)(gen); }
};

// A random shape with the given numel (factors drawn from its divisors).
Shape random_factorization(Rng& rng, int64_t numel) {
  Shape s;
  if (numel == 0) {
    s = {rng.uniform(1, 3), 0};
    if (rng.coin()) std::swap(s[0], s[1]);
    return s;
  }
  int64_t rest = numel;
  const int64_t dims = rng.uniform(1, 4);
  for (int64_t d = 0; d + 1 < dims; ++d) {
    std::vector<int64_t> divs;
    for (int64_t k = 1; k <= rest; ++k) {
      if (rest % k == 0) divs.push_back(k);
    }
    const int64_t f = divs[rng.uniform(0, static_cast<int64_t>(divs.size()) - 1)];
    s.push_back(f);
    rest /= f;
  }
  s.push_back(rest);
  if (rng.coin(0.3)) s[rng.uniform(0, static_cast<int64_t>(s.size()) - 1)] = -1;
  if (rng.coin(0.1)) s.insert(s.begin() + rng.uniform(0, static_cast<int64_t>(s.size())), 1);
  return s;
}

// One random op, applied identically to both tensors. Returns a description.
std::string apply_random_op(Rng& rng, Tensor& a, Tensor& b) {
  const int64_t nd = a.dim();
  const int op = static_cast<int>(rng.uniform(0, 17));
  auto rdim = [&] { return rng.uniform(-nd, nd - 1); };
  std::string desc;
  auto both = [&](auto f, std::string d) {
    a = f(a);
    b = f(b);
    desc = std::move(d);
  };
  switch (op) {
    case 0: {
      if (nd == 0) return "skip";
      const int64_t d = rng.uniform(0, nd - 1);
      const int64_t size = a.size(d);
      const int64_t start = rng.uniform(0, size);
      const int64_t len = rng.uniform(0, size - start);
      both([&](const Tensor& t) { return t.narrow(d, start, len); }, fmt::format("narrow({},{},{})", d, start, len));
      break;
    }
    case 1: {
      if (nd == 0 || a.numel() == 0) return "skip";
      const int64_t d = rng.uniform(0, nd - 1);
      const int64_t i = rng.uniform(-a.size(d), a.size(d) - 1);
      both([&](const Tensor& t) { return t.select(d, i); }, fmt::format("select({},{})", d, i));
      break;
    }
    case 2: {
      if (nd == 0) return "skip";
      const int64_t d = rdim();
      const int64_t size = a.size(d);
      std::optional<int64_t> start, stop;
      if (rng.coin()) start = rng.uniform(-size - 1, size + 1);
      if (rng.coin()) stop = rng.uniform(-size - 1, size + 1);
      const int64_t step = rng.uniform(1, 3);
      both([&](const Tensor& t) { return t.slice(d, start, stop, step); },
           fmt::format("slice({},{},{},{})", d, start.value_or(-99), stop.value_or(-99), step));
      break;
    }
    case 3:
    case 4: {
      Shape s = random_factorization(rng, a.numel());
      both([&](const Tensor& t) { return t.reshape(s); }, fmt::format("reshape({})", shape_str(s)));
      break;
    }
    case 5: {
      if (nd == 0) return "skip";
      const int64_t x = rdim(), y = rdim();
      both([&](const Tensor& t) { return t.transpose(x, y); }, fmt::format("transpose({},{})", x, y));
      break;
    }
    case 6: {
      if (nd > 2) return "skip";
      both([&](const Tensor& t) { return t.t(); }, "t()");
      break;
    }
    case 7: {
      std::vector<int64_t> p(static_cast<size_t>(nd));
      std::iota(p.begin(), p.end(), 0);
      std::shuffle(p.begin(), p.end(), rng.gen);
      both([&](const Tensor& t) { return t.permute(p); }, fmt::format("permute({})", shape_str(p)));
      break;
    }
    case 8: {
      if (nd == 0) {
        both([&](const Tensor& t) { return t.flatten(); }, "flatten()");
        break;
      }
      int64_t s = rng.uniform(0, nd - 1), e = rng.uniform(0, nd - 1);
      if (s > e) std::swap(s, e);
      both([&](const Tensor& t) { return t.flatten(s, e); }, fmt::format("flatten({},{})", s, e));
      break;
    }
    case 9: {
      if (nd == 0 || nd >= 5) return "skip";
      const int64_t d = rng.uniform(0, nd - 1);
      Shape f = random_factorization(rng, a.size(d));
      if (f.size() > 2) return "skip";
      both([&](const Tensor& t) { return t.unflatten(d, f); }, fmt::format("unflatten({},{})", d, shape_str(f)));
      break;
    }
    case 10: {
      if (nd >= 5) return "skip";
      const int64_t d = rng.uniform(-nd - 1, nd);
      both([&](const Tensor& t) { return t.unsqueeze(d); }, fmt::format("unsqueeze({})", d));
      break;
    }
    case 11: {
      if (rng.coin() || nd == 0) {
        both([&](const Tensor& t) { return t.squeeze(); }, "squeeze()");
      } else {
        const int64_t d = rdim();
        both([&](const Tensor& t) { return t.squeeze(d); }, fmt::format("squeeze({})", d));
      }
      break;
    }
    case 12: {
      if (nd == 0 || a.numel() == 0) return "skip";
      const int64_t d = rng.uniform(0, nd - 1);
      const int64_t chunks = rng.uniform(1, 4);
      auto la = a.chunk(chunks, d);
      auto lb = b.chunk(chunks, d);
      const size_t k = static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(la.size()) - 1));
      a = la[k];
      b = lb[k];
      desc = fmt::format("chunk({},{})[{}]", chunks, d, k);
      break;
    }
    case 13: {
      if (nd == 0 || a.numel() == 0) return "skip";
      const int64_t d = rng.uniform(0, nd - 1);
      const int64_t size = a.size(d);
      std::vector<int64_t> sizes;
      int64_t left = size;
      while (left > 0) {
        const int64_t s = rng.uniform(1, left);
        sizes.push_back(s);
        left -= s;
      }
      const bool by_sizes = rng.coin();
      auto la = by_sizes ? a.split(sizes, d) : a.split(sizes[0], d);
      auto lb = by_sizes ? b.split(sizes, d) : b.split(sizes[0], d);
      const size_t k = static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(la.size()) - 1));
      a = la[k];
      b = lb[k];
      desc = fmt::format("split({})[{}]", d, k);
      break;
    }
    case 14: {
      if (nd == 0 || a.numel() == 0) return "skip";
      const int64_t d = rng.uniform(0, nd - 1);
      auto la = a.unbind(d);
      auto lb = b.unbind(d);
      const size_t k = static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(la.size()) - 1));
      a = la[k];
      b = lb[k];
      desc = fmt::format("unbind({})[{}]", d, k);
      break;
    }
    case 15: {
      both([&](const Tensor& t) { return t.contiguous(); }, "contiguous()");
      break;
    }
    case 16: {  // view: fails (on both) when strides can't express it
      Shape s = random_factorization(rng, a.numel());
      both([&](const Tensor& t) { return t.view(s); }, fmt::format("view({})", shape_str(s)));
      break;
    }
    case 17: {  // arguments that may be out of range
      const int64_t d = rng.uniform(-nd - 1, nd);
      const int64_t start = rng.uniform(-4, 6), len = rng.uniform(-1, 6);
      both([&](const Tensor& t) { return t.narrow(d, start, len); }, fmt::format("narrow?({},{},{})", d, start, len));
      break;
    }
  }
  return desc;
}

Tensor index_tensor(const Shape& shape) {
  Tensor t = Tensor::empty(shape, DType::kI32);
  auto* p = reinterpret_cast<int32_t*>(*t.data_ptr());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<int32_t>(i);
  return t;
}

void fill(const Tensor& t, int32_t v) {
  auto* p = reinterpret_cast<int32_t*>(*t.data_ptr());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = v;
}

// How many seeds got to the replay, and how many of those went through a recorded copy
// (a reshape that strides could not express), so the test proves it exercised both.
int g_replayed = 0;
int g_recorded_copies = 0;
int g_rejected = 0;

// Runs one seed; returns an empty string on success, else a description of the failure.
std::string run_seed(uint64_t seed) {
  Rng rng(seed);
  Shape shape;
  const int64_t nd = rng.uniform(1, 4);
  for (int64_t d = 0; d < nd; ++d) shape.push_back(rng.uniform(1, 6));
  if (rng.coin(0.02)) shape[0] = 0;

  Tensor real = index_tensor(shape);
  Tensor rec = Tensor::source("w", shape, DType::kI32);
  std::string chain = fmt::format("{}", shape_str(shape));
  const int64_t len = rng.uniform(1, 8);
  for (int64_t i = 0; i < len; ++i) {
    std::string d = apply_random_op(rng, real, rec);
    chain += " ." + d;
    if (real.ok() != rec.ok()) {
      return fmt::format("seed {}: ok differs after {}: real {} / rec {}", seed, chain, real.status().to_string(),
                         rec.status().to_string());
    }
    if (!real.ok()) {  // an invalid op (both agree) ends the chain
      g_rejected++;
      return "";
    }
    if (real.shape() != rec.shape()) {
      return fmt::format("seed {}: shapes differ after {}: {} vs {}", seed, chain, shape_str(real.shape()),
                         shape_str(rec.shape()));
    }
  }

  // Destination: a param whose shape is the result's shape permuted, viewed back
  // (a strided destination), optionally one slot of two.
  const Shape& out = real.shape();
  std::vector<int64_t> perm(out.size());
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng.gen);
  std::vector<int64_t> inv(perm.size());
  Shape pshape;
  for (size_t i = 0; i < perm.size(); ++i) {
    pshape.push_back(out[perm[i]]);
    inv[perm[i]] = static_cast<int64_t>(i);
  }
  const bool slot = rng.coin(0.3);
  const int64_t which = rng.uniform(0, 1);
  Shape full = pshape;
  if (slot) full.insert(full.begin(), 2);

  auto dst_view = [&](const Tensor& p) {
    Tensor v = slot ? p.select(0, which) : p;
    return v.permute(inv);
  };

  Tensor expected = Tensor::empty(full, DType::kI32, "p");
  fill(expected, -1);
  if (auto st = dst_view(expected).copy_(real); !st.ok()) return fmt::format("seed {}: real copy failed: {}", seed, st.to_string());

  Recorder recorder;
  if (auto st = dst_view(Tensor::param("p", full, DType::kI32)).copy_(rec); !st.ok()) {
    return fmt::format("seed {}: recording failed after {}: {}", seed, chain, st.to_string());
  }
  auto plan = recorder.finish();
  if (!plan.ok()) return fmt::format("seed {}: finish: {}", seed, plan.status().to_string());
  if (auto st = plan->check_coverage(/*allow_unwritten=*/slot || real.numel() == 0); !st.ok()) {
    return fmt::format("seed {}: coverage after {}: {}", seed, chain, st.to_string());
  }
  auto decoded = Plan::decode(plan->encode());
  if (!decoded.ok()) return fmt::format("seed {}: decode: {}", seed, decoded.status().to_string());
  if (decoded->hash() != plan->hash() || decoded->encode() != plan->encode()) return fmt::format("seed {}: round trip differs", seed);
  Plan again = *decoded;
  again.canonicalize();
  if (again.encode() != plan->encode()) return fmt::format("seed {}: canonicalize is not idempotent after {}", seed, chain);

  Tensor got = Tensor::empty(full, DType::kI32, "p");
  fill(got, -1);
  const bool parallel = rng.coin(0.2);
  ExecuteOptions opts;
  if (parallel) {
    opts.threads = 3;
    opts.parallel_min_bytes = 0;
  }
  if (auto st = execute(*plan, {{"w", index_tensor(shape)}}, {{"p", got}}, opts); !st.ok()) {
    return fmt::format("seed {}: execute: {}", seed, st.to_string());
  }
  g_replayed++;
  if (rec.is_recorded_copy()) g_recorded_copies++;
  if (!*got.equal(expected)) {
    return fmt::format("seed {}: replay differs after {}\nexpected {}\ngot      {}\n{}", seed, chain,
                       fmt::join(*expected.to_vector(), ","), fmt::join(*got.to_vector(), ","), plan->to_string());
  }
  return "";
}

TEST(PlanProperty, RandomViewChainsReplayExactly) {
  constexpr uint64_t kSeeds = 10000;
  int failures = 0;
  for (uint64_t seed = 0; seed < kSeeds; ++seed) {
    std::string err = run_seed(seed);
    if (!err.empty()) {
      ADD_FAILURE() << err;
      if (++failures >= 5) break;
    }
  }
  EXPECT_GT(g_replayed, static_cast<int>(kSeeds * 6 / 10));
  EXPECT_GT(g_recorded_copies, static_cast<int>(kSeeds / 20));
  EXPECT_GT(g_rejected, static_cast<int>(kSeeds / 20));
  std::printf("replayed %d of %llu seeds, %d through recorded copies, %d chains ended by a rejected op\n",
              g_replayed, static_cast<unsigned long long>(kSeeds), g_recorded_copies, g_rejected);
}

}  // namespace
}  // namespace ferry

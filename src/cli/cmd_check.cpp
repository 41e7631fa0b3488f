// `ferry check`: loads every inference rank of a model two ways — direct (the loader on
// real tensors) and recorded plan + executor — runs post-processing on both, and
// compares bit for bit.
#include <cstdio>
#include <map>
#include <memory>
#include <set>
#include <string>

#include "cli/command.h"
#include "ferry/models.h"
#include "tools/config_path.h"

namespace ferry::cli {
namespace {

struct CheckOptions {
  std::string model;
  std::string inference = "tp=1";
  bool shrink = false;
  uint64_t seed = 0;
  std::string checkpoint;
  std::string quantize = "none";
  double max_gib = 4.0;
  bool verbose = false;
};

std::string human_bytes(uint64_t b) {
  if (b >= (1ull << 30)) return fmt::format("{:.2f} GiB", static_cast<double>(b) / (1ull << 30));
  if (b >= (1ull << 20)) return fmt::format("{:.2f} MiB", static_cast<double>(b) / (1ull << 20));
  if (b >= (1ull << 10)) return fmt::format("{:.1f} KiB", static_cast<double>(b) / (1ull << 10));
  return fmt::format("{} B", b);
}

int run_check(const CheckOptions& o) {
  auto found = tools::find_model_config(o.model);
  if (!found.ok()) return fail_with("check", found.status());
  auto cfg = ModelConfig::load(*found);
  if (!cfg.ok()) return fail_with("check", cfg.status());
  auto layout = InferenceLayout::parse(o.inference);
  if (!layout.ok()) return fail_with("check", layout.status());
  auto quant = parse_quantize(o.quantize);
  if (!quant.ok()) return fail_with("check", quant.status());
  LoaderOptions lopts;
  lopts.quantize = *quant;

  ModelConfig config = *cfg;
  if (o.shrink) {
    auto s = shrink_config(config, *layout, lopts);
    if (!s.ok()) return fail_with("check", s.status());
    std::printf("shrink: %s, %zu fields changed\n", config.path().c_str(), s->changes.size());
    for (const auto& c : s->changes) {
      std::printf("  %s: %s -> %s\n", c.field.c_str(), c.before.c_str(), c.after.c_str());
    }
    config = s->config;
  }
  auto loader = make_model_loader(config, *layout, lopts);
  if (!loader.ok()) return fail_with("check", loader.status());
  const ModelLoader& l = **loader;

  uint64_t ckpt_bytes = 0;
  for (const auto& d : l.checkpoint()) ckpt_bytes += static_cast<uint64_t>(shape_numel(d.shape)) * dtype_size(d.dtype);

  TensorMap checkpoint;
  std::string origin;
  if (!o.checkpoint.empty()) {
    auto c = read_checkpoint_dir(o.checkpoint);
    if (!c.ok()) return fail_with("check", c.status());
    checkpoint = std::move(*c);
    origin = fmt::format("safetensors in {}", o.checkpoint);
  } else {
    const double gib = static_cast<double>(ckpt_bytes) / (1ull << 30);
    if (gib > o.max_gib) {
      return fail_with("check", invalid_argument("a random checkpoint of {} would need {}; use --shrink, or raise --max-gib", config.path(),
                                   human_bytes(ckpt_bytes)));
    }
    auto c = random_checkpoint(l.checkpoint(), o.seed);
    if (!c.ok()) return fail_with("check", c.status());
    checkpoint = std::move(*c);
    origin = fmt::format("random, seed {}", o.seed);
  }
  if (auto st = check_checkpoint(l.checkpoint(), checkpoint); !st.ok()) return fail_with("check", st);

  std::printf("check: %s (%s), layout %s, quantize %s, %d ranks\n", config.architecture().c_str(), config.path().c_str(),
              layout->to_string().c_str(), std::string(quantize_name(lopts.quantize)).c_str(), layout->world_size());
  std::printf("checkpoint: %zu tensors, %s (%s)\n", l.checkpoint().size(), human_bytes(ckpt_bytes).c_str(),
              origin.c_str());

  int matched = 0;
  std::optional<std::string> first_mismatch;
  std::map<int, uint64_t> hash_of_engine_rank;  // engine rank -> hash in replica 0
  bool replicas_agree = true;
  std::set<uint64_t> distinct;
  for (int r = 0; r < layout->world_size(); ++r) {
    auto info = layout->rank(r);
    auto plan = record_plan(l, r);
    if (!plan.ok()) return fail_with("check", plan.status());
    const PlanStats st = plan->stats();
    const uint64_t h = plan->hash();
    distinct.insert(h);
    auto [it, fresh] = hash_of_engine_rank.emplace(info->engine_rank(), h);
    const bool same_as_replica0 = fresh || it->second == h;
    if (!same_as_replica0) replicas_agree = false;
    if (o.verbose) std::printf("%s", plan->to_string().c_str());

    auto direct = load_rank_direct(l, r, checkpoint);
    if (!direct.ok()) return fail_with("check", direct.status());
    auto replay = load_rank_from_plan(l, r, *plan, checkpoint);
    if (!replay.ok()) return fail_with("check", replay.status());
    auto rl = l.rank(r);
    if (!rl.ok()) return fail_with("check", rl.status());
    auto mm = compare_params((*rl)->final_params(), *direct, *replay);
    if (!mm.ok()) return fail_with("check", mm.status());
    uint64_t param_bytes = 0;
    for (const auto& d : (*rl)->final_params()) param_bytes += static_cast<uint64_t>(shape_numel(d.shape)) * dtype_size(d.dtype);
    std::string verdict;
    if (mm->has_value()) {
      const Mismatch& m = **mm;
      verdict = fmt::format("MISMATCH param '{}' index {} (direct vs plan: {})", m.param, m.index, m.detail);
      if (!first_mismatch) first_mismatch = fmt::format("rank {}: param '{}' index {}", r, m.param, m.index);
    } else {
      verdict = "match";
      ++matched;
    }
    std::printf("rank %d (replica %d, dp %d, tp %d): params %zu, bytes %llu, copies %llu, zeros %llu, plan %016llx%s, %s\n", r,
                info->replica, info->dp, info->tp, (*rl)->final_params().size(),
                static_cast<unsigned long long>(param_bytes), static_cast<unsigned long long>(st.copies),
                static_cast<unsigned long long>(st.zeros), static_cast<unsigned long long>(h),
                same_as_replica0 ? "" : " (DIFFERS from replica 0)", verdict.c_str());
  }
  const int world = layout->world_size();
  std::printf("summary: %d/%d ranks match, %zu distinct plans, replicas share plans: %s\n", matched, world, distinct.size(),
              layout->replicas > 1 ? (replicas_agree ? "yes" : "NO") : "n/a (1 replica)");
  if (first_mismatch) {
    std::fprintf(stderr, "ferry check: first mismatch: %s\n", first_mismatch->c_str());
    return 1;
  }
  if (!replicas_agree) {
    std::fprintf(stderr, "ferry check: the same rank of different replicas has different plans\n");
    return 1;
  }
  return 0;
}

FERRY_COMMAND(check_command, "check",
              "Load every inference rank two ways (loader direct, recorded plan + executor) and compare bit for bit",
              [](CLI::App& app) -> std::function<int()> {
                auto o = std::make_shared<CheckOptions>();
                app.add_option("--model", o->model, "HF config.json of the model (architectures[0] picks the loader)")
                    ->required();
                app.add_option("--inference", o->inference,
                               "inference layout \"tp=T,dp=D,ep=E,replicas=R\" (any subset, defaults 1; E is 1 or T*D)")
                    ->default_val("tp=1");
                auto* shrink = app.add_flag("--shrink", o->shrink,
                                            "first derive a structurally equal small variant of the model (fewer "
                                            "layers, heads, experts, smaller dims) and print what changed");
                app.add_option("--seed", o->seed, "seed of the random checkpoint")->default_val(0)->check(number_in(0, 1.8e19));
                app.add_option("--checkpoint", o->checkpoint,
                               "read the checkpoint from the *.safetensors files of DIR instead of random values")
                    ->excludes(shrink);
                app.add_option("--quantize", o->quantize,
                               "post-processing target: none, fp8 (e4m3, 128x128 blocks, fp32 scales), fp8-ue8m0 "
                               "(power-of-two scales as E8M0 bytes) or mxfp8 (1x32 blocks, E8M0 scales)")
                    ->default_val("none")
                    ->check(CLI::IsMember({"none", "fp8", "fp8-ue8m0", "mxfp8"}));
                app.add_option("--max-gib", o->max_gib, "refuse a random checkpoint larger than this (GiB)")
                    ->default_val(4.0)
                    ->check(number_in(0, 1 << 20));
                app.add_flag("-v,--verbose", o->verbose, "print every rank's plan");
                return [o] { return run_check(*o); };
              });

}  // namespace
}  // namespace ferry::cli

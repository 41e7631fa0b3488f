// `ferry checkpoint`: writes a synthetic safetensors checkpoint of a model (config.json
// and model.safetensors, random weights from a seed), to try `ferry serve` / `ferry
// fetch` without a real checkpoint, and for the device checks (scripts/device-check.sh).
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>

#include "cli/command.h"
#include "ferry/models.h"
#include "ferry/safetensors.h"
#include "tools/job_model.h"
#include "tools/proc_memory.h"

namespace ferry::cli {
namespace {

struct CheckpointArgs {
  std::string model, overrides, out;
  bool shrink = false;
  uint64_t seed = 1;
};

std::string gb(uint64_t bytes) { return fmt::format("{:.1f} GB", static_cast<double>(bytes) / 1e9); }

// What writing the checkpoint costs, checked before a byte of it is made: every tensor is
// built in memory, then the file written (memory and disk: `bytes` each). A checkpoint
// that does not fit is refused saying what it needs and what there is, instead of dying
// of bad_alloc (SIGABRT) after minutes, or filling the disk.
Status check_fits(const std::string& out, uint64_t bytes) {
  const std::string what = fmt::format("the checkpoint is {} ({} bytes), built in memory before it is written", gb(bytes), bytes);
  const char* hint = "(--shrink or --config-overrides make a smaller variant)";
  size_t pages = 0;
  std::ifstream("/proc/self/statm") >> pages;
  const uint64_t mapped = static_cast<uint64_t>(pages) * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  struct Limit {
    int resource;
    const char* name;
  };
  for (const Limit l : {Limit{RLIMIT_AS, "address-space limit (ulimit -v)"}, Limit{RLIMIT_DATA, "data limit (ulimit -d)"}}) {
    rlimit r{};
    if (::getrlimit(l.resource, &r) != 0 || r.rlim_cur == RLIM_INFINITY) continue;
    const uint64_t left = r.rlim_cur > mapped ? r.rlim_cur - mapped : 0;
    if (bytes > left) {
      return invalid_argument("{}: it needs {} of memory, and this process's {} of {} leaves {} {}", what, gb(bytes),
                              l.name, gb(r.rlim_cur), gb(left), hint);
    }
  }
  if (auto avail = tools::mem_available_bytes(); avail.ok() && bytes > *avail) {
    return invalid_argument("{}: it needs {} of memory, and the machine has {} available (MemAvailable) {}", what,
                            gb(bytes), gb(*avail), hint);
  }
  struct statvfs fs {};
  if (::statvfs(out.c_str(), &fs) == 0) {
    const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
    if (bytes > free_bytes) {
      return invalid_argument("the checkpoint is {} ({} bytes): it needs that much disk, and {} has {} free {}", gb(bytes),
                              bytes, out, gb(free_bytes), hint);
    }
  }
  return Status::Ok();
}

int run_checkpoint(const CheckpointArgs& a) {
  // Layouts only matter to the loader; the checkpoint is the model's, whole.
  auto m = tools::make_job_model(a.model, "tp=1", "tp=1", a.shrink, a.overrides);
  if (!m.ok()) {
    std::fprintf(stderr, "ferry checkpoint: %s\n", m.status().to_string().c_str());
    return 2;
  }
  std::error_code ec;
  std::filesystem::create_directories(a.out, ec);
  if (ec) {
    std::fprintf(stderr, "ferry checkpoint: creating %s: %s\n", a.out.c_str(), ec.message().c_str());
    return 2;
  }
  if (Status st = check_fits(a.out, m->checkpoint_bytes); !st.ok()) {
    std::fprintf(stderr, "ferry checkpoint: %s\n", st.to_string().c_str());
    return 2;
  }
  auto ckpt = random_checkpoint(m->metadata, a.seed);
  if (!ckpt.ok()) {
    std::fprintf(stderr, "ferry checkpoint: %s\n", ckpt.status().to_string().c_str());
    return 2;
  }
  std::vector<SafetensorsEntry> entries;
  for (const TensorDecl& d : m->metadata) entries.push_back({d.name, ckpt->at(d.name)});
  const std::string file = a.out + "/model.safetensors";
  if (Status st = write_safetensors(file, entries); !st.ok()) {
    std::fprintf(stderr, "ferry checkpoint: %s\n", st.to_string().c_str());
    return 2;
  }
  std::ofstream(a.out + "/config.json") << m->config.dump() << "\n";
  std::printf("ferry checkpoint: %s: %zu tensors, %llu bytes (seed %llu), config.json beside it\n", file.c_str(),
              entries.size(), static_cast<unsigned long long>(m->checkpoint_bytes),
              static_cast<unsigned long long>(a.seed));
  return 0;
}

std::function<int()> setup_checkpoint(CLI::App& app) {
  auto a = std::make_shared<CheckpointArgs>();
  app.add_option("--model", a->model, "HF config.json of the model")->required();
  app.add_option("--out", a->out, "Directory to write config.json and model.safetensors into")->required();
  app.add_flag("--shrink", a->shrink, "A structurally equal small variant of the model (as ferry demo and plan --shrink)");
  app.add_option("--config-overrides", a->overrides, "JSON merged into the config, e.g. '{\"num_hidden_layers\": 2}'");
  app.add_option("--seed", a->seed, "Seed of the random weights")->default_val(1);
  app.footer(
      "The checkpoint is built in memory, then written: one that needs more memory (ulimit -v, MemAvailable) or disk "
      "than there is is refused at once, saying what it needs.");
  return [a] { return run_checkpoint(*a); };
}

FERRY_COMMAND(checkpoint_cmd, "checkpoint",
              "Write a synthetic safetensors checkpoint of a model (random weights from a seed) with its config.json",
              setup_checkpoint);

}  // namespace
}  // namespace ferry::cli

// `ferry trace FILE...`: checks trace files written by `--trace` (Chrome trace-event
// JSON, tools/trace_file.h), prints a summary per rank and phase, checks the transfers
// against the reports in the file, merges files (--merge) and draws the timeline
// (--plot, matplotlib). docs/trace.md.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "cli/plot.h"
#include "tools/trace_file.h"

namespace ferry::cli {
namespace {

struct TraceArgs {
  std::vector<std::string> files;
  std::string plot;
  std::string merge;
  bool summary = false;
};

// One row per process (rank) and track, slices coloured by phase; time in ms from the
// first slice.
constexpr const char* kTracePlotScript = R"PY(
from matplotlib.patches import Patch
t = json.load(open(sys.argv[1]))
ev = t["traceEvents"]
pname, tname = {}, {}
for e in ev:
    if e["ph"] == "M" and e["name"] == "process_name":
        pname[e["pid"]] = e["args"]["name"]
    elif e["ph"] == "M" and e["name"] == "thread_name":
        tname[(e["pid"], e["tid"])] = e["args"]["name"]
xs = [e for e in ev if e["ph"] == "X"]
if not xs:
    sys.exit(4)
t0 = min(e["ts"] for e in xs)
rows = {}
for e in xs:
    rows.setdefault((e["pid"], e["tid"]), []).append(e)
keys = sorted(rows)
phases = sorted({e["name"].split(" ")[0] for e in xs})
cmap = plt.get_cmap("tab20")
colour = {p: cmap(i % 20) for i, p in enumerate(phases)}
fig, ax = plt.subplots(figsize=(13, max(3.0, 0.2 * len(keys) + 1.6)))
for i, k in enumerate(keys):
    by = {}
    for e in rows[k]:
        by.setdefault(e["name"].split(" ")[0], []).append(((e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, 0.02)))
    for p, segs in by.items():
        ax.broken_barh(segs, (i - 0.4, 0.8), facecolors=colour[p], edgecolor="none")
    if i > 0 and keys[i - 1][0] != k[0]:
        ax.axhline(i - 0.5, color="grey", linewidth=0.5)
ax.set_yticks(range(len(keys)))
ax.set_yticklabels(["%s: %s" % (pname.get(p, p), tname.get((p, tid), tid)) for p, tid in keys], fontsize=6)
ax.set_ylim(len(keys) - 0.5, -0.5)
ax.set_xlabel("ms since the first event")
ax.legend(handles=[Patch(color=colour[p], label=p) for p in phases], fontsize=7,
          loc="upper left", bbox_to_anchor=(1.0, 1.0))
ax.set_title(sys.argv[3] if len(sys.argv) > 3 else "ferry trace", fontsize=9)
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
)PY";

// Per rank and phase: slices, seconds; per rank and lane: transfers, bytes. Then every
// report in the file against its transfers: each transfer once, bytes summing to the
// report's. Returns the number of disagreements.
int summarise(const nlohmann::json& t, bool print) {
  std::map<int, std::string> pname;
  for (const auto& e : t["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") pname[e["pid"].get<int>()] = e["args"].value("name", "");
  }
  struct Phase {
    int slices = 0;
    double us = 0;
  };
  std::map<int, std::map<std::string, Phase>> phases;
  std::map<int, std::map<std::string, std::pair<int, uint64_t>>> lanes;
  std::map<std::pair<std::string, uint64_t>, uint64_t> counted;  // (process name, version) -> counted bytes
  std::set<std::tuple<int, uint64_t, int, int, std::string, bool, int, std::string>> seen;
  int problems = 0;
  for (const auto& e : t["traceEvents"]) {
    if (e["ph"] != "X") continue;
    const int pid = e["pid"].get<int>();
    const std::string name = e["name"];
    const std::string phase = name.substr(0, name.find(' '));
    Phase& ph = phases[pid][phase];
    ++ph.slices;
    ph.us += e["dur"].get<double>();
    if (e.value("cat", "") != "transfer") continue;
    const auto& a = e["args"];
    const uint64_t bytes = a.value("bytes", uint64_t{0});
    auto& l = lanes[pid][a.value("lane", "")];
    ++l.first;
    l.second += bytes;
    if (a.value("counted", true)) counted[{pname[pid], a.value("version", uint64_t{0})}] += bytes;
    auto key = std::make_tuple(pid, a.value("version", uint64_t{0}), a.value("group", -1), a.value("peer", -1),
                               a.value("lane", ""), a.value("into_params", false), a.value("attempt", 0), phase);
    if (!seen.insert(key).second) {
      ++problems;
      std::printf("DUPLICATE transfer: %s %s\n", pname[pid].c_str(), e.dump().c_str());
    }
  }
  if (print) {
    for (const auto& [pid, by] : phases) {
      std::printf("%s\n", pname.count(pid) ? pname[pid].c_str() : std::to_string(pid).c_str());
      for (const auto& [phase, ph] : by)
        std::printf("  %-12s %6d slices %10.3f s\n", phase.c_str(), ph.slices, ph.us / 1e6);
      for (const auto& [lane, l] : lanes[pid])
        std::printf("  %-12s %6d transfers %14llu bytes\n", lane.c_str(), l.first, static_cast<unsigned long long>(l.second));
    }
  }
  int reports = 0;
  if (t.contains("ferryReports")) {
    for (const auto& r : t["ferryReports"]) {
      const std::string who = fmt::format("{} {}", r.value("role", ""), r.value("rank", -1));
      const uint64_t v = r.value("version", uint64_t{0}), want = r.value("bytes", uint64_t{0});
      const uint64_t got = counted.count({who, v}) ? counted[{who, v}] : 0;
      ++reports;
      if (got != want) {
        ++problems;
        std::printf("MISMATCH: %s version %llu: the report says %llu bytes, its transfers sum to %llu\n", who.c_str(),
                    static_cast<unsigned long long>(v), static_cast<unsigned long long>(want),
                    static_cast<unsigned long long>(got));
      }
    }
  }
  std::printf("%zu ranks, %d reports: %s\n", phases.size(), reports,
              problems ? "the transfers DISAGREE with the reports" : "every transfer once, bytes equal to the reports'");
  return problems;
}

int run_trace(const TraceArgs& a) {
  nlohmann::json merged = {{"traceEvents", nlohmann::json::array()}, {"ferryReports", nlohmann::json::array()}};
  for (const std::string& f : a.files) {
    auto j = tools::read_trace_file(f);
    if (!j.ok()) return fail_with("trace", j.status());
    for (auto& e : (*j)["traceEvents"]) merged["traceEvents"].push_back(std::move(e));
    if (j->contains("ferryReports")) {
      for (auto& r : (*j)["ferryReports"]) merged["ferryReports"].push_back(std::move(r));
    }
  }
  std::printf("%zu file(s): %zu events\n", a.files.size(), merged["traceEvents"].size());
  if (!a.merge.empty()) {
    if (Status s = tools::merge_trace_files(a.files, a.merge); !s.ok()) return fail_with("trace", s);
    std::printf("merged into %s\n", a.merge.c_str());
  }
  const int problems = summarise(merged, a.summary || (a.plot.empty() && a.merge.empty()));
  if (!a.plot.empty()) {
    std::string input = a.files.front();
    std::string tmp;
    if (a.files.size() > 1) {
      tmp = fmt::format("{}.{}.json", a.plot, getpid());
      std::ofstream(tmp) << merged.dump();
      input = tmp;
    }
    std::string title = a.files.size() == 1 ? a.files.front() : fmt::format("{} files", a.files.size());
    Status st = run_plot_script(kTracePlotScript, {input, a.plot, title}, "--plot");
    if (!tmp.empty()) std::remove(tmp.c_str());
    if (!st.ok()) return fail_with("trace", st);
    std::printf("timeline written to %s\n", a.plot.c_str());
  }
  return problems ? 1 : 0;
}

std::function<int()> setup_trace(CLI::App& app) {
  auto a = std::make_shared<TraceArgs>();
  app.add_option("files", a->files, "trace file(s) written by --trace (Chrome trace-event JSON)")->required();
  app.add_flag("--summary", a->summary, "print the per-rank, per-phase summary (the default without --plot/--merge)");
  app.add_option("--plot", a->plot, "draw the timeline as a PNG (needs python3-matplotlib)");
  app.add_option("--merge", a->merge, "write every file's events and reports into one trace file");
  return [a] { return run_trace(*a); };
}

}  // namespace

FERRY_COMMAND(trace_command, "trace",
              "Check, summarise, merge or plot trace files written by --trace (exit 1 when the transfers disagree "
              "with the reports)",
              setup_trace);

}  // namespace ferry::cli

// The public value types of ferry/engine.h.
#include "ferry/engine.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>

#include "engine/protocol.h"

namespace ferry {

Result<SyncMode> parse_sync_mode(std::string_view text) {
  if (text == "pull") return SyncMode::kPull;
  if (text == "push") return SyncMode::kPush;
  return invalid_argument("sync mode '{}': expected pull or push", text);
}
std::string_view sync_mode_name(SyncMode mode) { return mode == SyncMode::kPull ? "pull" : "push"; }

Result<GroupOrderKind> parse_group_order_kind(std::string_view text) {
  if (text == "layer") return GroupOrderKind::kLayer;
  if (text == "rotated") return GroupOrderKind::kRotated;
  return invalid_argument("group order '{}': expected layer or rotated", text);
}
std::string_view group_order_kind_name(GroupOrderKind kind) {
  return kind == GroupOrderKind::kLayer ? "layer" : "rotated";
}

const char* commit_policy_name(CommitPolicy p) {
  switch (p) {
    case CommitPolicy::kShadow: return "shadow";
    case CommitPolicy::kGroups: return "groups";
    case CommitPolicy::kInPlace: break;
  }
  return "in_place";
}
Result<CommitPolicy> parse_commit_policy(std::string_view name) {
  if (name == "in_place") return CommitPolicy::kInPlace;
  if (name == "shadow") return CommitPolicy::kShadow;
  if (name == "groups") return CommitPolicy::kGroups;
  return invalid_argument("commit policy '{}': expected in_place, shadow or groups", name);
}

double SyncStages::sum() const {
  double s = unattributed;
  for (double x : seconds) s += x;
  return s;
}

std::vector<std::pair<std::string_view, double>> SyncStages::named() const {
  std::vector<std::pair<std::string_view, double>> out;
  for (int i = 0; i < kSyncStageCount; ++i) out.emplace_back(sync_stage_name(static_cast<SyncStage>(i)), seconds[i]);
  out.emplace_back("unattributed", unattributed);
  return out;
}

std::string SyncReport::to_string() const {
  std::string s = fmt::format("version {}: {}, {} bytes {} in {:.3f} s", version,
                              !status.ok()     ? status.to_string()
                              : missed.empty() ? std::string("ok")
                                               : fmt::format("NOT ok, consumer(s) {} missed it", fmt::join(missed, ",")),
                              bytes_sent + bytes_received,
                              bytes_received ? "received" : "sent", seconds);
  if (!left.empty()) s += fmt::format("; consumer(s) {} left the job", fmt::join(left, ","));
  if (!joined.empty()) s += fmt::format("; consumer(s) {} joined", fmt::join(joined, ","));
  for (const auto& f : failures) s += "; " + f;
  return s;
}

std::string CommittedState::to_string() const {
  const std::string v = version ? std::to_string(*version) : "none";
  if (whole()) return v;
  return fmt::format("{} ({} {} {})", v, mixed ? "mixed" : "torn", mixed ? "with" : "by",
                     newer ? std::to_string(*newer) : "?");
}

Result<std::vector<CommittedState>> committed_states(Store& store, std::string_view job, int num_consumers) {
  if (num_consumers < 0) return invalid_argument("committed_states: num_consumers {} is negative", num_consumers);
  if (Status s = engine::JobKeys::check(job); !s.ok()) return s.with_context("committed_states");
  const engine::JobKeys keys{std::string(job)};
  std::vector<CommittedState> out;
  auto number = [](std::string_view t, uint64_t& x) {
    auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), x);
    return ec == std::errc() && end == t.data() + t.size();
  };
  for (int c = 0; c < num_consumers; ++c) {
    CommittedState st;
    auto v = store.get(keys.committed(c));
    if (!v.ok()) {
      if (v.status().code() != StatusCode::kNotFound) return v.status();
      out.push_back(st);
      continue;
    }
    // "V", or "V mixed N" / "V torn N" with V a number or "none" (Consumer::Impl::record_not_whole).
    std::vector<std::string_view> words;
    for (size_t at = 0; at <= v->size();) {
      const size_t sp = std::min(v->find(' ', at), v->size());
      words.emplace_back(v->data() + at, sp - at);
      at = sp + 1;
    }
    uint64_t x = 0, n = 0;
    const bool head = words[0] == "none" || number(words[0], x);
    const bool tail = words.size() == 1 ? words[0] != "none"
                                        : words.size() == 3 && (words[1] == "mixed" || words[1] == "torn") &&
                                              number(words[2], n);
    if (!head || !tail)
      return corrupt("committed version of consumer {} in job '{}' is not 'V' or 'V mixed|torn N': '{}'", c, job, *v);
    if (words[0] != "none") st.version = x;
    if (words.size() == 3) {
      st.mixed = words[1] == "mixed";
      st.torn = words[1] == "torn";
      st.newer = n;
    }
    out.push_back(st);
  }
  return out;
}

Result<std::vector<std::optional<uint64_t>>> committed_versions(Store& store, std::string_view job,
                                                                int num_consumers) {
  FERRY_ASSIGN_OR_RETURN(std::vector<CommittedState> states, committed_states(store, job, num_consumers));
  std::vector<std::optional<uint64_t>> out;
  for (const CommittedState& s : states) out.push_back(s.version);
  return out;
}

}  // namespace ferry

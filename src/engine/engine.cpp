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

std::string SyncReport::to_string() const {
  std::string s = fmt::format("version {}: {}, {} bytes {} in {:.3f} s", version,
                              !status.ok()     ? status.to_string()
                              : missed.empty() ? std::string("ok")
                                               : fmt::format("NOT ok, consumer(s) {} missed it", fmt::join(missed, ",")),
                              bytes_sent + bytes_received,
                              bytes_received ? "received" : "sent", seconds);
  for (const auto& f : failures) s += "; " + f;
  return s;
}

Result<std::vector<std::optional<uint64_t>>> committed_versions(Store& store, std::string_view job,
                                                                int num_consumers) {
  if (num_consumers < 0) return invalid_argument("committed_versions: num_consumers {} is negative", num_consumers);
  if (Status s = engine::JobKeys::check(job); !s.ok()) return s.with_context("committed_versions");
  const engine::JobKeys keys{std::string(job)};
  std::vector<std::optional<uint64_t>> out;
  for (int c = 0; c < num_consumers; ++c) {
    auto v = store.get(keys.committed(c));
    if (!v.ok()) {
      if (v.status().code() != StatusCode::kNotFound) return v.status();
      out.emplace_back();
      continue;
    }
    uint64_t x = 0;
    auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), x);
    if (ec != std::errc() || end != v->data() + v->size())
      return corrupt("committed version of consumer {} in job '{}' is not a number: '{}'", c, job, *v);
    out.push_back(x);
  }
  return out;
}

}  // namespace ferry

// The public value types of ferry/engine.h.
#include "ferry/engine.h"

#include <fmt/format.h>

namespace ferry {

Result<SyncMode> parse_sync_mode(std::string_view text) {
  if (text == "pull") return SyncMode::kPull;
  if (text == "push") return SyncMode::kPush;
  return invalid_argument("sync mode '{}': expected pull or push", text);
}
std::string_view sync_mode_name(SyncMode mode) { return mode == SyncMode::kPull ? "pull" : "push"; }

std::string SyncReport::to_string() const {
  std::string s = fmt::format("version {}: {}, {} bytes {} in {:.3f} s", version,
                              status.ok() ? "ok" : status.to_string(), bytes_sent + bytes_received,
                              bytes_received ? "received" : "sent", seconds);
  for (const auto& f : failures) s += "; " + f;
  return s;
}

}  // namespace ferry

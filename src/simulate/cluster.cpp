#include "simulate/cluster.h"

#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace ferry::simulate {
namespace {

using json = nlohmann::json;

// Reads the fields of one JSON object: each known key with its own check; anything left
// over is an error naming it (a typo must not leave a default in place silently).
class ObjectReader {
 public:
  ObjectReader(const json& obj, std::string where, std::string origin)
      : obj_(obj), where_(std::move(where)), origin_(std::move(origin)) {}

  std::string field(const std::string& key) const { return where_.empty() ? key : where_ + "." + key; }

  Status error(const std::string& key, const std::string& what) const {
    return invalid_argument("{}: {}: {}", origin_, field(key), what);
  }

  // A finite number in [lo, hi] (hi may be infinity), times `scale`.
  Status number(const std::string& key, double* out, double scale, double lo, double hi, bool lo_open = false) {
    seen_[key] = true;
    auto it = obj_.find(key);
    if (it == obj_.end()) return Status::Ok();
    if (!it->is_number()) return error(key, fmt::format("must be a number, got {}", it->dump()));
    const double v = it->get<double>();
    if (!std::isfinite(v) || v < lo || v > hi || (lo_open && v == lo)) {
      return error(key, fmt::format("must be {} {} and <= {}, got {}", lo_open ? ">" : ">=", lo, hi, it->dump()));
    }
    *out = v * scale;
    return Status::Ok();
  }

  Status integer(const std::string& key, int* out, int lo, int hi, bool required = false) {
    seen_[key] = true;
    auto it = obj_.find(key);
    if (it == obj_.end()) return required ? error(key, "is required") : Status::Ok();
    if (!it->is_number_integer() || it->get<int64_t>() < lo || it->get<int64_t>() > hi) {
      return error(key, fmt::format("must be an integer in [{}, {}], got {}", lo, hi, it->dump()));
    }
    *out = static_cast<int>(it->get<int64_t>());
    return Status::Ok();
  }

  Status text(const std::string& key, std::string* out) {
    seen_[key] = true;
    auto it = obj_.find(key);
    if (it == obj_.end()) return Status::Ok();
    if (!it->is_string()) return error(key, fmt::format("must be a string, got {}", it->dump()));
    *out = it->get<std::string>();
    return Status::Ok();
  }

  void skip(const std::string& key) { seen_[key] = true; }

  Status no_unknown() const {
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      if (!seen_.count(it.key())) return error(it.key(), "unknown field");
    }
    return Status::Ok();
  }

 private:
  const json& obj_;
  std::string where_, origin_;
  std::map<std::string, bool> seen_;
};

constexpr double kInf = std::numeric_limits<double>::infinity();

Status read_node(const json& j, const std::string& where, const std::string& origin, NodeSpec* n, bool role) {
  if (!j.is_object()) return invalid_argument("{}: {}: must be an object, got {}", origin, where, j.dump());
  ObjectReader r(j, where, origin);
  r.skip("comment");
  if (role) {
    FERRY_RETURN_IF_ERROR(r.integer("nodes", &n->nodes, 1, 1 << 16, /*required=*/true));
  }
  FERRY_RETURN_IF_ERROR(r.integer("gpus_per_node", &n->gpus_per_node, 1, 1024));
  FERRY_RETURN_IF_ERROR(r.number("nics_per_gpu", &n->nics_per_gpu, 1, 0, 64, /*lo_open=*/true));
  FERRY_RETURN_IF_ERROR(r.number("nic_gbit_s", &n->nic_rate, 1e9 / 8, 0, kInf, true));
  FERRY_RETURN_IF_ERROR(r.number("nic_efficiency", &n->nic_efficiency, 1, 0, 1, true));
  FERRY_RETURN_IF_ERROR(r.number("nvlink_gbyte_s", &n->nvlink_rate, 1e9, 0, kInf, true));
  FERRY_RETURN_IF_ERROR(r.number("device_copy_gbyte_s", &n->device_copy_rate, 1e9, 0, kInf, true));
  FERRY_RETURN_IF_ERROR(r.number("host_device_gbyte_s", &n->host_device_rate, 1e9, 0, kInf, true));
  FERRY_RETURN_IF_ERROR(r.no_unknown());
  // GPUs share a NIC evenly, or a GPU owns whole NICs: the NIC of GPU g is then
  // floor(g * nics_per_gpu) (a node's GPUs per NIC must be a whole number).
  const double per = n->nics_per_gpu;
  const double inv = 1.0 / per;
  const bool whole = std::abs(per - std::round(per)) < 1e-9 || std::abs(inv - std::round(inv)) < 1e-9;
  if (!whole) {
    return invalid_argument("{}: {}: nics_per_gpu must be a whole number or 1/k (0.5, 0.25), got {}", origin, where,
                            per);
  }
  if (per < 1) {
    const int share = static_cast<int>(std::round(inv));
    if (n->gpus_per_node % share != 0) {
      return invalid_argument("{}: {}: nics_per_gpu {} means {} GPUs per NIC, which does not divide gpus_per_node {}",
                              origin, where, per, share, n->gpus_per_node);
    }
  }
  return Status::Ok();
}

}  // namespace

Result<ClusterSpec> ClusterSpec::parse(std::string_view text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    return invalid_argument("{}: not JSON: {}", origin, e.what());
  }
  if (!j.is_object()) return invalid_argument("{}: must be a JSON object, got {}", origin, j.type_name());
  ClusterSpec c;
  ObjectReader r(j, "", origin);
  r.skip("comment");
  FERRY_RETURN_IF_ERROR(r.text("name", &c.name));
  // "node": defaults for both roles; "trainer"/"inference": the role's nodes and overrides.
  json node = json::object();
  if (j.contains("node")) node = j["node"];
  r.skip("node");
  NodeSpec base;
  FERRY_RETURN_IF_ERROR(read_node(node, "node", origin, &base, false));
  for (const char* role : {"trainer", "inference"}) {
    r.skip(role);
    if (!j.contains(role)) return invalid_argument("{}: {}: is required (an object with at least \"nodes\")", origin, role);
    NodeSpec n = base;
    FERRY_RETURN_IF_ERROR(read_node(j[role], role, origin, &n, true));
    (std::string(role) == "trainer" ? c.trainer : c.inference) = n;
  }
  if (j.contains("fabric")) {
    const json& f = j["fabric"];
    if (!f.is_object()) return invalid_argument("{}: fabric: must be an object, got {}", origin, f.dump());
    ObjectReader fr(f, "fabric", origin);
    fr.skip("comment");
    std::string topo = "leaf-spine";
    FERRY_RETURN_IF_ERROR(fr.text("topology", &topo));
    if (topo == "leaf-spine" || topo == "fat-tree") {
      c.fabric.topology = Topology::kLeafSpine;
    } else if (topo == "single-switch") {
      c.fabric.topology = Topology::kSingleSwitch;
    } else {
      return fr.error("topology", fmt::format("unknown topology '{}' (leaf-spine, fat-tree, single-switch)", topo));
    }
    FERRY_RETURN_IF_ERROR(fr.integer("nodes_per_leaf", &c.fabric.nodes_per_leaf, 1, 1 << 16));
    FERRY_RETURN_IF_ERROR(fr.number("oversubscription", &c.fabric.oversubscription, 1, 1, 1024));
    FERRY_RETURN_IF_ERROR(fr.no_unknown());
  }
  r.skip("fabric");
  if (j.contains("latency_us")) {
    const json& l = j["latency_us"];
    if (!l.is_object()) return invalid_argument("{}: latency_us: must be an object, got {}", origin, l.dump());
    ObjectReader lr(l, "latency_us", origin);
    lr.skip("comment");
    FERRY_RETURN_IF_ERROR(lr.number("nic", &c.latency.nic, 1e-6, 0, 1e6));
    FERRY_RETURN_IF_ERROR(lr.number("nvlink", &c.latency.nvlink, 1e-6, 0, 1e6));
    FERRY_RETURN_IF_ERROR(lr.number("switch_hop", &c.latency.switch_hop, 1e-6, 0, 1e6));
    FERRY_RETURN_IF_ERROR(lr.no_unknown());
  }
  r.skip("latency_us");
  if (j.contains("overhead_us")) {
    const json& o = j["overhead_us"];
    if (!o.is_object()) return invalid_argument("{}: overhead_us: must be an object, got {}", origin, o.dump());
    ObjectReader orr(o, "overhead_us", origin);
    orr.skip("comment");
    FERRY_RETURN_IF_ERROR(orr.number("message", &c.overhead.message, 1e-6, 0, 1e9));
    FERRY_RETURN_IF_ERROR(orr.number("read", &c.overhead.read, 1e-6, 0, 1e9));
    FERRY_RETURN_IF_ERROR(orr.number("group", &c.overhead.group, 1e-6, 0, 1e9));
    FERRY_RETURN_IF_ERROR(orr.number("collective", &c.overhead.collective, 1e-6, 0, 1e9));
    FERRY_RETURN_IF_ERROR(orr.no_unknown());
  }
  r.skip("overhead_us");
  FERRY_RETURN_IF_ERROR(r.number("broadcast_bucket_bytes", &c.overhead.bucket_bytes, 1, 1, 1e15));
  FERRY_RETURN_IF_ERROR(r.no_unknown());
  return c;
}

Result<ClusterSpec> ClusterSpec::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return not_found("cluster description '{}': cannot open it", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), path);
}

}  // namespace ferry::simulate

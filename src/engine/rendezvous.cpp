#include "engine/rendezvous.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>

#include <nlohmann/json.hpp>

namespace ferry::engine {

namespace {
nlohmann::json decl_json(const TensorDecl& d) {
  return nlohmann::json{{"name", d.name}, {"dtype", std::string(dtype_name(d.dtype))}, {"shape", d.shape}};
}
// Types are checked before nlohmann converts: get<int64_t> static_casts a float such as
// 1e300 (undefined behaviour, found by fuzz_rendezvous), and a negative dimension or
// index is no shape.
bool is_index(const nlohmann::json& j) {
  return j.is_number_unsigned() && j.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX);
}
Result<Shape> json_shape(const nlohmann::json& j, const char* what) {
  if (!j.is_array()) return corrupt("{} must be a list of non-negative integers, got {}", what, j.type_name());
  Shape s;
  for (const auto& e : j) {
    if (!is_index(e)) return corrupt("{} must be a list of non-negative integers, got element {}", what, e.dump());
    s.push_back(e.get<int64_t>());
  }
  return s;
}
Result<TensorDecl> json_decl(const nlohmann::json& j) {
  if (!j.is_object() || !j.contains("name") || !j.contains("dtype") || !j.contains("shape"))
    return corrupt("tensor declaration must have name, dtype and shape");
  if (!j["name"].is_string() || !j["dtype"].is_string())
    return corrupt("tensor declaration: name and dtype must be strings");
  TensorDecl d;
  d.name = j["name"].get<std::string>();
  FERRY_ASSIGN_OR_RETURN(d.dtype, parse_dtype(j["dtype"].get<std::string>()));
  FERRY_ASSIGN_OR_RETURN(d.shape, json_shape(j["shape"], "tensor declaration shape"));
  return d;
}
}  // namespace

std::string encode_decls(const std::vector<TensorDecl>& decls) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& d : decls) a.push_back(decl_json(d));
  return a.dump();
}

Result<std::vector<TensorDecl>> decode_decls(std::string_view text) {
  try {
    auto j = nlohmann::json::parse(text);
    if (!j.is_array()) return corrupt("metadata is not a JSON array");
    std::vector<TensorDecl> out;
    for (const auto& e : j) {
      FERRY_ASSIGN_OR_RETURN(auto d, json_decl(e));
      out.push_back(std::move(d));
    }
    return out;
  } catch (const std::exception& e) {
    return corrupt("metadata JSON: {}", e.what());
  }
}

std::string encode_holdings(const Holdings& h) {
  nlohmann::json t = nlohmann::json::array();
  for (const auto& d : h.tensors) t.push_back(decl_json(d));
  nlohmann::json b = nlohmann::json::array();
  for (const auto& x : h.boxes) b.push_back(nlohmann::json{{"t", x.tensor}, {"start", x.box.start}, {"size", x.box.size}});
  return nlohmann::json{{"tensors", t}, {"boxes", b}}.dump();
}

Result<Holdings> decode_holdings(std::string_view text) {
  try {
    auto j = nlohmann::json::parse(text);
    Holdings h;
    for (const auto& e : j.at("tensors")) {
      FERRY_ASSIGN_OR_RETURN(auto d, json_decl(e));
      h.tensors.push_back(std::move(d));
    }
    for (const auto& e : j.at("boxes")) {
      HeldBox b;
      const auto& t = e.at("t");
      if (!is_index(t) || t.get<uint64_t>() >= h.tensors.size())
        return corrupt("holdings box names tensor {} of {}", t.dump(), h.tensors.size());
      b.tensor = t.get<uint32_t>();
      FERRY_ASSIGN_OR_RETURN(b.box.start, json_shape(e.at("start"), "holdings box start"));
      FERRY_ASSIGN_OR_RETURN(b.box.size, json_shape(e.at("size"), "holdings box size"));
      h.boxes.push_back(std::move(b));
    }
    return h;
  } catch (const std::exception& e) {
    return corrupt("holdings JSON: {}", e.what());
  }
}

Status publish_world(Store& store, const JobKeys& keys, const EngineOptions& o, Participant me) {
  // The first key a participant writes: a job name that could collide with another
  // job's keys is refused before any.
  if (Status s = JobKeys::check(keys.job()); !s.ok()) return s.with_context(fmt::format("{} {}", me.role, me.rank));
  const Millis ttl = std::clamp(o.rendezvous_timeout, Millis(1000), kMaxTtl);
  return store.set(keys.world(me.role, me.rank, o.num_producers, o.num_consumers), "", ttl);
}

Status check_world(Store& store, const JobKeys& keys, const EngineOptions& o, Participant me) {
  const std::string prefix = keys.world_prefix();
  FERRY_ASSIGN_OR_RETURN(auto listed, store.list(prefix));
  for (const std::string& k : listed) {
    // {role}/{rank}/{num_producers}/{num_consumers}, exactly; any other key is not a
    // participant's and says nothing about world sizes.
    const auto w = keys.world_of(k);
    if (!w) continue;
    const std::string& role = w->role;
    const int rank = w->rank, np = w->num_producers, nc = w->num_consumers;
    if (np == o.num_producers && nc == o.num_consumers) continue;
    const bool producers = np != o.num_producers;
    return invalid_argument(
        "{} {} was started with num_{}={} but {} {} with num_{}={} (num_producers/num_consumers must be the "
        "trainer's and the inference side's world sizes on every rank of job '{}')",
        me.role, me.rank, producers ? "producers" : "consumers", producers ? o.num_producers : o.num_consumers, role,
        rank, producers ? "producers" : "consumers", producers ? np : nc, keys.job());
  }
  return Status::Ok();
}

Status await_keys(Store& store, const JobKeys& keys, const EngineOptions& o, Participant me,
                  const std::vector<std::string>& wanted, std::string_view what) {
  const auto deadline = std::chrono::steady_clock::now() + o.rendezvous_timeout;
  for (;;) {
    FERRY_RETURN_IF_ERROR(check_world(store, keys, o, me));
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    const auto slice = std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(250));
    Status s = store.wait(wanted, slice);
    if (s.ok()) return check_world(store, keys, o, me);
    if (s.code() != StatusCode::kTimeout || left <= slice)
      return s.with_context(fmt::format("{} {} waiting for {} (rendezvous_timeout {} ms)", me.role, me.rank, what,
                                        o.rendezvous_timeout.count()));
  }
}

Result<RouteInputs> rendezvous_inputs(Store& store, const JobKeys& keys, const EngineOptions& o, Participant me,
                                      const std::vector<TensorDecl>& metadata) {
  std::vector<std::string> wanted;
  for (int p = 0; p < o.num_producers; ++p) wanted.push_back(keys.holdings(p));
  for (int c = 0; c < o.num_consumers; ++c) wanted.push_back(keys.plan(c));
  FERRY_RETURN_IF_ERROR(await_keys(store, keys, o, me, wanted, "every producer's holdings and consumer's plan")
                            .with_context("engine rendezvous"));
  RouteInputs in;
  in.metadata = metadata;
  for (int p = 0; p < o.num_producers; ++p) {
    FERRY_ASSIGN_OR_RETURN(auto text, store.get(keys.holdings(p)));
    auto h = decode_holdings(text);
    if (!h.ok()) return h.status().with_context(fmt::format("holdings of producer {}", p));
    in.holdings.push_back(std::move(*h));
  }
  for (int c = 0; c < o.num_consumers; ++c) {
    FERRY_ASSIGN_OR_RETURN(auto text, store.get(keys.plan(c)));
    auto plan = Plan::decode(text);
    if (!plan.ok()) return plan.status().with_context(fmt::format("plan of consumer {}", c));
    in.plans.push_back(std::move(*plan));
  }
  return in;
}

void heal_leases(std::chrono::milliseconds lease_ttl, const std::function<bool()>& missing,
                 const std::function<void()>& again) {
  const auto until = std::chrono::steady_clock::now() + lease_ttl;
  const auto poll = std::clamp(lease_ttl / 10, std::chrono::milliseconds(1), std::chrono::milliseconds(50));
  while (missing() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(poll);
    again();
  }
}

std::string rank_list(const std::set<int>& ranks) {
  std::string out;
  for (int r : ranks) {  // piecewise: gcc 12 at -O3 reports a false -Wrestrict on `"," + string`
    if (!out.empty()) out += ',';
    out += std::to_string(r);
  }
  return out;
}

Result<int> republish(Store& store, const Published& published) {
  int written = 0;
  for (const auto& [key, value] : published) {
    FERRY_ASSIGN_OR_RETURN(auto listed, store.list(key));
    if (std::find(listed.begin(), listed.end(), key) != listed.end()) continue;
    FERRY_RETURN_IF_ERROR(store.set(key, value));
    ++written;
  }
  return written;
}

Result<Routes> RouteState::start(RouteInputs inputs) {
  inputs_ = std::move(inputs);
  FERRY_ASSIGN_OR_RETURN(dead_, read_dead());
  return routes_without(dead_);
}

Result<std::set<int>> RouteState::read_dead() const {
  std::set<int> out;
  if (!failover_) return out;
  FERRY_ASSIGN_OR_RETURN(auto listed, store_.list(keys_.dead_prefix()));
  for (const auto& k : listed) {
    // Exactly {job}/dead/{p} with p a producer of the job (once start() has the inputs):
    // "1/meta" (a key of another job whose name began with this one's dead prefix, as
    // 'j/dead/1' did before names with '/' were refused) or "01" marks nobody.
    const auto p = keys_.dead_rank(k);
    if (!p) continue;
    if (!inputs_.holdings.empty() && static_cast<size_t>(*p) >= inputs_.holdings.size()) continue;
    out.insert(*p);
  }
  return out;
}

Result<Routes> RouteState::routes_without(const std::set<int>& dead) const {
  RouterInput in;
  in.metadata = inputs_.metadata;
  in.producers = inputs_.holdings;
  for (int p : dead) {
    if (p >= 0 && static_cast<size_t>(p) < in.producers.size()) in.producers[static_cast<size_t>(p)] = Holdings{};
  }
  for (const auto& p : inputs_.plans) in.consumers.push_back(&p);
  auto routes = build_routes(in);
  if (!routes.ok()) return routes.status().with_context("building routes");
  FERRY_RETURN_IF_ERROR(routes->validate());
  return routes;
}

Status RouteState::mark_dead(const std::set<int>& dead) const {
  for (int p : dead) FERRY_RETURN_IF_ERROR(store_.set(keys_.dead(p), "1"));
  return Status::Ok();
}

Status RouteState::refresh(const std::function<Status(Routes)>& apply) {
  if (!failover_) return Status::Ok();
  FERRY_ASSIGN_OR_RETURN(auto d, read_dead());
  if (d == dead_) return Status::Ok();
  FERRY_ASSIGN_OR_RETURN(auto r, routes_without(d));
  return adopt(d, std::move(r), apply);
}

Status RouteState::adopt(const std::set<int>& dead, Routes routes, const std::function<Status(Routes)>& apply) {
  FERRY_RETURN_IF_ERROR(apply(std::move(routes)));
  dead_ = dead;
  return Status::Ok();
}

}  // namespace ferry::engine

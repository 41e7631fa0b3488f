#include "engine/rendezvous.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <thread>

#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include "common/host.h"

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
  return store.set(keys.world(me.role, me.rank, o.num_producers, o.num_consumers, routing_choices(o)), "", ttl);
}

std::string routing_choices(const EngineOptions& o) {
  // A field per choice that is not the default; the defaults' key is as before. A push
  // rank beside pull ranks waited out every sync's timeout, and a consumer checking
  // checksums beside producers that sent none reported ok with nothing checked (issue 49).
  std::string out = fmt::format("{}.{}", group_order_kind_name(o.group_order), convert_on_name(o.convert_on));
  if (o.quantize_on == QuantizeOn::kConsumer) out += fmt::format(".quantize-{}", quantize_on_name(o.quantize_on));
  if (o.mode == SyncMode::kPush) out += ".push";
  if (o.checksums) out += ".checksums";
  if (o.delta) out += ".delta";
  if (o.delta && o.delta_same_host) out += ".delta-same-host";
  return out;
}

namespace {

// Each option routing_choices names, and its value in `choices`.
std::map<std::string, std::string> choices_of(std::string_view choices) {
  std::map<std::string, std::string> out{{"group_order", ""}, {"convert_on", ""}, {"quantize_on", "producer"},
                                         {"mode", "pull"},    {"checksums", "off"}, {"delta", "off"},
                                         {"delta_same_host", "off"}};
  size_t at = 0;
  for (int field = 0; at <= choices.size(); ++field) {
    const size_t dot = std::min(choices.find('.', at), choices.size());
    const std::string_view f = choices.substr(at, dot - at);
    if (field == 0) out["group_order"] = std::string(f);
    else if (field == 1) out["convert_on"] = std::string(f);
    else if (f.starts_with("quantize-")) out["quantize_on"] = std::string(f.substr(9));
    else if (f == "push") out["mode"] = "push";
    else if (f == "delta-same-host") out["delta_same_host"] = "on";
    else out[std::string(f)] = "on";  // checksums, delta (and a choice only a newer rank names)
    at = dot + 1;
  }
  return out;
}

// "mode: pull here, push there; checksums: ..." for the options whose values differ.
std::string choices_differ(std::string_view mine, std::string_view theirs, std::string_view there) {
  const auto a = choices_of(mine), b = choices_of(theirs);
  std::string out;
  for (const auto& [option, value] : a) {
    auto it = b.find(option);
    const std::string other = it == b.end() ? std::string("off") : it->second;
    if (other == value) continue;
    out += fmt::format("{}{}: {} here, {} at {}", out.empty() ? "" : "; ", option, value, other, there);
  }
  for (const auto& [option, value] : b)
    if (!a.count(option)) out += fmt::format("{}{}: off here, {} at {}", out.empty() ? "" : "; ", option, value, there);
  return out;
}

}  // namespace

Status check_world(Store& store, const JobKeys& keys, const EngineOptions& o, Participant me) {
  const std::string prefix = keys.world_prefix();
  const std::string mine = routing_choices(o);
  FERRY_ASSIGN_OR_RETURN(auto listed, store.list(prefix));
  for (const std::string& k : listed) {
    // {role}/{rank}/{num_producers}/{num_consumers}, exactly; any other key is not a
    // participant's and says nothing about world sizes.
    const auto w = keys.world_of(k);
    if (!w) continue;
    const std::string& role = w->role;
    const int rank = w->rank, np = w->num_producers, nc = w->num_consumers;
    if (np == o.num_producers && nc == o.num_consumers) {
      if (w->routing == mine) continue;
      return invalid_argument(
          "{} {} runs with '{}' but {} {} with '{}' ({}: EngineOptions::group_order, convert_on, quantize_on, mode, "
          "checksums, delta and delta_same_host must be the same on every rank of job '{}')",
          me.role, me.rank, mine, role, rank, w->routing,
          choices_differ(mine, w->routing, fmt::format("{} {}", role, rank)), keys.job());
    }
    const bool producers = np != o.num_producers;
    return invalid_argument(
        "{} {} was started with num_{}={} but {} {} with num_{}={} (num_producers/num_consumers must be the "
        "trainer's and the inference side's world sizes on every rank of job '{}')",
        me.role, me.rank, producers ? "producers" : "consumers", producers ? o.num_producers : o.num_consumers, role,
        rank, producers ? "producers" : "consumers", producers ? np : nc, keys.job());
  }
  return Status::Ok();
}

namespace {

using Clock = std::chrono::steady_clock;

std::chrono::milliseconds millis_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
}

// The failures other participants published, each first seen at `seen[key]`: PeerFailed
// naming the first that has stayed published for `grace` (in key order: producers after
// consumers, each by rank).
Status check_failures(Store& store, const JobKeys& keys, Participant me, std::chrono::milliseconds grace,
                      std::map<std::string, Clock::time_point>& seen) {
  FERRY_ASSIGN_OR_RETURN(auto listed, store.list(keys.failed_prefix()));
  std::map<std::string, Clock::time_point> now_seen;
  for (const std::string& k : listed) {
    const auto f = keys.failed_of(k);
    if (!f || (f->role == me.role && f->rank == me.rank)) continue;  // not a failure key; our own earlier instance's
    auto it = seen.find(k);
    now_seen[k] = it == seen.end() ? Clock::now() : it->second;
  }
  seen = std::move(now_seen);
  for (const auto& [k, since] : seen) {
    if (Clock::now() - since < grace) continue;
    auto why = store.get(k);
    if (!why.ok()) {
      if (why.status().code() == StatusCode::kNotFound) continue;  // taken back (its rank restarted) or expired
      return why.status();
    }
    const auto f = keys.failed_of(k);
    return peer_failed(
        "{} {} failed to join job '{}': {} (published as '{}'; every rank of the job stops rather than wait for it)",
        f->role, f->rank, keys.job(), *why, k);
  }
  return Status::Ok();
}

}  // namespace

Status await_keys(Store& store, const JobKeys& keys, const EngineOptions& o, Participant me,
                  const std::vector<std::string>& wanted, std::string_view what) {
  const auto t0 = Clock::now();
  const auto deadline = t0 + o.rendezvous_timeout;
  const auto grace = std::min(kFailureGrace, o.rendezvous_timeout / 4);
  std::map<std::string, Clock::time_point> failures;
  const auto context = [&] {
    return fmt::format("{} {} waiting for {} (rendezvous_timeout {} ms)", me.role, me.rank, what,
                       o.rendezvous_timeout.count());
  };
  for (;;) {
    FERRY_RETURN_IF_ERROR(check_world(store, keys, o, me));
    FERRY_RETURN_IF_ERROR(check_failures(store, keys, me, grace, failures).with_context(context()));
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());  // (not before it)
    const auto slice = std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(250));
    Status s = store.wait(wanted, slice);
    if (s.ok()) return check_world(store, keys, o, me);
    if (s.code() != StatusCode::kTimeout) return s.with_context(context());
    if (left > slice) continue;
    // Out of time: the store's message speaks of the last slice only; say the whole wait
    // (and which keys are still missing, read again).
    const auto waited = millis_since(t0);
    auto listed = store.list(keys.job() + "/");
    if (!listed.ok()) return s.with_context(fmt::format("{} (after {} ms in all)", context(), waited.count()));
    const std::set<std::string> present(listed->begin(), listed->end()), want(wanted.begin(), wanted.end());
    std::vector<std::string> missing;
    for (const auto& k : want)
      if (!present.count(k)) missing.push_back("'" + k + "'");
    if (missing.empty()) return check_world(store, keys, o, me);  // they came just now
    const size_t n = missing.size();
    missing.resize(std::min<size_t>(n, 8));
    return timeout_error("{}: {} of {} keys still missing after {} ms: {}{}", context(), n, want.size(),
                         waited.count(), fmt::join(missing, ", "), missing.size() < n ? ", ..." : "");
  }
}

std::string instance_name() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  const uint64_t id = (uint64_t{rd()} << 32 | rd()) ^ counter.fetch_add(1);
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "?");
  return fmt::format("instance {:016x} (pid {} on {}, pid space {:x})", id, ::getpid(), host,
                     common::process_space_tag());
}

namespace {

// True when `holder` (an instance_name()) names a process of this pid space (one kernel,
// one PID namespace: common/host.h) that no longer exists: a rank killed and restarted
// on one host need not wait for its claim to lapse. False when unsure (another host or
// namespace, a pid that exists — perhaps reused, or a zombie not reaped yet).
bool holder_is_gone(std::string_view holder) {
  const uint64_t space = common::process_space_tag();
  const size_t at = holder.find("(pid "), sp = holder.rfind(", pid space ");
  if (space == 0 || at == std::string_view::npos || sp == std::string_view::npos || !holder.ends_with(")")) return false;
  std::string_view digits = holder.substr(at + 5);
  digits = digits.substr(0, digits.find(' '));
  std::string_view tag = holder.substr(sp + 12);
  tag.remove_suffix(1);
  int64_t pid = 0;
  uint64_t theirs = 0;
  auto p = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
  auto t = std::from_chars(tag.data(), tag.data() + tag.size(), theirs, 16);
  if (p.ec != std::errc() || p.ptr != digits.data() + digits.size() || t.ec != std::errc() ||
      t.ptr != tag.data() + tag.size() || theirs != space || pid <= 0 || pid > INT32_MAX)
    return false;
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

}  // namespace

Result<std::unique_ptr<Lease>> claim_rank(Store& store, const JobKeys& keys, const EngineOptions& o, Participant me,
                                          const std::string& instance) {
  if (Status s = JobKeys::check(keys.job()); !s.ok()) return s.with_context(fmt::format("{} {}", me.role, me.rank));
  const std::string key = keys.instance(me.role, me.rank);
  // A live holder renews every lease_ttl/3; a dead one's claim lapses within lease_ttl
  // of our first look. Past 1.5 lease_ttl still held, it is alive.
  const auto t0 = Clock::now();
  const auto patience = o.lease_ttl + o.lease_ttl / 2;
  const auto poll = std::clamp(o.lease_ttl / 20, std::chrono::milliseconds(5), std::chrono::milliseconds(100));
  std::string holder;
  for (;;) {
    auto claimed = store.claim_lease(key, instance, o.lease_ttl, &holder);
    if (claimed.ok()) {
      // An earlier instance's failure is this rank's no more.
      Status cleared = store.remove(keys.failed(me.role, me.rank)).status();
      if (!cleared.ok()) return cleared.with_context(fmt::format("{} {} taking back its earlier failure", me.role, me.rank));
      return claimed;
    }
    if (claimed.status().code() != StatusCode::kAlreadyExists)
      return claimed.status().with_context(fmt::format("{} {} claiming its rank", me.role, me.rank));
    if (holder_is_gone(holder)) {
      // Its process is gone (killed on this host): take the claim over from it, if it is
      // still that one's; the next claim_lease finds it ours.
      auto taken = store.compare_set(key, holder, instance, o.lease_ttl);
      if (!taken.ok()) return taken.status().with_context(fmt::format("{} {} claiming its rank", me.role, me.rank));
      if (taken->swapped) continue;
    }
    if (Clock::now() - t0 >= patience)
      return already_exists(
          "{} {} of job '{}' is held by {}, which is alive (its claim '{}' stayed renewed for {} ms, 1.5 lease_ttl): "
          "{} is refused and the holder keeps the rank (two processes started with one rank? a restarted rank takes "
          "over once the holder has died: its claim lapses within lease_ttl)",
          me.role, me.rank, keys.job(), holder, key, millis_since(t0).count(), instance);
    std::this_thread::sleep_for(poll);
  }
}

Status check_claim(const Lease& claim, Store& store, Participant me, const std::string& instance) {
  if (!claim.lost()) return Status::Ok();
  auto holder = store.get(claim.key());
  return failed_precondition(
      "{} {}: {} no longer holds the rank: {} claimed it while this instance was away past lease_ttl (paused or cut "
      "off); this instance syncs no more",
      me.role, me.rank, instance, holder.ok() ? *holder : std::string("another instance"));
}

void publish_failure(Store& store, const JobKeys& keys, const EngineOptions& o, Participant me,
                     const std::string& instance, const Status& why) {
  if (why.ok() || why.code() == StatusCode::kAlreadyExists || why.code() == StatusCode::kPeerFailed) return;
  if (!JobKeys::check(keys.job()).ok()) return;
  constexpr size_t kMaxReason = 4096;
  std::string text = fmt::format("{}: {}", instance, why.to_string());
  if (text.size() > kMaxReason) text = text.substr(0, kMaxReason) + "...";
  const auto ttl = std::clamp(o.rendezvous_timeout, std::chrono::milliseconds(1000), kMaxTtl);
  store.set(keys.failed(me.role, me.rank), text, ttl).ignore();
}

Result<RouteInputs> rendezvous_inputs(Store& store, const JobKeys& keys, const EngineOptions& o, Participant me,
                                      const std::vector<TensorDecl>& metadata) {
  std::vector<std::string> wanted;
  for (int p = 0; p < o.num_producers; ++p) wanted.push_back(keys.holdings(p));
  for (int c = 0; c < o.num_consumers; ++c) wanted.push_back(keys.plan(c));
  // (Each published before its holdings or plan, publish_once; waited for too, so that a
  // store that restarted empty and is being written back fails no rank that meets meanwhile.)
  for (int p = 0; p < o.num_producers; ++p) wanted.push_back(keys.host("producer", p));
  for (int c = 0; c < o.num_consumers; ++c) wanted.push_back(keys.host("consumer", c));
  for (int c = 0; c < o.num_consumers; ++c) wanted.push_back(keys.relays(c));
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
  // Every rank's host, published before its holdings or plan (so present now).
  for (int p = 0; p < o.num_producers; ++p) {
    FERRY_ASSIGN_OR_RETURN(auto host, store.get(keys.host("producer", p)));
    in.producer_hosts.push_back(std::move(host));
  }
  for (int c = 0; c < o.num_consumers; ++c) {
    FERRY_ASSIGN_OR_RETURN(auto host, store.get(keys.host("consumer", c)));
    in.consumer_hosts.push_back(std::move(host));
  }
  in.relay_hosts.assign(static_cast<size_t>(o.num_consumers), "");
  for (int c = 0; c < o.num_consumers; ++c) {
    FERRY_ASSIGN_OR_RETURN(auto relays, store.get(keys.relays(c)));
    if (relays == "1") in.relay_hosts[static_cast<size_t>(c)] = in.consumer_hosts[static_cast<size_t>(c)];
  }
  return in;
}

std::vector<int> relay_groups(const RouteInputs& inputs, const std::vector<uint32_t>& consumer_plan) {
  std::vector<int> out(consumer_plan.size(), -1);
  std::map<std::pair<std::string, uint32_t>, int> first;  // (host, plan class) -> its lowest consumer
  std::map<int, int> size;
  for (size_t c = 0; c < consumer_plan.size() && c < inputs.relay_hosts.size(); ++c) {
    if (inputs.relay_hosts[c].empty()) continue;
    auto it = first.emplace(std::make_pair(inputs.relay_hosts[c], consumer_plan[c]), static_cast<int>(c)).first;
    out[c] = it->second;
    ++size[it->second];
  }
  for (int& g : out)
    if (g >= 0 && size[g] < 2) g = -1;  // (alone on its host: relays with nobody)
  return out;
}

Result<std::string> publish_once(Store& store, const std::string& key, const std::string& value) {
  FERRY_ASSIGN_OR_RETURN(CompareSetResult r, store.compare_set(key, std::nullopt, value));
  return r.value.value_or(value);
}

bool delta_runs(const EngineOptions& o, const RouteInputs& in) {
  if (!o.delta || o.delta_same_host) return o.delta;
  std::set<std::string> hosts(in.producer_hosts.begin(), in.producer_hosts.end());
  hosts.insert(in.consumer_hosts.begin(), in.consumer_hosts.end());
  return hosts.size() > 1;
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
  auto routes = build_routes(in, router_);
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

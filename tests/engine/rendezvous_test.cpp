// The metadata and holdings JSON published at rendezvous (engine/rendezvous.h): values
// round-trip, and a value of the wrong type is kCorrupt, never an exception or a cast
// out of range.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "engine/rendezvous.h"
#include "ferry/engine.h"
#include "tools/job_model.h"
#include "test_paths.h"

namespace ferry::engine {
namespace {

TEST(Rendezvous, DeclsAndHoldingsRoundTrip) {
  const std::vector<TensorDecl> decls = {{"model.norm.weight", DType::kF32, {8}}, {"x", DType::kBF16, {}}};
  auto d = decode_decls(encode_decls(decls));
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(*d, decls);
  Holdings h;
  h.tensors = decls;
  h.boxes.push_back(HeldBox{0, Box{{2}, {4}}});
  auto back = decode_holdings(encode_holdings(h));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_TRUE(*back == h);
}

// Found by fuzz_rendezvous: nlohmann's get<> static_casts a float into an integer
// (1e300 into int64_t is undefined behaviour); every field's type is now checked first.
TEST(Rendezvous, WrongTypesAreCorrupt) {
  for (const char* bad : {R"([{"name":5,"dtype":"BF16","shape":[1]}])", R"([{"name":"a","dtype":7,"shape":[1]}])",
                          R"([{"name":"a","dtype":"BF16","shape":[1e300]}])", R"([{"name":"a","dtype":"BF16","shape":[-1]}])",
                          R"([{"name":"a","dtype":"BF16","shape":[1.5]}])", R"([{"name":"a","dtype":"BF16","shape":3}])",
                          R"({"name":"a"})"}) {
    auto d = decode_decls(bad);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_EQ(d.status().code(), StatusCode::kCorrupt) << bad;
  }
  const std::string tensors = R"("tensors":[{"name":"a","dtype":"BF16","shape":[2]}])";
  for (const std::string boxes : {R"([{"t":1e20,"start":[0],"size":[2]}])", R"([{"t":-1,"start":[0],"size":[2]}])",
                                   R"([{"t":1,"start":[0],"size":[2]}])", R"([{"t":"0","start":[0],"size":[2]}])",
                                   R"([{"t":0,"start":[1e300],"size":[2]}])", R"([{"t":0,"start":[0],"size":["2"]}])"}) {
    const std::string text = "{" + tensors + R"(,"boxes":)" + boxes + "}";
    auto h = decode_holdings(text);
    ASSERT_FALSE(h.ok()) << text;
    EXPECT_EQ(h.status().code(), StatusCode::kCorrupt) << text;
  }
  auto named = decode_holdings("{" + tensors + R"(,"boxes":[{"t":4294967296,"start":[0],"size":[2]}]})");
  ASSERT_FALSE(named.ok());
  EXPECT_NE(named.status().message().find("holdings box names tensor 4294967296 of 1"), std::string::npos)
      << named.status().to_string();
}

// A store of its own (the embedded TCP server) for tests of what ranks read back.
struct TestStore {
  static constexpr const char* kToken = "rendezvous-test-token-0123";
  std::unique_ptr<StoreServer> server;
  std::unique_ptr<Store> store;
  TestStore() {
    StoreServerOptions sso;
    sso.token = kToken;
    server = StoreServer::start(sso).value();
    StoreOptions so;
    so.token = kToken;
    store = Store::open(server->url(), so).value();
  }
};

// Two DP replicas of a shrunk Llama and one consumer: what RouteState needs to start.
RouteInputs replicated_inputs() {
  auto m = tools::make_job_model(std::string(FERRY_SOURCE_DIR) + "/configs/llama-3.1-8b.json", "tp=1,dp=2", "tp=1",
                                 true, "");
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  RouteInputs in;
  in.metadata = m->metadata;
  in.holdings = *m->holdings;
  auto plan = record_plan(*m->loader, 0, m->metadata);
  EXPECT_TRUE(plan.ok()) << plan.status().to_string();
  in.plans.push_back(std::move(*plan));
  return in;
}

// Issue 30: job 'j/dead/1' wrote j/dead/1/meta, and job 'j' read it as producer 1 dead
// (stoi("1/meta") = 1): it routed without a healthy replica, silently. Only keys that
// are exactly {job}/dead/{p}, p a producer of the job, mark one dead.
TEST(RouteState, OnlyExactDeadMarksOfTheJobsProducersCount) {
  TestStore ts;
  Store& st = *ts.store;
  for (const char* k : {"j/dead/1/meta", "j/dead/01", "j/dead/+1", "j/dead/-1", "j/dead/1 ", "j/dead/2",
                        "j/dead/4294967297"})
    ASSERT_TRUE(st.set(k, "1").ok()) << k;
  RouteState rs(st, JobKeys("j"), /*failover=*/true);
  auto routes = rs.start(replicated_inputs());
  ASSERT_TRUE(routes.ok()) << routes.status().to_string();
  EXPECT_TRUE(rs.dead().empty()) << "dead: " << rank_list(rs.dead());
  auto listed = rs.read_dead();
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty()) << rank_list(*listed);
  // The real mark counts.
  ASSERT_TRUE(st.set(JobKeys("j").dead(1), "1").ok());
  Status applied = rs.refresh([](Routes) { return Status::Ok(); });
  ASSERT_TRUE(applied.ok()) << applied.to_string();
  EXPECT_EQ(rs.dead(), std::set<int>{1});
}

// check_world read world keys with sscanf("%15[a-z]/%d/%d/%d"): a key with more after
// them, or a sign, was taken for a rank started with other world sizes and failed the
// job. Only exact world keys count; a real mismatch still fails at once, naming both.
TEST(Rendezvous, OnlyExactWorldKeysAreCheckedAgainstTheWorldSizes) {
  TestStore ts;
  Store& st = *ts.store;
  const JobKeys keys("w");
  EngineOptions o;
  o.job = "w";
  o.num_producers = 2;
  o.num_consumers = 1;
  for (const char* k : {"w/world/producer/0/3/1/layer.producer/extra", "w/world/producer/1/+3/1/layer.producer",
                        "w/world/consumer/0/2/01/layer.producer", "w/world/producer/0/3/1"})
    ASSERT_TRUE(st.set(k, "").ok()) << k;
  Status ok = check_world(st, keys, o, Participant{"consumer", 0});
  EXPECT_TRUE(ok.ok()) << ok.to_string();
  ASSERT_TRUE(st.set(keys.world("producer", 0, 2, 1, routing_choices(o)), "").ok());
  ok = check_world(st, keys, o, Participant{"consumer", 0});
  EXPECT_TRUE(ok.ok()) << ok.to_string();
  ASSERT_TRUE(st.set(keys.world("producer", 1, 3, 1, routing_choices(o)), "").ok());
  Status bad = check_world(st, keys, o, Participant{"consumer", 0});
  ASSERT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.to_string();
  EXPECT_NE(bad.message().find("producer 1 with num_producers=3"), std::string::npos) << bad.to_string();
}

// Ranks that would build other routes (another group order, or conversion on the other
// side) are refused at once, naming both choices: before, a consumer under another
// order waited for announcements its producers never made until the timeout.
TEST(Rendezvous, RanksWithOtherRoutingChoicesAreRefused) {
  TestStore ts;
  Store& st = *ts.store;
  const JobKeys keys("w");
  EngineOptions o;
  o.job = "w";
  EXPECT_EQ(routing_choices(o), "rotated.producer");  // the defaults
  EngineOptions other = o;
  other.convert_on = ConvertOn::kConsumer;
  other.group_order = GroupOrderKind::kLayer;
  EXPECT_EQ(routing_choices(other), "layer.consumer");
  ASSERT_TRUE(publish_world(st, keys, other, Participant{"producer", 0}).ok());
  Status bad = check_world(st, keys, o, Participant{"consumer", 0});
  ASSERT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.to_string();
  EXPECT_NE(bad.message().find("'rotated.producer' but producer 0 with 'layer.consumer'"), std::string::npos)
      << bad.to_string();
  EXPECT_TRUE(check_world(st, keys, other, Participant{"consumer", 0}).ok());
}

// So are ranks that would move other bytes: push beside pull (every sync waited out the
// timeout), checksums or delta on one side only (a consumer checking checksums reported ok
// with nothing checked): each option that differs named with both values (issue 49).
TEST(Rendezvous, RanksWithOtherModeChecksumsOrDeltaAreRefusedNamingEach) {
  TestStore ts;
  Store& st = *ts.store;
  const JobKeys keys("m");
  EngineOptions o;
  o.job = "m";
  EngineOptions push = o;
  push.mode = SyncMode::kPush;
  push.delta = true;
  EXPECT_EQ(routing_choices(push), "rotated.producer.push.delta");
  ASSERT_TRUE(publish_world(st, keys, push, Participant{"producer", 0}).ok());
  EngineOptions fetch = o;
  fetch.checksums = true;
  Status bad = check_world(st, keys, fetch, Participant{"consumer", 1});
  ASSERT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad.to_string();
  for (const char* want : {"checksums: on here, off at producer 0", "delta: off here, on at producer 0",
                           "mode: pull here, push at producer 0"})
    EXPECT_NE(bad.message().find(want), std::string::npos) << want << ": " << bad.to_string();
  EXPECT_EQ(bad.message().find("group_order:"), std::string::npos) << bad.to_string();  // (only what differs)
  EXPECT_TRUE(check_world(st, keys, push, Participant{"consumer", 1}).ok());
}

// A rank of a job whose name contains the key separator is refused before it writes a
// key (publish_world is every rank's first write), and so is committed_versions.
TEST(Rendezvous, AJobNameWithTheKeySeparatorIsRefusedBeforeAnyKey) {
  TestStore ts;
  Store& st = *ts.store;
  EngineOptions o;
  o.job = "j/dead/1";
  Status s = publish_world(st, JobKeys(o.job), o, Participant{"producer", 0});
  ASSERT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("contains '/'"), std::string::npos) << s.to_string();
  // claim_rank (what create() writes first) refuses it too, and no failure is published.
  const Status claimed = claim_rank(st, JobKeys(o.job), o, Participant{"producer", 0}, instance_name()).status();
  EXPECT_EQ(claimed.code(), StatusCode::kInvalidArgument) << claimed.to_string();
  publish_failure(st, JobKeys(o.job), o, Participant{"producer", 0}, instance_name(), claimed);
  auto listed = st.list("j/");
  ASSERT_TRUE(listed.ok());
  EXPECT_TRUE(listed->empty());
  EXPECT_EQ(committed_versions(st, "j/dead/1", 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(publish_world(st, JobKeys("j"), EngineOptions{}, Participant{"producer", 0}).ok());
}

// A rendezvous that times out says how long it waited in all (rendezvous_timeout, not
// the last 250 ms slice of it, as "store wait: 1 of 2 keys still missing after 92 ms"
// did) and which keys are still missing.
TEST(Rendezvous, ATimeoutSaysTheTimeReallyWaited) {
  TestStore ts;
  Store& st = *ts.store;
  const JobKeys keys("t");
  EngineOptions o;
  o.job = "t";
  o.rendezvous_timeout = std::chrono::milliseconds(1200);
  ASSERT_TRUE(st.set(keys.plan(0), "p").ok());
  Status s = await_keys(st, keys, o, Participant{"producer", 0}, {keys.plan(0), keys.plan(1)}, "every plan");
  ASSERT_EQ(s.code(), StatusCode::kTimeout) << s.to_string();
  EXPECT_NE(s.message().find("1 of 2 keys still missing"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("'t/plan/1'"), std::string::npos) << s.to_string();
  EXPECT_EQ(s.message().find("'t/plan/0'"), std::string::npos) << s.to_string();
  const size_t at = s.message().find("after ");
  ASSERT_NE(at, std::string::npos) << s.to_string();
  EXPECT_GE(std::stol(s.message().substr(at + 6)), 1200) << s.to_string();
}

// A participant's failure is published for the others (not one that is not its own: a
// refused claim, another's failure); another participant's wait fails naming it, well
// before rendezvous_timeout; a new instance of the failed rank takes it back when it
// claims the rank.
TEST(Rendezvous, APublishedFailureFailsTheOthersWaitsUntilTakenBack) {
  TestStore ts;
  Store& st = *ts.store;
  const JobKeys keys("f");
  EngineOptions o;
  o.job = "f";
  o.num_consumers = 3;
  o.rendezvous_timeout = std::chrono::seconds(60);
  const Participant c1{"consumer", 1}, c2{"consumer", 2}, p0{"producer", 0};
  publish_failure(st, keys, o, c2, "instance x", already_exists("held"));
  publish_failure(st, keys, o, c2, "instance x", peer_failed("another failed"));
  publish_failure(st, keys, o, c2, "instance x", Status::Ok());
  EXPECT_EQ(st.get(keys.failed("consumer", 2)).status().code(), StatusCode::kNotFound);
  publish_failure(st, keys, o, c1, "instance y", invalid_argument("a plan over the wrong dtype"));
  EXPECT_EQ(st.get(keys.failed("consumer", 1)).value_or("?"), "instance y: InvalidArgument: a plan over the wrong dtype");
  // (kPeerFailed, not kTimeout: the wait ended on the published failure, not the timeout)
  Status s = await_keys(st, keys, o, p0, {keys.plan(1)}, "every plan");
  ASSERT_EQ(s.code(), StatusCode::kPeerFailed) << s.to_string();
  EXPECT_NE(s.message().find("consumer 1 failed to join job 'f': instance y: InvalidArgument: a plan over the wrong dtype"),
            std::string::npos)
      << s.to_string();
  // Its own earlier failure does not stop the failed rank's new instance, which takes it
  // back when it claims the rank.
  o.rendezvous_timeout = std::chrono::milliseconds(300);
  EXPECT_EQ(await_keys(st, keys, o, c1, {keys.plan(1)}, "its plan").code(), StatusCode::kTimeout);
  auto claim = claim_rank(st, keys, o, c1, instance_name());
  ASSERT_TRUE(claim.ok()) << claim.status().to_string();
  EXPECT_EQ(st.get(keys.failed("consumer", 1)).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(st.set(keys.plan(1), "p").ok());
  o.rendezvous_timeout = std::chrono::seconds(60);
  EXPECT_TRUE(await_keys(st, keys, o, p0, {keys.plan(1)}, "every plan").ok());
}

// claim_rank: a rank held by a live instance (here: this process) is refused after 1.5
// lease_ttl naming the holder; one whose holder's process is gone from this host (a
// child that exited) is taken at once, long before its claim would lapse; a holder on
// another host (another pid space) is waited for, not looked up.
TEST(Rendezvous, AClaimIsRefusedWhileItsHolderLivesAndTakenWhenItsProcessIsGone) {
  TestStore ts;
  Store& st = *ts.store;
  const JobKeys keys("c");
  EngineOptions o;
  o.job = "c";
  o.lease_ttl = std::chrono::milliseconds(400);
  const Participant c0{"consumer", 0};
  auto first = claim_rank(st, keys, o, c0, instance_name());
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  auto second = claim_rank(st, keys, o, c0, instance_name());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyExists) << second.status().to_string();
  EXPECT_NE(second.status().message().find(fmt::format("consumer 0 of job 'c' is held by instance")),
            std::string::npos)
      << second.status().to_string();
  EXPECT_NE(second.status().message().find(fmt::format("(pid {} on ", ::getpid())), std::string::npos)
      << second.status().to_string();
  first->reset();

  // A holder whose process exited (reaped): its claim, with an hour to live, is taken.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  std::string dead = instance_name();
  const size_t pid_at = dead.find("(pid ") + 5;
  dead.replace(pid_at, dead.find(' ', pid_at) - pid_at, std::to_string(child));
  ASSERT_TRUE(st.set(keys.instance("consumer", 0), dead, std::chrono::hours(1)).ok());
  // (a claim that waited for it would be refused after 1.5 lease_ttl, as below: taken
  // means it was not waited for)
  o.lease_ttl = std::chrono::seconds(60);
  auto taken = claim_rank(st, keys, o, c0, instance_name());
  ASSERT_TRUE(taken.ok()) << taken.status().to_string();
  taken->reset();

  // The same pid in another pid space: not looked up here, so waited for (1.5 ttl).
  std::string elsewhere = dead;
  elsewhere.replace(elsewhere.rfind("pid space ") + 10, std::string::npos, "1)");
  ASSERT_TRUE(st.set(keys.instance("consumer", 0), elsewhere, std::chrono::hours(1)).ok());
  o.lease_ttl = std::chrono::milliseconds(400);
  auto waited = claim_rank(st, keys, o, c0, instance_name());
  ASSERT_FALSE(waited.ok());
  EXPECT_EQ(waited.status().code(), StatusCode::kAlreadyExists) << waited.status().to_string();
}

}  // namespace
}  // namespace ferry::engine

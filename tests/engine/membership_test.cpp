// Membership (engine/membership.h) against a fake store whose members change between
// roll calls: the epoch advances exactly when the live instances (or the world's size)
// change, a lapsed lease that a rank is counted on is waited for, and store errors other
// than an absent lease are returned.
#include "engine/membership.h"

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <set>
#include <mutex>
#include <thread>

namespace ferry::engine {
namespace {

using namespace std::chrono_literals;

// A store of plain keys: what the roll reads (get), and what the test changes.
class FakeStore final : public Store {
 public:
  void put(const std::string& k, const std::string& v) {
    std::lock_guard<std::mutex> lk(mu_);
    kv_[k] = v;
  }
  void drop(const std::string& k) {
    std::lock_guard<std::mutex> lk(mu_);
    kv_.erase(k);
  }
  bool broken = false;  // get() fails as an unreachable store does

  Status set(std::string_view key, std::string_view value, Millis) override {
    put(std::string(key), std::string(value));
    return Status::Ok();
  }
  Result<std::string> get(std::string_view key) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken) return unavailable("fake store: unreachable");
    auto it = kv_.find(std::string(key));
    if (it == kv_.end()) return not_found("no key {}", key);
    return it->second;
  }
  Result<int64_t> add(std::string_view, int64_t) override { return unimplemented("fake store"); }
  Result<CompareSetResult> compare_set(std::string_view, std::optional<std::string_view>, std::string_view,
                                       Millis) override {
    return unimplemented("fake store");
  }
  Result<bool> remove(std::string_view key) override {
    drop(std::string(key));
    return true;
  }
  Result<std::vector<std::string>> list(std::string_view) override { return unimplemented("fake store"); }
  Status wait(const std::vector<std::string>&, Millis) override { return unimplemented("fake store"); }
  Status renew(std::string_view, Millis) override { return unimplemented("fake store"); }
  Result<std::unique_ptr<Store>> clone() const override { return unimplemented("fake store"); }
  std::string url() const override { return "fake://"; }

 private:
  std::mutex mu_;
  std::map<std::string, std::string> kv_;
};

// Leases "instance|versions": the instance is the part before '|'.
std::string key(int r) { return "lease/" + std::to_string(r); }
std::string instance_of(std::string_view v) { return std::string(v.substr(0, v.find('|'))); }

TEST(Membership, EpochAdvancesExactlyWhenTheLiveInstancesOrTheWorldChange) {
  FakeStore store;
  Membership m(store, key, instance_of, 3, 200ms);
  EXPECT_EQ(m.size(), 3);
  EXPECT_EQ(m.epoch(), 0u);
  store.put(key(0), "a|1");
  store.put(key(1), "b|1");
  auto roll = m.call({});
  ASSERT_TRUE(roll.ok()) << roll.status().to_string();
  ASSERT_EQ(roll->size(), 3u);
  EXPECT_EQ((*roll)[0], std::optional<std::string>("a|1"));
  EXPECT_EQ((*roll)[1], std::optional<std::string>("b|1"));
  EXPECT_FALSE((*roll)[2]);
  const uint64_t e1 = m.epoch();
  EXPECT_EQ(e1, 1u);
  // The same members again, one with new versions in its lease: the same epoch.
  store.put(key(1), "b|2");
  roll = m.call({});
  ASSERT_TRUE(roll.ok());
  EXPECT_EQ((*roll)[1], std::optional<std::string>("b|2"));
  EXPECT_EQ(m.epoch(), e1);
  // Rank 2 joins: a new epoch. Rank 0 restarts (another instance): another. Rank 1
  // leaves: another.
  store.put(key(2), "c|1");
  ASSERT_TRUE(m.call({}).ok());
  EXPECT_EQ(m.epoch(), e1 + 1);
  store.put(key(0), "a2|1");
  ASSERT_TRUE(m.call({}).ok());
  EXPECT_EQ(m.epoch(), e1 + 2);
  store.drop(key(1));
  roll = m.call({});
  ASSERT_TRUE(roll.ok());
  EXPECT_FALSE((*roll)[1]);
  EXPECT_EQ(m.epoch(), e1 + 3);
  // The world grows to 4 ranks: a new epoch, and the roll reads the new rank.
  m.resize(4);
  EXPECT_EQ(m.size(), 4);
  EXPECT_EQ(m.epoch(), e1 + 4);
  m.resize(4);  // (the same size: nothing changes)
  EXPECT_EQ(m.epoch(), e1 + 4);
  store.put(key(3), "d|1");
  roll = m.call({});
  ASSERT_TRUE(roll.ok());
  ASSERT_EQ(roll->size(), 4u);
  EXPECT_EQ((*roll)[3], std::optional<std::string>("d|1"));
  EXPECT_EQ(m.epoch(), e1 + 5);
  // It shrinks back: rank 3 is no longer read.
  m.resize(3);
  roll = m.call({});
  ASSERT_TRUE(roll.ok());
  EXPECT_EQ(roll->size(), 3u);
}

TEST(Membership, ALapsedLeaseCountedOnIsWaitedForAndOthersAreNot) {
  FakeStore store;
  Membership m(store, key, instance_of, 2, 5000ms);
  store.put(key(0), "a|1");
  // Rank 1's lease comes back (its holder resumed) while the roll waits for it.
  std::thread healer([&] {
    std::this_thread::sleep_for(50ms);
    store.put(key(1), "b|1");
  });
  int asked = 0;
  auto roll = m.call([&](int r) {
    ++asked;
    return r == 1;
  });
  healer.join();
  ASSERT_TRUE(roll.ok()) << roll.status().to_string();
  EXPECT_EQ((*roll)[1], std::optional<std::string>("b|1"));
  EXPECT_GE(asked, 1);
  // Not counted on: absent at once.
  store.drop(key(1));
  roll = m.call([](int) { return false; });
  ASSERT_TRUE(roll.ok());
  EXPECT_FALSE((*roll)[1]);
}

TEST(Membership, ALeaseThatNeverComesBackIsAbsentAfterTheTtl) {
  FakeStore store;
  Membership m(store, key, instance_of, 1, 100ms);
  auto roll = m.call([](int) { return true; });
  ASSERT_TRUE(roll.ok());
  EXPECT_FALSE((*roll)[0]);
  EXPECT_EQ(m.epoch(), 0u);  // (no instance before, none now)
}

TEST(Membership, AStoreErrorIsReturnedNotTakenForAnAbsentMember) {
  FakeStore store;
  Membership m(store, key, instance_of, 2, 100ms);
  store.put(key(0), "a|1");
  ASSERT_TRUE(m.call({}).ok());
  const uint64_t e = m.epoch();
  store.broken = true;
  auto roll = m.call({});
  ASSERT_FALSE(roll.ok());
  EXPECT_EQ(roll.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(roll.status().message().find("unreachable"), std::string::npos);
  EXPECT_EQ(m.epoch(), e);  // what it knew stands
}


// A rank that left on purpose (its left mark set, its lease gone) is never waited for,
// even when counted on, and is listed in left(); joined() lists the ranks whose instance
// appeared or changed since the roll before (none at the first roll); a new instance of
// the rank (its lease back, the mark cleared) is a member again.
TEST(Membership, ARankThatLeftIsNotWaitedForAndAJoinerIsNamed) {
  FakeStore store;
  auto left_key = [](int r) { return "left/" + std::to_string(r); };
  Membership m(store, key, instance_of, 3, 60000ms, left_key);  // (a wait would take a minute)
  store.put(key(0), "a|1");
  store.put(key(1), "b|1");
  auto roll = m.call({});
  ASSERT_TRUE(roll.ok());
  EXPECT_TRUE(m.joined().empty());  // the first roll: everyone was there already
  EXPECT_TRUE(m.left().empty());    // rank 2 is absent, not left
  store.put(left_key(1), "b");
  store.drop(key(1));
  int asked_for_1 = 0;
  roll = m.call([&](int r) {
    asked_for_1 += r == 1;
    return r == 1;  // counted on: it would be waited for, had it not left
  });
  ASSERT_TRUE(roll.ok());
  EXPECT_EQ(asked_for_1, 0);  // (never asked whether to wait for it)
  EXPECT_FALSE((*roll)[1]);
  EXPECT_EQ(m.left(), std::set<int>{1});
  // A new instance of rank 1 joins (it clears the mark), and rank 2 comes for the first time.
  store.drop(left_key(1));
  store.put(key(1), "b2|1");
  store.put(key(2), "c|1");
  const uint64_t e = m.epoch();
  roll = m.call({});
  ASSERT_TRUE(roll.ok());
  EXPECT_TRUE(m.left().empty());
  EXPECT_EQ(m.joined(), (std::vector<int>{1, 2}));
  EXPECT_EQ(m.epoch(), e + 1);
  auto has_left = m.has_left(1);
  ASSERT_TRUE(has_left.ok());
  EXPECT_FALSE(*has_left);
}

}  // namespace
}  // namespace ferry::engine

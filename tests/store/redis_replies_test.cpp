// What the Redis backend makes of a server's replies (store/redis/replies.h): replies of
// the right shape decode; anything else — a wrong type, a value over the store's limit,
// a cursor that is not a number, a swap that names no value — is refused as an
// unexpected reply (kPeerFailed), never believed. Replies are RESP bytes parsed by
// hiredis' reader, as a server's bytes are.
#include <hiredis.h>

#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "store/redis/replies.h"

namespace ferry::store_detail::redis_replies {
namespace {

struct ReplyFree {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyFree>;

Reply parse(const std::string& resp) {
  redisReader* rd = redisReaderCreate();
  EXPECT_EQ(redisReaderFeed(rd, resp.data(), resp.size()), REDIS_OK);
  void* raw = nullptr;
  EXPECT_EQ(redisReaderGetReply(rd, &raw), REDIS_OK) << resp;
  redisReaderFree(rd);
  EXPECT_NE(raw, nullptr) << "incomplete reply: " << resp;
  return Reply(static_cast<redisReply*>(raw));
}

std::string bulk(const std::string& s) { return "$" + std::to_string(s.size()) + "\r\n" + s + "\r\n"; }

TEST(RedisReplies, GetDecodesAStringAndNil) {
  auto v = get(*parse(bulk("hello")), "k");
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(*v, "hello");
  EXPECT_EQ(get(*parse("$-1\r\n"), "k").status().code(), StatusCode::kNotFound);
  auto wrong = get(*parse(":7\r\n"), "k");
  EXPECT_EQ(wrong.status().code(), StatusCode::kPeerFailed);
  EXPECT_NE(wrong.status().message().find("store get 'k': unexpected reply from redis"), std::string::npos)
      << wrong.status().to_string();
}

TEST(RedisReplies, ValueOverTheStoreLimitIsRefused) {
  const std::string big(kMaxValueBytes + 1, 'x');
  EXPECT_EQ(get(*parse(bulk(big)), "k").status().code(), StatusCode::kPeerFailed);
  EXPECT_EQ(compare_set(*parse("*2\r\n:0\r\n" + bulk(big)), "k").status().code(), StatusCode::kPeerFailed);
}

TEST(RedisReplies, CompareSetShapes) {
  auto swapped = compare_set(*parse("*2\r\n:1\r\n" + bulk("v")), "k");
  ASSERT_TRUE(swapped.ok());
  EXPECT_TRUE(swapped->swapped);
  EXPECT_EQ(swapped->value, "v");
  auto absent = compare_set(*parse("*1\r\n:0\r\n"), "k");
  ASSERT_TRUE(absent.ok());
  EXPECT_FALSE(absent->swapped);
  EXPECT_FALSE(absent->value);
  // A swap that names no value, a flag that is neither 0 nor 1, too many elements.
  const std::vector<std::string> bad_replies = {"*1\r\n:1\r\n", "*1\r\n:2\r\n", "*3\r\n:0\r\n$1\r\na\r\n$1\r\nb\r\n",
                                               "*0\r\n", "*2\r\n" + bulk("1") + bulk("v"), "+OK\r\n"};
  for (const std::string& bad : bad_replies) {
    EXPECT_EQ(compare_set(*parse(bad), "k").status().code(), StatusCode::kPeerFailed) << bad;
  }
}

TEST(RedisReplies, ScanPageKeepsOnlyThePrefixAndRefusesOddCursors) {
  auto p = scan_page(*parse("*2\r\n" + bulk("17") + "*3\r\n" + bulk("job/a") + bulk("other") + bulk("job/b")), "job/");
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->cursor, "17");
  EXPECT_EQ(p->keys, (std::vector<std::string>{"a", "b"}));
  for (const char* cursor : {"", "-1", "12a", "123456789012345678901"}) {
    EXPECT_EQ(scan_page(*parse("*2\r\n" + bulk(cursor) + "*0\r\n"), "").status().code(), StatusCode::kPeerFailed)
        << "cursor '" << cursor << "'";
  }
  EXPECT_EQ(scan_page(*parse("*2\r\n" + bulk("0") + "*1\r\n:5\r\n"), "").status().code(), StatusCode::kPeerFailed);
  EXPECT_EQ(scan_page(*parse("*2\r\n:0\r\n*0\r\n"), "").status().code(), StatusCode::kPeerFailed);
}

TEST(RedisReplies, ErrorRepliesMapToCodes) {
  EXPECT_EQ(error_status("get", "k", "WRONGPASS invalid username-password pair").code(),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(error_status("add", "k", "ERR increment or decrement would overflow").code(), StatusCode::kOutOfRange);
  EXPECT_EQ(error_status("add", "k", "ERR value is not an integer or out of range").code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(error_status("get", "k", "ERR something else").code(), StatusCode::kInternal);
  // A restarted redis-server loading its data is there but not serving yet: retry.
  EXPECT_EQ(error_status("get", "k", "LOADING Redis is loading the dataset in memory").code(),
            StatusCode::kUnavailable);
  EXPECT_EQ(error_status("set", "k", "BUSY Redis is busy running a script").code(), StatusCode::kUnavailable);
  EXPECT_EQ(integer(*parse(bulk("5")), "add", "k").status().code(), StatusCode::kPeerFailed);
  EXPECT_EQ(*integer(*parse(":-3\r\n"), "add", "k"), -3);
}

}  // namespace
}  // namespace ferry::store_detail::redis_replies

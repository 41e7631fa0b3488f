// The metadata and holdings JSON published at rendezvous (engine/rendezvous.h): values
// round-trip, and a value of the wrong type is kCorrupt, never an exception or a cast
// out of range.
#include <gtest/gtest.h>

#include "engine/rendezvous.h"

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

}  // namespace
}  // namespace ferry::engine

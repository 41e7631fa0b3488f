// common/hmac.h — HMAC-SHA256 (internal, header only): the one keyed hash both the
// store's authentication (store/tcp/protocol.cpp) and the data plane's handshake
// (transport/auth.cpp) use. Each user links OpenSSL::Crypto itself; a header keeps the
// store and the transport from depending on each other or on a shared library for it.
#pragma once

#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>

namespace ferry::crypto {

using Mac = std::array<uint8_t, 32>;

// HMAC-SHA256 of the concatenation of `parts` under `key` (OpenSSL 3 EVP_MAC, streamed,
// so a 32 MiB value is not copied to be tagged). Never fails visibly: should OpenSSL
// fail (no HMAC provider), the result is random bytes, which verify against nothing,
// rather than a predictable tag.
inline Mac hmac_sha256(std::span<const uint8_t> key, std::initializer_list<std::span<const uint8_t>> parts) {
  static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  Mac out{};
  bool ok = false;
  if (EVP_MAC_CTX* ctx = mac != nullptr ? EVP_MAC_CTX_new(mac) : nullptr) {
    char digest[] = "SHA256";
    OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0), OSSL_PARAM_END};
    // An empty key is a valid HMAC key; OpenSSL wants a non-null pointer.
    static const uint8_t kEmpty = 0;
    ok = EVP_MAC_init(ctx, key.empty() ? &kEmpty : key.data(), key.size(), params) == 1;
    for (std::span<const uint8_t> p : parts) ok = ok && EVP_MAC_update(ctx, p.data(), p.size()) == 1;
    size_t len = 0;
    ok = ok && EVP_MAC_final(ctx, out.data(), &len, out.size()) == 1 && len == out.size();
    EVP_MAC_CTX_free(ctx);
  }
  if (!ok) RAND_bytes(out.data(), static_cast<int>(out.size()));
  return out;
}

}  // namespace ferry::crypto

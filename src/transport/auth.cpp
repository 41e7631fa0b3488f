#include "transport/auth.h"

#include "common/hmac.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include <initializer_list>
#include <span>

namespace ferry::transport_auth {
namespace {

using Bytes = std::span<const uint8_t>;

Bytes bytes_of(std::string_view s) { return {reinterpret_cast<const uint8_t*>(s.data()), s.size()}; }

std::array<uint8_t, 8> le64(uint64_t v) {
  std::array<uint8_t, 8> out{};
  for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(v >> (8 * i));
  return out;
}

Mac proof(std::string_view label, std::string_view token, uint64_t connector_id, uint64_t acceptor_id,
          const Nonce& connector_nonce, const Nonce& acceptor_nonce) {
  const auto c = le64(connector_id);
  const auto a = le64(acceptor_id);
  return crypto::hmac_sha256(bytes_of(token), {bytes_of(label), c, a, connector_nonce, acceptor_nonce});
}

}  // namespace

Result<Nonce> random_nonce() {
  Nonce n{};
  if (RAND_bytes(n.data(), int(n.size())) != 1) return internal_error("transport handshake: RAND_bytes failed");
  return n;
}

Mac acceptor_proof(std::string_view token, uint64_t connector_id, uint64_t acceptor_id, const Nonce& connector_nonce,
                   const Nonce& acceptor_nonce) {
  return proof("ferry transport v1 acceptor", token, connector_id, acceptor_id, connector_nonce, acceptor_nonce);
}

Mac connector_proof(std::string_view token, uint64_t connector_id, uint64_t acceptor_id, const Nonce& connector_nonce,
                    const Nonce& acceptor_nonce) {
  return proof("ferry transport v1 connector", token, connector_id, acceptor_id, connector_nonce, acceptor_nonce);
}

bool macs_equal(const Mac& a, const Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

}  // namespace ferry::transport_auth

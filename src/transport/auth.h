// transport/auth.h — the data plane's proof of the job's token (internal): the
// HMAC-SHA256 proofs both sides of a transport handshake compute, and fresh nonces.
// The frame that carries them is transport_wire::Handshake (wire.h); the flow is each
// backend's (ucx: endpoints.cpp; inproc compares tokens in process). docs/transport.md,
// "Authentication".
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "ferry/status.h"

namespace ferry::transport_auth {

using Nonce = std::array<uint8_t, 32>;
using Mac = std::array<uint8_t, 32>;

// 32 bytes from OpenSSL's RAND_bytes; kInternal if it fails.
Result<Nonce> random_nonce();

// The acceptor's proof (sent with its nonce): it knows `token`, answering this very
// connector's nonce. The connector's proof (sent last) covers the acceptor's nonce too.
// Both bind both instance ids, so a proof for one pair of transports is worthless to
// another, and distinct labels keep one side's proof from serving as the other's.
Mac acceptor_proof(std::string_view token, uint64_t connector_id, uint64_t acceptor_id, const Nonce& connector_nonce,
                   const Nonce& acceptor_nonce);
Mac connector_proof(std::string_view token, uint64_t connector_id, uint64_t acceptor_id, const Nonce& connector_nonce,
                    const Nonce& acceptor_nonce);

// Constant-time comparison (CRYPTO_memcmp).
bool macs_equal(const Mac& a, const Mac& b);

}  // namespace ferry::transport_auth

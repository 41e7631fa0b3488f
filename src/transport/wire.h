// transport/wire.h — the byte formats a Transport exchanges with peers: addresses,
// remote keys and control-message headers. Every decoder is length- and
// bounds-checked and returns kCorrupt for anything malformed; nothing decoded is
// trusted beyond what is checked here.
//
// All integers are little-endian. Layouts (offsets in bytes):
//   address: magic "FRAD"(4) version(1) backend(1) reserved(2)=0 instance_id(8)
//            pid(4) host_tag(8) payload_len(4) payload(payload_len)    — total 32 + n
//            (pid + host_tag let a peer on the same host watch the process: see
//            transport/ucx/peer_watch.cpp and endpoints.cpp)
//   key:     magic "FRRK"(4) version(1) backend(1) kind(1) reserved(1)=0 owner_id(8)
//            region_id(8) base(8) length(8) payload_len(4) payload(n)  — total 44 + n
//   message header (UCX active-message header; inproc passes it in memory):
//            magic "FRMS"(4) version(1) reserved(3)=0 sender_id(8) tag(4)
//            payload_len(4)                                            — total 24
//   handshake (one per step of the token handshake, docs/transport.md "Authentication"):
//            magic "FRHS"(4) version(1) step(1) reserved(2)=0 sender_id(8)
//            receiver_id(8) nonce(32) mac(32)                          — total 88
#pragma once

#include <cstddef>
#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "ferry/status.h"
#include "ferry/transport.h"

namespace ferry::transport_wire {

inline constexpr uint8_t kVersion = 1;
enum class Backend : uint8_t { kUcx = 1, kInproc = 2 };
const char* backend_name(Backend b);

// Upper bounds on opaque payloads: a UCP worker address or packed rkey is far smaller.
inline constexpr size_t kMaxAddressPayload = 64 * 1024;
inline constexpr size_t kMaxKeyPayload = 64 * 1024;

struct Address {
  Backend backend = Backend::kUcx;
  uint64_t instance_id = 0;
  uint32_t pid = 0;       // the owning process (0: unknown)
  uint64_t host_tag = 0;  // same value <=> same kernel and PID namespace (0: unknown; common/host.h)
  std::vector<std::byte> payload;
};
// This process's host tag: common::process_space_tag() (the boot id and the PID namespace;
// common/host.h, the one place that says what "same host" means).
uint64_t local_host_tag();
std::vector<std::byte> encode_address(const Address& a);
// kCorrupt for malformed bytes; kInvalidArgument when the backend differs from `expect`.
Result<Address> decode_address(std::span<const std::byte> bytes, Backend expect);

struct Key {
  Backend backend = Backend::kUcx;
  MemoryKind kind = MemoryKind::kHost;
  uint64_t owner_id = 0;
  uint64_t region_id = 0;
  uint64_t base = 0;
  uint64_t length = 0;
  std::vector<std::byte> payload;
};
std::vector<std::byte> encode_key(const Key& k);
// Also checks base + length does not wrap and length > 0.
Result<Key> decode_key(std::span<const std::byte> bytes, Backend expect);

inline constexpr size_t kMessageHeaderSize = 24;
struct MessageHeader {
  uint64_t sender_id = 0;
  uint32_t tag = 0;
  uint32_t payload_len = 0;
};
void encode_message_header(const MessageHeader& h, std::byte out[kMessageHeaderSize]);
// Checks the header bytes, and that the payload that came with it has exactly
// payload_len bytes and at most max_payload.
Result<MessageHeader> decode_message_header(std::span<const std::byte> header, size_t payload_size,
                                            size_t max_payload);

// One step of the token handshake (a connector proves the job's token to an acceptor,
// and the acceptor to it) — the transport-level handshake of every connection when
// TransportOptions::token is set:
//   kHello      connector -> acceptor: its nonce (mac zero)
//   kChallenge  acceptor -> connector: its nonce and acceptor_proof (auth.h)
//   kProof      connector -> acceptor: the acceptor's nonce echoed and connector_proof
//   kAccept / kRefuse  acceptor -> connector: the verdict (nonce and mac zero)
enum class HandshakeStep : uint8_t { kHello = 1, kChallenge = 2, kProof = 3, kAccept = 4, kRefuse = 5 };
const char* handshake_step_name(HandshakeStep step);
inline constexpr size_t kHandshakeSize = 88;
struct Handshake {
  HandshakeStep step = HandshakeStep::kHello;
  uint64_t sender_id = 0;
  uint64_t receiver_id = 0;
  std::array<uint8_t, 32> nonce{};
  std::array<uint8_t, 32> mac{};
};
std::array<std::byte, kHandshakeSize> encode_handshake(const Handshake& h);
// kCorrupt unless exactly kHandshakeSize bytes with the magic, version, a known step,
// zero reserved bytes and non-zero ids.
Result<Handshake> decode_handshake(std::span<const std::byte> bytes);

}  // namespace ferry::transport_wire

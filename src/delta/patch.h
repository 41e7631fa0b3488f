// delta/patch.h — lossless weight patches: the bytes that changed between two versions
// of a buffer, in whichever of three encodings is smallest (docs/delta.md).
//
// Contract:
//  * Pure functions over caller-owned memory: no state, no allocation kept, no
//    threads started (encoding allocates n/8 bytes of scratch for its scan; applying
//    allocates nothing). Any number of threads may call them at once on different
//    (or the same read-only) buffers. Inputs and outputs must not overlap.
//  * Lossless: an element "changed" when its bit pattern differs (bytes are compared,
//    never floats, so NaNs and -0.0 are exact). Element sizes 1, 2 and 4 bytes (fp8,
//    bf16/fp16, f32); any other size is kInvalidArgument.
//  * Bounded: with PatchChoice::kSmallest a patch is never larger than
//    max_patch_bytes(next.size()) = next.size() + kPatchHeaderBytes (dense is always
//    a candidate), so the engine can size staging memory before encoding.
//  * Verified: every patch carries the XXH3-64 of the content it produces; apply
//    checks the structure before writing anything, and the result's hash after.
//  * Errors: kInvalidArgument for the caller's arguments (sizes, element size, an
//    output buffer too small), kCorrupt for patch bytes that fail validation (bad
//    magic or version, truncated, a position out of range, a count that does not
//    add up) and for a result whose hash is not the one the patch names (wrong base
//    or damaged values; the message gives both hashes). Nothing throws.
//
// Wire format (little-endian), header of kPatchHeaderBytes:
//   0 magic "FRYD" | 4 u8 version (1) | 5 u8 encoding | 6 u8 elem size | 7 u8 zero
//   8 u64 element count | 16 u64 XXH3-64 of the resulting content | 24 u64 payload bytes
// then the payload (exactly that many bytes; see docs/delta.md per encoding).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "ferry/status.h"

namespace ferry::delta {

enum class PatchEncoding : uint8_t {
  kDense = 0,      // the new bytes as they are
  kBitmap = 1,     // 2-bit state per block (unchanged / some / all), a bitmap per
                   // partly changed block, then the changed elements' new values
  kPositions = 2,  // LEB128 gaps between changed elements, then their new values
  kBlocks = 3,     // whole changed blocks (encode_changed_blocks: no-copy producers)
};

const char* patch_encoding_name(PatchEncoding e);

// What encode_patch may pick. kSmallest is what the engine uses; the forced choices are
// for tests and benchmarks (a forced kBitmap/kPositions may be larger than dense).
enum class PatchChoice : uint8_t { kSmallest, kDense, kBitmap, kPositions };

inline constexpr size_t kPatchHeaderBytes = 32;
// Elements per kBitmap block (measured: docs/delta.md).
inline constexpr size_t kBitmapBlockElems = 1024;

// The most bytes a kSmallest patch of `dense_bytes` of content can take.
inline constexpr size_t max_patch_bytes(size_t dense_bytes) { return dense_bytes + kPatchHeaderBytes; }

// What a patch is (from its header, or from the encoder).
struct PatchInfo {
  PatchEncoding encoding = PatchEncoding::kDense;
  size_t elem_size = 0;
  uint64_t elems = 0;          // elements in the content (bytes for kBlocks)
  uint64_t content_hash = 0;   // XXH3-64 of the content the patch produces
  size_t bytes = 0;            // the whole patch, header included
  // Filled by the encoders only: elements (kBlocks: blocks) that changed, and what
  // each encoding would have taken for this pair (header included).
  uint64_t changed = 0;
  size_t dense_bytes = 0, bitmap_bytes = 0, positions_bytes = 0;
};

// Encodes next relative to base (same size, a multiple of elem_size) into `out`;
// returns what it wrote (PatchInfo::bytes of out). With kSmallest, out.size() >=
// max_patch_bytes(next.size()) always suffices; otherwise a too-small `out` is
// kInvalidArgument naming the bytes needed. Ties go to the cheaper apply (dense, then
// bitmap). `out` must not overlap base or next.
Result<PatchInfo> encode_patch_into(std::span<const std::byte> base, std::span<const std::byte> next,
                                    size_t elem_size, std::span<std::byte> out,
                                    PatchChoice choice = PatchChoice::kSmallest);

// The same into a vector of exactly the patch's size.
Result<std::vector<std::byte>> encode_patch(std::span<const std::byte> base, std::span<const std::byte> next,
                                            size_t elem_size, PatchChoice choice = PatchChoice::kSmallest);

// Validates and decodes the header only (magic, version, encoding, element size,
// payload length against patch.size(), dense payload size).
Result<PatchInfo> read_patch_header(std::span<const std::byte> patch);

// `target` holds the base on entry and the new content on success. Applies any
// encoding, kBlocks included. A patch whose structure is invalid is rejected before
// `target` is written (target unchanged); a hash mismatch is detected after writing
// (target then holds base with the patch's values applied: not a valid version).
Status apply_patch(std::span<std::byte> target, std::span<const std::byte> patch);

// ---- No-copy producers: block hashes instead of a copy of the base ----
//
// A producer that keeps no copy of what receivers hold keeps only block_hashes() of it;
// encode_changed_blocks() then sends the blocks whose hash differs, whole. A block-hash
// collision (a changed block taken for unchanged) is caught by apply's content hash.

// XXH3-64 of each block_bytes-sized block of data (the last may be shorter).
// block_bytes == 0 is kInvalidArgument.
Result<std::vector<uint64_t>> block_hashes(std::span<const std::byte> data, size_t block_bytes);

// The most bytes a kBlocks patch can take (every block changed).
size_t max_block_patch_bytes(size_t dense_bytes, size_t block_bytes);

// Encodes the blocks of next whose hash differs from prev_hashes (which must have one
// entry per block of next) into `out` (>= max_block_patch_bytes). PatchInfo::changed
// counts changed blocks. If next_hashes is given, it receives block_hashes(next) (the
// producer's prev_hashes for the next round).
Result<PatchInfo> encode_changed_blocks(std::span<const uint64_t> prev_hashes, std::span<const std::byte> next,
                                        size_t block_bytes, std::span<std::byte> out,
                                        std::vector<uint64_t>* next_hashes = nullptr);

// ---- Predicted patch sizes (ferry simulate, ferry plan) ----
//
// How the changed elements are laid out: scattered (each element changes independently
// with probability `fraction`: the field's bf16 RL updates) or clustered (the changes
// are whole contiguous runs: whole tensors or experts updated, the rest untouched).
enum class ChangeLayout : uint8_t { kScattered, kClustered };
Result<ChangeLayout> parse_change_layout(std::string_view text);  // scattered | clustered
const char* change_layout_name(ChangeLayout l);

// The expected size of a kSmallest patch over a large buffer, as a fraction of its dense
// bytes (0 < result <= 1; the 32-byte header is left out: buffers are megabytes), for
// `fraction` of its elements changed (0..1) and elements of `elem_bytes` (may be
// fractional: a model's bytes per element, fp8 experts beside bf16 attention). Computed
// from the format (docs/delta.md) with the expected LEB128 gap lengths and partly
// changed blocks of the layout; tests compare it with encode_patch on sampled buffers.
double predicted_patch_ratio(double fraction, double elem_bytes, ChangeLayout layout);

}  // namespace ferry::delta

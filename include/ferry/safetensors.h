// ferry/safetensors.h — reading and writing .safetensors checkpoints.
//
// File format (https://github.com/huggingface/safetensors): an 8-byte little-endian
// header length N, N bytes of JSON, then the byte buffer. The JSON is an object that
// maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
// relative to the byte buffer), plus an optional "__metadata__" object of
// string -> string.
//
// Contract:
//  * Validation. parse_safetensors_header() is a pure function over bytes and checks
//    everything the reference implementation checks: header size limit
//    (kSafetensorsMaxHeaderSize), valid JSON object, known dtypes, non-negative
//    integer shapes, offsets in range and not reversed, shape numel x dtype size equal
//    to the byte length (overflow-checked), no two tensors overlapping, and the byte
//    buffer fully covered (no holes, no trailing bytes). Errors are kCorrupt and
//    name the tensor and what is wrong:
//      "tensor 'model.norm.weight': data_offsets [0, 10] hold 10 bytes but shape [4] x
//       BF16 needs 8".
//    Errors from SafetensorsFile::open / SafetensorsDir::open are prefixed with the path.
//  * Access. SafetensorsAccess::kRead (the default) reads the whole file with pread into
//    read-only memory the process owns: a file truncated while it is read is an
//    kIoError naming the file, and one truncated later changes nothing. kMap maps the
//    file instead (no copy, pages read on first touch); the caller then promises that
//    nobody truncates the file while any of its tensors lives, because a touch of a
//    page past the new end raises SIGBUS wherever it happens.
//  * Ownership. SafetensorsFile holds the bytes (read or mapped) read-only. Every
//    Tensor it hands out borrows the mapping and holds a shared reference to it, so a
//    view keeps the mapping alive after the SafetensorsFile (and every copy of it) is
//    gone; the file is unmapped when the last of them goes. The bytes are read-only
//    (Tensor::is_read_only): copy_ into them and zero_ fail with kFailedPrecondition;
//    a store through data_ptr() faults. clone() first to get writable bytes. Tensors may be unaligned for their
//    dtype when a third-party writer did not align the buffer (ferry's writer does);
//    ferry's element access tolerates that.
//  * Threading. SafetensorsFile and SafetensorsDir are immutable values (cheap copies
//    of a shared handle): safe to share and read from any number of threads.
//  * Writing. write_safetensors() writes to a temporary file in the same folder and
//    renames it over `path`: `path` is either the old file or the complete new one,
//    never half-written. No exceptions escape any function here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"
#include "ferry/tensor.h"

namespace ferry {

// The reference implementation's limit on N (100 MB).
inline constexpr uint64_t kSafetensorsMaxHeaderSize = 100'000'000;

// One tensor of a parsed header.
struct SafetensorsTensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  Shape shape;
  uint64_t begin = 0;  // data_offsets, relative to the byte buffer
  uint64_t end = 0;

  uint64_t nbytes() const { return end - begin; }
};

// A validated header.
struct SafetensorsHeader {
  uint64_t header_size = 0;  // N
  uint64_t data_size = 0;    // bytes in the byte buffer (file size - 8 - N)
  // In file order (by data offset; zero-size tensors at the same offset by name).
  std::vector<SafetensorsTensorInfo> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__"; empty when absent

  // File offset of the byte buffer.
  uint64_t data_start() const { return 8 + header_size; }
};

// Parses and validates the header of a safetensors file whose complete contents are
// `file` (only the first 8 + N bytes are read; the size of `file` fixes the size of
// the byte buffer). Never reads outside `file`; kCorrupt on any violation.
Result<SafetensorsHeader> parse_safetensors_header(std::span<const std::byte> file);

// A (name, tensor) pair: what a SafetensorsFile exposes and what the writer takes.
struct SafetensorsEntry {
  std::string name;
  Tensor tensor;
};

// How SafetensorsFile gets a file's bytes (see Access above).
enum class SafetensorsAccess : uint8_t {
  kRead,  // pread into owned memory: safe against truncation
  kMap,   // mmap: no copy; SIGBUS if the file is truncated while its tensors live
};

// An open, validated .safetensors file whose tensors borrow its read-only bytes.
class SafetensorsFile {
 public:
  // Reads (or maps) and validates `path`. kNotFound / kIoError when the OS refuses or
  // the file shrinks while read, kCorrupt when validation fails; messages start with
  // the path.
  static Result<SafetensorsFile> open(const std::string& path, SafetensorsAccess access = SafetensorsAccess::kRead);

  const std::string& path() const;
  const SafetensorsHeader& header() const;
  const std::map<std::string, std::string>& metadata() const;

  // The tensors in file order; each borrows the mapping and is named after its entry.
  const std::vector<SafetensorsEntry>& tensors() const;
  // The whole file's bytes as opened (the mapping under kMap, the owned copy under
  // kRead): read-only, at a fixed address while this file or any of its tensors lives
  // (what a trainer registers to serve its tensors in place). Under kMap the same
  // SIGBUS caveat as the tensors' applies.
  std::span<const std::byte> bytes() const;
  size_t size() const { return tensors().size(); }
  bool contains(std::string_view name) const;
  // nullptr when absent.
  const Tensor* find(std::string_view name) const;
  // kNotFound naming the tensor and the file when absent.
  Result<Tensor> get(std::string_view name) const;

  struct State;

 private:
  explicit SafetensorsFile(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  std::shared_ptr<const State> state_;
};

// Every *.safetensors file of a folder (not recursive), opened as one checkpoint
// (a sharded HF checkpoint: model-00001-of-00004.safetensors, ...).
class SafetensorsDir {
 public:
  // kNotFound when `dir` is missing or holds no *.safetensors; any file's error
  // (prefixed with its path); kCorrupt when one tensor name appears in two files
  // ("tensor 'x' appears in both 'DIR/a.safetensors' and 'DIR/b.safetensors'").
  static Result<SafetensorsDir> open(const std::string& dir, SafetensorsAccess access = SafetensorsAccess::kRead);

  const std::string& dir() const;
  // The files, sorted by file name.
  const std::vector<SafetensorsFile>& files() const;
  // Every tensor: files in order, each in file order.
  const std::vector<SafetensorsEntry>& tensors() const;
  size_t size() const { return tensors().size(); }
  bool contains(std::string_view name) const;
  const Tensor* find(std::string_view name) const;
  Result<Tensor> get(std::string_view name) const;
  // The file that holds `name`; nullptr when absent.
  const SafetensorsFile* file_of(std::string_view name) const;

  struct State;

 private:
  explicit SafetensorsDir(std::shared_ptr<const State> state) : state_(std::move(state)) {}
  std::shared_ptr<const State> state_;
};

// Writes `tensors` (real storage, any layout; written contiguous) and `metadata` to
// `path` as safetensors, laid out as the reference writer does: tensors sorted by
// dtype size (largest first) then name, so each is aligned for its dtype, and the
// header padded with spaces to a multiple of 8. kInvalidArgument for an undefined,
// error or recording tensor, an empty, duplicate or "__metadata__" name, or names and
// metadata that are not valid UTF-8; kIoError when the OS refuses (nothing is left
// behind: the temporary file is removed).
Status write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

// The header bytes (8-byte length + padded JSON) write_safetensors would write for
// `tensors`, in the order it returns in `order` (indices into `tensors`). Exposed for
// tests and tools; same validation as write_safetensors.
Result<std::string> encode_safetensors_header(const std::vector<SafetensorsEntry>& tensors,
                                              const std::map<std::string, std::string>& metadata,
                                              std::vector<size_t>* order = nullptr);

}  // namespace ferry

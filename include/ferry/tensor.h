// ferry/tensor.h — dtypes, layouts and tensors over real or recording storage.
//
// A `Tensor` is a `Layout` (shape, strides and offset, all in elements) over a storage.
// The storage is either
//   * real: bytes, owned by the tensor (Tensor::empty) or borrowed (Tensor::borrow,
//     with an optional keep-alive handle, e.g. an mmap of a safetensors file), or
//   * recording: a named tensor that has a dtype and a full shape but no bytes —
//     a checkpoint *source* (Tensor::source) or an inference *param* (Tensor::param).
//
// The same view ops work on both storages with torch's names and semantics. On real
// storage `copy_` copies bytes; with a recording source, `copy_` appends a copy to
// the recorder active on the calling thread (see ferry/plan.h). This is how a model
// loader, written once against Tensor, yields an exact element map (a plan).
//
// Errors: ops never throw. An op with bad arguments returns a tensor that holds the
// error (`ok()` is false, `status()` explains: op, shape, argument); every later op
// on it returns the same error, and `copy_`/`zero_` return it as their Status. So a
// loader can chain `dst.narrow(0, a, n).copy_(src.narrow(0, b, n))` and check once.
// Ops that need values (data access, item, equal, arithmetic) fail on recording
// tensors with an error naming the op and the tensor.
//
// Threading: a Tensor is a value (a shared handle to its storage). Concurrent view
// ops on the same tensor are safe; concurrent writes to overlapping real bytes are
// the caller's business, as with torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"
#include "ferry/shape.h"

namespace ferry {

// ---------------------------------------------------------------------------------------
// DType

enum class DType : uint8_t {
  kBF16,
  kF16,
  kF32,
  kF8E4M3,  // float8_e4m3fn: no infinities, max 448
  kF8E5M2,
  kI8,
  kI16,
  kI32,
  kI64,
  kU8,
  kBool,
};
inline constexpr int kNumDTypes = 11;

// Bytes per element.
size_t dtype_size(DType dtype);
// The safetensors name: "BF16", "F16", "F32", "F8_E4M3", "F8_E5M2", "I8", "I16",
// "I32", "I64", "U8", "BOOL".
std::string_view dtype_name(DType dtype);
// Parses a safetensors name or a torch name ("bfloat16", "float8_e4m3fn", "int32"...).
Result<DType> parse_dtype(std::string_view name);
bool is_floating(DType dtype);

// Element conversion through double (exact for every dtype above except int64 values
// beyond 2^53). Floats round to nearest even; FP8 e4m3 saturates to +-448, NaN stays NaN.
double load_element(const std::byte* p, DType dtype);
void store_element(std::byte* p, DType dtype, double value);

// ---------------------------------------------------------------------------------------
// Devices: where a real tensor's bytes live (ferry/device.h has the rest: names, the
// CUDA plugin, batched copies).

enum class DeviceKind : uint8_t { kHost, kCuda };

// Host memory, or CUDA device `index`.
struct Device {
  DeviceKind kind = DeviceKind::kHost;
  int index = 0;  // CUDA device ordinal; 0 for the host

  static Device host() { return {}; }
  static Device cuda(int index) { return {DeviceKind::kCuda, index}; }
  bool is_host() const { return kind == DeviceKind::kHost; }
  bool is_cuda() const { return kind == DeviceKind::kCuda; }
  friend bool operator==(const Device&, const Device&) = default;
};

// ---------------------------------------------------------------------------------------
// Shapes and layouts

// Shape (ferry/shape.h): a vector of int64_t keeping up to four elements inline.

int64_t shape_numel(const Shape& shape);
// "[2, 3]"
std::string shape_str(const Shape& shape);
// Row-major strides of `shape`.
Shape contiguous_strides(const Shape& shape);

// A strided map from an index space (`shape`) into a flat element space:
// element (i0..in) lives at offset + sum(ik * strides[k]). Strides may be zero or
// negative in layouts produced by plan composition; views made by Tensor ops have
// non-negative strides.
struct Layout {
  Shape shape;
  Shape strides;
  int64_t offset = 0;

  static Layout contiguous(Shape shape, int64_t offset = 0);

  int64_t ndim() const { return static_cast<int64_t>(shape.size()); }
  int64_t numel() const { return shape_numel(shape); }
  bool is_contiguous() const;
  // Smallest and largest flat offset touched (offset when numel is 0).
  int64_t min_offset() const;
  int64_t max_offset() const;
  // Flat offset of a multi-index (no bounds checks).
  int64_t offset_of(const Shape& index) const;
  // "[2, 3] strides [3, 1] offset 0"
  std::string to_string() const;

  friend bool operator==(const Layout& a, const Layout& b) = default;
};

// Merges dims that are contiguous in both layouts (same shapes required) and drops
// size-1 dims, keeping the element correspondence; used before strided loops and to
// canonicalise plan copies. Zero-size layouts become a single dim of size 0.
void coalesce_layouts(Layout& a, Layout& b);
// The same for one layout.
void coalesce_layout(Layout& a);

// ---------------------------------------------------------------------------------------
// Tensor

class Tensor;
class TensorList;

// Where a recording tensor's copies go. Implemented by ferry::Recorder (plan.h);
// installed per thread. Tensors call it from copy_/zero_ when a recording tensor is
// involved; the sink validates and records.
class RecordSink {
 public:
  virtual ~RecordSink() = default;
  // dst and src have equal numel; src is recording.
  virtual Status record_copy(const Tensor& dst, const Tensor& src) = 0;
  // dst is a recording param: its elements are explicitly zero (padding).
  virtual Status record_zero(const Tensor& dst) = 0;
};
// The sink active on this thread (nullptr when none). Used by Recorder's scope.
RecordSink* active_record_sink();
void set_active_record_sink(RecordSink* sink);

// One piece of a recording tensor's element map: the box of this tensor's index space
// starting at `start` with extent `root.shape`, whose elements live at `root` in the
// flat (row-major) element space of the root storage.
struct MapPiece {
  Shape start;
  Layout root;
  uint32_t part = 0;  // compose_layout: index of the piece of the inner map it lies in
};

// Composition of strided maps. `layout` maps its index space into the row-major flat
// space of an index space of shape `radix`; `pieces` are disjoint boxes of that radix
// space (start, extent root.shape), each with a layout (root) into a storage of its own.
// Returns `layout`'s index space cut into boxes on which the composed map is strided,
// each inside one piece (`part` is that piece's index), in no particular order.
// Elements that fall in no piece are left out (callers count them to detect gaps).
std::vector<MapPiece> compose_layout(const Layout& layout, const Shape& radix, const std::vector<MapPiece>& pieces);
// The same pieces in the same order, each handed to `each` (valid during the call only)
// instead of collected, over pieces[(*subset)[i]] when `subset` is given (`part` is then
// i). What the router uses: no vector of pieces per copy, no copy of the candidates.
void compose_layout_each(const Layout& layout, const Shape& radix, const std::vector<MapPiece>& pieces,
                         const std::vector<uint32_t>* subset, const std::function<void(const MapPiece&)>& each);

enum class StorageKind : uint8_t { kReal, kSource, kParam };

class Tensor {
 public:
  // An undefined tensor (ok() is false).
  Tensor();

  // Real storage, owned, zero-filled, contiguous. `name` is optional for real tensors;
  // a named real tensor can be the destination of a recorded copy (as a param).
  static Tensor empty(Shape shape, DType dtype, std::string name = "");
  // Real storage over `data` (not owned): `keepalive` is held as long as any view is.
  static Tensor borrow(void* data, Shape shape, DType dtype,
                       std::shared_ptr<const void> keepalive = nullptr, std::string name = "");
  // Real storage over read-only bytes (e.g. a PROT_READ mapping): copy_ and zero_ into
  // it fail instead of faulting. data_ptr() still returns the address: don't write.
  static Tensor borrow_readonly(const void* data, Shape shape, DType dtype,
                                std::shared_ptr<const void> keepalive = nullptr, std::string name = "");
  // Real storage of `numel` elements at `data` (not owned), seen through `layout`: a
  // view with any non-negative strides (e.g. a torch view of a trainer's own parameter),
  // no copy. Errors: a negative stride or offset, or an element outside [0, numel).
  static Tensor borrow_strided(void* data, int64_t numel, Layout layout, DType dtype,
                               std::shared_ptr<const void> keepalive = nullptr, std::string name = "");
  // Real storage over `data` in `device`'s memory (not owned), contiguous; for a CUDA
  // device, a device pointer (e.g. a torch CUDA tensor's data_ptr()). Values can't be
  // read on the host (data_ptr, item, ... fail naming the device); copy_ and zero_
  // between tensors of the same device run there (ferry/device.h's copy_batch).
  static Tensor borrow_device(void* data, Shape shape, DType dtype, Device device,
                              std::shared_ptr<const void> keepalive = nullptr, std::string name = "");
  // Recording storage: a checkpoint tensor with no bytes.
  static Tensor source(std::string name, Shape shape, DType dtype);
  // Recording storage: an inference parameter with no bytes.
  static Tensor param(std::string name, Shape shape, DType dtype);
  // A tensor that holds `status` (an error); every op on it returns that error.
  static Tensor error(Status status);

  bool ok() const;
  const Status& status() const;

  StorageKind storage_kind() const;
  bool is_recording() const;  // source or param (or a recorded copy of one)
  bool is_real() const;
  bool is_read_only() const;  // real storage made by borrow_readonly
  // Where the bytes are: the host for every tensor but those made by borrow_device.
  Device device() const;
  // The storage's name (the root storage for a recorded copy); may be empty for real.
  const std::string& name() const;
  // The full shape of the root storage (a source's or param's declared shape; a real
  // storage's flat size as [n]).
  const Shape& root_shape() const;

  DType dtype() const;
  const Shape& shape() const;
  const Shape& strides() const;
  int64_t offset() const;
  const Layout& layout() const;
  int64_t dim() const;
  int64_t ndim() const { return dim(); }
  int64_t size(int64_t dim) const;  // negative dims wrap; -1 when out of range
  int64_t numel() const;
  bool is_contiguous() const;
  int64_t nbytes() const;  // numel * dtype size

  // --- views (torch semantics; negative dims and indices wrap) -----------------------
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor select(int64_t dim, int64_t index) const;
  // Python slicing x[start:stop:step] on `dim`; bounds are clamped like Python's;
  // step must be positive.
  Tensor slice(int64_t dim, std::optional<int64_t> start, std::optional<int64_t> stop,
               int64_t step = 1) const;
  Tensor operator[](int64_t index) const { return select(0, index); }
  // A view with the given shape (one -1 allowed); fails when strides can't express it.
  Tensor view(Shape shape) const;
  // view() when possible, otherwise contiguous().view(); on recording storage the copy
  // is recorded lazily as an element map, so the plan stays exact.
  Tensor reshape(Shape shape) const;
  Tensor transpose(int64_t dim0, int64_t dim1) const;
  Tensor t() const;  // 0-D and 1-D: self; 2-D: transpose(0, 1); else error
  Tensor permute(std::vector<int64_t> dims) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor unflatten(int64_t dim, Shape sizes) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor squeeze() const;             // drops every size-1 dim
  Tensor squeeze(int64_t dim) const;  // no-op when that dim is not 1
  TensorList chunk(int64_t chunks, int64_t dim = 0) const;
  TensorList split(int64_t split_size, int64_t dim = 0) const;
  TensorList split(std::vector<int64_t> sizes, int64_t dim = 0) const;
  TensorList unbind(int64_t dim = 0) const;
  // Self when contiguous; otherwise a contiguous copy (real: bytes copied; recording:
  // a recorded element map over the same root storage).
  Tensor contiguous() const;
  // A contiguous real copy (real storage only).
  Tensor clone() const;

  // --- writes ---------------------------------------------------------------------
  // Copies `src` into this tensor with torch's shape rule: `src` must broadcast to this
  // shape (right-aligned dims equal or 1 in `src`; a broadcast src is copied into every
  // slice). Real <- real: copies, converting between float dtypes (other dtypes must
  // match). Real or param <- recording source: recorded (needs an active recorder).
  // On a CUDA device both tensors must be on it and of one dtype (host <-> device
  // copies are not copy_'s: they fail naming both devices).
  Status copy_(const Tensor& src) const;
  // Zero-fills (real) or records explicit zeros (recording param, for padding).
  Status zero_() const;

  // --- values (real storage only; recording tensors fail naming op and tensor) ------
  Result<std::byte*> data_ptr() const;     // address of element offset() (host memory only)
  // Address of element offset() in device()'s memory: a device pointer for CUDA tensors.
  Result<std::byte*> device_ptr() const;
  Result<double> item() const;             // numel must be 1
  Result<std::vector<double>> to_vector() const;  // row-major values
  Result<bool> equal(const Tensor& other) const;  // same shape, dtype and bytes per element
  Result<Tensor> add(const Tensor& other) const;  // elementwise, same shape and dtype
  Result<Tensor> mul(double scalar) const;        // elementwise

  // True for a (view of a) recorded contiguous() copy of a recording view that strides
  // could not express; such a tensor is not a view of its root storage, so writing into
  // it would write nothing (copy_ into it is refused).
  bool is_recorded_copy() const;

  // Element map of a recording tensor, as boxes of its index space; one piece with
  // this tensor's layout for a plain view (also for real storage).
  Result<std::vector<MapPiece>> element_map() const;

  // "source 'model.norm.weight' [4096] bf16" — for messages.
  std::string describe() const;

  struct Impl;

 private:
  explicit Tensor(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
  friend class TensorOps;
};

// The result of chunk/split/unbind: the parts, or the error that prevented them.
// Indexing past the end returns an error tensor (never undefined behaviour).
class TensorList {
 public:
  TensorList() = default;
  explicit TensorList(std::vector<Tensor> parts) : parts_(std::move(parts)) {}
  explicit TensorList(Status error) : status_(std::move(error)) {}

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }
  size_t size() const { return parts_.size(); }
  Tensor operator[](size_t i) const;
  std::vector<Tensor>::const_iterator begin() const { return parts_.begin(); }
  std::vector<Tensor>::const_iterator end() const { return parts_.end(); }
  const std::vector<Tensor>& parts() const { return parts_; }

 private:
  std::vector<Tensor> parts_;
  Status status_;
};

// Copies `layout`-shaped elements from src (flat element space at `src`, of `src_dtype`)
// to dst, converting float dtypes. The innermost contiguous runs are memcpy'd.
// No bounds checks: callers validate layouts against their buffers first.
void strided_copy(const std::byte* src, const Layout& src_layout, DType src_dtype,
                  std::byte* dst, const Layout& dst_layout, DType dst_dtype);

// Zero-fills the `layout`-shaped elements of dtype `dtype` at `base` (innermost
// contiguous runs as memset). No bounds checks, as strided_copy.
void strided_zero(std::byte* base, const Layout& layout, DType dtype);

}  // namespace ferry

// Tensor: view ops over real or recording storage.
#include <algorithm>
#include <cstring>
#include <new>
#include <numeric>

#include "ferry/device.h"
#include "ferry/tensor.h"

namespace ferry {

// The bytes (real) or the identity (recording) behind a tensor.
struct Storage {
  StorageKind kind = StorageKind::kReal;
  std::string name;
  DType dtype = DType::kF32;
  Shape root_shape;  // declared shape (recording) or creation shape (real)
  // Real storage only.
  std::byte* data = nullptr;
  int64_t numel = 0;
  std::shared_ptr<const void> keepalive;
  bool read_only = false;
  Device device;  // real storage: where `data` points
};

struct Tensor::Impl {
  Status status;
  std::shared_ptr<const Storage> storage;
  Layout layout;
  // Recording only: when set, `layout` indexes a virtual contiguous buffer whose
  // element j is element j (row-major) of *parent: a recorded contiguous() copy.
  std::shared_ptr<const Tensor> parent;
};

namespace {

thread_local RecordSink* g_sink = nullptr;

const Status& undefined_status() {
  static const Status s = failed_precondition("undefined tensor (default-constructed)");
  return s;
}

const Shape& empty_shape() {
  static const Shape s;
  return s;
}
const Layout& empty_layout() {
  static const Layout l;
  return l;
}
const std::string& empty_string() {
  static const std::string s;
  return s;
}

// Wraps a negative dim; returns -1 when out of range.
int64_t wrap_dim(int64_t dim, int64_t ndim) {
  if (dim < -ndim || dim >= ndim) return -1;
  return dim < 0 ? dim + ndim : dim;
}

}  // namespace

RecordSink* active_record_sink() { return g_sink; }
void set_active_record_sink(RecordSink* sink) { g_sink = sink; }

// Friend of Tensor: builds views.
class TensorOps {
 public:
  static const Tensor::Impl& impl(const Tensor& t) { return *t.impl_; }
  static bool defined(const Tensor& t) { return t.impl_ != nullptr; }

  static Tensor make(const Tensor& base, Layout layout) {
    auto impl = std::make_shared<Tensor::Impl>();
    impl->storage = base.impl_->storage;
    impl->parent = base.impl_->parent;
    impl->layout = std::move(layout);
    return Tensor(std::move(impl));
  }

  static Tensor make_virtual(const Tensor& parent) {
    auto impl = std::make_shared<Tensor::Impl>();
    impl->storage = parent.impl_->storage;
    impl->parent = std::make_shared<const Tensor>(parent);
    impl->layout = Layout::contiguous(parent.shape());
    return Tensor(std::move(impl));
  }

  static Tensor make_storage(std::shared_ptr<Storage> storage, Layout layout) {
    auto impl = std::make_shared<Tensor::Impl>();
    impl->storage = std::move(storage);
    impl->layout = std::move(layout);
    return Tensor(std::move(impl));
  }

  template <typename... Args>
  static Tensor fail(const Tensor& t, std::string_view op, fmt::format_string<Args...> f,
                     Args&&... args) {
    return Tensor::error(invalid_argument("{}: {} (tensor {})", op,
                                          fmt::format(f, std::forward<Args>(args)...),
                                          t.describe()));
  }
};

namespace {

// ---------------------------------------------------------------------------------------
// torch's view stride computation (at::detail::computeStride).
std::optional<Shape> compute_view_strides(const Shape& oldshape, const Shape& oldstride,
                                          const Shape& newshape) {
  if (oldshape.empty()) return Shape(newshape.size(), 1);
  const int64_t numel = shape_numel(oldshape);
  if (numel == 0 && oldshape == newshape) return oldstride;
  Shape newstride(newshape.size(), 0);
  if (numel == 0) {
    for (int64_t view_d = static_cast<int64_t>(newshape.size()) - 1; view_d >= 0; view_d--) {
      if (view_d == static_cast<int64_t>(newshape.size()) - 1) {
        newstride[view_d] = 1;
      } else {
        newstride[view_d] = std::max<int64_t>(newshape[view_d + 1], 1) * newstride[view_d + 1];
      }
    }
    return newstride;
  }
  int64_t view_d = static_cast<int64_t>(newshape.size()) - 1;
  int64_t chunk_base_stride = oldstride.back();
  int64_t tensor_numel = 1;
  int64_t view_numel = 1;
  for (int64_t tensor_d = static_cast<int64_t>(oldshape.size()) - 1; tensor_d >= 0; tensor_d--) {
    tensor_numel *= oldshape[tensor_d];
    if (tensor_d == 0 ||
        (oldshape[tensor_d - 1] != 1 && oldstride[tensor_d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || newshape[view_d] == 1)) {
        newstride[view_d] = view_numel * chunk_base_stride;
        view_numel *= newshape[view_d];
        view_d--;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (tensor_d > 0) {
        chunk_base_stride = oldstride[tensor_d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return newstride;
}

// Resolves one -1 in `shape` for `numel` elements.
Result<Shape> infer_shape(const Shape& shape, int64_t numel, std::string_view op, const Shape& from) {
  Shape out = shape;
  int64_t infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (infer >= 0) return invalid_argument("{}: only one dimension can be -1 in {}", op, shape_str(shape));
      infer = static_cast<int64_t>(i);
    } else if (shape[i] < 0) {
      return invalid_argument("{}: invalid size {} in {}", op, shape[i], shape_str(shape));
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel % known != 0) {
      return invalid_argument("{}: shape {} is invalid for input of size {} ({})", op, shape_str(shape), numel,
                              shape_str(from));
    }
    out[infer] = numel / known;
  } else if (known != numel) {
    return invalid_argument("{}: shape {} is invalid for input of size {} ({})", op, shape_str(shape), numel,
                            shape_str(from));
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Construction

Tensor::Tensor() = default;
Tensor::Tensor(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

Tensor Tensor::error(Status status) {
  auto impl = std::make_shared<Impl>();
  impl->status = status.ok() ? internal_error("Tensor::error called with OK status") : std::move(status);
  return Tensor(std::move(impl));
}

namespace {
Status check_shape(const Shape& shape, std::string_view what) {
  int64_t product = 1;  // of max(size, 1), so that contiguous strides can't overflow
  for (int64_t s : shape) {
    if (s < 0) return invalid_argument("{}: negative size in shape {}", what, shape_str(shape));
    if (__builtin_mul_overflow(product, std::max<int64_t>(s, 1), &product) || product > kMaxShapeElements) {
      return invalid_argument("{}: shape {} is too large", what, shape_str(shape));
    }
  }
  return Status::Ok();
}
}  // namespace

Tensor Tensor::empty(Shape shape, DType dtype, std::string name) {
  if (auto st = check_shape(shape, "empty"); !st.ok()) return error(st);
  auto storage = std::make_shared<Storage>();
  storage->kind = StorageKind::kReal;
  storage->name = std::move(name);
  storage->dtype = dtype;
  storage->numel = shape_numel(shape);
  const size_t bytes = static_cast<size_t>(storage->numel) * dtype_size(dtype);
  // No exception leaves the core: memory the allocator refuses is an error tensor.
  std::byte* raw = new (std::nothrow) std::byte[std::max<size_t>(bytes, 1)]();
  if (raw == nullptr) {
    return error(io_error("empty: out of memory: cannot allocate {} bytes for {} {} '{}'", bytes, dtype_name(dtype),
                          shape_str(shape), storage->name));
  }
  auto buf = std::shared_ptr<std::byte[]>(raw);
  storage->data = buf.get();
  storage->keepalive = buf;
  storage->root_shape = shape;
  return TensorOps::make_storage(std::move(storage), Layout::contiguous(std::move(shape)));
}

Tensor Tensor::borrow(void* data, Shape shape, DType dtype, std::shared_ptr<const void> keepalive,
                      std::string name) {
  if (auto st = check_shape(shape, "borrow"); !st.ok()) return error(st);
  if (data == nullptr && shape_numel(shape) != 0) return error(invalid_argument("borrow: null data for {}", shape_str(shape)));
  auto storage = std::make_shared<Storage>();
  storage->kind = StorageKind::kReal;
  storage->name = std::move(name);
  storage->dtype = dtype;
  storage->numel = shape_numel(shape);
  storage->data = static_cast<std::byte*>(data);
  storage->keepalive = std::move(keepalive);
  storage->root_shape = shape;
  return TensorOps::make_storage(std::move(storage), Layout::contiguous(std::move(shape)));
}

Tensor Tensor::borrow_strided(void* data, int64_t numel, Layout layout, DType dtype,
                              std::shared_ptr<const void> keepalive, std::string name) {
  if (auto st = check_shape(layout.shape, "borrow_strided"); !st.ok()) return error(st);
  if (layout.strides.size() != layout.shape.size()) {
    return error(invalid_argument("borrow_strided: {} strides for {} dims", layout.strides.size(), layout.shape.size()));
  }
  if (numel < 0) return error(invalid_argument("borrow_strided: negative storage size {}", numel));
  for (int64_t s : layout.strides) {
    if (s < 0) return error(invalid_argument("borrow_strided: negative stride in {}", layout.to_string()));
  }
  if (layout.numel() > 0) {
    if (data == nullptr) return error(invalid_argument("borrow_strided: null data for {}", layout.to_string()));
    if (layout.offset < 0 || layout.max_offset() >= numel) {
      return error(out_of_range("borrow_strided: {} reaches outside a storage of {} elements", layout.to_string(), numel));
    }
  }
  auto storage = std::make_shared<Storage>();
  storage->kind = StorageKind::kReal;
  storage->name = std::move(name);
  storage->dtype = dtype;
  storage->numel = numel;
  storage->data = static_cast<std::byte*>(data);
  storage->keepalive = std::move(keepalive);
  storage->root_shape = {numel};
  return TensorOps::make_storage(std::move(storage), std::move(layout));
}

Tensor Tensor::borrow_readonly(const void* data, Shape shape, DType dtype, std::shared_ptr<const void> keepalive,
                               std::string name) {
  Tensor t = borrow(const_cast<void*>(data), std::move(shape), dtype, std::move(keepalive), std::move(name));
  if (!t.ok()) return t;
  // The storage was just made and is not shared yet.
  const_cast<Storage&>(*t.impl_->storage).read_only = true;
  return t;
}

Tensor Tensor::borrow_device(void* data, Shape shape, DType dtype, Device device, std::shared_ptr<const void> keepalive,
                             std::string name) {
  if (device.is_cuda() && device.index < 0) return error(invalid_argument("borrow_device: CUDA device {}", device.index));
  Tensor t = borrow(data, std::move(shape), dtype, std::move(keepalive), std::move(name));
  if (!t.ok()) return t;
  // The storage was just made and is not shared yet.
  const_cast<Storage&>(*t.impl_->storage).device = device;
  return t;
}

namespace {
Tensor make_recording(StorageKind kind, std::string name, Shape shape, DType dtype) {
  const char* what = kind == StorageKind::kSource ? "source" : "param";
  if (auto st = check_shape(shape, what); !st.ok()) return Tensor::error(st);
  if (name.empty()) return Tensor::error(invalid_argument("{}: a recording tensor needs a name", what));
  auto storage = std::make_shared<Storage>();
  storage->kind = kind;
  storage->name = std::move(name);
  storage->dtype = dtype;
  storage->numel = shape_numel(shape);
  storage->root_shape = shape;
  return TensorOps::make_storage(std::move(storage), Layout::contiguous(std::move(shape)));
}
}  // namespace

Tensor Tensor::source(std::string name, Shape shape, DType dtype) {
  return make_recording(StorageKind::kSource, std::move(name), std::move(shape), dtype);
}
Tensor Tensor::param(std::string name, Shape shape, DType dtype) {
  return make_recording(StorageKind::kParam, std::move(name), std::move(shape), dtype);
}

// ---------------------------------------------------------------------------------------
// Accessors

bool Tensor::ok() const { return impl_ && impl_->status.ok(); }
const Status& Tensor::status() const { return impl_ ? impl_->status : undefined_status(); }
StorageKind Tensor::storage_kind() const { return ok() ? impl_->storage->kind : StorageKind::kReal; }
bool Tensor::is_recording() const { return ok() && impl_->storage->kind != StorageKind::kReal; }
bool Tensor::is_real() const { return ok() && impl_->storage->kind == StorageKind::kReal; }
const std::string& Tensor::name() const { return ok() ? impl_->storage->name : empty_string(); }
const Shape& Tensor::root_shape() const { return ok() ? impl_->storage->root_shape : empty_shape(); }
DType Tensor::dtype() const { return ok() ? impl_->storage->dtype : DType::kF32; }
const Shape& Tensor::shape() const { return ok() ? impl_->layout.shape : empty_shape(); }
const Shape& Tensor::strides() const { return ok() ? impl_->layout.strides : empty_shape(); }
int64_t Tensor::offset() const { return ok() ? impl_->layout.offset : 0; }
const Layout& Tensor::layout() const { return ok() ? impl_->layout : empty_layout(); }
int64_t Tensor::dim() const { return static_cast<int64_t>(shape().size()); }
int64_t Tensor::size(int64_t d) const {
  int64_t w = wrap_dim(d, dim());
  return w < 0 ? -1 : shape()[w];
}
int64_t Tensor::numel() const { return shape_numel(shape()); }
bool Tensor::is_read_only() const { return ok() && impl_->storage->read_only; }
Device Tensor::device() const { return ok() ? impl_->storage->device : Device::host(); }
bool Tensor::is_recorded_copy() const { return ok() && impl_->parent != nullptr; }
bool Tensor::is_contiguous() const { return ok() && impl_->layout.is_contiguous(); }
int64_t Tensor::nbytes() const { return numel() * static_cast<int64_t>(dtype_size(dtype())); }

std::string Tensor::describe() const {
  if (!impl_) return "<undefined>";
  if (!impl_->status.ok()) return "<error>";
  const Storage& s = *impl_->storage;
  std::string kind;
  switch (s.kind) {
    case StorageKind::kSource: kind = fmt::format("source '{}'", s.name); break;
    case StorageKind::kParam: kind = fmt::format("param '{}'", s.name); break;
    case StorageKind::kReal: kind = s.name.empty() ? "real tensor" : fmt::format("buffer '{}'", s.name); break;
  }
  if (!s.device.is_host()) {
    return fmt::format("{} {} {} on {}", kind, shape_str(impl_->layout.shape), dtype_name(s.dtype), device_str(s.device));
  }
  return fmt::format("{} {} {}", kind, shape_str(impl_->layout.shape), dtype_name(s.dtype));
}

// ---------------------------------------------------------------------------------------
// Views

#define FERRY_CHECK_OK(t) \
  if (!(t).ok()) return (t).impl_ ? (t) : Tensor::error((t).status())

Tensor Tensor::narrow(int64_t dim_, int64_t start, int64_t length) const {
  FERRY_CHECK_OK(*this);
  const int64_t d = wrap_dim(dim_, dim());
  if (dim() == 0) return TensorOps::fail(*this, "narrow", "cannot narrow a 0-d tensor");
  if (d < 0) return TensorOps::fail(*this, "narrow", "dim {} out of range for {}-d shape {}", dim_, dim(), shape_str(shape()));
  const int64_t size = shape()[d];
  if (start < -size || start > size) {
    return TensorOps::fail(*this, "narrow", "start {} out of range for size {} of dim {} of {}", start, size, d, shape_str(shape()));
  }
  if (start < 0) start += size;
  if (length < 0 || start + length > size) {
    return TensorOps::fail(*this, "narrow", "start {} + length {} exceeds size {} of dim {} of {}", start, length, size, d,
                           shape_str(shape()));
  }
  Layout l = layout();
  l.offset += start * l.strides[d];
  l.shape[d] = length;
  return TensorOps::make(*this, std::move(l));
}

Tensor Tensor::select(int64_t dim_, int64_t index) const {
  FERRY_CHECK_OK(*this);
  if (dim() == 0) return TensorOps::fail(*this, "select", "cannot select on a 0-d tensor");
  const int64_t d = wrap_dim(dim_, dim());
  if (d < 0) return TensorOps::fail(*this, "select", "dim {} out of range for {}-d shape {}", dim_, dim(), shape_str(shape()));
  const int64_t size = shape()[d];
  if (index < -size || index >= size) {
    return TensorOps::fail(*this, "select", "index {} out of range for size {} of dim {} of {}", index, size, d, shape_str(shape()));
  }
  if (index < 0) index += size;
  Layout l = layout();
  l.offset += index * l.strides[d];
  l.shape.erase(l.shape.begin() + d);
  l.strides.erase(l.strides.begin() + d);
  return TensorOps::make(*this, std::move(l));
}

Tensor Tensor::slice(int64_t dim_, std::optional<int64_t> start, std::optional<int64_t> stop, int64_t step) const {
  FERRY_CHECK_OK(*this);
  if (dim() == 0) return TensorOps::fail(*this, "slice", "cannot slice a 0-d tensor");
  const int64_t d = wrap_dim(dim_, dim());
  if (d < 0) return TensorOps::fail(*this, "slice", "dim {} out of range for {}-d shape {}", dim_, dim(), shape_str(shape()));
  if (step <= 0) return TensorOps::fail(*this, "slice", "step must be positive, got {}", step);
  const int64_t size = shape()[d];
  int64_t b = start.value_or(0);
  int64_t e = stop.value_or(size);
  if (b < 0) b += size;
  if (e < 0) e += size;
  b = std::clamp<int64_t>(b, 0, size);
  e = std::clamp<int64_t>(e, 0, size);
  const int64_t len = e > b ? (e - b + step - 1) / step : 0;
  Layout l = layout();
  l.offset += b * l.strides[d];
  l.shape[d] = len;
  l.strides[d] *= step;
  return TensorOps::make(*this, std::move(l));
}

Tensor Tensor::view(Shape new_shape) const {
  FERRY_CHECK_OK(*this);
  auto inferred = infer_shape(new_shape, numel(), "view", shape());
  if (!inferred.ok()) return TensorOps::fail(*this, "view", "{}", inferred.status().message());
  auto strides = compute_view_strides(shape(), layout().strides, *inferred);
  if (!strides) {
    return TensorOps::fail(*this, "view", "shape {} is not compatible with strides {} of {}; use reshape",
                           shape_str(*inferred), shape_str(layout().strides), shape_str(shape()));
  }
  Layout l{std::move(*inferred), std::move(*strides), offset()};
  return TensorOps::make(*this, std::move(l));
}

Tensor Tensor::reshape(Shape new_shape) const {
  FERRY_CHECK_OK(*this);
  auto inferred = infer_shape(new_shape, numel(), "reshape", shape());
  if (!inferred.ok()) return TensorOps::fail(*this, "reshape", "{}", inferred.status().message());
  if (compute_view_strides(shape(), layout().strides, *inferred)) return view(*inferred);
  return contiguous().view(*inferred);
}

Tensor Tensor::transpose(int64_t dim0, int64_t dim1) const {
  FERRY_CHECK_OK(*this);
  if (dim() == 0 && (dim0 == 0 || dim0 == -1) && (dim1 == 0 || dim1 == -1)) return *this;
  const int64_t a = wrap_dim(dim0, dim());
  const int64_t b = wrap_dim(dim1, dim());
  if (a < 0 || b < 0) {
    return TensorOps::fail(*this, "transpose", "dims ({}, {}) out of range for {}-d shape {}", dim0, dim1, dim(), shape_str(shape()));
  }
  Layout l = layout();
  std::swap(l.shape[a], l.shape[b]);
  std::swap(l.strides[a], l.strides[b]);
  return TensorOps::make(*this, std::move(l));
}

Tensor Tensor::t() const {
  FERRY_CHECK_OK(*this);
  if (dim() < 2) return *this;
  if (dim() > 2) return TensorOps::fail(*this, "t", "expects a tensor with <= 2 dims, got {}-d {}", dim(), shape_str(shape()));
  return transpose(0, 1);
}

Tensor Tensor::permute(std::vector<int64_t> dims) const {
  FERRY_CHECK_OK(*this);
  if (static_cast<int64_t>(dims.size()) != dim()) {
    return TensorOps::fail(*this, "permute", "{} dims given for {}-d shape {}", dims.size(), dim(), shape_str(shape()));
  }
  std::vector<bool> seen(dims.size(), false);
  Layout l;
  for (int64_t& d : dims) {
    const int64_t w = wrap_dim(d, dim());
    if (w < 0 || seen[w]) {
      return TensorOps::fail(*this, "permute", "invalid permutation {} for shape {}", shape_str(dims), shape_str(shape()));
    }
    seen[w] = true;
    l.shape.push_back(shape()[w]);
    l.strides.push_back(layout().strides[w]);
  }
  l.offset = offset();
  return TensorOps::make(*this, std::move(l));
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  FERRY_CHECK_OK(*this);
  if (dim() == 0) return reshape({1});
  const int64_t a = wrap_dim(start_dim, dim());
  const int64_t b = wrap_dim(end_dim, dim());
  if (a < 0 || b < 0 || a > b) {
    return TensorOps::fail(*this, "flatten", "invalid dims start {} end {} for shape {}", start_dim, end_dim, shape_str(shape()));
  }
  if (a == b) return *this;
  Shape s;
  for (int64_t i = 0; i < a; ++i) s.push_back(shape()[i]);
  int64_t m = 1;
  for (int64_t i = a; i <= b; ++i) m *= shape()[i];
  s.push_back(m);
  for (int64_t i = b + 1; i < dim(); ++i) s.push_back(shape()[i]);
  return reshape(std::move(s));
}

Tensor Tensor::unflatten(int64_t dim_, Shape sizes) const {
  FERRY_CHECK_OK(*this);
  const int64_t d = wrap_dim(dim_, dim());
  if (d < 0) return TensorOps::fail(*this, "unflatten", "dim {} out of range for shape {}", dim_, shape_str(shape()));
  if (sizes.empty()) return TensorOps::fail(*this, "unflatten", "sizes must be non-empty");
  auto inferred = infer_shape(sizes, shape()[d], "unflatten", shape());
  if (!inferred.ok()) return TensorOps::fail(*this, "unflatten", "sizes {} do not multiply to size {} of dim {}", shape_str(sizes), shape()[d], d);
  Shape s(shape().begin(), shape().begin() + d);
  s.insert(s.end(), inferred->begin(), inferred->end());
  s.insert(s.end(), shape().begin() + d + 1, shape().end());
  return view(std::move(s));
}

Tensor Tensor::unsqueeze(int64_t dim_) const {
  FERRY_CHECK_OK(*this);
  const int64_t d = wrap_dim(dim_, dim() + 1);
  if (d < 0) return TensorOps::fail(*this, "unsqueeze", "dim {} out of range for shape {}", dim_, shape_str(shape()));
  Layout l = layout();
  const int64_t stride = d < dim() ? l.strides[d] * l.shape[d] : 1;
  l.shape.insert(l.shape.begin() + d, 1);
  l.strides.insert(l.strides.begin() + d, stride);
  return TensorOps::make(*this, std::move(l));
}

Tensor Tensor::squeeze() const {
  FERRY_CHECK_OK(*this);
  Layout l;
  l.offset = offset();
  for (int64_t i = 0; i < dim(); ++i) {
    if (shape()[i] != 1) {
      l.shape.push_back(shape()[i]);
      l.strides.push_back(layout().strides[i]);
    }
  }
  return TensorOps::make(*this, std::move(l));
}

Tensor Tensor::squeeze(int64_t dim_) const {
  FERRY_CHECK_OK(*this);
  if (dim() == 0 && (dim_ == 0 || dim_ == -1)) return *this;
  const int64_t d = wrap_dim(dim_, dim());
  if (d < 0) return TensorOps::fail(*this, "squeeze", "dim {} out of range for shape {}", dim_, shape_str(shape()));
  if (shape()[d] != 1) return *this;
  Layout l = layout();
  l.shape.erase(l.shape.begin() + d);
  l.strides.erase(l.strides.begin() + d);
  return TensorOps::make(*this, std::move(l));
}

TensorList Tensor::split(int64_t split_size, int64_t dim_) const {
  if (!ok()) return TensorList(status());
  const int64_t d = wrap_dim(dim_, dim());
  if (d < 0) return TensorList(TensorOps::fail(*this, "split", "dim {} out of range for shape {}", dim_, shape_str(shape())).status());
  const int64_t size = shape()[d];
  if (split_size < 0 || (split_size == 0 && size != 0)) {
    return TensorList(TensorOps::fail(*this, "split", "split_size {} must be positive", split_size).status());
  }
  std::vector<Tensor> parts;
  if (size == 0) {
    parts.push_back(*this);
    return TensorList(std::move(parts));
  }
  for (int64_t s = 0; s < size; s += split_size) parts.push_back(narrow(d, s, std::min(split_size, size - s)));
  return TensorList(std::move(parts));
}

TensorList Tensor::split(std::vector<int64_t> sizes, int64_t dim_) const {
  if (!ok()) return TensorList(status());
  const int64_t d = wrap_dim(dim_, dim());
  if (d < 0) return TensorList(TensorOps::fail(*this, "split", "dim {} out of range for shape {}", dim_, shape_str(shape())).status());
  int64_t total = 0;
  for (int64_t s : sizes) {
    if (s < 0) return TensorList(TensorOps::fail(*this, "split", "negative size in {}", shape_str(sizes)).status());
    total += s;
  }
  if (total != shape()[d]) {
    return TensorList(TensorOps::fail(*this, "split", "sizes {} sum to {} but dim {} has size {}", shape_str(sizes), total, d,
                                      shape()[d]).status());
  }
  std::vector<Tensor> parts;
  int64_t start = 0;
  for (int64_t s : sizes) {
    parts.push_back(narrow(d, start, s));
    start += s;
  }
  return TensorList(std::move(parts));
}

TensorList Tensor::chunk(int64_t chunks, int64_t dim_) const {
  if (!ok()) return TensorList(status());
  if (chunks <= 0) return TensorList(TensorOps::fail(*this, "chunk", "chunks must be positive, got {}", chunks).status());
  const int64_t d = wrap_dim(dim_, dim());
  if (d < 0) return TensorList(TensorOps::fail(*this, "chunk", "dim {} out of range for shape {}", dim_, shape_str(shape())).status());
  const int64_t size = shape()[d];
  const int64_t each = (size + chunks - 1) / chunks;
  if (each == 0) {
    // torch: a size-0 dim gives `chunks` empty chunks.
    std::vector<Tensor> parts(static_cast<size_t>(chunks), *this);
    return TensorList(std::move(parts));
  }
  return split(each, d);
}

TensorList Tensor::unbind(int64_t dim_) const {
  if (!ok()) return TensorList(status());
  const int64_t d = wrap_dim(dim_, dim());
  if (d < 0) return TensorList(TensorOps::fail(*this, "unbind", "dim {} out of range for shape {}", dim_, shape_str(shape())).status());
  std::vector<Tensor> parts;
  for (int64_t i = 0; i < shape()[d]; ++i) parts.push_back(select(d, i));
  return TensorList(std::move(parts));
}

Tensor TensorList::operator[](size_t i) const {
  if (!status_.ok()) return Tensor::error(status_);
  if (i >= parts_.size()) {
    return Tensor::error(out_of_range("index {} out of range for a list of {} tensors", i, parts_.size()));
  }
  return parts_[i];
}

Tensor Tensor::contiguous() const {
  FERRY_CHECK_OK(*this);
  if (is_contiguous()) return *this;
  if (is_recording()) return TensorOps::make_virtual(*this);
  return clone();
}

Tensor Tensor::clone() const {
  FERRY_CHECK_OK(*this);
  if (is_recording()) {
    return Tensor::error(failed_precondition("clone: needs values but {} is recording (no bytes)", describe()));
  }
  if (!device().is_host()) {
    return Tensor::error(failed_precondition("clone: makes a host copy, but {} is in device memory", describe()));
  }
  Tensor out = Tensor::empty(shape(), dtype());
  strided_copy(impl_->storage->data, layout(), dtype(), out.impl_->storage->data, out.layout(), dtype());
  return out;
}

// ---------------------------------------------------------------------------------------
// Writes

Status Tensor::copy_(const Tensor& src) const {
  if (!ok()) return status().with_context("copy_ (destination)");
  if (!src.ok()) return src.status();
  // torch's rule: src broadcasts to this shape (right-aligned, each src dim equal to the
  // destination's or 1, src no more dims than the destination).
  const Shape& ds = shape();
  const Shape& ss = src.shape();
  bool broadcasts = ss.size() <= ds.size();
  for (size_t k = 0; broadcasts && k < ss.size(); ++k) {
    const int64_t s = ss[ss.size() - 1 - k];
    broadcasts = s == ds[ds.size() - 1 - k] || s == 1;
  }
  if (!broadcasts) {
    return invalid_argument("copy_: {} (numel {}) does not broadcast to {} (numel {}); torch's copy_ needs each source "
                            "dim, right-aligned, equal to the destination's or 1",
                            src.describe(), src.numel(), describe(), numel());
  }
  if (numel() != src.numel()) {
    // A real broadcast: copy src into every slice along the first broadcast dim (each
    // slice recurses until the shapes agree), so a recording records one copy per slice.
    const size_t lead = ds.size() - ss.size();
    size_t dim = 0;
    while (dim < ds.size() && !(dim < lead || (ss[dim - lead] == 1 && ds[dim] != 1))) ++dim;
    for (int64_t i = 0; i < ds[dim]; ++i) {
      const Tensor part = dim < lead ? select(static_cast<int64_t>(dim), i) : narrow(static_cast<int64_t>(dim), i, 1);
      FERRY_RETURN_IF_ERROR(part.copy_(src));
    }
    return Status::Ok();
  }
  if (src.is_recording() || is_recording()) {
    if (!src.is_recording()) {
      return invalid_argument("copy_: cannot record a copy of real values from {} into {}; a recorded loader may only "
                              "copy from recording sources",
                              src.describe(), describe());
    }
    RecordSink* sink = active_record_sink();
    if (sink == nullptr) {
      return failed_precondition("copy_: {} is recording but no Recorder is active on this thread", src.describe());
    }
    return sink->record_copy(*this, src);
  }
  if (is_read_only()) return failed_precondition("copy_: destination {} is read-only; clone() it first", describe());
  if (!device().is_host() || !src.device().is_host()) {
    if (device() != src.device()) {
      return invalid_argument("copy_: {} is on {} and {} on {}; copy_ runs within one device", src.describe(),
                              device_str(src.device()), describe(), device_str(device()));
    }
    if (dtype() != src.dtype() && !(is_floating(dtype()) && is_floating(src.dtype()))) {
      return invalid_argument("copy_: dtype {} of {} cannot convert to {} of {}", dtype_name(src.dtype()), src.describe(),
                              dtype_name(dtype()), describe());
    }
    Tensor v = src.layout().shape == shape() ? src : src.reshape(shape());
    if (!v.ok()) return v.status();
    std::optional<DType> from;
    if (src.dtype() != dtype()) from = src.dtype();
    const StridedCopy c{v.impl_->storage->data, v.layout(), impl_->storage->data, layout(), dtype(), from};
    return copy_batch(device(), std::span<const StridedCopy>(&c, 1));
  }
  if (dtype() != src.dtype() && !(is_floating(dtype()) && is_floating(src.dtype()))) {
    return invalid_argument("copy_: dtype {} of {} cannot convert to {} of {}", dtype_name(src.dtype()), src.describe(),
                            dtype_name(dtype()), describe());
  }
  Layout s = src.layout();
  if (s.shape != shape()) {
    // Elements are matched in row-major order: bring src into this shape first.
    Tensor v = src.reshape(shape());
    if (!v.ok()) return v.status();
    strided_copy(v.impl_->storage->data, v.layout(), v.dtype(), impl_->storage->data, layout(), dtype());
    return Status::Ok();
  }
  strided_copy(src.impl_->storage->data, s, src.dtype(), impl_->storage->data, layout(), dtype());
  return Status::Ok();
}

Status Tensor::zero_() const {
  if (!ok()) return status().with_context("zero_");
  if (is_recording()) {
    if (storage_kind() != StorageKind::kParam) {
      return invalid_argument("zero_: {} is a recording source; only params can be zero-filled", describe());
    }
    RecordSink* sink = active_record_sink();
    if (sink == nullptr) return failed_precondition("zero_: {} is recording but no Recorder is active on this thread", describe());
    return sink->record_zero(*this);
  }
  if (is_read_only()) return failed_precondition("zero_: {} is read-only; clone() it first", describe());
  if (!device().is_host()) {
    const StridedCopy c{nullptr, {}, impl_->storage->data, layout(), dtype()};
    return copy_batch(device(), std::span<const StridedCopy>(&c, 1));
  }
  strided_zero(impl_->storage->data, layout(), dtype());
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// Values

namespace {
Status needs_values(const Tensor& t, std::string_view op) {
  if (!t.ok()) return t.status();
  if (t.is_recording()) {
    return failed_precondition("{}: needs values but {} is recording (no bytes); a recorded loader cannot read values",
                               op, t.describe());
  }
  if (!t.device().is_host()) {
    return failed_precondition("{}: needs values in host memory but {} is in device memory", op, t.describe());
  }
  return Status::Ok();
}
}  // namespace

Result<std::byte*> Tensor::data_ptr() const {
  FERRY_RETURN_IF_ERROR(needs_values(*this, "data_ptr"));
  return impl_->storage->data + offset() * static_cast<int64_t>(dtype_size(dtype()));
}

Result<std::byte*> Tensor::device_ptr() const {
  if (!ok()) return status();
  if (is_recording()) return failed_precondition("device_ptr: {} is recording (no bytes)", describe());
  return impl_->storage->data + offset() * static_cast<int64_t>(dtype_size(dtype()));
}

Result<std::vector<double>> Tensor::to_vector() const {
  FERRY_RETURN_IF_ERROR(needs_values(*this, "to_vector"));
  std::vector<double> out;
  out.reserve(static_cast<size_t>(numel()));
  const int64_t es = static_cast<int64_t>(dtype_size(dtype()));
  Shape idx(shape().size(), 0);
  for (int64_t i = 0; i < numel(); ++i) {
    int64_t rem = i;
    for (size_t k = idx.size(); k-- > 0;) {
      idx[k] = rem % shape()[k];
      rem /= shape()[k];
    }
    out.push_back(load_element(impl_->storage->data + layout().offset_of(idx) * es, dtype()));
  }
  return out;
}

Result<double> Tensor::item() const {
  FERRY_RETURN_IF_ERROR(needs_values(*this, "item"));
  if (numel() != 1) return invalid_argument("item: needs exactly one element, {} has {}", describe(), numel());
  return load_element(impl_->storage->data + offset() * static_cast<int64_t>(dtype_size(dtype())), dtype());
}

Result<bool> Tensor::equal(const Tensor& other) const {
  FERRY_RETURN_IF_ERROR(needs_values(*this, "equal"));
  FERRY_RETURN_IF_ERROR(needs_values(other, "equal"));
  if (shape() != other.shape() || dtype() != other.dtype()) return false;
  Tensor a = contiguous();
  Tensor b = other.contiguous();
  const size_t n = static_cast<size_t>(nbytes());
  return n == 0 || std::memcmp(*a.data_ptr(), *b.data_ptr(), n) == 0;
}

Result<Tensor> Tensor::add(const Tensor& other) const {
  FERRY_RETURN_IF_ERROR(needs_values(*this, "add"));
  FERRY_RETURN_IF_ERROR(needs_values(other, "add"));
  if (shape() != other.shape() || dtype() != other.dtype()) {
    return invalid_argument("add: {} and {} differ in shape or dtype", describe(), other.describe());
  }
  FERRY_ASSIGN_OR_RETURN(auto a, to_vector());
  FERRY_ASSIGN_OR_RETURN(auto b, other.to_vector());
  Tensor out = Tensor::empty(shape(), dtype());
  const size_t es = dtype_size(dtype());
  for (size_t i = 0; i < a.size(); ++i) store_element(out.impl_->storage->data + i * es, dtype(), a[i] + b[i]);
  return out;
}

Result<Tensor> Tensor::mul(double scalar) const {
  FERRY_RETURN_IF_ERROR(needs_values(*this, "mul"));
  FERRY_ASSIGN_OR_RETURN(auto a, to_vector());
  Tensor out = Tensor::empty(shape(), dtype());
  const size_t es = dtype_size(dtype());
  for (size_t i = 0; i < a.size(); ++i) store_element(out.impl_->storage->data + i * es, dtype(), a[i] * scalar);
  return out;
}

// ---------------------------------------------------------------------------------------
// Element maps of recorded copies (compose_layout: compose_layout.cpp).

Result<std::vector<MapPiece>> Tensor::element_map() const {
  if (!ok()) return status();
  if (!impl_->parent) {
    return std::vector<MapPiece>{MapPiece{Shape(static_cast<size_t>(dim()), 0), layout()}};
  }
  const Tensor& parent = *impl_->parent;
  FERRY_ASSIGN_OR_RETURN(auto parent_map, parent.element_map());
  auto pieces = compose_layout(layout(), parent.shape(), parent_map);
  for (auto& p : pieces) p.part = 0;
  return pieces;
}

}  // namespace ferry

// libFuzzer target: parse_safetensors_header over arbitrary bytes (the whole "file").
// It must never crash, read out of bounds or throw; when it accepts, the result must
// satisfy the invariants the reader relies on, checked here with __builtin_trap.
#include <cstddef>
#include <cstdint>
#include <span>

#include "ferry/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto bytes = std::as_bytes(std::span<const uint8_t>(data, size));
  auto h = ferry::parse_safetensors_header(bytes);
  if (!h.ok()) {
    if (h.status().code() != ferry::StatusCode::kCorrupt || h.status().message().empty()) __builtin_trap();
    return 0;
  }
  if (h->data_start() + h->data_size != size) __builtin_trap();
  uint64_t pos = 0;
  for (const auto& t : h->tensors) {
    if (t.begin != pos || t.end < t.begin || t.end > h->data_size) __builtin_trap();
    if (ferry::shape_numel(t.shape) * static_cast<int64_t>(ferry::dtype_size(t.dtype)) !=
        static_cast<int64_t>(t.nbytes())) {
      __builtin_trap();
    }
    pos = t.end;
    // What SafetensorsFile::open does with each entry: borrow the bytes and read them.
    auto* p = const_cast<std::byte*>(bytes.data() + h->data_start() + t.begin);
    ferry::Tensor view = ferry::Tensor::borrow(p, t.shape, t.dtype, nullptr, t.name);
    if (!view.ok()) __builtin_trap();
    if (view.numel() <= 64) {
      auto v = view.to_vector();
      if (!v.ok()) __builtin_trap();
    }
  }
  if (pos != h->data_size) __builtin_trap();
  return 0;
}

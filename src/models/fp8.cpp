// FP8 e4m3 block quantisation (post-processing for Quantize::kFp8): on the host, or on
// the CUDA device the weight lives on (the same bits: ferry/device.h's
// fp8_block_quantize, whose per-tile arithmetic the kernel and the host share).
#include "ferry/device.h"
#include "models/builder.h"

namespace ferry::models {

QuantizedForm quantized_form(Quantize q) {
  switch (q) {
    case Quantize::kFp8Ue8m0: return {Fp8Scales::kUe8m0, kFp8Block, "_scale_inv", DType::kU8};
    case Quantize::kMxfp8: return {Fp8Scales::kMx, 32, "_scale", DType::kU8};
    default: return {};
  }
}

Shape quantized_scale_shape(const QuantizedForm& f, const Shape& weight) {
  Shape s = weight;
  const size_t n = s.size();
  if (f.format != Fp8Scales::kMx) s[n - 2] = ceil_div(s[n - 2], f.block);
  s[n - 1] = ceil_div(s[n - 1], f.block);
  return s;
}

Result<std::pair<Tensor, Tensor>> quantize_fp8_blocks(const Tensor& w, int64_t block, Fp8Scales format) {
  if (!w.ok()) return w.status();
  if (!w.is_real()) return failed_precondition("quantize_fp8_blocks: needs values but {} is recording", w.describe());
  if (!is_floating(w.dtype())) return invalid_argument("quantize_fp8_blocks: {} is not a float tensor", w.describe());
  if (w.dim() < 2) return invalid_argument("quantize_fp8_blocks: {} needs at least 2 dims", w.describe());
  if (block <= 0) return invalid_argument("quantize_fp8_blocks: block {} must be positive", block);
  const Device device = w.device();
  if (!device.is_host() && !w.is_contiguous()) {
    return invalid_argument("quantize_fp8_blocks: {} is a strided view in {} memory; quantise a contiguous tensor",
                            w.describe(), device_str(device));
  }
  const Tensor src = device.is_host() ? w.contiguous() : w;
  Shape shape = src.shape();
  const size_t nd = shape.size();
  const int64_t rows = shape[nd - 2], cols = shape[nd - 1];
  const int64_t batch = rows * cols == 0 ? 0 : src.numel() / (rows * cols);
  const QuantizedForm form{format, block, "", format == Fp8Scales::kF32 ? DType::kF32 : DType::kU8};
  const Shape sshape = quantized_scale_shape(form, shape);
  Tensor q, s;
  if (device.is_host()) {
    q = Tensor::empty(shape, DType::kF8E4M3);
    s = Tensor::empty(sshape, form.scale_dtype);
  } else {
    // On the weight's device: the quantised weight and its scales stay there.
    FERRY_ASSIGN_OR_RETURN(auto qm, device_alloc(device, static_cast<size_t>(shape_numel(shape))));
    FERRY_ASSIGN_OR_RETURN(auto sm, device_alloc(device, static_cast<size_t>(shape_numel(sshape)) * dtype_size(form.scale_dtype)));
    q = Tensor::borrow_device(qm.get(), shape, DType::kF8E4M3, device, qm);
    s = Tensor::borrow_device(sm.get(), sshape, form.scale_dtype, device, sm);
  }
  if (src.numel() == 0) return std::make_pair(q, s);
  FERRY_ASSIGN_OR_RETURN(const std::byte* in, src.device_ptr());
  FERRY_ASSIGN_OR_RETURN(std::byte* out, q.device_ptr());
  FERRY_ASSIGN_OR_RETURN(std::byte* sc, s.device_ptr());
  Status st = fp8_block_quantize(device, in, src.dtype(), batch, rows, cols, block, out, sc, nullptr, format);
  if (!st.ok()) return st.with_context(fmt::format("quantize_fp8_blocks of {}", w.describe()));
  return std::make_pair(q, s);
}

}  // namespace ferry::models

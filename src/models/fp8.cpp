// FP8 e4m3 block quantisation (post-processing for Quantize::kFp8).
#include <cmath>
#include <cstring>

#include "models/builder.h"

namespace ferry::models {

Result<std::pair<Tensor, Tensor>> quantize_fp8_blocks(const Tensor& w, int64_t block) {
  if (!w.ok()) return w.status();
  if (!w.is_real()) return failed_precondition("quantize_fp8_blocks: needs values but {} is recording", w.describe());
  if (!is_floating(w.dtype())) return invalid_argument("quantize_fp8_blocks: {} is not a float tensor", w.describe());
  if (w.dim() < 2) return invalid_argument("quantize_fp8_blocks: {} needs at least 2 dims", w.describe());
  if (block <= 0) return invalid_argument("quantize_fp8_blocks: block {} must be positive", block);
  const Tensor src = w.contiguous();
  Shape shape = src.shape();
  const size_t nd = shape.size();
  const int64_t rows = shape[nd - 2], cols = shape[nd - 1];
  const int64_t batch = rows * cols == 0 ? 0 : src.numel() / (rows * cols);
  const int64_t brows = ceil_div(rows, block), bcols = ceil_div(cols, block);
  Shape sshape = shape;
  sshape[nd - 2] = brows;
  sshape[nd - 1] = bcols;
  Tensor q = Tensor::empty(shape, DType::kF8E4M3);
  Tensor s = Tensor::empty(sshape, DType::kF32);
  if (src.numel() == 0) return std::make_pair(q, s);
  FERRY_ASSIGN_OR_RETURN(const std::byte* in, src.data_ptr());
  FERRY_ASSIGN_OR_RETURN(std::byte* out, q.data_ptr());
  FERRY_ASSIGN_OR_RETURN(std::byte* sc, s.data_ptr());
  const DType dt = src.dtype();
  const int64_t es = static_cast<int64_t>(dtype_size(dt));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t base = b * rows * cols;
    for (int64_t br = 0; br < brows; ++br) {
      for (int64_t bc = 0; bc < bcols; ++bc) {
        const int64_t r0 = br * block, r1 = std::min(rows, r0 + block);
        const int64_t c0 = bc * block, c1 = std::min(cols, c0 + block);
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = c0; c < c1; ++c) {
            const float v = static_cast<float>(load_element(in + (base + r * cols + c) * es, dt));
            amax = std::max(amax, std::fabs(v));
          }
        }
        const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
        const float sv = scale;
        std::memcpy(sc + 4 * (b * brows * bcols + br * bcols + bc), &sv, 4);
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = c0; c < c1; ++c) {
            const int64_t i = base + r * cols + c;
            const float v = static_cast<float>(load_element(in + i * es, dt));
            store_element(out + i, DType::kF8E4M3, static_cast<double>(v / scale));
          }
        }
      }
    }
  }
  return std::make_pair(q, s);
}

}  // namespace ferry::models

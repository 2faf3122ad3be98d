// The pack copy table, resolved to raw pointers with every block bounds-checked. Shared by the CPU kernel
// (pack_cpu.cpp) and the CUDA bindings (cuda/ops_bindings.cpp); the table layout is documented in
// mcore_rl/ops/pack.py.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

namespace mcore_rl {

// Columns of the copy table, all in elements: which tensor, where the block starts in it, the block's
// rows x cols, the tensor's row stride, where the block sits in the packed buffer and the packed row stride.
enum TableCol : int64_t {
  kSource = 0,
  kSourceOffset,
  kRows,
  kCols,
  kSourceStride,
  kPackedOffset,
  kPackedStride,
  kTableCols
};

// One block copy with both sides resolved to raw pointers (strides in elements of each side's dtype).
struct BlockCopy {
  const char* src;
  char* dst;
  int64_t rows, cols, src_stride, dst_stride;
};

// The tensors on one side of the copies: base pointers, sizes (for bounds checks), dtype.
struct Side {
  std::vector<char*> bases;
  std::vector<int64_t> numels;
  int64_t elem_size = 0;
  at::ScalarType dtype = at::kFloat;
};

inline Side make_side(at::TensorList tensors, const char* what, const at::Device& device) {
  TORCH_CHECK(!tensors.empty(), "mcore_rl: no ", what, " tensors");
  Side side;
  side.dtype = tensors[0].scalar_type();
  TORCH_CHECK(side.dtype == at::kFloat || side.dtype == at::kBFloat16 || side.dtype == at::kHalf,
              "mcore_rl: pack/unpack support float32, bfloat16 and float16, got ", side.dtype);
  side.elem_size = static_cast<int64_t>(tensors[0].element_size());
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device() == device && t.is_contiguous() && t.scalar_type() == side.dtype, "mcore_rl: every ",
                what, " tensor must be a contiguous ", side.dtype, " tensor on ", device);
    side.bases.push_back(static_cast<char*>(const_cast<void*>(t.const_data_ptr())));
    side.numels.push_back(t.numel());
  }
  return side;
}

inline void check_in_bounds(int64_t offset, int64_t rows, int64_t cols, int64_t stride, int64_t numel, int64_t k) {
  TORCH_CHECK(offset >= 0 && rows >= 0 && cols >= 0 && stride >= 0, "mcore_rl: table row ", k, " is negative");
  if (rows == 0 || cols == 0) return;
  // offset + (rows - 1) * stride + cols <= numel, in a form no table value can overflow (a huge stride
  // wrapped the product negative and passed the check).
  const bool fits = cols <= numel && offset <= numel - cols &&
                    (rows == 1 || stride == 0 || rows - 1 <= (numel - cols - offset) / stride);
  TORCH_CHECK(fits, "mcore_rl: table row ", k, " reaches past the end of its tensor (", numel, " elements)");
}

// Resolves the table into pointer-level copies; `unpack` swaps the direction (packed -> tensors).
inline std::vector<BlockCopy> resolve(const at::Tensor& table, const Side& tensors, const Side& packed, bool unpack) {
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kLong && table.dim() == 2 &&
                  table.size(1) == kTableCols && table.is_contiguous(),
              "mcore_rl: table must be a contiguous int64 CPU tensor [K, ", int64_t{kTableCols}, "]");
  const int64_t* t = table.const_data_ptr<int64_t>();
  std::vector<BlockCopy> blocks;
  blocks.reserve(table.size(0));
  for (int64_t k = 0; k < table.size(0); ++k, t += kTableCols) {
    const int64_t i = t[kSource], rows = t[kRows], cols = t[kCols];
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(tensors.bases.size()), "mcore_rl: table row ", k,
                " names tensor ", i, " of ", tensors.bases.size());
    check_in_bounds(t[kSourceOffset], rows, cols, t[kSourceStride], tensors.numels[i], k);
    check_in_bounds(t[kPackedOffset], rows, cols, t[kPackedStride], packed.numels[0], k);
    char* tensor_ptr = tensors.bases[i] + t[kSourceOffset] * tensors.elem_size;
    char* packed_ptr = packed.bases[0] + t[kPackedOffset] * packed.elem_size;
    if (unpack) {
      blocks.push_back({packed_ptr, tensor_ptr, rows, cols, t[kPackedStride], t[kSourceStride]});
    } else {
      blocks.push_back({tensor_ptr, packed_ptr, rows, cols, t[kSourceStride], t[kPackedStride]});
    }
  }
  return blocks;
}

}  // namespace mcore_rl

// CPU kernels of the reshard pack / unpack: a list of 2-D block copies with a dtype cast, run in one
// parallel pass. The table layout and the builders that produce it are in mcore_rl/ops/pack.py.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "pack_table.h"

namespace mcore_rl {
namespace {

// Work is cut into pieces of at most this many elements of one block row, so a few huge contiguous runs
// (a whole QKV head group) still spread over every thread, and tiny blocks cost one piece each.
constexpr int64_t kPiece = int64_t{1} << 15;

template <typename src_t, typename dst_t>
void copy_run(const src_t* src, dst_t* dst, int64_t n) {
  if constexpr (std::is_same_v<src_t, dst_t>) {
    std::memcpy(dst, src, n * sizeof(src_t));
  } else {
    at::vec::convert(src, dst, n);  // vectorised fp32 <-> 16-bit casts, round to nearest even
  }
}

template <typename src_t, typename dst_t>
void run_blocks(const std::vector<BlockCopy>& blocks) {
  // first_piece[b] = index of block b's first piece; pieces of one block go row by row.
  std::vector<int64_t> first_piece(blocks.size() + 1, 0);
  for (size_t b = 0; b < blocks.size(); ++b) {
    const int64_t per_row = (blocks[b].cols + kPiece - 1) / kPiece;
    first_piece[b + 1] = first_piece[b] + blocks[b].rows * per_row;
  }
  at::parallel_for(0, first_piece.back(), 1, [&](int64_t begin, int64_t end) {
    size_t b = std::upper_bound(first_piece.begin(), first_piece.end(), begin) - first_piece.begin() - 1;
    for (int64_t p = begin; p < end; ++p) {
      while (p >= first_piece[b + 1]) ++b;
      const BlockCopy& blk = blocks[b];
      const int64_t per_row = (blk.cols + kPiece - 1) / kPiece;
      const int64_t row = (p - first_piece[b]) / per_row, c0 = (p - first_piece[b]) % per_row * kPiece;
      const auto* src = reinterpret_cast<const src_t*>(blk.src) + row * blk.src_stride + c0;
      auto* dst = reinterpret_cast<dst_t*>(blk.dst) + row * blk.dst_stride + c0;
      copy_run(src, dst, std::min(kPiece, blk.cols - c0));
    }
  });
}

#define MCORE_RL_DISPATCH_PACK(TYPE, NAME, ...)                     \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                    \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)      \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                             AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

void run_typed(const std::vector<BlockCopy>& blocks, at::ScalarType src_dtype, at::ScalarType dst_dtype) {
  MCORE_RL_DISPATCH_PACK(src_dtype, "mcore_rl_pack_src", [&] {
    using src_t = scalar_t;
    MCORE_RL_DISPATCH_PACK(dst_dtype, "mcore_rl_pack_dst", [&] { run_blocks<src_t, scalar_t>(blocks); });
  });
}

void pack_copy_cpu(at::TensorList sources, const at::Tensor& table, at::Tensor& out) {
  const at::Device cpu(at::kCPU);
  const Side src = make_side(sources, "source", cpu);
  const Side dst = make_side({out}, "output", cpu);
  run_typed(resolve(table, src, dst, /*unpack=*/false), src.dtype, dst.dtype);
}

void unpack_copy_cpu(const at::Tensor& packed, const at::Tensor& table, at::TensorList outs) {
  const at::Device cpu(at::kCPU);
  const Side dst = make_side(outs, "output", cpu);
  const Side src = make_side({packed}, "packed", cpu);
  run_typed(resolve(table, dst, src, /*unpack=*/true), src.dtype, dst.dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(mcore_rl, CPU, m) {
  m.impl("pack_copy", &pack_copy_cpu);
  m.impl("unpack_copy", &unpack_copy_cpu);
}

}  // namespace mcore_rl

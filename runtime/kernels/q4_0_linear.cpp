// edgemtp::q4_0_linear.out: y = x W^T for a GGML Q4_0 weight, the way llama.cpp computes it.
//
// XNNPACK's blockwise int4 kernel has no zero points and rejects negative scales, so a Q4_0
// linear lowered there is an int4 GEMM, an fp32 correction pair (the blocks whose scale is
// negative) and the activations' quantize step: five operators and as many thread-pool
// hand-offs, and a fifth more bytes. This kernel reads the checkpoint's blocks as they are
// (codes and signed float16 scales) in one call, for the few rows of a decode, verify or draft
// step:
//   1. each row of x is quantized as Q8_0: per block of 32, d = max|x| / 127 and
//      q = round-half-even(x * (1 / d)) in int8 (one scale per block: finer than one per row);
//   2. y[r, o] = sum over blocks g of (scale[o, g] * d[r, g]) * sum_j q[r, 32g + j] (code - 8),
//      the inner sum in exact integers (with AVX-512 VNNI: codes as unsigned bytes against q,
//      minus 8 * sum q, one instruction per 64 products); output rows split on ExecuTorch's
//      threadpool.
//
// Shapes (contiguous):
//   x       float32 [..., in]         in a multiple of 32
//   codes   uint8   [out, in / 2]     block g of row o is bytes 16g..16g+15: byte j holds
//                                     element 32g + j in its low nibble, 32g + 16 + j in its
//                                     high nibble (GGML's block_q4_0.qs)
//   scales  float16 [out, in / 32]    GGML's block_q4_0.d, any sign
//   out     float32 [..., out]
//
// edgemtp::q4_0_gated_linear.out is the same product for x = gelu_tanh(gate) * up (Gemma's MLP
// down projection and per-layer input projection, whose input is that gate): computed here
// while the rows are quantized, it needs no delegate call between the two kernels.
//   gate, up  float32 [..., in]
//
// The arithmetic (and its variants per instruction set) is q4_0.h; this file is the operators.

#include <algorithm>
#include <cstdint>
#include <vector>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

#include "exp_poly.h"
#include "parallel.h"
#include "q4_0.h"

namespace edgemtp {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;
using q4_0::kBlock;

constexpr int64_t kGrain = 32;  // output rows per task at least
// and bytes of weight per task at least: below that a hand-off to the thread pool costs more
// than the rows (a per-layer input's 64-wide projections, 16 KB, run on the calling thread)
constexpr int64_t kTaskBytes = 32 * 1024;

// The checks and the product of both ops: y = x W^T for `rows` rows of x (contiguous, `in`
// wide); `shape` gives out's leading dims.
Tensor& linear(KernelRuntimeContext& ctx, const float* x, const Tensor& shape, const Tensor& codes,
               const Tensor& scales, Tensor& out) {
  ET_KERNEL_CHECK(ctx,
                  codes.scalar_type() == ScalarType::Byte &&
                      scales.scalar_type() == ScalarType::Half && shape.dim() >= 1 &&
                      codes.dim() == 2 && scales.dim() == 2,
                  InvalidArgument, out);
  const int64_t in = shape.size(shape.dim() - 1), n_out = codes.size(0);
  ET_KERNEL_CHECK(ctx,
                  in % kBlock == 0 && codes.size(1) == in / 2 && scales.size(0) == n_out &&
                      scales.size(1) == in / kBlock,
                  InvalidArgument, out);
  executorch::aten::SizesType sizes[executorch::runtime::kTensorDimensionLimit];
  for (int64_t i = 0; i < shape.dim(); ++i) sizes[i] = shape.size(i);
  sizes[shape.dim() - 1] = static_cast<executorch::aten::SizesType>(n_out);
  ET_KERNEL_CHECK(
      ctx,
      executorch::runtime::resize_tensor(out, {sizes, static_cast<size_t>(shape.dim())}) ==
          executorch::runtime::Error::Ok,
      InvalidArgument, out);
  const int64_t rows = in ? shape.numel() / in : 0;
  const auto* c = codes.const_data_ptr<uint8_t>();
  using executorch::aten::Half;  // IEEE binary16, read as its bits
  const auto* s = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<Half>());
  const int64_t row_bytes = in / 2 + in / kBlock * 2;
  const int64_t grain = std::max(kGrain, (kTaskBytes + row_bytes - 1) / row_bytes);
  auto parallel = [grain](int64_t n, const auto& fn) { parallel_tiles(n, grain, fn); };
  q4_0::linear(x, rows, in, c, s, n_out, out.mutable_data_ptr<float>(), q4_0::best_variant(),
               parallel);
  return out;
}

}  // namespace

Tensor& q4_0_linear_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& codes,
                        const Tensor& scales, Tensor& out) {
  ET_KERNEL_CHECK(ctx, x.scalar_type() == ScalarType::Float, InvalidArgument, out);
  return linear(ctx, x.const_data_ptr<float>(), x, codes, scales, out);
}

Tensor& q4_0_gated_linear_out(KernelRuntimeContext& ctx, const Tensor& gate, const Tensor& up,
                              const Tensor& codes, const Tensor& scales, Tensor& out) {
  ET_KERNEL_CHECK(ctx,
                  gate.scalar_type() == ScalarType::Float &&
                      up.scalar_type() == ScalarType::Float && gate.numel() == up.numel(),
                  InvalidArgument, out);
  // gelu_tanh(g) = 0.5 g (1 + tanh z) = g sigmoid(2z), z = sqrt(2 / pi) (g + 0.044715 g^3)
  const float* g = gate.const_data_ptr<float>();
  const float* u = up.const_data_ptr<float>();
  const int64_t n = gate.numel();
  thread_local std::vector<float> x;
  x.resize(static_cast<size_t>(n));
  constexpr float k2 = 2 * 0.7978845608028654f, k2c = k2 * 0.044715f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = g[i];
    x[i] = v * u[i] / (1.0f + exp_poly(-v * (k2 + k2c * v * v)));
  }
  return linear(ctx, x.data(), gate, codes, scales, out);
}

}  // namespace edgemtp

EXECUTORCH_LIBRARY(edgemtp, "q4_0_linear.out", edgemtp::q4_0_linear_out);
EXECUTORCH_LIBRARY(edgemtp, "q4_0_gated_linear.out", edgemtp::q4_0_gated_linear_out);

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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define EDGEMTP_Q4_0_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define EDGEMTP_Q4_0_AVX2 1
#include <immintrin.h>
#endif

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

#include "exp_poly.h"
#include "parallel.h"

namespace edgemtp {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;

constexpr int64_t kBlock = 32;       // weights per Q4_0 block
constexpr int64_t kBlockBytes = 16;  // two codes per byte
constexpr int64_t kQuad = 4;         // blocks per vector step (64 code bytes, 128 weights)
constexpr int kRows = 4;             // x rows sharing every block of codes loaded
constexpr int64_t kGrain = 32;       // output rows per task at least
// and bytes of weight per task at least: below that a hand-off to the thread pool costs more
// than the rows (a per-layer input's 64-wide projections, 16 KB, run on the calling thread)
constexpr int64_t kTaskBytes = 32 * 1024;
constexpr int64_t kTile = 16;        // output rows whose codes all rows of x pass at once

// x's rows as Q8_0, blocks padded with zeros to a multiple of kQuad. The AVX-512 path reads a
// quad of blocks as two registers: the low halves (elements 0..15) of its four blocks, then the
// high halves, which is how the nibbles of 64 code bytes unpack.
struct Activations {
  int64_t quads = 0;
  std::vector<int8_t> q;      // [rows, quads, 2, 4, 16]: low halves of 4 blocks, high halves
  std::vector<int32_t> bias;  // [rows, quads, 16]: -8 * sum q of block b in lane 4b, else 0
  std::vector<float> d16;     // [rows, quads, 16]: d of block b in lanes 4b..4b+3
};

// What the dot products read of Activations: plain pointers, so that stores to the output
// cannot be taken for writes to them (which made the compiler reload every field per block).
struct Q8View {
  const int8_t* q;
  const int32_t* bias;
  const float* d16;
  int64_t quads;
};

// Block b of one row: its 32 values of x as q (low half at `low`, high half 64 bytes on), its
// d in lanes 4(b % 4)..+3 of `d16` and -8 * sum q in lane 4(b % 4) of `bias`.
inline void quantize_block(const float* xb, int8_t* low, float* d16, int32_t* bias) {
#if defined(EDGEMTP_Q4_0_AVX512)
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const __m512 m = _mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1));
  const float amax = _mm512_reduce_max_ps(m);
#else
  float amax = 0;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
#endif
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  int32_t sum = 0;
#if defined(EDGEMTP_Q4_0_AVX512)
  // (cvtps rounds half to even in the default rounding mode, as nearbyint does)
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(low), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(low + 64), _mm512_cvtepi32_epi8(q1));
  sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
  for (int64_t j = 0; j < kBlock; ++j) {
    const auto v = static_cast<int8_t>(std::nearbyint(xb[j] * id));  // half to even
    low[(j / 16) * 64 + j % 16] = v;
    sum += v;
  }
#endif
  for (int lane = 0; lane < 4; ++lane) d16[lane] = d;
  bias[0] = -8 * sum;
}

void quantize(const float* x, int64_t rows, int64_t in, Activations& a) {
  const int64_t blocks = in / kBlock;
  a.quads = (blocks + kQuad - 1) / kQuad;
  a.q.assign(static_cast<size_t>(rows * a.quads * 128), 0);
  a.bias.assign(static_cast<size_t>(rows * a.quads * 16), 0);
  a.d16.assign(static_cast<size_t>(rows * a.quads * 16), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t quad = r * a.quads + b / kQuad, lane = (b % kQuad) * 4;
      quantize_block(x + r * in + b * kBlock, a.q.data() + quad * 128 + lane * 4,
                     a.d16.data() + quad * 16 + lane, a.bias.data() + quad * 16 + lane);
    }
  }
}

// One row of the output, for R rows of x: sum over blocks of scale * d * integer dot.
template <int R>
void rows_portable(const uint8_t* codes, const uint16_t* scales, int64_t blocks, const Q8View& a,
                   int64_t r0, float* y, int64_t y_stride) {
  float acc[R] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* c = codes + b * kBlockBytes;
    _Float16 s;
    std::memcpy(&s, scales + b, sizeof s);
    for (int r = 0; r < R; ++r) {
      const int8_t* low = a.q + ((r0 + r) * a.quads + b / kQuad) * 128 + (b % kQuad) * 16;
      int32_t dot = 0;
      for (int64_t j = 0; j < kBlockBytes; ++j) {
        dot += (c[j] & 15) * low[j] + (c[j] >> 4) * low[64 + j];
      }
      dot += a.bias[((r0 + r) * a.quads + b / kQuad) * 16 + (b % kQuad) * 4];
      acc[r] += static_cast<float>(s) *
                a.d16[((r0 + r) * a.quads + b / kQuad) * 16 + (b % kQuad) * 4] *
                static_cast<float>(dot);
    }
  }
  for (int r = 0; r < R; ++r) y[r * y_stride] = acc[r];
}

#if defined(EDGEMTP_Q4_0_AVX512)
inline float lane_sum(__m512 v) {
  using Vec = float __attribute__((vector_size(64)));
  using Oct = float __attribute__((vector_size(32)));
  using Quad = float __attribute__((vector_size(16)));
  const Vec w = reinterpret_cast<Vec>(v);
  const Oct h = __builtin_shufflevector(w, w, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(w, w, 8, 9, 10, 11, 12, 13, 14, 15);
  const Quad q =
      __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

constexpr int64_t kAhead = 2048;  // bytes of codes prefetched ahead

template <int R>
void rows_avx512(const uint8_t* codes, const uint16_t* scales, int64_t blocks, const Q8View& x,
                 int64_t r0, float* y, int64_t y_stride) {
  const __m512i nibble = _mm512_set1_epi8(15);
  // lane 4b + i takes block b's scale: the int32 lanes of a quad's dot, four per block
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const int8_t* q[R];
  const int32_t* bias[R];
  const float* d[R];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    q[r] = x.q + (r0 + r) * x.quads * 128;
    bias[r] = x.bias + (r0 + r) * x.quads * 16;
    d[r] = x.d16 + (r0 + r) * x.quads * 16;
    acc[r] = _mm512_setzero_ps();
  }
  auto quad = [&](int64_t k, __m512i v, __m128i s16) {
    const __m512i low = _mm512_and_si512(v, nibble);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    const __m512 s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(s16)));
    for (int r = 0; r < R; ++r) {
      __m512i dot = _mm512_loadu_si512(bias[r] + k * 16);
      dot = _mm512_dpbusd_epi32(dot, low, _mm512_loadu_si512(q[r] + k * 128));
      dot = _mm512_dpbusd_epi32(dot, high, _mm512_loadu_si512(q[r] + k * 128 + 64));
      const __m512 scale = _mm512_mul_ps(s, _mm512_loadu_ps(d[r] + k * 16));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
    }
  };
  const int64_t full = blocks / kQuad;
  for (int64_t k = 0; k < full; ++k) {
    const uint8_t* c = codes + k * kQuad * kBlockBytes;
    _mm_prefetch(reinterpret_cast<const char*>(c) + kAhead, _MM_HINT_T0);
    quad(k, _mm512_loadu_si512(c),
         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + k * kQuad)));
  }
  if (const int64_t left = blocks - full * kQuad) {  // the last blocks, zeros past them
    quad(full,
         _mm512_maskz_loadu_epi8((1ULL << (left * kBlockBytes)) - 1,
                                 codes + full * kQuad * kBlockBytes),
         _mm_maskz_loadu_epi16(static_cast<__mmask8>((1U << left) - 1), scales + full * kQuad));
  }
  for (int r = 0; r < R; ++r) y[r * y_stride] = lane_sum(acc[r]);
}
#endif

#if defined(EDGEMTP_Q4_0_AVX2)
inline float lane_sum(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// As rows_avx512, 8 lanes: a quad's codes are two registers (blocks 0-1, blocks 2-3), each
// unpacked once for all R rows. maddubs multiplies the unsigned codes by q in int16 pairs
// (|pair| <= 2 * 15 * 127, and low + high <= 4 * 15 * 127: exact), madd sums them to int32.
template <int R>
void rows_avx2(const uint8_t* codes, const uint16_t* scales, int64_t blocks, const Q8View& x,
               int64_t r0, float* y, int64_t y_stride) {
  const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i first = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
  const __m256i second = _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2);
  const int8_t* q[R];
  const int32_t* bias[R];
  const float* d[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    q[r] = x.q + (r0 + r) * x.quads * 128;
    bias[r] = x.bias + (r0 + r) * x.quads * 16;
    d[r] = x.d16 + (r0 + r) * x.quads * 16;
    acc[r] = _mm256_setzero_ps();
  }
  alignas(32) uint8_t tail[kQuad * kBlockBytes];
  alignas(16) uint16_t tail_scales[8];
  const int64_t quads = (blocks + kQuad - 1) / kQuad;
  for (int64_t k = 0; k < quads; ++k) {
    const uint8_t* c = codes + k * kQuad * kBlockBytes;
    const uint16_t* sc = scales + k * kQuad;
    if (const int64_t left = blocks - k * kQuad; left < kQuad) {  // zeros past the last block
      std::memset(tail, 0, sizeof tail);
      std::memset(tail_scales, 0, sizeof tail_scales);
      std::memcpy(tail, c, static_cast<size_t>(left * kBlockBytes));
      std::memcpy(tail_scales, sc, static_cast<size_t>(left) * sizeof(uint16_t));
      c = tail;
      sc = tail_scales;
    }
    // Two blocks at a time (0-1, then 2-3): fewer registers live across the rows' loop.
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * half));
      const __m256i low = _mm256_and_si256(v, nibble);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      const __m256 s = _mm256_permutevar8x32_ps(
          _mm256_castps128_ps256(
              _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)))),
          half ? second : first);
      for (int r = 0; r < R; ++r) {
        const int8_t* qk = q[r] + k * 128 + 32 * half;
        const __m256i p = _mm256_add_epi16(
            _mm256_maddubs_epi16(low, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qk))),
            _mm256_maddubs_epi16(high,
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qk + 64))));
        const __m256i dot = _mm256_add_epi32(
            _mm256_madd_epi16(p, ones),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias[r] + k * 16 + 8 * half)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                 _mm256_mul_ps(s, _mm256_loadu_ps(d[r] + k * 16 + 8 * half)),
                                 acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r * y_stride] = lane_sum(acc[r]);
}
#endif

template <int R>
void output_rows(const uint8_t* codes, const uint16_t* scales, int64_t in, const Q8View& a,
                 int64_t r0, int64_t begin, int64_t end, float* y, int64_t out) {
  const int64_t blocks = in / kBlock;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* c = codes + o * (in / 2);
    const uint16_t* s = scales + o * blocks;
#if defined(EDGEMTP_Q4_0_AVX512)
    rows_avx512<R>(c, s, blocks, a, r0, y + r0 * out + o, out);
#elif defined(EDGEMTP_Q4_0_AVX2)
    rows_avx2<R>(c, s, blocks, a, r0, y + r0 * out + o, out);
#else
    rows_portable<R>(c, s, blocks, a, r0, y + r0 * out + o, out);
#endif
  }
}

// Every row of x against output rows [begin, end), a tile of outputs at a time so that the
// tile's codes stay in cache while groups of kRows rows of x go past them.
void output_range(const uint8_t* codes, const uint16_t* scales, int64_t in, int64_t out,
                  const Q8View& a, int64_t rows, int64_t begin, int64_t end, float* y) {
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t t_end = std::min(end, t + kTile);
    int64_t r0 = 0;
    for (; r0 + kRows <= rows; r0 += kRows) {
      output_rows<kRows>(codes, scales, in, a, r0, t, t_end, y, out);
    }
    switch (rows - r0) {
      case 3: output_rows<3>(codes, scales, in, a, r0, t, t_end, y, out); break;
      case 2: output_rows<2>(codes, scales, in, a, r0, t, t_end, y, out); break;
      case 1: output_rows<1>(codes, scales, in, a, r0, t, t_end, y, out); break;
      default: break;
    }
  }
}

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
  thread_local Activations a;
  quantize(x, rows, in, a);
  const Q8View view{a.q.data(), a.bias.data(), a.d16.data(), a.quads};
  const auto* c = codes.const_data_ptr<uint8_t>();
  using executorch::aten::Half;  // IEEE binary16, read as its bits
  const auto* s = reinterpret_cast<const uint16_t*>(scales.const_data_ptr<Half>());
  float* y = out.mutable_data_ptr<float>();
  const int64_t row_bytes = in / 2 + in / kBlock * 2;
  const int64_t grain = std::max(kGrain, (kTaskBytes + row_bytes - 1) / row_bytes);
  parallel_tiles(n_out, grain, [&](int64_t begin, int64_t end) {
    output_range(c, s, in, n_out, view, rows, begin, end, y);
  });
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

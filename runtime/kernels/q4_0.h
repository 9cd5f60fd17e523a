// GGML Q4_0 linears as llama.cpp computes them: the arithmetic, in plain C++ with no runtime
// dependency (the ExecuTorch operators in q4_0_linear.cpp wrap it; tests build it alone, also
// for aarch64). See q4_0_linear.cpp for the numerics and the tensor layouts.
//
// Variants: a portable loop; AVX2 and AVX-512 VNNI where the compiler targets them; on aarch64,
// NEON (every arm64 core), NEON with the int8 dot product (sdot, Armv8.2 dotprod) and with the
// int8 matrix multiply (smmla, i8mm: two rows of x against two output rows in one instruction),
// chosen at run time from the CPU's features, so one binary serves every phone.
#pragma once

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

#if defined(__aarch64__)
#define EDGEMTP_Q4_0_NEON 1
#include <arm_neon.h>
#if defined(__APPLE__)
#include <sys/sysctl.h>
#elif defined(__linux__)
#include <sys/auxv.h>
#endif
// the int8 dot product's functions are compiled for it whatever the baseline, and called only
// where the CPU has it
#if defined(__clang__)
#define EDGEMTP_DOTPROD __attribute__((target("dotprod")))
#define EDGEMTP_I8MM __attribute__((target("dotprod,i8mm")))
#else
#define EDGEMTP_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))
#define EDGEMTP_I8MM __attribute__((target("arch=armv8.2-a+dotprod+i8mm")))
#endif
#endif

// Internal linkage: each program that includes this has its own copy, which the compiler inlines
// into its callers as it did when this lived in the operator's file (with external linkage the
// 2- and 3-row kernels stopped being inlined: verify_1 took 20 % longer).
namespace edgemtp::q4_0 {
namespace {

constexpr int64_t kBlock = 32;       // weights per Q4_0 block
constexpr int64_t kBlockBytes = 16;  // two codes per byte
constexpr int64_t kQuad = 4;         // blocks per vector step (64 code bytes, 128 weights)
constexpr int kRows = 4;             // x rows sharing every block of codes loaded
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
#elif defined(EDGEMTP_Q4_0_AVX2)
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 m8 = _mm256_max_ps(
      _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
      _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
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
#elif defined(EDGEMTP_Q4_0_AVX2)
  __m256i q[4];  // rounded half to even by cvtps, as nearbyint
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
  const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
  // packs works within 128-bit lanes: the permute puts the 32 bytes back in order
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(low), _mm256_castsi256_si128(bytes));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(low + 64), _mm256_extracti128_si256(bytes, 1));
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

inline void quantize(const float* x, int64_t rows, int64_t in, Activations& a) {
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

// An IEEE binary16 value, given as its bits, exactly as a float (no compiler has one half type
// on every target).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float v = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -v : v;
  }
  const uint32_t bits = sign | (exponent == 31 ? 0x7f800000u | (mantissa << 13)
                                               : ((exponent + 112) << 23) | (mantissa << 13));
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// One row of the output, for R rows of x: sum over blocks of scale * d * integer dot.
template <int R>
void rows_portable(const uint8_t* codes, const uint16_t* scales, int64_t blocks, const Q8View& a,
                   int64_t r0, float* y, int64_t y_stride) {
  float acc[R] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* c = codes + b * kBlockBytes;
    const float s = half_to_float(scales[b]);
    for (int r = 0; r < R; ++r) {
      const int8_t* low = a.q + ((r0 + r) * a.quads + b / kQuad) * 128 + (b % kQuad) * 16;
      int32_t dot = 0;
      for (int64_t j = 0; j < kBlockBytes; ++j) {
        dot += (c[j] & 15) * low[j] + (c[j] >> 4) * low[64 + j];
      }
      dot += a.bias[((r0 + r) * a.quads + b / kQuad) * 16 + (b % kQuad) * 4];
      acc[r] += s *
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

constexpr int64_t kAheadAvx2 = 4096;  // bytes of codes prefetched ahead (a prefetch is a hint:
                                     // past the end of the codes it does not fault)

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
    _mm_prefetch(reinterpret_cast<const char*>(c) + kAheadAvx2, _MM_HINT_T0);
    if (const int64_t left = blocks - k * kQuad; left < kQuad) {  // zeros past the last block
      std::memset(tail, 0, sizeof tail);
      std::memset(tail_scales, 0, sizeof tail_scales);
      std::memcpy(tail, c, static_cast<size_t>(left * kBlockBytes));
      std::memcpy(tail_scales, sc, static_cast<size_t>(left) * sizeof(uint16_t));
      c = tail;
      sc = tail_scales;
    }
    const __m256 s4 = _mm256_castps128_ps256(
        _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
    // Two blocks at a time (0-1, then 2-3): fewer registers live across the rows' loop.
    for (int half = 0; half < 2; ++half) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * half));
      const __m256i low = _mm256_and_si256(v, nibble);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      const __m256 s = _mm256_permutevar8x32_ps(s4, half ? second : first);
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


#if defined(EDGEMTP_Q4_0_NEON)
// Block b of one row of x: its 16 low-half and 16 high-half values, its d (4 lanes) and its
// -8 * sum q (lane 0), in Activations' layout.
struct BlockOfX {
  const int8_t* low;
  const float* d4;
  const int32_t* bias4;
};

inline BlockOfX block_of_x(const Q8View& x, int64_t row, int64_t b) {
  const int64_t quad = row * x.quads + b / kQuad, lane = b % kQuad;
  return {x.q + quad * 128 + lane * 16, x.d16 + quad * 16 + lane * 4,
          x.bias + quad * 16 + lane * 4};
}

// A block's 32 codes as two registers of int8: elements 0-15 (low nibbles), 16-31 (high).
struct Codes {
  int8x16_t low, high;
};

inline Codes unpack(const uint8_t* block) {
  const uint8x16_t v = vld1q_u8(block);
  return {vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15))), vreinterpretq_s8_u8(vshrq_n_u8(v, 4))};
}

// One block at a time for R rows of x: the codes unpacked once, each row's 32 products in int16
// pairs (|15 * 127| twice fits), widened and summed to 4 int32 lanes.
template <int R>
void rows_neon(const uint8_t* codes, const uint16_t* scales, int64_t blocks, const Q8View& x,
               int64_t r0, float* y, int64_t y_stride) {
  float32x4_t acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const auto [low, high] = unpack(codes + b * kBlockBytes);
    const float s = half_to_float(scales[b]);
    for (int r = 0; r < R; ++r) {
      const BlockOfX xb = block_of_x(x, r0 + r, b);
      const int8x16_t ql = vld1q_s8(xb.low), qh = vld1q_s8(xb.low + 64);
      const int16x8_t p0 = vmlal_s8(vmull_s8(vget_low_s8(low), vget_low_s8(ql)),
                                    vget_low_s8(high), vget_low_s8(qh));
      const int16x8_t p1 = vmlal_high_s8(vmull_high_s8(low, ql), high, qh);
      const int32x4_t dot = vaddq_s32(vpadalq_s16(vpaddlq_s16(p0), p1), vld1q_s32(xb.bias4));
      acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(dot), vmulq_n_f32(vld1q_f32(xb.d4), s));
    }
  }
  for (int r = 0; r < R; ++r) y[r * y_stride] = vaddvq_f32(acc[r]);
}

// The same with sdot: 16 products summed four at a time into each int32 lane, one instruction.
template <int R>
EDGEMTP_DOTPROD void rows_neon_dot(const uint8_t* codes, const uint16_t* scales, int64_t blocks,
                                   const Q8View& x, int64_t r0, float* y, int64_t y_stride) {
  float32x4_t acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const auto [low, high] = unpack(codes + b * kBlockBytes);
    const float s = half_to_float(scales[b]);
    for (int r = 0; r < R; ++r) {
      const BlockOfX xb = block_of_x(x, r0 + r, b);
      int32x4_t dot = vdotq_s32(vld1q_s32(xb.bias4), low, vld1q_s8(xb.low));
      dot = vdotq_s32(dot, high, vld1q_s8(xb.low + 64));
      acc[r] = vfmaq_f32(acc[r], vcvtq_f32_s32(dot), vmulq_n_f32(vld1q_f32(xb.d4), s));
    }
  }
  for (int r = 0; r < R; ++r) y[r * y_stride] = vaddvq_f32(acc[r]);
}
#endif

#if defined(EDGEMTP_Q4_0_NEON)
// Two output rows (codes c0, c1) against RP pairs of rows of x with smmla: each instruction
// multiplies a 2 x 8 block of x (8 values of two rows) by the same 8 positions of both outputs'
// codes, giving the 2 x 2 int32 dot products [row a out 0, row a out 1, row b out 0, row b out 1].
// A block of 32 is 4 instructions for its 4 results (sdot: 8).
template <int RP>
EDGEMTP_I8MM void pairs_neon_i8mm(const uint8_t* c0, const uint8_t* c1, const uint16_t* s0,
                                  const uint16_t* s1, int64_t blocks, const Q8View& x,
                                  int64_t r0, float* y, int64_t y_stride) {
  float32x4_t acc[RP];
  for (int p = 0; p < RP; ++p) acc[p] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const auto [low0, high0] = unpack(c0 + b * kBlockBytes);
    const auto [low1, high1] = unpack(c1 + b * kBlockBytes);
    // elements 0-7, 8-15, 16-23, 24-31 of both outputs
    const int8x16_t w[4] = {vcombine_s8(vget_low_s8(low0), vget_low_s8(low1)),
                            vcombine_s8(vget_high_s8(low0), vget_high_s8(low1)),
                            vcombine_s8(vget_low_s8(high0), vget_low_s8(high1)),
                            vcombine_s8(vget_high_s8(high0), vget_high_s8(high1))};
    const float sa = half_to_float(s0[b]), sb = half_to_float(s1[b]);
    const float32x4_t scale = {sa, sb, sa, sb};
    for (int p = 0; p < RP; ++p) {
      const BlockOfX xa = block_of_x(x, r0 + 2 * p, b), xb = block_of_x(x, r0 + 2 * p + 1, b);
      const int8x16_t la = vld1q_s8(xa.low), lb = vld1q_s8(xb.low);
      const int8x16_t ha = vld1q_s8(xa.low + 64), hb = vld1q_s8(xb.low + 64);
      int32x4_t dot = vcombine_s32(vdup_n_s32(xa.bias4[0]), vdup_n_s32(xb.bias4[0]));
      dot = vmmlaq_s32(dot, vcombine_s8(vget_low_s8(la), vget_low_s8(lb)), w[0]);
      dot = vmmlaq_s32(dot, vcombine_s8(vget_high_s8(la), vget_high_s8(lb)), w[1]);
      dot = vmmlaq_s32(dot, vcombine_s8(vget_low_s8(ha), vget_low_s8(hb)), w[2]);
      dot = vmmlaq_s32(dot, vcombine_s8(vget_high_s8(ha), vget_high_s8(hb)), w[3]);
      const float32x4_t d = vcombine_f32(vdup_n_f32(xa.d4[0]), vdup_n_f32(xb.d4[0]));
      acc[p] = vfmaq_f32(acc[p], vcvtq_f32_s32(dot), vmulq_f32(d, scale));
    }
  }
  for (int p = 0; p < RP; ++p) {
    float* ya = y + 2 * p * y_stride;
    ya[0] = vgetq_lane_f32(acc[p], 0);
    ya[1] = vgetq_lane_f32(acc[p], 1);
    ya[y_stride] = vgetq_lane_f32(acc[p], 2);
    ya[y_stride + 1] = vgetq_lane_f32(acc[p], 3);
  }
}
#endif

enum class Variant { kPortable, kAvx2, kAvx512Vnni, kNeon, kNeonDot, kNeonI8mm };

inline const char* variant_name(Variant v) {
  switch (v) {
    case Variant::kPortable: return "portable";
    case Variant::kAvx2: return "avx2";
    case Variant::kAvx512Vnni: return "avx512vnni";
    case Variant::kNeon: return "neon";
    case Variant::kNeonDot: return "neon-dotprod";
    case Variant::kNeonI8mm: return "neon-i8mm";
  }
  return "?";
}

// Whether this build has the variant and this CPU runs it.
inline bool supported(Variant v) {
  switch (v) {
    case Variant::kPortable: return true;
#if defined(EDGEMTP_Q4_0_AVX2)
    case Variant::kAvx2: return true;
#endif
#if defined(EDGEMTP_Q4_0_AVX512)
    case Variant::kAvx512Vnni: return true;
#endif
#if defined(EDGEMTP_Q4_0_NEON)
    case Variant::kNeon: return true;
    case Variant::kNeonDot: {
#if defined(__APPLE__)
      int has = 0;
      size_t size = sizeof has;
      return sysctlbyname("hw.optional.arm.FEAT_DotProd", &has, &size, nullptr, 0) == 0 && has;
#elif defined(__linux__) && defined(HWCAP_ASIMDDP)
      return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
      return false;
#endif
    }
    case Variant::kNeonI8mm: {  // its odd rows and outputs run the dotprod kernel
      if (!supported(Variant::kNeonDot)) return false;
#if defined(__APPLE__)
      int has = 0;
      size_t size = sizeof has;
      return sysctlbyname("hw.optional.arm.FEAT_I8MM", &has, &size, nullptr, 0) == 0 && has;
#elif defined(__linux__) && defined(HWCAP2_I8MM)
      return (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
#else
      return false;
#endif
    }
#endif
    default: return false;
  }
}

// The fastest variant this build and CPU have (asked once: the answer cannot change).
inline Variant best_variant() {
  static const Variant best = [] {
    for (Variant v : {Variant::kAvx512Vnni, Variant::kAvx2, Variant::kNeonI8mm, Variant::kNeonDot,
                      Variant::kNeon}) {
      if (supported(v)) return v;
    }
    return Variant::kPortable;
  }();
  return best;
}

template <Variant V, int R>
void output_rows(const uint8_t* codes, const uint16_t* scales, int64_t in, const Q8View& a,
                 int64_t r0, int64_t begin, int64_t end, float* y, int64_t out) {
  const int64_t blocks = in / kBlock;
#if defined(EDGEMTP_Q4_0_NEON)
  if constexpr (V == Variant::kNeonI8mm) {  // output rows and rows of x in pairs
    int64_t o = begin;
    for (; R > 1 && o + 1 < end; o += 2) {
      const uint8_t* c = codes + o * (in / 2);
      const uint16_t* s = scales + o * blocks;
      float* yo = y + r0 * out + o;
      pairs_neon_i8mm<R / 2>(c, c + in / 2, s, s + blocks, blocks, a, r0, yo, out);
      if constexpr (R % 2) {  // the last row of x, against each output
        rows_neon_dot<1>(c, s, blocks, a, r0 + R - 1, yo + (R - 1) * out, out);
        rows_neon_dot<1>(c + in / 2, s + blocks, blocks, a, r0 + R - 1, yo + (R - 1) * out + 1,
                         out);
      }
    }
    for (; o < end; ++o) {
      rows_neon_dot<R>(codes + o * (in / 2), scales + o * blocks, blocks, a, r0,
                       y + r0 * out + o, out);
    }
    return;
  }
#endif
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* c = codes + o * (in / 2);
    const uint16_t* s = scales + o * blocks;
    float* yo = y + r0 * out + o;
#if defined(EDGEMTP_Q4_0_AVX512)
    if constexpr (V == Variant::kAvx512Vnni) {
      rows_avx512<R>(c, s, blocks, a, r0, yo, out);
      continue;
    }
#endif
#if defined(EDGEMTP_Q4_0_AVX2)
    if constexpr (V == Variant::kAvx2) {
      rows_avx2<R>(c, s, blocks, a, r0, yo, out);
      continue;
    }
#endif
#if defined(EDGEMTP_Q4_0_NEON)
    if constexpr (V == Variant::kNeon) {
      rows_neon<R>(c, s, blocks, a, r0, yo, out);
      continue;
    }
    if constexpr (V == Variant::kNeonDot) {
      rows_neon_dot<R>(c, s, blocks, a, r0, yo, out);
      continue;
    }
#endif
    rows_portable<R>(c, s, blocks, a, r0, yo, out);
  }
}

// Every row of x against output rows [begin, end), a tile of outputs at a time so that the
// tile's codes stay in cache while groups of kRows rows of x go past them.
template <Variant V>
void output_range(const uint8_t* codes, const uint16_t* scales, int64_t in, int64_t out,
                  const Q8View& a, int64_t rows, int64_t begin, int64_t end, float* y) {
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t t_end = std::min(end, t + kTile);
    int64_t r0 = 0;
    for (; r0 + kRows <= rows; r0 += kRows) {
      output_rows<V, kRows>(codes, scales, in, a, r0, t, t_end, y, out);
    }
    switch (rows - r0) {
      case 3: output_rows<V, 3>(codes, scales, in, a, r0, t, t_end, y, out); break;
      case 2: output_rows<V, 2>(codes, scales, in, a, r0, t, t_end, y, out); break;
      case 1: output_rows<V, 1>(codes, scales, in, a, r0, t, t_end, y, out); break;
      default: break;
    }
  }
}

// The variant's output_range (chosen once per call, not per output row).
using RangeFn = void (*)(const uint8_t*, const uint16_t*, int64_t, int64_t, const Q8View&,
                         int64_t, int64_t, int64_t, float*);

inline RangeFn range_for(Variant variant) {
  switch (variant) {
#if defined(EDGEMTP_Q4_0_AVX512)
    case Variant::kAvx512Vnni: return output_range<Variant::kAvx512Vnni>;
#endif
#if defined(EDGEMTP_Q4_0_AVX2)
    case Variant::kAvx2: return output_range<Variant::kAvx2>;
#endif
#if defined(EDGEMTP_Q4_0_NEON)
    case Variant::kNeon: return output_range<Variant::kNeon>;
    case Variant::kNeonDot: return output_range<Variant::kNeonDot>;
    case Variant::kNeonI8mm: return output_range<Variant::kNeonI8mm>;
#endif
    default: return output_range<Variant::kPortable>;
  }
}

// y [rows, out] = x [rows, in] W^T for Q4_0 W (codes [out, in / 2], float16 scale bits
// [out, in / 32]); `parallel(n, fn)` runs fn(begin, end) over [0, n) output rows in tiles.
template <typename Parallel>
void linear(const float* x, int64_t rows, int64_t in, const uint8_t* codes,
            const uint16_t* scales, int64_t out, float* y, Variant variant,
            const Parallel& parallel) {
  thread_local Activations a;
  quantize(x, rows, in, a);
  const Q8View view{a.q.data(), a.bias.data(), a.d16.data(), a.quads};
  const RangeFn range = range_for(variant);
  parallel(out, [&](int64_t begin, int64_t end) {
    range(codes, scales, in, out, view, rows, begin, end, y);
  });
}

}  // namespace
}  // namespace edgemtp::q4_0

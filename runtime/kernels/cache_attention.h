// The arithmetic of edgemtp::cache_attention.out (cache_attention.cpp): grouped-query attention of a few rows over a static KV cache,
// reading only the cache slots some row may attend to.
//
// XNNPACK runs the static programs' attention as batched matmuls over every slot of the cache,
// and packs the whole cache at every call: a decode step at position 16 pays for all 512 slots
// of its bucket, one at position 1800 for all 2048. This kernel skips every key
// the additive mask blocks for all rows (empty slots, future positions, out of the window), so
// its cost follows the keys actually attended, and it reads each K and V row once for all the
// rows of a KV group. Keys are split into chunks run on ExecuTorch's threadpool; each chunk keeps
// its own softmax max and sum, merged at the end (flash-decoding).
//
// Shapes (contiguous; float32 but for the cache, float32, float16 or int8 rows):
//   q        [kv_heads, group * rows, head_dim]  query row g * rows + t belongs to mask row t
//   k_cache  [kv_heads, slots, head_dim]         slots may exceed what the mask reads
//   v_cache  [kv_heads, slots, head_dim]         float16: half the bytes read, widened on load;
//                                                int8: [kv_heads, slots, head_dim + 4], each
//                                                row's codes then its float32 scale (a quarter
//                                                of float32's bytes and one scale)
//   k_new    [kv_heads, fresh, head_dim] or none  the call's own keys, after the cache's (with
//   v_new    [kv_heads, fresh, head_dim] or none  a narrower cache, rounded as they will be
//                                                stored: a verify row then sees the keys a
//                                                later decode step reads from the cache)
//   mask     [rows, keys]                        additive: 0 attends, <= -1e29 blocked; the
//                                                cache's first keys - fresh slots are read
//   out      [kv_heads, group * rows, head_dim]
// edgemtp::cache_attention_rows.out is the same attention with out [rows, kv_heads * group *
// head_dim]: row t holds every head's output for mask row t (head kv * group + g from query
// row g * rows + t), the input layout of the output projection, so no transpose (a delegate
// call of its own in a program) runs between the kernel and that projection.
// Scores are q . k (scale 1.0). A row that every key blocks gets zeros (the static programs
// never build one).

//
// Plain C++ without ExecuTorch (the thread pool aside: parallel.h), so the tests build it alone,
// for arm64 under qemu too (tests/native/attention_check.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include "exp_poly.h"
#include "parallel.h"

namespace edgemtp::attention {
namespace {

constexpr float kBlocked = -1e29f;  // masks block with multiples of -1e30
constexpr int64_t kChunk = 128;     // keys per task: small enough to split a 512-key decode

constexpr int kRows = 4;  // query rows sharing every K and V row loaded

// One register of floats as one value (GCC/Clang vector extension), as wide as the build's
// target allows: AVX-512, AVX, else SSE/NEON. The accumulators below stay in registers, as
// arrays of floats would not (they spilled to the stack at every key).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
// IEEE binary16 (GCC before 13 has no _Float16 in C++ on aarch64; its __fp16 is the same format)
#if defined(__aarch64__) && !defined(__clang__)
using Float16 = __fp16;
#else
using Float16 = _Float16;
#endif

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Float16 widened a whole register at a time. Written out per target: left to
// __builtin_convertvector, GCC widened lane by lane (one scalar conversion and shuffle per
// float), which was most of a long-context decode's attention.
inline Vec load(const Float16* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return reinterpret_cast<Vec>(_mm512_cvtph_ps(h));
#elif defined(__AVX__) && defined(__F16C__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Vec>(_mm256_cvtph_ps(h));
#elif defined(__ARM_NEON) && defined(__aarch64__)
  return reinterpret_cast<Vec>(vcvt_f32_f16(vld1_f16(reinterpret_cast<const float16_t*>(p))));
#else
  using HalfVec = Float16 __attribute__((vector_size(kLanes * sizeof(Float16))));
  HalfVec h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, Vec);
#endif
}

// int8 codes widened a register at a time (an int8 cache's rows; the scale is applied to the
// dot product or the softmax weight, once per key, not per element).
inline Vec load(const int8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Vec>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Vec>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
#elif defined(__ARM_NEON) && defined(__aarch64__)
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  const int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(word)));
  return reinterpret_cast<Vec>(vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))));
#else
  using ByteVec = int8_t __attribute__((vector_size(kLanes)));
  ByteVec b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, Vec);
#endif
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

// --- an int8 cache's rows: head_dim codes, then the row's float32 scale ---------------------

constexpr int64_t kScaleBytes = 4;

// One K or V row as an int8 cache stores it: scale = max|x| / 127, codes = round-half-even(x /
// scale) (times the float32 reciprocal), scale 0 and codes 0 for an all-zero row; the same
// float32 operations as the Python side's `quantize_kv`, so the codes are equal.
inline void quantize_row(const float* x, int64_t dim, int8_t* out) {
  float amax = 0.0f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax / 127.0f;
  const float inverse = scale == 0.0f ? 0.0f : 1.0f / scale;
  for (int64_t d = 0; d < dim; ++d) {
    const float code = std::nearbyint(x[d] * inverse);  // ties to even: the default mode
    out[d] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, code)));
  }
  std::memcpy(out + dim, &scale, sizeof scale);
}

inline float row_scale(const int8_t* row, int64_t dim) {
  float scale;
  std::memcpy(&scale, row + dim, sizeof scale);
  return scale;
}

// Elements of one cached row of type T.
template <typename T>
constexpr int64_t row_width(int64_t dim) {
  return std::is_same_v<T, int8_t> ? dim + kScaleBytes : dim;
}

// The lanes summed pairwise, halves onto halves: a sequential sum (what the compiler must keep
// for a plain loop without -ffast-math) is one dependent add per lane, at every key and row.
// (Vector shuffles, not intrinsics: GCC 12 warns inside _mm512_reduce_add_ps and its kin.)
using Quad = float __attribute__((vector_size(4 * sizeof(float))));

inline float lane_sum(Vec v) {
#if defined(__AVX512F__)
  using Oct = float __attribute__((vector_size(8 * sizeof(float))));
  const Oct h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Quad q =
      __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
#elif defined(__AVX__)
  const Quad q =
      __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
  const Quad q = v;
#endif
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// The lane sums of 2R accumulators (R query rows x two keys) into sums[r] and sums[R + r].
// Pairwise across registers (AVX's hadd, NEON's padd), so a sum costs a fraction of an
// instruction, not one shuffle-and-add chain per accumulator.
template <int R>
inline void lane_sums(const Vec* a0, const Vec* a1, float* sums) {
#if defined(__AVX__)
  if constexpr (R == 4) {
    __m256 x[4], y[4];
    for (int r = 0; r < 4; ++r) {
#if defined(__AVX512F__)  // 16 lanes folded to 8 first
      x[r] = _mm256_add_ps(_mm512_castps512_ps256(reinterpret_cast<__m512>(a0[r])),
                           _mm512_extractf32x8_ps(reinterpret_cast<__m512>(a0[r]), 1));
      y[r] = _mm256_add_ps(_mm512_castps512_ps256(reinterpret_cast<__m512>(a1[r])),
                           _mm512_extractf32x8_ps(reinterpret_cast<__m512>(a1[r]), 1));
#else
      x[r] = reinterpret_cast<__m256>(a0[r]);
      y[r] = reinterpret_cast<__m256>(a1[r]);
#endif
    }
    // [x0 x1 x2 x3 | y0 y1 y2 y3] summed lane-wise within each 128-bit half, then halves added
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3]));
    const __m256 lo = _mm256_permute2f128_ps(h0, h1, 0x20), hi = _mm256_permute2f128_ps(h0, h1, 0x31);
    _mm256_storeu_ps(sums, _mm256_add_ps(lo, hi));
    return;
  }
#elif defined(__ARM_NEON) && defined(__aarch64__)
  if constexpr (R == 4) {
    const float32x4_t s0 = vpaddq_f32(vpaddq_f32(reinterpret_cast<float32x4_t>(a0[0]),
                                                 reinterpret_cast<float32x4_t>(a0[1])),
                                      vpaddq_f32(reinterpret_cast<float32x4_t>(a0[2]),
                                                 reinterpret_cast<float32x4_t>(a0[3])));
    const float32x4_t s1 = vpaddq_f32(vpaddq_f32(reinterpret_cast<float32x4_t>(a1[0]),
                                                 reinterpret_cast<float32x4_t>(a1[1])),
                                      vpaddq_f32(reinterpret_cast<float32x4_t>(a1[2]),
                                                 reinterpret_cast<float32x4_t>(a1[3])));
    vst1q_f32(sums, s0);
    vst1q_f32(sums + 4, s1);
    return;
  }
#endif
  for (int r = 0; r < R; ++r) {
    sums[r] = lane_sum(a0[r]);
    sums[R + r] = lane_sum(a1[r]);
  }
}

// Keys ahead of the pair being scored whose rows are requested from memory (with the values
// of the pair, read once every score is known): between two layers a decode step's weights
// push the cache out of the CPU's caches, and a row was otherwise requested only when read.
constexpr int64_t kAheadKeys = 6;

// scores[r * stride + i] = q[r] . keys[i] for R query rows, two keys at a time; with `values`,
// the rows of keys kAheadKeys on and the pair's values are prefetched. The columns past the
// last whole register (head_dim % kLanes, none for real heads) are added one by one.
template <int R, typename T>
void block_scores(const float* q, int64_t dim, const T* const* keys, int64_t n, float* scores,
                  int64_t stride, const T* const* values = nullptr) {
  const int64_t row_bytes = row_width<T>(dim) * static_cast<int64_t>(sizeof(T));
  const int64_t body = dim - dim % kLanes;
  auto tail = [&](int r, const T* k) {
    float sum = 0;
    for (int64_t d = body; d < dim; ++d) sum += q[r * dim + d] * static_cast<float>(k[d]);
    return sum;
  };
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {
    const T* k0 = keys[i];
    const T* k1 = keys[i + 1];
    for (int64_t j = i; values && j < i + 2; ++j) {
      const char* ahead = j + kAheadKeys < n ? reinterpret_cast<const char*>(keys[j + kAheadKeys])
                                             : nullptr;
      for (int64_t b = 0; b < row_bytes; b += 64) {  // a cache line at a time
        if (ahead) __builtin_prefetch(ahead + b);
        __builtin_prefetch(reinterpret_cast<const char*>(values[j]) + b);
      }
    }
    Vec a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = Vec{};
    for (int64_t d = 0; d < body; d += kLanes) {
      const Vec x0 = load(k0 + d), x1 = load(k1 + d);
      for (int r = 0; r < R; ++r) {
        const Vec qr = load(q + r * dim + d);
        a0[r] += qr * x0;
        a1[r] += qr * x1;
      }
    }
    float sums[2 * R];
    lane_sums<R>(a0, a1, sums);
    for (int r = 0; r < R; ++r) {
      scores[r * stride + i] = sums[r];
      scores[r * stride + i + 1] = sums[R + r];
    }
    if (body != dim) {
      for (int r = 0; r < R; ++r) {
        scores[r * stride + i] += tail(r, k0);
        scores[r * stride + i + 1] += tail(r, k1);
      }
    }
  }
  for (; i < n; ++i) {
    Vec a[R];
    for (int r = 0; r < R; ++r) a[r] = Vec{};
    for (int64_t d = 0; d < body; d += kLanes) {
      const Vec x = load(keys[i] + d);
      for (int r = 0; r < R; ++r) a[r] += load(q + r * dim + d) * x;
    }
    for (int r = 0; r < R; ++r) scores[r * stride + i] = lane_sum(a[r]) + tail(r, keys[i]);
  }
}

// out[r * dim + d] (+)= sum over i of weights[r * stride + i] * values[i][d], for R rows, two
// vectors of columns at a time, over blocks of keys whose value rows stay in L1.
constexpr int64_t kKeyBlock = 32;

template <int R, typename T>
void block_values(const float* weights, int64_t stride, const T* const* values, int64_t n,
                  int64_t dim, float* out, bool accumulate) {
  if (!accumulate) std::fill(out, out + R * dim, 0.0f);
  for (int64_t first = 0; first < n; first += kKeyBlock) {
    const int64_t last = std::min(n, first + kKeyBlock);
    int64_t d = 0;
    for (; d + 2 * kLanes <= dim; d += 2 * kLanes) {
      Vec a0[R], a1[R];
      for (int r = 0; r < R; ++r) {
        a0[r] = load(out + r * dim + d);
        a1[r] = load(out + r * dim + d + kLanes);
      }
      for (int64_t i = first; i < last; ++i) {
        const Vec v0 = load(values[i] + d), v1 = load(values[i] + d + kLanes);
        for (int r = 0; r < R; ++r) {
          const float w = weights[r * stride + i];
          a0[r] += w * v0;
          a1[r] += w * v1;
        }
      }
      for (int r = 0; r < R; ++r) {
        store(out + r * dim + d, a0[r]);
        store(out + r * dim + d + kLanes, a1[r]);
      }
    }
    for (; d < dim; ++d) {
      for (int r = 0; r < R; ++r) {
        float sum = out[r * dim + d];
        for (int64_t i = first; i < last; ++i) {
          sum += weights[r * stride + i] * static_cast<float>(values[i][d]);
        }
        out[r * dim + d] = sum;
      }
    }
  }
}

// fn(R, r0) for the query rows in blocks of kRows (R a compile-time constant), the rest last.
template <typename Fn>
void by_row_blocks(int64_t q_rows, Fn&& fn) {
  for (int64_t r0 = 0; r0 < q_rows; r0 += kRows) {
    switch (std::min<int64_t>(kRows, q_rows - r0)) {
      case 4: fn(std::integral_constant<int, 4>{}, r0); break;
      case 3: fn(std::integral_constant<int, 3>{}, r0); break;
      case 2: fn(std::integral_constant<int, 2>{}, r0); break;
      default: fn(std::integral_constant<int, 1>{}, r0); break;
    }
  }
}

struct Partial {  // one chunk's softmax state per query row: max, sum, unnormalised output
  float* max;
  float* sum;
  float* acc;
};

// One call's inputs: the cache's element type T (float, Float16 or int8_t rows), the call's own
// keys' O (as they will be stored: T, or float rounded through int8).
template <typename T, typename O>
struct Call {
  const float* q;
  const T* k_cache;
  const T* v_cache;
  const O* k_new;
  const O* v_new;
  const float* mask;
  int64_t q_rows, dim, rows, keys, cached, fresh, slots, chunks;

  // The softmax state of one task's keys (a chunk of one KV head) for every query row.
  void chunk(int64_t task, Partial state) const {
    const int64_t head = task / chunks, first = (task % chunks) * kChunk;
    const int64_t last = std::min(keys, first + kChunk);
    std::fill(state.max, state.max + q_rows, -std::numeric_limits<float>::infinity());
    std::fill(state.sum, state.sum + q_rows, 0.0f);
    int64_t live[kChunk];
    int64_t n = 0;
    for (int64_t j = first; j < last; ++j) {
      bool open = false;
      for (int64_t t = 0; t < rows && !open; ++t) open = mask[t * keys + j] > kBlocked;
      if (open) live[n++] = j;
    }
    // the cache's keys, then the call's own: live is ascending and they come last
    constexpr bool kInt8 = std::is_same_v<T, int8_t>;
    const T* cache_k[kChunk];
    const T* cache_v[kChunk];
    const O* own_k[kChunk];
    const O* own_v[kChunk];
    float k_scale[kInt8 ? kChunk : 1];
    float v_scale[kInt8 ? kChunk : 1];
    int64_t from_cache = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = live[i];
      if (j < cached) {
        cache_k[from_cache] = k_cache + (head * slots + j) * row_width<T>(dim);
        cache_v[from_cache] = v_cache + (head * slots + j) * row_width<T>(dim);
        if constexpr (kInt8) {
          k_scale[from_cache] = row_scale(cache_k[from_cache], dim);
          v_scale[from_cache] = row_scale(cache_v[from_cache], dim);
        }
        ++from_cache;
      } else {
        own_k[i - from_cache] = k_new + (head * fresh + (j - cached)) * dim;
        own_v[i - from_cache] = v_new + (head * fresh + (j - cached)) * dim;
      }
    }
    const int64_t own = n - from_cache;
    thread_local std::vector<float> scores;  // per worker thread, reused across calls
    scores.resize(static_cast<size_t>(q_rows * kChunk));
    const float* hq = q + head * q_rows * dim;
    by_row_blocks(q_rows, [&](auto block, int64_t r0) {
      constexpr int R = decltype(block)::value;
      float* sr = scores.data() + r0 * kChunk;
      // rows prefetched by the first block of rows; an int8 cache's are requested as their
      // scales are read above (prefetched as well, 128-wide rows measured slower)
      block_scores<R>(hq + r0 * dim, dim, cache_k, from_cache, sr, kChunk,
                      r0 == 0 && !kInt8 ? cache_v : nullptr);
      block_scores<R>(hq + r0 * dim, dim, own_k, own, sr + from_cache, kChunk);
    });
    // each row padded to whole registers with -inf, which weighs 0
    constexpr float kInf = std::numeric_limits<float>::infinity();
    const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;  // <= kChunk, a multiple of it
    for (int64_t r = 0; r < q_rows; ++r) {
      float* s = scores.data() + r * kChunk;
      const float* m_row = mask + (r % rows) * keys;
      for (int64_t i = 0; i < n; ++i) {  // q . (codes * scale) as (q . codes) * scale
        const float score = kInt8 && i < from_cache ? s[i] * k_scale[i] : s[i];
        s[i] = score + m_row[live[i]];
      }
      std::fill(s + n, s + padded, -kInf);
      Vec top = Vec{} - kInf;
      for (int64_t i = 0; i < padded; i += kLanes) {
        const Vec x = load(s + i);
        top = x > top ? x : top;
      }
      float m = -kInf;
      for (int l = 0; l < kLanes; ++l) m = std::max(m, top[l]);
      // below e^-87 a weight is under float epsilon of the row's largest (1): exactly 0 keeps
      // every blocked key out of the sum
      const float shift = m > kBlocked ? m : kInf;
      Vec total{};
      for (int64_t i = 0; i < padded; i += kLanes) {
        const Vec d = load(s + i) - shift;
        const Vec weight = d > -87.0f ? exp_poly(d) : Vec{};
        store(s + i, weight);
        total += weight;
      }
      state.max[r] = m;
      state.sum[r] = lane_sum(total);
      if constexpr (kInt8) {  // weight * (codes * scale) as (weight * scale) * codes
        for (int64_t i = 0; i < from_cache; ++i) s[i] *= v_scale[i];
      }
    }
    by_row_blocks(q_rows, [&](auto block, int64_t r0) {
      constexpr int R = decltype(block)::value;
      const float* wr = scores.data() + r0 * kChunk;
      float* ar = state.acc + r0 * dim;
      block_values<R>(wr, kChunk, cache_v, from_cache, dim, ar, false);
      block_values<R>(wr + from_cache, kChunk, own_v, own, dim, ar, true);
    });
  }
};

// `by_rows`: out as [rows, heads * dim] (cache_attention_rows) instead of [kv_heads, q_rows, dim].
template <typename T, typename O>
void attend(const Call<T, O>& call, int64_t kv_heads, float* out, bool by_rows) {
  const int64_t q_rows = call.q_rows, dim = call.dim, chunks = call.chunks;
  const int64_t tasks = kv_heads * chunks;
  const int64_t stride = q_rows * (dim + 2);  // one Partial's floats
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < tasks * stride) scratch.resize(tasks * stride);
  float* base = scratch.data();
  auto partial = [&](int64_t task) {
    float* p = base + task * stride;
    return Partial{p, p + q_rows, p + 2 * q_rows};
  };
  parallel_tiles(tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) call.chunk(task, partial(task));
  });
  for (int64_t head = 0; head < kv_heads; ++head) {  // merge the chunks' softmaxes
    for (int64_t r = 0; r < q_rows; ++r) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) m = std::max(m, partial(head * chunks + c).max[r]);
      const int64_t group = q_rows / call.rows, t = r % call.rows;
      float* o = by_rows ? out + ((t * kv_heads + head) * group + r / call.rows) * dim
                         : out + (head * q_rows + r) * dim;
      std::fill(o, o + dim, 0.0f);
      float total = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        Partial state = partial(head * chunks + c);
        if (state.sum[r] == 0.0f) continue;
        const float w = std::exp(state.max[r] - m);
        total += w * state.sum[r];
        const float* acc = state.acc + r * dim;
        for (int64_t i = 0; i < dim; ++i) o[i] += w * acc[i];
      }
      if (total > 0) {
        const float inv = 1.0f / total;
        for (int64_t i = 0; i < dim; ++i) o[i] *= inv;
      }
    }
  }
}

// The call's own rows as the cache of T will give them back: float16 as stored, an int8
// row's codes times its scale (in float32).
template <typename T>
using Own = std::conditional_t<std::is_same_v<T, int8_t>, float, T>;

template <typename T>
void round_as_stored(const float* x, int64_t rows, int64_t dim, Own<T>* out) {
  if constexpr (std::is_same_v<T, int8_t>) {
    std::vector<int8_t> row(static_cast<size_t>(dim + kScaleBytes));
    for (int64_t r = 0; r < rows; ++r) {
      quantize_row(x + r * dim, dim, row.data());
      const float scale = row_scale(row.data(), dim);
      for (int64_t d = 0; d < dim; ++d) out[r * dim + d] = static_cast<float>(row[d]) * scale;
    }
  } else {
    for (int64_t i = 0; i < rows * dim; ++i) out[i] = static_cast<T>(x[i]);
  }
}

// One call over plain arrays, shapes as above; T: the cache's element type (float, Float16 or
// int8_t rows). The call's own keys and values come as float32, attended as they will be stored.
template <typename T>
void cache_attention(const float* q, const T* k_cache, const T* v_cache, const float* k_new,
                     const float* v_new, const float* mask, int64_t kv_heads, int64_t q_rows,
                     int64_t dim, int64_t rows, int64_t keys, int64_t fresh, int64_t slots,
                     float* out, bool by_rows) {
  using O = Own<T>;
  const O* own_k = nullptr;
  const O* own_v = nullptr;
  thread_local std::vector<O> rounded;
  if constexpr (std::is_same_v<T, float>) {
    own_k = k_new, own_v = v_new;
  } else if (fresh) {
    const int64_t n = kv_heads * fresh;
    rounded.resize(static_cast<size_t>(2 * n * dim));
    round_as_stored<T>(k_new, n, dim, rounded.data());
    round_as_stored<T>(v_new, n, dim, rounded.data() + n * dim);
    own_k = rounded.data(), own_v = rounded.data() + n * dim;
  }
  const int64_t chunks = (keys + kChunk - 1) / kChunk;
  const Call<T, O> call{q,    k_cache, v_cache, own_k, own_v, mask, q_rows, dim,
                        rows, keys,    keys - fresh, fresh, slots, chunks};
  attend(call, kv_heads, out, by_rows);
}

}  // namespace
}  // namespace edgemtp::attention

// exp(v) for loops that should vectorize (the GELU gate of edgemtp::q4_0_gated_linear, the
// softmax of edgemtp::cache_attention): std::exp is a call per element.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace edgemtp {

// exp(v) as 2^n p(r), n = round(v / ln 2), r = v - n ln 2 (ln 2 in two parts), p the degree-6
// Taylor polynomial (within 2 ulp on |r| <= ln 2 / 2); v clamped to [-87, 88]. Plain float
// and integer operations, rounding by the 1.5 * 2^23 shift: the loop calling it vectorizes.
// V: float, or a GCC/Clang vector of floats (the same operations lane by lane).
template <typename V>
inline V exp_poly(V v) {
  const V zero{};
  v = v < zero - 87.0f ? zero - 87.0f : v;
  v = v > zero + 88.0f ? zero + 88.0f : v;
  const float shift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V n = (v * 1.44269504088896341f + shift) - shift;
  V r = v - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  V p = zero + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  V two_n;
  if constexpr (std::is_same_v<V, float>) {
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    std::memcpy(&two_n, &bits, sizeof two_n);
  } else {
    using Ints = decltype(n < n);  // the int32 vector of as many lanes
    const Ints bits = (__builtin_convertvector(n, Ints) + 127) << 23;
    std::memcpy(&two_n, &bits, sizeof two_n);
  }
  return p * two_n;
}

}  // namespace edgemtp

// exp(v) for loops that should vectorize (the GELU gate of edgemtp::q4_0_gated_linear, the
// softmax of edgemtp::cache_attention): std::exp is a call per element.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace edgemtp {

// exp(v) as 2^n p(r), n = round(v / ln 2), r = v - n ln 2 (ln 2 in two parts), p the degree-6
// Taylor polynomial (within 2 ulp on |r| <= ln 2 / 2); v clamped to [-87, 88]. Plain float
// and integer operations, rounding by the 1.5 * 2^23 shift: the loop calling it vectorizes.
inline float exp_poly(float v) {
  v = std::min(std::max(v, -87.0f), 88.0f);
  const float shift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (v * 1.44269504088896341f + shift) - shift;
  float r = v - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

}  // namespace edgemtp

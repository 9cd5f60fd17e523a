// Rows of a GGML Q4_0 or Q8_0 lookup table (the bundle's token and per-layer embeddings),
// dequantized and scaled into float32, for the host's one-row-per-token lookups.
//
// A decode step looks up two rows between two calls of a program that streams every weight
// through the caches; the numpy form of the same arithmetic (quantize/tables.py) is a dozen
// array operations per table, each paying the cold caches, where this is one call. Plain C ABI,
// no ExecuTorch: ctypes calls it (quantize/tables.py).
//
// Values are exactly the numpy form's: ((code - offset) * float(d)) * scale, each product
// rounded to float32 as numpy and torch round it.

#include <cstdint>
#include <cstring>

namespace {

float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);  // little-endian, as GGML stores it
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

constexpr int64_t kBlock = 32;

// One Q4_0 block: fp16 d, then 16 bytes: code j in the low nibble of byte j, code j + 16 in
// its high nibble; value = (code - 8) * d.
void q4_0_block(const uint8_t* block, float scale, float* out) {
  const float d = half_to_float(block);
  const uint8_t* codes = block + 2;
  for (int j = 0; j < kBlock / 2; ++j) {
    out[j] = static_cast<float>((codes[j] & 0x0f) - 8) * d * scale;
    out[j + kBlock / 2] = static_cast<float>((codes[j] >> 4) - 8) * d * scale;
  }
}

// One Q8_0 block: fp16 d, then 32 int8 codes; value = code * d.
void q8_0_block(const uint8_t* block, float scale, float* out) {
  const float d = half_to_float(block);
  const int8_t* codes = reinterpret_cast<const int8_t*>(block + 2);
  for (int j = 0; j < kBlock; ++j) out[j] = static_cast<float>(codes[j]) * d * scale;
}

template <void (*Block)(const uint8_t*, float, float*)>
int64_t rows(const uint8_t* table, int64_t table_rows, int64_t block_bytes, const int64_t* ids,
             int64_t n, int64_t cols, float scale, float* out) {
  for (int64_t r = 0; r < n; ++r) {
    if (ids[r] < 0 || ids[r] >= table_rows) return r;  // the first id out of range
  }
  const int64_t blocks = cols / kBlock;
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = table + ids[r] * blocks * block_bytes;
    for (int64_t b = 0; b < blocks; ++b) Block(row + b * block_bytes, scale, out + b * kBlock);
    out += cols;
  }
  return n;
}

}  // namespace

// out [n, cols] = scale * rows `ids` of the table [table_rows, cols / 32 blocks]. Returns n,
// or the index of the first id outside 0..table_rows-1 (then nothing is written).
extern "C" int64_t edgemtp_q4_0_rows(const uint8_t* table, int64_t table_rows,
                                     const int64_t* ids, int64_t n, int64_t cols, float scale,
                                     float* out) {
  return rows<q4_0_block>(table, table_rows, 2 + kBlock / 2, ids, n, cols, scale, out);
}

extern "C" int64_t edgemtp_q8_0_rows(const uint8_t* table, int64_t table_rows,
                                     const int64_t* ids, int64_t n, int64_t cols, float scale,
                                     float* out) {
  return rows<q8_0_block>(table, table_rows, 2 + kBlock, ids, n, cols, scale, out);
}

// runtime/kernels/q4_0.h alone, as a program: y = x W^T in the variant asked for, so the tests
// can run each variant's arithmetic on any machine, aarch64 ones under qemu.
//
//   q4_0_check VARIANT IN OUT   (VARIANT: portable, avx2, avx512vnni, neon, neon-dotprod,
//                               neon-i8mm, best)
//   IN:  int64 rows, in, out; float32 x [rows, in]; uint8 codes [out, in / 2];
//        uint16 float16 scale bits [out, in / 32]
//   OUT: float32 y [rows, out]
// Prints the variant it ran; exits 3 when this build or CPU lacks it.
#include <cstdio>
#include <cstring>
#include <vector>

#include "q4_0.h"

using edgemtp::q4_0::Variant;

template <typename T>
static bool read(std::FILE* f, T* data, size_t n) {
  return std::fread(data, sizeof(T), n, f) == n;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s VARIANT IN OUT\n", argv[0]);
    return 2;
  }
  Variant variant = edgemtp::q4_0::best_variant();
  if (std::strcmp(argv[1], "best") != 0) {
    bool known = false;
    for (Variant v : {Variant::kPortable, Variant::kAvx2, Variant::kAvx512Vnni, Variant::kNeon,
                      Variant::kNeonDot, Variant::kNeonI8mm}) {
      if (std::strcmp(argv[1], edgemtp::q4_0::variant_name(v)) == 0) variant = v, known = true;
    }
    if (!known) {
      std::fprintf(stderr, "unknown variant %s\n", argv[1]);
      return 2;
    }
    if (!edgemtp::q4_0::supported(variant)) {
      std::printf("unsupported %s\n", argv[1]);
      return 3;
    }
  }
  std::FILE* in = std::fopen(argv[2], "rb");
  int64_t shape[3];
  if (!in || !read(in, shape, 3)) return 1;
  const int64_t rows = shape[0], n_in = shape[1], n_out = shape[2];
  std::vector<float> x(rows * n_in), y(rows * n_out);
  std::vector<uint8_t> codes(n_out * n_in / 2);
  std::vector<uint16_t> scales(n_out * n_in / 32);
  if (!read(in, x.data(), x.size()) || !read(in, codes.data(), codes.size()) ||
      !read(in, scales.data(), scales.size())) {
    return 1;
  }
  std::fclose(in);
  auto serial = [](int64_t n, const auto& fn) { fn(int64_t{0}, n); };
  edgemtp::q4_0::linear(x.data(), rows, n_in, codes.data(), scales.data(), n_out, y.data(),
                        variant, serial);
  std::FILE* out = std::fopen(argv[3], "wb");
  if (!out || std::fwrite(y.data(), sizeof(float), y.size(), out) != y.size()) return 1;
  std::fclose(out);
  std::printf("%s\n", edgemtp::q4_0::variant_name(variant));
  return 0;
}

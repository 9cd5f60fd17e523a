// runtime/kernels/cache_attention.h alone, as a program, so the tests can run the attention's
// arithmetic for any target, aarch64 under qemu, without ExecuTorch.
//
//   attention_check IN OUT
//   IN:  int64 kv_heads, q_rows, dim, rows, keys, fresh, slots, storage, by_rows;
//        float32 q [kv_heads, q_rows, dim]; the cache k and v [kv_heads, slots, dim] (storage
//        0: float32, 1: float16 bits, 2: int8 rows [kv_heads, slots, dim + 4], codes then the
//        float32 scale); float32 k_new and v_new [kv_heads, fresh, dim];
//        float32 mask [rows, keys]
//   OUT: float32 out (q's shape, or [rows, kv_heads * q_rows / rows * dim] when by_rows)
#include <cstdio>
#include <vector>

#include "cache_attention.h"

// parallel.h's thread pool, run on the calling thread (a null pool does that in ExecuTorch).
extern "C" void pthreadpool_parallelize_1d_tile_1d(pthreadpool_t, pthreadpool_task_1d_tile_1d_t fn,
                                                   void* context, size_t range, size_t tile,
                                                   uint32_t) {
  for (size_t start = 0; start < range; start += tile) {
    fn(context, start, range - start < tile ? range - start : tile);
  }
}
pthreadpool_t executorch::extension::threadpool::get_pthreadpool() { return nullptr; }

template <typename T>
static bool read(std::FILE* f, std::vector<T>& data) {
  return std::fread(data.data(), sizeof(T), data.size(), f) == data.size();
}

template <typename T>
static bool run(std::FILE* in, const int64_t* s, std::vector<float>& out) {
  const int64_t kv_heads = s[0], q_rows = s[1], dim = s[2], rows = s[3], keys = s[4];
  const int64_t fresh = s[5], slots = s[6];
  std::vector<float> q(kv_heads * q_rows * dim), k_new(kv_heads * fresh * dim);
  std::vector<float> v_new(k_new.size()), mask(rows * keys);
  std::vector<T> k(kv_heads * slots * edgemtp::attention::row_width<T>(dim)), v(k.size());
  if (!read(in, q) || !read(in, k) || !read(in, v) || !read(in, k_new) || !read(in, v_new) ||
      !read(in, mask)) {
    return false;
  }
  out.resize(q.size());
  edgemtp::attention::cache_attention(q.data(), k.data(), v.data(),
                                      fresh ? k_new.data() : nullptr,
                                      fresh ? v_new.data() : nullptr, mask.data(), kv_heads,
                                      q_rows, dim, rows, keys, fresh, slots, out.data(), s[8] != 0);
  return true;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
    return 2;
  }
  std::FILE* in = std::fopen(argv[1], "rb");
  int64_t shape[9];
  if (!in || std::fread(shape, sizeof(int64_t), 9, in) != 9) return 1;
  std::vector<float> out;
  const bool ok = shape[7] == 2   ? run<int8_t>(in, shape, out)
                 : shape[7] == 1 ? run<edgemtp::attention::Float16>(in, shape, out)
                                 : run<float>(in, shape, out);
  std::fclose(in);
  if (!ok) return 1;
  std::FILE* f = std::fopen(argv[2], "wb");
  if (!f || std::fwrite(out.data(), sizeof(float), out.size(), f) != out.size()) return 1;
  std::fclose(f);
  return 0;
}

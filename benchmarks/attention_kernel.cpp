// edgemtp's cache attention alone (runtime/kernels/cache_attention.h), one thread, per key.
// Built and run by attention_kernel.py, once per source tree it compares.
//
//   attention_kernel CALLS DTYPE:DIM:KEYS:EVICT ...   (DTYPE f16 or i8; EVICT 1: the cache
//   is pushed out of the CPU caches before each call by reading 64 MiB, as a decode step's
//   weights push it out between two layers)
//
// Per case, one line: DTYPE DIM KEYS EVICT median-ns-per-key. One decode row of 4 query heads
// over one KV head (PEER-90M's layers: 4 x 128 sliding, 4 x 256 full), every key attended.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cache_attention.h"

// ExecuTorch's pool is not linked here: the range runs on the calling thread.
extern "C" void pthreadpool_parallelize_1d_tile_1d(pthreadpool_t, pthreadpool_task_1d_tile_1d_t fn,
                                                   void* context, size_t range, size_t tile,
                                                   uint32_t) {
  for (size_t start = 0; start < range; start += tile) {
    fn(context, start, std::min(tile, range - start));
  }
}
pthreadpool_t executorch::extension::threadpool::get_pthreadpool() { return nullptr; }

namespace {

using namespace edgemtp::attention;
volatile unsigned char sink;

template <typename T>
double ns_per_key(int64_t dim, int64_t keys, bool evict, int calls) {
  const int64_t rows = 4, width = row_width<T>(dim);
  std::mt19937 gen(0);
  std::normal_distribution<float> normal;
  std::vector<float> q(rows * dim), mask(keys, 0.0f), out(rows * dim), x(dim);
  for (float& e : q) e = 0.1f * normal(gen);
  std::vector<T> k(keys * width), v(keys * width);
  for (std::vector<T>* cache : {&k, &v}) {
    for (int64_t s = 0; s < keys; ++s) {
      for (float& e : x) e = normal(gen);
      T* row = cache->data() + s * width;
      if constexpr (std::is_same_v<T, int8_t>) {
        quantize_row(x.data(), dim, row);
      } else {
        for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<T>(x[d]);
      }
    }
  }
  std::vector<unsigned char> other(64 << 20, 1);
  std::vector<double> seconds;
  for (int call = 0; call < calls; ++call) {
    if (evict) {
      unsigned char sum = 0;
      for (size_t i = 0; i < other.size(); i += 64) sum += other[i];
      sink = sum;
    }
    const auto start = std::chrono::steady_clock::now();
    cache_attention<T>(q.data(), k.data(), v.data(), nullptr, nullptr, mask.data(), 1, rows, dim,
                       1, keys, 0, keys, out.data(), false);
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(seconds.begin(), seconds.begin() + calls / 2, seconds.end());
  return seconds[calls / 2] / keys * 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const int calls = std::atoi(argv[1]);
  for (int i = 2; i < argc; ++i) {
    char dtype[8];
    int dim, keys, evict;
    if (std::sscanf(argv[i], "%7[^:]:%d:%d:%d", dtype, &dim, &keys, &evict) != 4) return 2;
    const bool int8 = std::string(dtype) == "i8";
    const double ns = int8 ? ns_per_key<int8_t>(dim, keys, evict, calls)
                           : ns_per_key<Float16>(dim, keys, evict, calls);
    std::printf("%s %d %d %d %.2f\n", dtype, dim, keys, evict, ns);
  }
  return 0;
}

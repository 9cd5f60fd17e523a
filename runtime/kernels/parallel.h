// Work split into tiles that the threads of ExecuTorch's threadpool (the pool XNNPACK runs on)
// take one at a time.
//
// ExecuTorch's parallel_for cuts a range into one task per thread. Its pool's workers spin only
// a few microseconds after a job before sleeping, so inside a decode step, where a delegate
// call or a portable operator usually runs between two kernels, the worker is asleep when a
// kernel starts: waking it is slow next to such small kernels (benchmarks/README.md), and
// with one task per thread the calling thread finishes its half and then waits for the worker's
// whole half. Here every tile is claimed as it is started, so the calling thread keeps taking
// tiles while the worker wakes, and the worker takes what is left when it arrives.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {
// pthreadpool's C API (the library in ExecuTorch's threadpool extension); declared here because
// the executorch wheel ships no pthreadpool.h. A null pool runs the range on the calling thread.
typedef struct pthreadpool* pthreadpool_t;
typedef void (*pthreadpool_task_1d_tile_1d_t)(void*, size_t, size_t);
void pthreadpool_parallelize_1d_tile_1d(pthreadpool_t threadpool,
                                        pthreadpool_task_1d_tile_1d_t function, void* context,
                                        size_t range, size_t tile, uint32_t flags);
}

namespace executorch::extension::threadpool {
pthreadpool_t get_pthreadpool();  // extension/threadpool/threadpool.h
}

namespace edgemtp {

// fn(begin, end) over [0, range) in tiles of `tile`; a range of one tile runs on the calling
// thread without touching the pool.
template <typename Fn>
void parallel_tiles(int64_t range, int64_t tile, const Fn& fn) {
  if (range <= 0) return;
  if (range <= tile) {
    fn(int64_t{0}, range);
    return;
  }
  auto run = [](void* context, size_t start, size_t count) {
    (*static_cast<const Fn*>(context))(static_cast<int64_t>(start),
                                       static_cast<int64_t>(start + count));
  };
  pthreadpool_parallelize_1d_tile_1d(executorch::extension::threadpool::get_pthreadpool(), run,
                                     const_cast<Fn*>(&fn), static_cast<size_t>(range),
                                     static_cast<size_t>(tile), 0);
}

}  // namespace edgemtp

// How the 2:4 CPU GEMM's row groups are shared between threads: claimed in small chunks from one
// counter as each thread finishes its last, so that a thread whose core is busy with another
// process takes fewer chunks instead of holding every call (a static half each ran 2 threads at
// 0.4x of 1 thread with one of two cores busy).
//
// The end of a call waits for the last chunk, which a descheduled thread may hold. A thread with
// nothing left to claim spins for about two of its own chunks' time, 20 to 200 us (both threads
// finish within a chunk of each other on quiet cores), then sleeps on a futex until the last chunk
// is done: its core falls idle, and Linux's idle balancing can move the straggler onto it, where
// OpenMP's spinning barrier would hold that core.
#pragma once
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <thread>
#include <vector>

#include <ATen/Parallel.h>

#include "sparse24_args.h"

namespace {

// test hook (nmsparse::cpu24_split_probe): one thread sleeps before each chunk it claims, and each
// thread's chunk count is recorded; null on every real call
struct SplitProbe {
  int64_t slow_thread = -1;
  int64_t slow_us = 0;
  std::vector<int64_t> chunks;  // per OpenMP thread number
};

// a thread takes at least this many groups (small layers stay on one thread)
constexpr int64_t kMinGroupsPerThread = 8;
// chunks per thread on an even split: an uneven end costs at most one chunk's time
constexpr int64_t kChunksPerThread = 32;
// how long a thread with nothing left spins before it sleeps (two of its chunks, within these)
constexpr std::chrono::microseconds kMinSpin{20}, kMaxSpin{200};

inline void futex_wait(std::atomic<int>* word, int expected) {
  syscall(SYS_futex, reinterpret_cast<int*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

inline void futex_wake_all(std::atomic<int>* word) {
  syscall(SYS_futex, reinterpret_cast<int*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// row groups [0, groups) through rows(a, r0, r1) on at::get_num_threads() threads at most
inline void nm24_split(Nm24Rows rows, const Nm24Args& a, int64_t groups, SplitProbe* probe = nullptr) {
  static_assert(sizeof(std::atomic<int>) == sizeof(int), "the futex word is the atomic's int");
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t workers = std::max<int64_t>(1, std::min(threads, groups / kMinGroupsPerThread));
  if (probe) probe->chunks.assign(workers, 0);
  if (workers == 1) {
    rows(a, 0, groups * NM24_GROUP);
    if (probe) probe->chunks[0] = groups > 0;
    return;
  }
  const int64_t per_chunk = std::max<int64_t>(1, groups / (workers * kChunksPerThread));
  const int chunks = static_cast<int>((groups + per_chunk - 1) / per_chunk);
  std::atomic<int> next{0}, done{0}, sleepers{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    using Clock = std::chrono::steady_clock;
    const int64_t me = at::get_thread_num();
    Clock::duration longest{0};
    for (int c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      if (probe && me == probe->slow_thread) std::this_thread::sleep_for(std::chrono::microseconds(probe->slow_us));
      const Clock::time_point start = Clock::now();
      const int64_t g0 = c * per_chunk, g1 = std::min(groups, g0 + per_chunk);
      rows(a, g0 * NM24_GROUP, g1 * NM24_GROUP);
      longest = std::max(longest, Clock::now() - start);
      if (probe && me < static_cast<int64_t>(probe->chunks.size())) ++probe->chunks[me];
      if (done.fetch_add(1) + 1 == chunks && sleepers.load() > 0) futex_wake_all(&done);
    }
    const Clock::duration spin = std::min<Clock::duration>(std::max<Clock::duration>(2 * longest, kMinSpin), kMaxSpin);
    const Clock::time_point until = Clock::now() + spin;
    while (done.load(std::memory_order_acquire) < chunks && Clock::now() < until) _mm_pause();
    sleepers.fetch_add(1);
    for (int seen = done.load(); seen < chunks; seen = done.load()) futex_wait(&done, seen);
    sleepers.fetch_sub(1);
  });
}

}  // namespace

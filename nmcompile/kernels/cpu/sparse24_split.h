// How the 2:4 CPU GEMM's row groups are shared between threads: claimed in small chunks from one
// counter as each thread finishes its last, so that a thread whose core is busy with another
// process takes fewer chunks instead of holding every call (a static half each ran 2 threads at
// 0.4x of 1 thread with one of two cores busy).
//
// The threads are the caller and helper tasks on PyTorch's inter-op pool (at::launch), not an
// OpenMP team: an OpenMP region ends only when every thread of its team has arrived, so a thread
// waiting for a busy core held every call even with nothing left to do, and a team's idle threads
// spin for milliseconds after each region, keeping the other core busy (measured with a busy loop
// pinned to one of two cores: 4 fp32 [4096, 4096] layers at one token took 48-58 ms with either
// split on OpenMP, 24 ms on the caller plus a pool task, 33 ms on one thread; indicative, on a
// shared machine). The call returns when every chunk is done: a helper that starts late finds no
// chunk left and touches nothing else (the job it reads is shared, not the caller's). Waiting for a
// chunk a helper holds, the caller spins for about one chunk's time (20 to 200 us), then sleeps on
// a futex: its core falls idle, and Linux's idle balancing can move a helper that waits for the
// busy core onto it.
#pragma once
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <memory>
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
  std::vector<int64_t> chunks;  // per thread: 0 the caller, 1.. the helpers
};

// a thread takes at least this many groups (small layers stay on one thread)
constexpr int64_t kMinGroupsPerThread = 8;
// chunks per thread on an even split: an uneven end costs at most one chunk's time
constexpr int64_t kChunksPerThread = 32;
// how long the caller spins for the helpers' last chunks before it sleeps (one chunk's time, within these)
constexpr std::chrono::microseconds kMinSpin{20}, kMaxSpin{200};

inline void futex_wait(std::atomic<int>* word, int expected) {
  syscall(SYS_futex, reinterpret_cast<int*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

inline void futex_wake_all(std::atomic<int>* word) {
  syscall(SYS_futex, reinterpret_cast<int*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// one call's chunks, shared with the helper tasks (which may start after the call has returned:
// then they find no chunk left and touch nothing else)
struct SplitJob {
  Nm24Rows rows;
  Nm24Args a;
  int64_t groups, per_chunk;
  int chunks;
  SplitProbe* probe;
  std::atomic<int> next{0}, done{0}, sleepers{0};
};

// claims and computes chunks until none is left; `me`: 0 the caller, 1.. the helpers
inline void nm24_work(SplitJob& job, int64_t me) {
  for (int c = job.next.fetch_add(1); c < job.chunks; c = job.next.fetch_add(1)) {
    if (job.probe && me == job.probe->slow_thread)
      std::this_thread::sleep_for(std::chrono::microseconds(job.probe->slow_us));
    const int64_t g0 = c * job.per_chunk, g1 = std::min(job.groups, g0 + job.per_chunk);
    job.rows(job.a, g0 * NM24_GROUP, g1 * NM24_GROUP);
    if (job.probe) ++job.probe->chunks[me];
    if (job.done.fetch_add(1) + 1 == job.chunks && job.sleepers.load() > 0) futex_wake_all(&job.done);
  }
}

// whether helper tasks can run in this process: not in a child forked after this library first
// launched them (the inter-op pool's threads are not copied by fork, and its queue would only grow)
inline std::atomic<pid_t>& first_launcher() {
  static std::atomic<pid_t> pid{0};
  return pid;
}

inline bool helpers_alive() {
  const pid_t first = first_launcher().load(std::memory_order_relaxed);
  return first == 0 || first == getpid();
}

// row groups [0, groups) through rows(a, r0, r1) on at::get_num_threads() threads at most: the
// caller and helper tasks on PyTorch's inter-op pool, whose threads sleep when idle
inline void nm24_split(Nm24Rows rows, const Nm24Args& a, int64_t groups, SplitProbe* probe = nullptr) {
  static_assert(sizeof(std::atomic<int>) == sizeof(int), "the futex word is the atomic's int");
  const int64_t threads = at::in_parallel_region() || !helpers_alive() ? 1 : at::get_num_threads();
  const int64_t workers = std::max<int64_t>(1, std::min(threads, groups / kMinGroupsPerThread));
  if (probe) probe->chunks.assign(workers, 0);
  if (workers == 1) {
    rows(a, 0, groups * NM24_GROUP);
    if (probe) probe->chunks[0] = groups > 0;
    return;
  }
  auto job = std::make_shared<SplitJob>();
  job->rows = rows;
  job->a = a;
  job->groups = groups;
  job->per_chunk = std::max<int64_t>(1, groups / (workers * kChunksPerThread));
  job->chunks = static_cast<int>((groups + job->per_chunk - 1) / job->per_chunk);
  job->probe = probe;
  pid_t none = 0;
  first_launcher().compare_exchange_strong(none, getpid(), std::memory_order_relaxed);
  for (int64_t helper = 1; helper < workers; ++helper) at::launch([job, helper] { nm24_work(*job, helper); });
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  nm24_work(*job, 0);
  // the chunks the helpers hold: spin for a share of this call's time, then sleep (this core falls
  // idle, and Linux can move a helper waiting for a busy core onto it)
  const Clock::duration spin = std::min<Clock::duration>(
      std::max<Clock::duration>((Clock::now() - start) / (2 * kChunksPerThread), kMinSpin), kMaxSpin);
  const Clock::time_point until = Clock::now() + spin;
  while (job->done.load(std::memory_order_acquire) < job->chunks && Clock::now() < until) _mm_pause();
  job->sleepers.fetch_add(1);
  for (int seen = job->done.load(); seen < job->chunks; seen = job->done.load()) futex_wait(&job->done, seen);
  job->sleepers.fetch_sub(1);
}

}  // namespace

// How the 2:4 CPU GEMM's row groups are shared between threads: claimed in small chunks from one
// counter as each thread finishes its last, so that a thread whose core is busy with another
// process takes fewer chunks instead of holding every call (a static half each ran 2 threads at
// 0.4x of 1 thread with one of two cores busy).
//
// Which threads: PyTorch's OpenMP team, as long as it keeps up. Its idle threads spin between
// regions, so a team that just ran (the kernel's previous call, a dense op) starts at once: in a
// model that mixes the kernel with dense ops, the OpenMP team ran 4 kernel layers and 4 dense GEMVs
// in 4.6-5.1 ms where the caller plus inter-op pool tasks took 7.5-11.7 ms (their thread fights the
// team's spinning one). But an OpenMP region ends only when every thread has arrived, and with one
// core busy the caller waited for a thread that was not scheduled, every call. So a call whose
// caller waited kLateWait or more for its team sends the next kPoolCalls calls to the caller plus
// tasks on PyTorch's inter-op pool (at::launch), whose threads sleep when idle and which returns
// when every chunk is done, whether a helper has started or not (a helper that starts late finds no
// chunk left and touches nothing else); then the team is tried again. With a busy loop pinned to
// one of two cores, 4 fp32 [4096, 4096] layers at one token took 0.46-0.99x of their 1-thread time
// on 2 threads this way, 1.4-2.5x with either split on OpenMP alone (indicative: a machine shared
// with other jobs).
//
// Waiting for the others (a chunk they hold, or, on OpenMP, their arrival), a thread spins for about
// one chunk's time (20 to 200 us), then sleeps on a futex: its core falls idle, and Linux's idle
// balancing can move a thread that waits for the busy core onto it.
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

#include "cpu24_args.h"

namespace {

// test hook (nmsparse::cpu24_split_probe): one thread sleeps before each chunk it claims, and each
// thread's chunk count is recorded; null on every real call
struct SplitProbe {
  int64_t slow_thread = -1;
  int64_t slow_us = 0;
  int64_t route = -1;           // in: -1 as a real call decides, 1 OpenMP, 2 the pool; out: 0 one thread, 1, 2
  std::vector<int64_t> chunks;  // per thread: 0 the caller, 1.. the others
  int64_t pool_calls_left = 0;  // out: the calls left that take the pool, after this one
};

// a thread takes at least this many groups (small layers stay on one thread)
constexpr int64_t kMinGroupsPerThread = 8;
// chunks per thread on an even split: an uneven end costs at most one chunk's time
constexpr int64_t kChunksPerThread = 32;
// how long a thread with nothing left spins before it sleeps (one chunk's time, within these)
constexpr std::chrono::microseconds kMinSpin{20}, kMaxSpin{200};
// an OpenMP call whose caller waited this long for its team (on quiet cores, at most about a chunk)
// sends the next kPoolCalls calls to the pool
constexpr std::chrono::microseconds kLateWait{500};
constexpr int kPoolCalls = 128;

inline void futex_wait(std::atomic<int>* word, int expected) {
  syscall(SYS_futex, reinterpret_cast<int*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

inline void futex_wake_all(std::atomic<int>* word) {
  syscall(SYS_futex, reinterpret_cast<int*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

using SplitClock = std::chrono::steady_clock;

// waits until *count reaches target: spins for `spin`, then sleeps on the futex (the core falls
// idle, and Linux can move a thread that waits for a busy core onto it)
inline void wait_for(std::atomic<int>& count, int target, std::atomic<int>& sleepers, SplitClock::duration spin) {
  const SplitClock::time_point until = SplitClock::now() + spin;
  while (count.load(std::memory_order_acquire) < target && SplitClock::now() < until) _mm_pause();
  sleepers.fetch_add(1);
  for (int seen = count.load(); seen < target; seen = count.load()) futex_wait(&count, seen);
  sleepers.fetch_sub(1);
}

// about one chunk's time of a call that has run for `elapsed`, within kMinSpin and kMaxSpin
inline SplitClock::duration chunk_spin(SplitClock::duration elapsed) {
  return std::min<SplitClock::duration>(std::max<SplitClock::duration>(elapsed / (2 * kChunksPerThread), kMinSpin),
                                        kMaxSpin);
}

// one call's chunks; on the pool it is shared with the helper tasks, which may start after the
// call has returned: then they find no chunk left and touch nothing else
struct SplitJob {
  Nm24Rows rows;
  Nm24Args a;
  int64_t groups, per_chunk;
  int chunks;
  SplitProbe* probe;
  std::atomic<int> next{0}, done{0}, sleepers{0};
};

// claims and computes chunks until none is left; `me`: 0 the caller, 1.. the others
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

// whether pool tasks can run in this process: not in a child forked after this library first
// launched them (the inter-op pool's threads are not copied by fork, and its queue would only grow)
inline std::atomic<pid_t>& first_launcher() {
  static std::atomic<pid_t> pid{0};
  return pid;
}

inline bool pool_alive() {
  const pid_t first = first_launcher().load(std::memory_order_relaxed);
  return first == 0 || first == getpid();
}

// the calls left that take the pool after an OpenMP call waited kLateWait or more for its team
inline std::atomic<int>& pool_calls_left() {
  static std::atomic<int> left{0};
  return left;
}

// the OpenMP team: fast when its threads are on their cores (they spin between regions), but a
// region ends only when every thread has arrived. Returns how long the caller waited for the others
// after its last chunk.
inline SplitClock::duration split_openmp(SplitJob& job, int64_t workers) {
  const int team = static_cast<int>(workers);
  std::atomic<int> arrived{0}, sleepers{0};
  SplitClock::duration waited{0};
  const SplitClock::time_point start = SplitClock::now();
  at::parallel_for(0, workers, 1, [&](int64_t t0, int64_t t1) {
    const int64_t me = at::get_thread_num();
    nm24_work(job, me);
    const int ids = static_cast<int>(t1 - t0);
    if (arrived.fetch_add(ids) + ids == team) {
      if (sleepers.load() > 0) futex_wake_all(&arrived);
    } else {
      const SplitClock::time_point idle = SplitClock::now();
      wait_for(arrived, team, sleepers, chunk_spin(idle - start));
      if (me == 0) waited = SplitClock::now() - idle;
    }
  });
  return waited;
}

// the caller and tasks on PyTorch's inter-op pool (whose threads sleep when idle): the call returns
// when every chunk is done, whether or not a helper has started
inline void split_pool(const std::shared_ptr<SplitJob>& job, int64_t workers) {
  pid_t none = 0;
  first_launcher().compare_exchange_strong(none, getpid(), std::memory_order_relaxed);
  for (int64_t helper = 1; helper < workers; ++helper) at::launch([job, helper] { nm24_work(*job, helper); });
  const SplitClock::time_point start = SplitClock::now();
  nm24_work(*job, 0);
  wait_for(job->done, job->chunks, job->sleepers, chunk_spin(SplitClock::now() - start));
}

// row groups [0, groups) through rows(a, r0, r1) on at::get_num_threads() threads at most
inline void nm24_split(Nm24Rows rows, const Nm24Args& a, int64_t groups, SplitProbe* probe = nullptr) {
  static_assert(sizeof(std::atomic<int>) == sizeof(int), "the futex word is the atomic's int");
  // a child forked after the pool ran computes alone: its pool is gone, and GNU OpenMP hangs in a
  // child whose parent had a team (as every multi-threaded op there would)
  const int64_t threads = at::in_parallel_region() || !pool_alive() ? 1 : at::get_num_threads();
  const int64_t workers = std::max<int64_t>(1, std::min(threads, groups / kMinGroupsPerThread));
  if (probe) probe->chunks.assign(workers, 0);
  if (workers == 1) {
    rows(a, 0, groups * NM24_GROUP);
    if (probe) probe->chunks[0] = groups > 0, probe->route = 0, probe->pool_calls_left = pool_calls_left().load();
    return;
  }
  auto job = std::make_shared<SplitJob>();
  job->rows = rows;
  job->a = a;
  job->groups = groups;
  job->per_chunk = std::max<int64_t>(1, groups / (workers * kChunksPerThread));
  job->chunks = static_cast<int>((groups + job->per_chunk - 1) / job->per_chunk);
  job->probe = probe;
  std::atomic<int>& left = pool_calls_left();
  const bool pool = probe && probe->route >= 0 ? probe->route == 2 : left.load(std::memory_order_relaxed) > 0;
  if (probe) probe->route = pool ? 2 : 1;
  if (pool) {
    left.fetch_sub(1, std::memory_order_relaxed);  // at 0, the next call tries the OpenMP team again
    split_pool(job, workers);
  } else if (split_openmp(*job, workers) >= kLateWait) {
    left.store(kPoolCalls, std::memory_order_relaxed);
  }
  if (probe) probe->pool_calls_left = left.load(std::memory_order_relaxed);
}

}  // namespace

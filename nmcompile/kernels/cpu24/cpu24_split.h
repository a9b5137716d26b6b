// How the 2:4 CPU GEMM's row groups are shared between threads. Each thread owns a contiguous run of
// chunks (an even share) and computes it from its start, as a static split would: its value and bit
// streams stay contiguous and the prefetches ahead land in its own rows. A thread that finishes its
// run takes chunks from the end of another's, so a thread whose core is busy with another process
// computes fewer chunks instead of holding every call (a static half each ran 2 threads at 0.4x of 1
// thread with one of two cores busy). One shared counter of small chunks did that too, but on quiet
// cores it cost the GPT-2-shaped decode 7-25% (8 layers of width 1024, fp32, 2 threads, Zen 3): a
// chunk there is one or two row groups of 32 KB, so each thread's streams broke at every chunk and
// the 32 KB prefetch ahead fetched rows the other thread computed (benchmarks/cpu/ab_decode.py).
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
// balancing can move a thread that waits for the busy core onto it. Measured in the GPT-2-shaped
// decode above (per kernel call, as a fraction of the dense output head's GEMV in the same profile,
// to take out the machine's drift): one shared counter 1.19; own runs 0.90 (0.87-0.90 with a spin of
// up to 1 ms, which cost the busy-core case: 4 [4096, 4096] layers, 2 threads 1.02-1.20x of 1
// thread's time against 0.82x, benchmarks/cpu/cpu_shared_cores.py); a static split 0.89-1.05; the
// kernel before the dynamic split 0.86-0.95.
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
// chunks per thread's run: a thread that takes from another's run waits at most one chunk's time
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

// one thread's run of chunks [lo, hi) in one word: its owner takes lo, the others take hi - 1
struct alignas(64) ChunkRun {
  std::atomic<uint64_t> span{0};
  static uint64_t of(uint32_t lo, uint32_t hi) { return static_cast<uint64_t>(hi) << 32 | lo; }
  // the next chunk from the start (owner) or the end (another thread), or -1 when the run is empty
  int take(bool from_start) {
    uint64_t s = span.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t lo = static_cast<uint32_t>(s), hi = static_cast<uint32_t>(s >> 32);
      if (lo >= hi) return -1;
      const uint64_t next = from_start ? of(lo + 1, hi) : of(lo, hi - 1);
      if (span.compare_exchange_weak(s, next, std::memory_order_acq_rel, std::memory_order_relaxed))
        return static_cast<int>(from_start ? lo : hi - 1);
    }
  }
};

// one call's chunks; on the pool it is shared with the helper tasks, which may start after the
// call has returned: then they find no chunk left and touch nothing else
struct SplitJob {
  Nm24Rows rows;
  Nm24Args a;
  int64_t groups, per_chunk;
  int chunks;
  int64_t workers;
  SplitProbe* probe;
  std::unique_ptr<ChunkRun[]> runs;  // one per worker: an even share of the chunks, in order
  std::atomic<int> done{0}, sleepers{0};

  void share(int64_t n_workers) {
    workers = n_workers;
    runs.reset(new ChunkRun[n_workers]);
    for (int64_t w = 0; w < n_workers; ++w)
      runs[w].span.store(ChunkRun::of(static_cast<uint32_t>(chunks * w / n_workers),
                                      static_cast<uint32_t>(chunks * (w + 1) / n_workers)),
                         std::memory_order_relaxed);
  }
};

inline void nm24_chunk(SplitJob& job, int64_t me, int c) {
  if (job.probe && me == job.probe->slow_thread)
    std::this_thread::sleep_for(std::chrono::microseconds(job.probe->slow_us));
  const int64_t g0 = c * job.per_chunk, g1 = std::min(job.groups, g0 + job.per_chunk);
  job.rows(job.a, g0 * NM24_GROUP, g1 * NM24_GROUP);
  if (job.probe) ++job.probe->chunks[me];
  if (job.done.fetch_add(1) + 1 == job.chunks && job.sleepers.load() > 0) futex_wake_all(&job.done);
}

// computes its own run from the start, then takes chunks from the end of the others' runs until
// none is left; `me`: 0 the caller, 1.. the others
inline void nm24_work(SplitJob& job, int64_t me) {
  for (int c = job.runs[me].take(true); c >= 0; c = job.runs[me].take(true)) nm24_chunk(job, me, c);
  for (int64_t i = 1; i < job.workers; ++i) {
    ChunkRun& other = job.runs[(me + i) % job.workers];
    for (int c = other.take(false); c >= 0; c = other.take(false)) nm24_chunk(job, me, c);
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
    const int64_t me = t0;  // one id a thread while the team has `workers` threads
    for (int64_t id = t0; id < t1; ++id) nm24_work(job, id);
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
  job->share(workers);
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

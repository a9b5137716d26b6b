// Cost of one 16-position word of one row in the AVX2 2:4 kernel at one token, the kernel called
// directly (no PyTorch op around it), so that a change to its inner step can be compared build
// against build with the weight in L2 (compute) and in memory (streaming).
//
//   K=nmcompile/kernels/cpu
//   g++ -O3 -std=c++17 -I$K -c $K/sparse24_avx2.cpp -o /tmp/k.o   # or another version of the file
//   g++ -O3 -mavx2 -std=c++17 -I$K benchmarks/cpu/cpu24_word_cost.cpp /tmp/k.o -o /tmp/word_cost
//   /tmp/word_cost DTYPE N K LAYERS ITERS [THREADS]   # DTYPE 0 fp32, 1 bf16
//   e.g. 1 256 1024 1 4000 (in L2) and 1 4096 4096 8 12 (from memory)
//
// Prints the 10th-percentile time of ITERS passes over LAYERS random [N, K] 2:4 weights, as GB/s of
// the layout's bytes and ns per word-row, and the largest error of the first layer against a double
// reference. Alternate the builds over several rounds: a VM's rounds differ by more than a step
// change does. THREADS 2 splits the rows in two static halves (the op's chunked split is not here).
//
// Environment, for the streaming questions (each off unless set):
//   PROBE=1  time a plain AVX2 read of the same arrays (values and bits, split as the kernel splits
//            them) in place of the kernel: what the memory gives this access pattern's bytes
//   HUGE=1   the arrays on 2 MB pages (madvise MADV_HUGEPAGE before they are first written)
//   PF=BYTES the kernel's prefetch distance (the op's is 32768 on AMD, cpu24_op.cpp)
#include <sys/mman.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "cpu24_args.h"

// 2 MB-aligned arrays, on huge pages when HUGE is set (the kernel reads them; nothing else differs)
template <class T>
struct PageAlloc {
  using value_type = T;
  PageAlloc() = default;
  template <class U>
  PageAlloc(const PageAlloc<U>&) {}
  T* allocate(size_t n) {
    constexpr size_t kPage = size_t{2} << 20;
    const size_t bytes = (n * sizeof(T) + kPage - 1) / kPage * kPage;
    void* p = std::aligned_alloc(kPage, bytes);
    if (!p) throw std::bad_alloc();
    if (std::getenv("HUGE")) madvise(p, bytes, MADV_HUGEPAGE);
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <class U>
  bool operator==(const PageAlloc<U>&) const { return true; }
  template <class U>
  bool operator!=(const PageAlloc<U>&) const { return false; }
};
template <class T>
using Array = std::vector<T, PageAlloc<T>>;

// a plain read of `bytes` at p (four independent sums, so that the loads are not serialized)
static float read_all(const void* p, size_t bytes) {
  const float* f = static_cast<const float*>(p);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 32 <= bytes / 4; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_load_ps(f + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(f + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(f + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(f + i + 24));
  }
  float o[8];
  _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  return o[0];
}

static uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s DTYPE(0 fp32, 1 bf16) N K LAYERS ITERS [THREADS]\n", argv[0]);
    return 2;
  }
  const int dtype = std::atoi(argv[1]);
  const int64_t n = std::atol(argv[2]), k = std::atol(argv[3]);
  const int layers = std::atoi(argv[4]), iters = std::atoi(argv[5]), threads = argc > 6 ? std::atoi(argv[6]) : 1;
  if (n % NM24_GROUP || k % 32 || layers < 1 || iters < 1) {
    std::fprintf(stderr, "N must be a multiple of %d, K of 32\n", NM24_GROUP);
    return 2;
  }
  const int64_t words = k / 16;
  const uint16_t pairs[6] = {0x3, 0x5, 0x9, 0x6, 0xA, 0xC};  // the 2-of-4 position patterns
  std::mt19937 rng(0);
  auto uniform = [&] { return static_cast<float>(rng() % 1000) / 1000.f - 0.5f; };
  std::vector<Array<uint16_t>> bits(layers), v16(layers);
  std::vector<Array<float>> v32(layers);
  for (int l = 0; l < layers; ++l) {
    bits[l].resize(n * words);
    for (auto& b : bits[l]) {
      b = 0;
      for (int g = 0; g < 4; ++g) b |= pairs[rng() % 6] << (4 * g);
    }
    if (dtype == 0) {
      v32[l].resize(n * words * 8);
      for (auto& v : v32[l]) v = uniform();
    } else {
      v16[l].resize(n * words * 8);
      for (auto& v : v16[l]) v = to_bf16(uniform());
    }
  }
  std::vector<float> x(k), out(n);
  for (auto& v : x) v = uniform();
  const bool probe = std::getenv("PROBE") != nullptr;
  const int64_t prefetch = std::getenv("PF") ? std::atol(std::getenv("PF")) : 32768;
  volatile float sink = 0;
  auto read_layer = [&](int l) {  // the same bytes as the kernel reads, halves as the threads take them
    const void* vp = dtype == 0 ? static_cast<const void*>(v32[l].data()) : static_cast<const void*>(v16[l].data());
    const size_t vb = dtype == 0 ? v32[l].size() * 4 : v16[l].size() * 2, bb = bits[l].size() * 2;
    const char* vc = static_cast<const char*>(vp);
    const char* bc = reinterpret_cast<const char*>(bits[l].data());
    if (threads == 1) return void(sink = sink + read_all(vc, vb) + read_all(bc, bb));
    float other_sum = 0;
    std::thread other([&] { other_sum = read_all(vc + vb / 2, vb / 2) + read_all(bc + bb / 2, bb / 2); });
    const float mine = read_all(vc, vb / 2) + read_all(bc, bb / 2);
    other.join();
    sink = sink + mine + other_sum;
  };
  auto run = [&](int l) {
    Nm24Args a{};
    a.x = x.data(), a.tokens = 1, a.k = k, a.kp = k;
    a.values = dtype == 0 ? static_cast<const void*>(v32[l].data()) : static_cast<const void*>(v16[l].data());
    a.wdtype = dtype, a.bits = bits[l].data(), a.out = out.data(), a.n = n;
    a.panel_bytes = 2 << 20, a.prefetch_bytes = prefetch;  // the op's panel on the Zen 3 VM
    if (threads == 1) return nm24_rows_avx2(a, 0, n);
    const int64_t half = n / 2 / NM24_GROUP * NM24_GROUP;
    std::thread other([&] { nm24_rows_avx2(a, half, n); });
    nm24_rows_avx2(a, 0, half);
    other.join();
  };
  run(0);
  double worst = 0;  // layout: cpu24_args.h
  for (int64_t r = 0; r < n; ++r) {
    const int64_t group = r / NM24_GROUP, within = r % NM24_GROUP;
    double sum = 0;
    for (int64_t w = 0; w < words; ++w) {
      const int64_t at = (group * words + w) * NM24_GROUP + within;
      int rank = 0;
      for (int j = 0; j < 16; ++j) {
        if (!(bits[0][at] >> j & 1)) continue;
        float value;
        if (dtype == 0) {
          value = v32[0][at * 8 + rank++];
        } else {
          const uint32_t u = static_cast<uint32_t>(v16[0][at * 8 + rank++]) << 16;
          std::memcpy(&value, &u, 4);
        }
        sum += static_cast<double>(value) * x[w * 16 + j];
      }
    }
    worst = std::max(worst, std::abs(sum - out[r]));
  }
  const auto pass = [&](int l) { return probe ? read_layer(l) : run(l); };
  for (int i = 0; i < 3; ++i)
    for (int l = 0; l < layers; ++l) pass(l);
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    for (int l = 0; l < layers; ++l) pass(l);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  const double t = times[times.size() / 10], word_rows = static_cast<double>(layers) * n * words;
  const double bytes = word_rows * (dtype == 0 ? 34 : 18);  // 8 values and 2 bytes of bits a word
  std::printf("%s%s [%ld, %ld] x %d, %d thread(s): %.3f ms  %.1f GB/s  %.2f ns/word-row  max error %.2e\n",
              probe ? "plain read of " : "", dtype ? "bf16" : "fp32", static_cast<long>(n), static_cast<long>(k), layers, threads, t * 1e3,
              bytes / t / 1e9, t / word_rows * 1e9, worst);
  return worst > 1e-3 * k ? 1 : 0;
}

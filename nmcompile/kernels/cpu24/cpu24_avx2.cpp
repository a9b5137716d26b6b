// 2:4 CPU GEMM, AVX2 + FMA + F16C: a word's 16 positions as two ymm halves of 8 fp32 lanes; each
// half's 4 kept values are placed (zeros elsewhere) by one byte shuffle from a table indexed by the
// half's 8 position bits (fp32, bf16, int8), or by a lane permute after conversion (fp16).
#include <cstdint>
#include <cstring>
#include <type_traits>

#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "cpu24_kernel.h"

namespace {

// Byte shuffles that place 4 kept values into the 8 fp32 lanes of a half word: entry m (the half's
// 8 position bits) gives, for lane j, the bytes of value rank(j) if bit j is set, else 0x80 (zero).
// The 4 values sit in both 128-bit lanes of the source (a broadcast), so vpshufb reaches them from
// either lane. fp32: value r is bytes 4r..4r+3; bf16: bytes 2r, 2r+1 land in the lane's high half
// (the fp32 with the same value). A bf16 word's 8 values are 16 bytes, broadcast once to both lanes
// for both halves: the second half's table reads values 4..7 (bytes 8..15); one load per word in
// place of two took a word-row from 0.90 to 0.80 ns with the weight in L2 (Zen 3, 1 thread;
// benchmarks/cpu/cpu24_word_cost.cpp). Built
// at compile time (a constructor running at load would be AVX2 code on any CPU).
struct ShuffleTable {
  alignas(64) uint8_t f32[256][32];
  alignas(64) uint8_t bf16[256][32];
  alignas(64) uint8_t bf16_hi[256][32];  // the same, from values 4..7 (bytes 8..15)
  // int8: value r's byte into the top byte of its lane (an arithmetic shift then sign-extends it);
  // the second half's values are bytes 4..7
  alignas(64) uint8_t i8[256][32];
  alignas(64) uint8_t i8_hi[256][32];
  constexpr ShuffleTable() : f32{}, bf16{}, bf16_hi{}, i8{}, i8_hi{} {
    for (int m = 0; m < 256; ++m) {
      int rank = 0;
      for (int j = 0; j < 8; ++j) {
        const bool kept = (m >> j) & 1;
        for (int byte = 0; byte < 4; ++byte) {
          f32[m][4 * j + byte] = static_cast<uint8_t>(kept ? 4 * rank + byte : 0x80);
          bf16[m][4 * j + byte] = static_cast<uint8_t>(kept && byte >= 2 ? 2 * rank + byte - 2 : 0x80);
          bf16_hi[m][4 * j + byte] = static_cast<uint8_t>(kept && byte >= 2 ? 8 + 2 * rank + byte - 2 : 0x80);
          i8[m][4 * j + byte] = static_cast<uint8_t>(kept && byte == 3 ? rank : 0x80);
          i8_hi[m][4 * j + byte] = static_cast<uint8_t>(kept && byte == 3 ? 4 + rank : 0x80);
        }
        rank += kept;
      }
    }
  }
};
constexpr ShuffleTable kShuffle{};

// fp16: converted first (vcvtph2ps), then placed by a lane permute whose indices come from this
// table (4: a zero lane of the zero-extended half)
struct PermuteTable {
  alignas(64) uint8_t idx[256][8];
  constexpr PermuteTable() : idx{} {
    for (int m = 0; m < 256; ++m) {
      int rank = 0;
      for (int j = 0; j < 8; ++j) idx[m][j] = static_cast<uint8_t>((m >> j) & 1 ? rank++ : 4);
    }
  }
};
constexpr PermuteTable kPermute{};


struct Pair {
  __m256 lo, hi;
};

inline __m256i control(const uint8_t (*table)[32], unsigned m) {
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(table[m]));
}

// a word's 8 kept values (16 positions) as two fp32 vectors, zeros at the dropped positions
template <typename W>
inline Pair place(const W* v, unsigned m);
template <>
inline Pair place<float>(const float* v, unsigned m) {
  const __m256i first = _mm256_castps_si256(_mm256_broadcast_ps(reinterpret_cast<const __m128*>(v)));
  const __m256i last = _mm256_castps_si256(_mm256_broadcast_ps(reinterpret_cast<const __m128*>(v + 4)));
  return {_mm256_castsi256_ps(_mm256_shuffle_epi8(first, control(kShuffle.f32, m & 0xFF))),
          _mm256_castsi256_ps(_mm256_shuffle_epi8(last, control(kShuffle.f32, m >> 8)))};
}
template <>
inline Pair place<uint16_t>(const uint16_t* v, unsigned m) {  // bf16
  const __m256i all = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
  return {_mm256_castsi256_ps(_mm256_shuffle_epi8(all, control(kShuffle.bf16, m & 0xFF))),
          _mm256_castsi256_ps(_mm256_shuffle_epi8(all, control(kShuffle.bf16_hi, m >> 8)))};
}
template <>
inline Pair place<int8_t>(const int8_t* v, unsigned m) {  // 8 bytes in every quarter, shuffled, shifted, converted
  int64_t bytes;
  std::memcpy(&bytes, v, 8);
  const __m256i all = _mm256_set1_epi64x(bytes);
  const __m256i lo = _mm256_srai_epi32(_mm256_shuffle_epi8(all, control(kShuffle.i8, m & 0xFF)), 24);
  const __m256i hi = _mm256_srai_epi32(_mm256_shuffle_epi8(all, control(kShuffle.i8_hi, m >> 8)), 24);
  return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
}
inline __m256 widen8(const int8_t* v) {  // 8 int8 values as fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))));
}
inline __m256 permute4(__m128 v, unsigned m) {
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kPermute.idx[m])));
  return _mm256_permutevar8x32_ps(_mm256_zextps128_ps256(v), idx);
}
template <>
inline Pair place<Half>(const Half* v, unsigned m) {
  const __m256 all = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
  return {permute4(_mm256_castps256_ps128(all), m & 0xFF), permute4(_mm256_extractf128_ps(all, 1), m >> 8)};
}

template <typename W, int R_, int TT_>
struct Avx2 {
  using WT = W;
  using XT = float;
  using XV = Pair;
  using WV = Pair;
  using Acc = __m256;
  static constexpr int WORDS = 1, R = R_, TT = TT_, STREAMS = 4;
  static inline Acc zero() { return _mm256_setzero_ps(); }
  static inline XV load_x(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static inline WV expand(const W* v, const uint16_t* b, int64_t) {
    if constexpr (std::is_same_v<W, DenseI8>) {  // every position: 16 values, no bits
      const auto* q = reinterpret_cast<const int8_t*>(v);
      return {widen8(q), widen8(q + 8)};
    } else {
      return place<W>(v, *b);
    }
  }
  static inline Acc madd(Acc acc, const WV& w, const XV& x) {
    return _mm256_fmadd_ps(w.hi, x.hi, _mm256_fmadd_ps(w.lo, x.lo, acc));
  }
  static inline float sum(Acc v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
  }
};

}  // namespace

void nm24_rows_avx2(const Nm24Args& a, int64_t r0, int64_t r1) { nm24_rows_by_dtype<Avx2, 2>(a, r0, r1); }

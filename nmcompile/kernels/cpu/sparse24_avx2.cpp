// 2:4 CPU GEMM, AVX2 + FMA + F16C: a word's 16 positions as two ymm halves; each half's 4 kept
// values are placed by one permute whose lane indices come from a table indexed by its 8 bits
// (lanes 4..7 of the zero-extended half are zero, which the table uses for the
// dropped positions).
#include <cstdint>

#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "sparse24_kernel.h"

namespace {

// lane j of entry m: the rank of bit j among m's set bits, or 4 (a zero lane) where bit j is clear;
// bytes, read with a zero-extending load; built at compile time (a constructor running at load
// would be AVX2 code on any CPU)
struct ExpandTable {
  alignas(64) uint8_t idx[256][8];
  constexpr ExpandTable() : idx{} {
    for (int m = 0; m < 256; ++m) {
      int rank = 0;
      for (int j = 0; j < 8; ++j) idx[m][j] = static_cast<uint8_t>((m >> j) & 1 ? rank++ : 4);
    }
  }
};
constexpr ExpandTable kTable{};

struct Half { uint16_t v; };

// a word's 8 kept values as fp32: the first 4 and the last 4
template <typename W>
inline void load8(const W* p, __m128& first, __m128& last);
template <>
inline void load8<float>(const float* p, __m128& first, __m128& last) {
  first = _mm_loadu_ps(p);
  last = _mm_loadu_ps(p + 4);
}
template <>
inline void load8<uint16_t>(const uint16_t* p, __m128& first, __m128& last) {  // bf16: an fp32's high half
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), zero = _mm_setzero_si128();
  first = _mm_castsi128_ps(_mm_unpacklo_epi16(zero, v));
  last = _mm_castsi128_ps(_mm_unpackhi_epi16(zero, v));
}
template <>
inline void load8<Half>(const Half* p, __m128& first, __m128& last) {
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  first = _mm256_castps256_ps128(v);
  last = _mm256_extractf128_ps(v, 1);
}

struct Pair {
  __m256 lo, hi;
};

inline __m256 place4(__m128 v, unsigned m) {  // 4 values into the lanes of m's set bits, zeros elsewhere
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(kTable.idx[m])));
  return _mm256_permutevar8x32_ps(_mm256_zextps128_ps256(v), idx);
}

template <typename W, int R_, int TT_>
struct Avx2 {
  using WT = W;
  using XT = float;
  using XV = Pair;
  using WV = Pair;
  using Acc = __m256;
  static constexpr int WORDS = 1, R = R_, TT = TT_;
  static inline Acc zero() { return _mm256_setzero_ps(); }
  static inline XV load_x(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static inline WV expand(const W* v, const uint16_t* b, int64_t) {
    const unsigned m = *b;
    __m128 first, last;
    load8<W>(v, first, last);
    return {place4(first, m & 0xFF), place4(last, m >> 8)};
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

template <typename W>
void rows(const Nm24Args& a, int64_t r0, int64_t r1) {
  if (a.tokens == 1)
    nm24_rows<Avx2<W, 8, 1>>(a, r0, r1);
  else
    nm24_rows<Avx2<W, 4, 2>>(a, r0, r1);
}

}  // namespace

void nm24_rows_avx2(const Nm24Args& a, int64_t r0, int64_t r1) {
  if (a.wdtype == NM24_F32) rows<float>(a, r0, r1);
  else if (a.wdtype == NM24_BF16) rows<uint16_t>(a, r0, r1);
  else rows<Half>(a, r0, r1);
}

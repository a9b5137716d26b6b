// 2:4 CPU GEMM, AVX-512: 16 positions per step, the 8 kept values placed by one masked expand
// (`vexpandps`, the mask being the chunk's 16 position bits). With AVX512-BF16 and VBMI2, bf16
// weights and activations take 32 positions per step: `vpexpandw` of 16 kept bf16 values, then
// `vdpbf16ps` (pairs of bf16 products summed into fp32).
#include <cstdint>
#include <type_traits>

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vbmi2,avx512bf16,avx2,fma,f16c")
#include <immintrin.h>

#include "cpu24_kernel.h"

namespace {


template <typename W>
inline __m256 load8(const W* p);
template <>
inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8<uint16_t>(const uint16_t* p) {  // bf16: the high half of an fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
template <>
inline __m256 load8<int8_t>(const int8_t* p) {  // int8: sign-extended, converted exactly
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <>
inline __m256 load8<Half>(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

template <typename W, int R_, int TT_>
struct Avx512 {
  using WT = W;
  using XT = float;
  using XV = __m512;
  using WV = __m512;
  using Acc = __m512;
  // one token: K read as 4 segments at once (cpu24_kernel.h). On a Zen 5 core, 16 bf16 [8192, 2048]
  // layers went from 26.0 to 11.6 ms at 1 thread (fp32: 25.3 to 21.4 ms)
  static constexpr int WORDS = 1, R = R_, TT = TT_, STREAMS = 4;
  static inline Acc zero() { return _mm512_setzero_ps(); }
  static inline XV load_x(const float* p) { return _mm512_loadu_ps(p); }
  static inline WV expand(const W* v, const uint16_t* b, int64_t) {
    if constexpr (std::is_same_v<W, DenseI8>) {  // every position: 16 values, no bits
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))));
    } else {
      return _mm512_maskz_expand_ps(static_cast<__mmask16>(*b), _mm512_castps256_ps512(load8<W>(v)));
    }
  }
  static inline Acc madd(Acc acc, WV w, XV x) { return _mm512_fmadd_ps(w, x, acc); }
  static inline float sum(Acc v) { return _mm512_reduce_add_ps(v); }
};

struct Avx512Bf16 {
  using WT = uint16_t;
  using XT = uint16_t;
  using XV = __m512i;
  using WV = __m512i;
  using Acc = __m512;
  static constexpr int WORDS = 2, R = 4, TT = 4, STREAMS = 1;  // 4 streams: slower on Zen 5
  static inline Acc zero() { return _mm512_setzero_ps(); }
  static inline XV load_x(const uint16_t* p) { return _mm512_loadu_si512(p); }  // kp: a multiple of 32
  static inline WV expand(const uint16_t* v, const uint16_t* b, int64_t words_left) {
    const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
    if (words_left >= 2) {  // the next word of this row: one group of rows further on
      const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + NM24_GROUP * 8));
      const __mmask32 m = static_cast<uint32_t>(b[0]) | (static_cast<uint32_t>(b[NM24_GROUP]) << 16);
      return _mm512_maskz_expand_epi16(m, _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(first), second, 1)));
    }
    // the last word of a row whose length is an odd multiple of 16: 8 values, 16 positions
    return _mm512_maskz_expand_epi16(static_cast<__mmask32>(b[0]), _mm512_castsi128_si512(first));
  }
  static inline Acc madd(Acc acc, WV w, XV x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
  static inline float sum(Acc v) { return _mm512_reduce_add_ps(v); }
};

}  // namespace

void nm24_rows_avx512(const Nm24Args& a, int64_t r0, int64_t r1) { nm24_rows_by_dtype<Avx512, 4>(a, r0, r1); }

void nm24_rows_avx512_bf16(const Nm24Args& a, int64_t r0, int64_t r1) { nm24_rows<Avx512Bf16>(a, r0, r1); }

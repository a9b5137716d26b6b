// int8 or 4-bit weights times int8 activations, AVX2: the "avx2_a8" route of nmsparse::cpu24_linear_q8,
// nmsparse::cpu24_dense_q8 and nmsparse::cpu24_linear_q4.
//
// The activations of each token are quantized in blocks of 32 positions (a block's scale d = its largest
// magnitude / 127, codes rounded to nearest even), and each row's sum is
//   scales[row] * sum over blocks of d_block * (integer dot product of the block's codes with the row's),
// the integer products summed exactly by vpmaddubsw/vpmaddwd (|code| <= 127 on both sides: a pair's sum
// stays within int16). The float route (cpu24_avx2.cpp) widens every kept value to fp32 and multiplies it
// with fp32 activations: some 12 instructions per 16 positions, which held 2:4 int8 at 7.5 GB/s of weight
// bytes on two Zen 3 cores; this one takes about 20 per 64 positions and reads the weight at the memory's
// speed there (benchmarks/cpu/int8_layers.py).
//
// A step covers 4 words (64 positions) of a row. The activation codes are stored arranged per step as
// [w0 | w2 | w1 | w3] (16 bytes a word), so that xa = [w0 | w2] and xb = [w1 | w3] (two 128-bit lanes each),
// and the block scales per step as [dA x4 | dB x4] (block A: words 0-1, B: 2-3). A 2:4 row's 8 kept values a
// word are paired with their activations by vpshufb: the control (for each kept value, its position in its
// word) is derived in registers from the position bits: each group of 4 positions has two bits set, whose
// nibble (3, 5, 6, 9, 10 or 12) indexes a 16-entry table for the first position and, XORed with 1 (2, 4, 7,
// 8, 11, 13: none of the six), for the second. Layouts: cpu24_args.h.
#include <cmath>
#include <cstdint>

#pragma GCC target("avx2,fma,f16c")  // f16c: the 4-bit weights' fp16 scales
#include <immintrin.h>

#include "cpu24_args.h"

namespace {

constexpr int G = NM24_GROUP;

// the step's controls, built at compile time (a constructor at load would run AVX2 code on any CPU)
struct A8Tables {
  // sel[r][k]: for row r, which byte of the step's nibbles (one byte per group of 4 positions, rows r % 4 at
  // bytes 4 (r % 4)..+3 of each lane: rows 0-3 in one vector, 4-7 in another) each control byte reads: k = 0
  // from words [0 | 2] (the control's first half in each lane), 1 from words [1 | 3] (its second half)
  alignas(32) uint8_t sel[G][2][32];
  alignas(32) uint8_t first_second[32];  // nibble -> first kept position; nibble ^ 1 -> second
  alignas(32) uint8_t second[32];        // 1 on the bytes of a pair's second value
  alignas(32) uint8_t group_base[32];    // 4 * the group of 4 positions a control byte is in
  constexpr A8Tables() : sel{}, first_second{}, second{}, group_base{} {
    const int nibbles[6] = {3, 5, 6, 9, 10, 12};
    for (int lane = 0; lane < 2; ++lane)
      for (int j = 0; j < 16; ++j) {
        const int i = j % 8, group = i / 2, at = 16 * lane + j;
        uint8_t v = 0;
        for (int n : nibbles) {
          const int lo = n & 1 ? 0 : n & 2 ? 1 : 2, hi = n & 8 ? 3 : n & 4 ? 2 : 1;
          if (j == n) v = static_cast<uint8_t>(lo);
          if (j == (n ^ 1)) v = static_cast<uint8_t>(hi);
        }
        first_second[at] = v;
        second[at] = static_cast<uint8_t>(i % 2);
        group_base[at] = static_cast<uint8_t>(4 * group);
        // byte j of lane `lane`: half j / 8 (0: word 0 or 2 by lane, 1: word 1 or 3), group i / 2
        for (int r = 0; r < G; ++r)
          for (int k = 0; k < 2; ++k) sel[r][k][at] = static_cast<uint8_t>(j / 8 == k ? 4 * (r % 4) + group : 0x80);
      }
  }
};
constexpr A8Tables kA8{};

inline __m256i load32(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }

inline __m256i load2(const void* lo, const void* hi) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(static_cast<const __m128i*>(lo))),
                                 _mm_loadu_si128(static_cast<const __m128i*>(hi)), 1);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// where word w % 4 of a step sits in the arranged activations, and which of the step's 8 scales is its block's
constexpr int kArranged[4] = {0, 32, 16, 48};
constexpr int kScaleOf[4] = {0, 0, 4, 4};

// the words past the last whole step (K/16 not a multiple of 4), one row and token, exactly as a step does
inline float tail(const Nm24Args& a, const int8_t* v, const uint16_t* b, int64_t row_in_group, const int8_t* q,
                  const float* d, bool dense) {
  const int64_t words = a.k / 16, first = words / 4 * 4;
  float sum = 0.0f;
  for (int64_t w = first; w < words; ++w) {
    const int8_t* x = q + w / 4 * 64 + kArranged[w % 4];
    int32_t dot = 0;
    if (dense) {
      const int8_t* vw = v + (w * G + row_in_group) * 16;
      for (int j = 0; j < 16; ++j) dot += int32_t{vw[j]} * x[j];
    } else {
      const int8_t* vw = v + (w * G + row_in_group) * 8;
      const unsigned m = b[w * G + row_in_group];
      for (int j = 0, kept = 0; j < 16; ++j)
        if ((m >> j) & 1) dot += int32_t{vw[kept++]} * x[j];
    }
    sum += static_cast<float>(dot) * d[w / 4 * 8 + kScaleOf[w % 4]];
  }
  return sum;
}

inline void store(const Nm24Args& a, int64_t row, int64_t t, float sum) {
  if (row >= a.n) return;  // the layout's padding rows
  a.out[t * a.n + row] = (a.scales ? sum * a.scales[row] : sum) + (a.bias ? a.bias[row] : 0.0f);
}

// rows [group * G + r0, + RP) (RP even) of a 2:4 weight, tokens [t0, t0 + TT); Q4: 4-bit codes with a scale per
// row and group of positions (NM24_I4: K a multiple of the group, so no words past the last step)
template <int RP, int TT, bool Q4>
inline void sparse_tile(const Nm24Args& a, int64_t group, int r0, int64_t t0) {
  const int64_t words = a.k / 16, steps = words / 4, kq = a.kp;
  constexpr int kStepBytes = Q4 ? G * 16 : 4 * G * 8;  // a step's values for the group's rows
  // the group's values: int8 ones hold every word (K/16 may pass the last whole step), 4-bit ones whole steps
  const auto* v0 = static_cast<const int8_t*>(a.values) + group * (Q4 ? steps * kStepBytes : words * G * 8);
  // int8: the position bits (16 a word, per row); 4-bit: each kept value's position in its group of 4, 2 bits
  // (8 bytes per row and step: cpu24_args.h)
  const uint16_t* b0 = a.bits + group * (Q4 ? steps * 4 * G : words * G);
  const auto* q = static_cast<const int8_t*>(a.x) + t0 * kq;
  const float* d = a.xscales + t0 * (kq / 8);
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  const __m256i lut = load32(kA8.first_second), second = load32(kA8.second), base = load32(kA8.group_base);
  const __m256i shifts = _mm256_setr_epi64x(0, 2, 4, 6), three = _mm256_set1_epi8(3);
  // Q4: the group's scales, 8 rows a step's group (fp16), and how many steps share one
  const uint16_t* ws0 = Q4 ? a.wscales + group * (a.k / a.wgroup) * G : nullptr;
  const int64_t steps_per_scale = Q4 ? a.wgroup / 64 : 1;
  alignas(32) float wsf[G];
  __m256 acc[RP][TT];
  for (int r = 0; r < RP; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  const int8_t* v = v0;
  const uint16_t* b = b0;
  for (int64_t s = 0; s < steps; ++s, v += kStepBytes, b += 4 * G) {
    if (RP == G) {  // one pass over the group: its steps are read once, in order
      for (int line = 0; line < kStepBytes; line += 64) __builtin_prefetch(reinterpret_cast<const char*>(v) + a.prefetch_bytes + line);
      __builtin_prefetch(reinterpret_cast<const char*>(b) + a.prefetch_bytes / (Q4 ? 2 : 4));
    }
    if (Q4 && s % steps_per_scale == 0)
      _mm256_store_ps(wsf, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws0 + s / steps_per_scale * G))));
    __m256i xa[TT], xb[TT];
    __m256 ds[TT];
    for (int t = 0; t < TT; ++t) {
      xa[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * kq + s * 64));
      xb[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * kq + s * 64 + 32));
      ds[t] = _mm256_loadu_ps(d + t * (kq / 8) + s * 8);
    }
    // the step's position bits, one byte per group of 4 positions (its nibble): words [0 | 2] and [1 | 3], rows
    // 0-3 and 4-7. Done once for the 8 rows, this took a row's control from 10 instructions to 6 (a loop's
    // compute-bound rate per core 10.9 -> 13.3-14.2 GB/s, Zen 3, a standalone probe)
    __m256i nib02[2], nib13[2];
    if constexpr (!Q4) {
      const __m256i s0 = load2(b, b + 2 * G), s1 = load2(b + G, b + 3 * G);
      const __m256i lo0 = _mm256_and_si256(s0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(s0, 4), low4);
      const __m256i lo1 = _mm256_and_si256(s1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(s1, 4), low4);
      nib02[0] = _mm256_unpacklo_epi8(lo0, hi0);
      nib02[1] = _mm256_unpackhi_epi8(lo0, hi0);
      nib13[0] = _mm256_unpacklo_epi8(lo1, hi1);
      nib13[1] = _mm256_unpackhi_epi8(lo1, hi1);
    }
    for (int rp = r0; rp < r0 + RP; rp += 2) {
      // rows rp, rp + 1 as a row's [w0 w1 | w2 w3]: int8 values in two loads a pair of words and an unpack; 4-bit
      // codes in one load, the first row's the low nibbles, the second's the high ones (offset by 8)
      __m256i wr[2];
      if constexpr (Q4) {
        const __m256i pk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + rp * 16));
        wr[0] = _mm256_sub_epi8(_mm256_and_si256(pk, low4), eight);
        wr[1] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(pk, 4), low4), eight);
      } else {
        const __m256i wa = load2(v + rp * 8, v + 2 * G * 8 + rp * 8), wb = load2(v + G * 8 + rp * 8, v + 3 * G * 8 + rp * 8);
        wr[0] = _mm256_unpacklo_epi64(wa, wb);
        wr[1] = _mm256_unpackhi_epi64(wa, wb);
      }
      for (int h = 0; h < 2; ++h) {
        const int r = rp + h;
        __m256i ctl;
        if constexpr (Q4) {  // byte 8L + j: bits 2L.. of the row's byte j (word L of the step, kept value j)
          const uint64_t row_index = reinterpret_cast<const uint64_t*>(b)[r];
          ctl = _mm256_add_epi8(_mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(static_cast<int64_t>(row_index)), shifts), three), base);
        } else {
          const __m256i nib = _mm256_xor_si256(_mm256_or_si256(_mm256_shuffle_epi8(nib02[r / 4], load32(kA8.sel[r][0])),
                                                               _mm256_shuffle_epi8(nib13[r / 4], load32(kA8.sel[r][1]))),
                                               second);
          ctl = _mm256_add_epi8(_mm256_shuffle_epi8(lut, nib), base);
        }
        for (int t = 0; t < TT; ++t) {
          const __m256i xg = _mm256_blend_epi32(_mm256_shuffle_epi8(xa[t], ctl), _mm256_shuffle_epi8(xb[t], ctl), 0xCC);
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(xg), _mm256_sign_epi8(wr[h], xg)), ones);
          const __m256 scale = Q4 ? _mm256_mul_ps(ds[t], _mm256_broadcast_ss(wsf + r)) : ds[t];
          acc[r - r0][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r - r0][t]);
        }
      }
    }
  }
  for (int r = 0; r < RP; ++r)
    for (int t = 0; t < TT; ++t)
      store(a, group * G + r0 + r, t0 + t,
            hsum(acc[r][t]) + (Q4 ? 0.0f : tail(a, v0, b0, r0 + r, q + t * kq, d + t * (kq / 8), false)));
}

// the same for a dense int8 weight (every position kept, no bits); Q4: a dense 4-bit one (NM24_I4_DENSE), a row's
// step 32 bytes: the low nibbles its words [0 | 2], the high ones [1 | 3] (offset by 8), a scale per row and group
template <int RP, int TT, bool Q4>
inline void dense_tile(const Nm24Args& a, int64_t group, int r0, int64_t t0) {
  const int64_t words = a.k / 16, steps = words / 4, kq = a.kp;
  constexpr int kStepBytes = Q4 ? G * 32 : 4 * G * 16;
  const auto* v0 = static_cast<const int8_t*>(a.values) + group * (Q4 ? steps * kStepBytes : words * G * 16);
  const auto* q = static_cast<const int8_t*>(a.x) + t0 * kq;
  const float* d = a.xscales + t0 * (kq / 8);
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  const uint16_t* ws0 = Q4 ? a.wscales + group * (a.k / a.wgroup) * G : nullptr;
  const int64_t steps_per_scale = Q4 ? a.wgroup / 64 : 1;
  alignas(32) float wsf[G];
  __m256 acc[RP][TT];
  for (int r = 0; r < RP; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  const int8_t* v = v0;
  for (int64_t s = 0; s < steps; ++s, v += kStepBytes) {
    if (RP == G)
      for (int line = 0; line < kStepBytes; line += 64) __builtin_prefetch(reinterpret_cast<const char*>(v) + a.prefetch_bytes + line);
    if (Q4 && s % steps_per_scale == 0)
      _mm256_store_ps(wsf, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ws0 + s / steps_per_scale * G))));
    __m256i xa[TT], xb[TT], ua[TT], ub[TT];
    __m256 ds[TT];
    for (int t = 0; t < TT; ++t) {
      xa[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * kq + s * 64));
      xb[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * kq + s * 64 + 32));
      ua[t] = _mm256_abs_epi8(xa[t]);
      ub[t] = _mm256_abs_epi8(xb[t]);
      ds[t] = _mm256_loadu_ps(d + t * (kq / 8) + s * 8);
    }
    for (int r = r0; r < r0 + RP; ++r) {
      __m256i wa, wb;
      if constexpr (Q4) {
        const __m256i pk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + r * 32));
        wa = _mm256_sub_epi8(_mm256_and_si256(pk, low4), eight);
        wb = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(pk, 4), low4), eight);
      } else {
        wa = load2(v + r * 16, v + (2 * G + r) * 16);
        wb = load2(v + (G + r) * 16, v + (3 * G + r) * 16);
      }
      for (int t = 0; t < TT; ++t) {
        const __m256i pa = _mm256_maddubs_epi16(ua[t], _mm256_sign_epi8(wa, xa[t]));
        const __m256i pb = _mm256_maddubs_epi16(ub[t], _mm256_sign_epi8(wb, xb[t]));
        // 4-bit: the two halves' pair sums add in int16 (|sum| <= 4 * 127 * 8); int8 ones would overflow
        const __m256i p = Q4 ? _mm256_madd_epi16(_mm256_add_epi16(pa, pb), ones)
                             : _mm256_add_epi32(_mm256_madd_epi16(pa, ones), _mm256_madd_epi16(pb, ones));
        const __m256 scale = Q4 ? _mm256_mul_ps(ds[t], _mm256_broadcast_ss(wsf + r)) : ds[t];
        acc[r - r0][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r - r0][t]);
      }
    }
  }
  for (int r = 0; r < RP; ++r)
    for (int t = 0; t < TT; ++t)
      store(a, group * G + r0 + r, t0 + t,
            hsum(acc[r][t]) + (Q4 ? 0.0f : tail(a, v0, nullptr, r0 + r, q + t * kq, d + t * (kq / 8), true)));
}

enum Kind { kSparse8, kDense8, kSparse4, kDense4 };

// tokens [t0, t1) of rows [r0, r0 + RP) of a group: TT at a time, then the remainder
template <Kind KIND, int RP, int TT>
inline void tokens(const Nm24Args& a, int64_t group, int r0, int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + TT <= t1; t += TT) {
    if constexpr (KIND == kDense8 || KIND == kDense4) dense_tile<RP, TT, KIND == kDense4>(a, group, r0, t);
    else sparse_tile<RP, TT, KIND == kSparse4>(a, group, r0, t);
  }
  if constexpr (TT > 1) {
    if (t < t1) tokens<KIND, RP, TT - 1>(a, group, r0, t, t1);
  }
}

// one token: a group's 8 rows in one pass over its steps (memory-bound: the weight streams once); more
// tokens: two rows at a time for up to 4 tokens (the group's weights, 20 KB at K = 4096, stay in L1/L2
// between the passes)
template <Kind KIND>
void rows(const Nm24Args& a, int64_t r0, int64_t r1) {
  for (int64_t group = r0 / G; group * G < r1 && group * G < a.n; ++group) {
    if (a.tokens == 1) {
      tokens<KIND, G, 1>(a, group, 0, 0, 1);
    } else {
      for (int r = 0; r < G; r += 2) tokens<KIND, 2, 4>(a, group, r, 0, a.tokens);
    }
  }
}

}  // namespace

void nm24_rows_a8_avx2(const Nm24Args& a, int64_t r0, int64_t r1) {
  if (a.wdtype == NM24_I8_DENSE) rows<kDense8>(a, r0, r1);
  else if (a.wdtype == NM24_I4) rows<kSparse4>(a, r0, r1);
  else if (a.wdtype == NM24_I4_DENSE) rows<kDense4>(a, r0, r1);
  else rows<kSparse8>(a, r0, r1);
}

void nm24_quantize_a8(const float* x, int64_t tokens, int64_t k, int64_t kp, int8_t* q, float* d, int64_t kq) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float* xt = x + t * kp;
    int8_t* qt = q + t * kq;
    float* dt = d + t * (kq / 8);
    for (int64_t block = 0; block < kq / 32; ++block) {
      const int64_t p0 = block * 32;
      __m256 v[4];
      __m256 top = _mm256_setzero_ps();
      const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
      for (int i = 0; i < 4; ++i) {
        v[i] = p0 < kp ? _mm256_loadu_ps(xt + p0 + 8 * i) : _mm256_setzero_ps();  // zero padded to kp (32s)
        top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));  // a NaN lane: see below
      }
      float amax = 0.0f;
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, top);
      for (float l : lanes) amax = l > amax ? l : amax;
      bool finite = std::isfinite(amax);
      for (int i = 0; i < 4 && finite; ++i)  // max_ps drops NaN lanes: look for them
        finite = _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q)) == 0;
      const float scale = finite ? amax / 127.0f : NAN;  // a block holding NaN or inf: its rows' sums NaN
      const __m256 inv = _mm256_set1_ps(finite && amax > 0.0f ? 127.0f / amax : 0.0f);
      __m256i c[4];
      for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // nearest even
      // int32 -> int8 (in range: |code| <= 127), back in position order
      const __m256i w16a = _mm256_packs_epi32(c[0], c[1]), w16b = _mm256_packs_epi32(c[2], c[3]);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16a, w16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      const int64_t s = block / 2, half = block % 2;  // block A (words 0, 1) or B (words 2, 3) of step s
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qt + s * 64 + kArranged[2 * half]), _mm256_castsi256_si128(bytes));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qt + s * 64 + kArranged[2 * half + 1]), _mm256_extracti128_si256(bytes, 1));
      for (int i = 0; i < 4; ++i) dt[s * 8 + 4 * half + i] = scale;
    }
  }
}

// The 2:4 CPU GEMM, written once over a small set of vector operations ("Ops").
//
// Each ISA translation unit (cpu24_avx2.cpp, cpu24_avx512.cpp, cpu24_emulated.cpp) defines
// its Ops and includes this header; everything here has internal linkage, so the instantiations of
// one unit (compiled for its own target) never mix with another's. Layout: cpu24_args.h.
//
// A step covers Ops::WORDS words (16 positions each) of R rows and TT tokens: each row's kept values
// are expanded once into dense vectors (zeros at the dropped positions) and multiplied with the TT
// tokens' activations; the R rows share each activation load. Tokens are taken in panels of
// a.panel_bytes of activations: each panel streams the weight from memory once, and a row group's
// weights stay in L2 while the panel's tiles reread them.
//
// Ops: WT/XT (weight/activation element), XV/WV/Acc (vectors), WORDS, R, TT, STREAMS (one token's
//   streams, nm24_tile), and
//   zero(), load_x(const XT* at position 16w), expand(values of row r at word w, bits of row r at
//   word w, words left), madd(acc, w, x), sum(acc). Word w + 1 of the same row is NM24_GROUP * 8
//   values and NM24_GROUP bits further on (a dense int8 weight, DenseI8: NM24_GROUP * 16 values, and
//   no bits: expand never reads them).
#pragma once
#include <cstdint>

#include "cpu24_args.h"


namespace {

struct Half {  // an fp16 value's bits (the ISA units convert it)
  uint16_t v;
};

// an element of a dense int8 weight (NM24_I8_DENSE): 16 values a word, every position kept, no bits
struct DenseI8 {
  int8_t v;
};

// values a word holds per row: the 8 kept of 16 positions, or all 16 of a dense weight
template <typename W>
struct Kept {
  static constexpr int value = 8;
};
template <>
struct Kept<DenseI8> {
  static constexpr int value = 16;
};

// one step (Ops::WORDS words at word w) of R rows and TT tokens into acc; v and b point at word w
// of the tile's first row
template <class Ops, int R, int TT>
inline void nm24_step(const Nm24Args& a, typename Ops::Acc (&acc)[R][TT], const typename Ops::XT* x,
                      const typename Ops::WT* v, const uint16_t* b, int64_t w, int64_t words) {
  using W = typename Ops::WT;
  constexpr int KEPT = Kept<W>::value;
  // the streams are read once: ask for them a.prefetch_bytes ahead (a row group's step is
  // contiguous, so a few lines cover it)
  for (int line = 0; line < R * KEPT * static_cast<int>(sizeof(W)); line += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(v) + a.prefetch_bytes * Ops::WORDS + line);
  if constexpr (KEPT == 8) __builtin_prefetch(reinterpret_cast<const char*>(b) + a.prefetch_bytes / 4);
  typename Ops::XV xv[TT];
  for (int t = 0; t < TT; ++t) xv[t] = Ops::load_x(x + t * a.kp + w * 16);
  for (int r = 0; r < R; ++r) {
    typename Ops::WV wv = Ops::expand(v + r * KEPT, b + r, words - w);
    for (int t = 0; t < TT; ++t) acc[r][t] = Ops::madd(acc[r][t], wv, xv[t]);
  }
}

// R rows x TT tokens. The row group's words are read as S streams at once: K in S segments, a step
// of each in turn, into the same accumulators (then the words left over). One stream of values
// and one of bits kept a Zen 3 core's DRAM reads at 10-13 GB/s on one token; four of each, 15-19
// GB/s (4 fp32 [4096, 4096] layers, 1 thread; dense GEMV 16-20 GB/s there).
template <class Ops, int R, int TT, int S>
inline void nm24_tile(const Nm24Args& a, int64_t row, int64_t t0) {
  using W = typename Ops::WT;
  using X = typename Ops::XT;
  constexpr int G = NM24_GROUP;
  constexpr int KEPT = Kept<W>::value;
  constexpr int64_t VSTEP = Ops::WORDS * G * KEPT, BSTEP = Ops::WORDS * G;  // one step of each stream
  typename Ops::Acc acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = Ops::zero();
  const int64_t words = a.k / 16;
  const X* x = static_cast<const X*>(a.x) + t0 * a.kp;
  // the group that holds `row`, then the row's place in it
  const int64_t group = row / G, within = row % G;
  const W* v = static_cast<const W*>(a.values) + (group * words * G + within) * KEPT;
  const uint16_t* b = a.bits + group * words * G + within;
  const int64_t seg = words / S / Ops::WORDS * Ops::WORDS;  // words per segment, whole steps
  int64_t w = 0;
  if constexpr (S > 1) {
    for (; w < seg; w += Ops::WORDS)
      for (int s = 0; s < S; ++s) {
        const int64_t at = s * seg + w;
        nm24_step<Ops, R, TT>(a, acc, x, v + at / Ops::WORDS * VSTEP, b + at / Ops::WORDS * BSTEP, at, words);
      }
    w = S * seg;
  }
  for (; w < words; w += Ops::WORDS)
    nm24_step<Ops, R, TT>(a, acc, x, v + w / Ops::WORDS * VSTEP, b + w / Ops::WORDS * BSTEP, w, words);
  for (int r = 0; r < R; ++r) {
    if (row + r >= a.n) break;  // the layout's padding rows
    const float bias = a.bias ? a.bias[row + r] : 0.0f;
    const float scale = a.scales ? a.scales[row + r] : 1.0f;  // int8 values: the row's scale, once (x * 1 is exact)
    for (int t = 0; t < TT; ++t) a.out[(t0 + t) * a.n + row + r] = Ops::sum(acc[r][t]) * scale + bias;
  }
}

// tokens [t0, t1) of rows [row, row + R): full TT tiles, then the remaining count
template <class Ops, int R, int TT>
inline void nm24_tokens(const Nm24Args& a, int64_t row, int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + TT <= t1; t += TT) nm24_tile<Ops, R, TT, TT == 1 ? Ops::STREAMS : 1>(a, row, t);
  if constexpr (TT > 1) {
    if (t < t1) nm24_tokens<Ops, R, TT - 1>(a, row, t, t1);
  }
}

// rows [r0, r1) for every token: R rows at a time (R divides NM24_GROUP)
template <class Ops>
inline void nm24_rows(const Nm24Args& a, int64_t r0, int64_t r1) {
  constexpr int R = Ops::R, TT = Ops::TT;
  static_assert(NM24_GROUP % R == 0, "a tile's rows lie in one group");
  const int64_t xbytes = a.kp * static_cast<int64_t>(sizeof(typename Ops::XT));
  int64_t panel = a.panel_bytes / (xbytes > 0 ? xbytes : 1);
  panel = panel < TT ? TT : panel - panel % TT;
  for (int64_t p0 = 0; p0 < a.tokens; p0 += panel) {
    const int64_t p1 = p0 + panel < a.tokens ? p0 + panel : a.tokens;
    for (int64_t row = r0; row < r1 && row < a.n; row += R) nm24_tokens<Ops, R, TT>(a, row, p0, p1);
  }
}

// rows [r0, r1) with the unit's fp32-product Ops for the weight's dtype: R=8 rows x 1 token for a
// single token (decoding: memory-bound, more rows in flight), else 4 rows x TT tokens
template <template <typename, int, int> class Ops, int TT>
inline void nm24_rows_by_dtype(const Nm24Args& a, int64_t r0, int64_t r1) {
  if (a.wdtype == NM24_F32) {
    a.tokens == 1 ? nm24_rows<Ops<float, 8, 1>>(a, r0, r1) : nm24_rows<Ops<float, 4, TT>>(a, r0, r1);
  } else if (a.wdtype == NM24_BF16) {
    a.tokens == 1 ? nm24_rows<Ops<uint16_t, 8, 1>>(a, r0, r1) : nm24_rows<Ops<uint16_t, 4, TT>>(a, r0, r1);
  } else if (a.wdtype == NM24_I8) {
    a.tokens == 1 ? nm24_rows<Ops<int8_t, 8, 1>>(a, r0, r1) : nm24_rows<Ops<int8_t, 4, TT>>(a, r0, r1);
  } else if (a.wdtype == NM24_I8_DENSE) {
    a.tokens == 1 ? nm24_rows<Ops<DenseI8, 8, 1>>(a, r0, r1) : nm24_rows<Ops<DenseI8, 4, TT>>(a, r0, r1);
  } else {
    a.tokens == 1 ? nm24_rows<Ops<Half, 8, 1>>(a, r0, r1) : nm24_rows<Ops<Half, 4, TT>>(a, r0, r1);
  }
}

}  // namespace

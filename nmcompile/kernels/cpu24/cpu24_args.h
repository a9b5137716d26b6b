// The arguments of one 2:4 CPU GEMM and the row-range entry points of each ISA (plain C++, no ATen:
// the ISA units compile for their own target and must not instantiate shared inline code).
//
// CPU layout (made once from nmcompile's packed format by nmcompile/kernels/cpu24/__init__.py): rows in
// groups of NM24_GROUP, N padded up with zero rows; per group, per 16-position word w, per row r:
//   values [groups, K/16, NM24_GROUP, 8]  the 8 kept values of word w of row r, in order;
//   bits   [groups, K/16, NM24_GROUP]     uint16, bit j set iff position 16w + j is kept (two bits
//                                          per group of 4, so exactly 8 values per word).
// A kernel step reads one contiguous run per array for all the rows it computes.
#pragma once
#include <cstdint>

constexpr int NM24_GROUP = 8;

// NM24_I8: int8 values of a row scaled by scales[row] (fp32; applied once to the row's fp32 sum);
// NM24_I8_DENSE: a dense int8 weight, scaled the same way, values [groups, K/16, NM24_GROUP, 16] (every
// position of the word, no bits); NM24_I4: 4-bit codes of the kept values with an fp16 scale per row and group of
// wgroup positions (values [groups, K/64, NM24_GROUP/2, 32] uint8, two rows a byte; quantize.py), and in place of
// the bits an index [groups, K/64, NM24_GROUP, 8] uint8: per row and step of 64 positions, byte j holds in bits
// 2L, 2L + 1 the position of kept value j of the step's word L within its group of 4 (kept value j of a word is in
// the word's group of 4 number j / 2): one 64-bit broadcast, a shift by (0, 2, 4, 6) and an `and` make the
// kernel's pairing control
// NM24_I4_DENSE: a dense 4-bit weight, values [groups, K/64, NM24_GROUP, 32] uint8 (a row's step: the low nibbles
// its words [0 | 2] in position order, the high ones [1 | 3]), scales as NM24_I4's, no bits
enum Nm24Dtype : int { NM24_F32 = 0, NM24_BF16 = 1, NM24_F16 = 2, NM24_I8 = 3, NM24_I8_DENSE = 4, NM24_I4 = 5, NM24_I4_DENSE = 6 };

struct Nm24Args {
  const void* x;          // [tokens, kp] activations, fp32 (bf16 for the bf16-pair kernels)
  int64_t tokens, k, kp;  // kp: k rounded up to 32, zero padded
  const void* values;     // CPU layout, see above
  int wdtype;             // Nm24Dtype of values
  const uint16_t* bits;   // CPU layout, see above
  const float* bias;      // [n] or nullptr
  float* out;             // [tokens, n]
  int64_t n;              // rows computed and stored (the layout holds n rounded up to NM24_GROUP)
  int64_t panel_bytes;    // activations per token panel (cpu24_op.cpp: a multiple of the L2 size)
  int64_t prefetch_bytes; // how far ahead in a tile's values stream the weight is prefetched (the
                          // bits stream, 16x smaller, a quarter of it; cpu24_op.cpp: by CPU vendor)
  const float* scales = nullptr;  // [n] per-row scales of int8 values (NM24_I8), else nullptr
  // the avx2_a8 route (cpu24_a8.cpp): x holds int8 activation codes [tokens, kp] (kp: k rounded up to 64,
  // arranged per 64 positions as words [0 | 2 | 1 | 3]) and xscales their block scales [tokens, kp / 8]
  const float* xscales = nullptr;
  // NM24_I4: fp16 scales [groups, K / wgroup, NM24_GROUP] (as uint16 bits), wgroup 64 or 128 positions
  const uint16_t* wscales = nullptr;
  int64_t wgroup = 0;
};

using Nm24Rows = void (*)(const Nm24Args&, int64_t, int64_t);

// Rows [r0, r1) (multiples of NM24_GROUP, r1 may pass n) for every token. fp32 products: the
// weight's values converted to fp32 when loaded; the `bf16` variants multiply bf16 pairs
// (activations and weights bf16).
void nm24_rows_avx2(const Nm24Args& a, int64_t r0, int64_t r1);
void nm24_rows_avx512(const Nm24Args& a, int64_t r0, int64_t r1);
void nm24_rows_avx512_bf16(const Nm24Args& a, int64_t r0, int64_t r1);
// the AVX-512 kernels' exact algorithm on plain arrays: runs anywhere, tests the AVX-512 logic
void nm24_rows_emulated512(const Nm24Args& a, int64_t r0, int64_t r1);
void nm24_rows_emulated512_bf16(const Nm24Args& a, int64_t r0, int64_t r1);
// int8 and int4 weights (NM24_I8, NM24_I8_DENSE, NM24_I4) times int8 activations in blocks of 32 (AVX2; cpu24_a8.cpp), and
// the activations' quantization: x fp32 [tokens, kp] (k used, zero padded to kp) -> q [tokens, kq] arranged
// and d [tokens, kq / 8] (kq: k rounded up to 64)
void nm24_rows_a8_avx2(const Nm24Args& a, int64_t r0, int64_t r1);
void nm24_quantize_a8(const float* x, int64_t tokens, int64_t k, int64_t kp, int8_t* q, float* d, int64_t kq);

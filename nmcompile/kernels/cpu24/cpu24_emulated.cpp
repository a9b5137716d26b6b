// The AVX-512 kernels' algorithm on plain arrays: the same chunk sizes, masks, value strides, tails
// and bf16-pair products as cpu24_avx512.cpp, lane by lane. It runs on any CPU, so the tests
// check the AVX-512 logic (blocking, tails, value offsets) where the CPU has no AVX-512; only the
// intrinsics themselves need an AVX-512 CPU to be tested.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu24_kernel.h"

namespace {

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float half_to_float(uint16_t h) {  // IEEE binary16, subnormals included
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000 | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400));
      u = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (man & 0x3FF) << 13;
    }
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return bf16_to_float(v); }
inline float to_float(Half v) { return half_to_float(v.v); }
inline float to_float(int8_t v) { return static_cast<float>(v); }

template <int L>
struct Vec { float v[L]; };

// vexpandps: lanes whose mask bit is set take the next value in order, the others zero
template <typename W, int R_, int TT_>
struct Emulated512 {
  using WT = W;
  using XT = float;
  using XV = Vec<16>;
  using WV = Vec<16>;
  using Acc = Vec<16>;
  static constexpr int WORDS = 1, R = R_, TT = TT_, STREAMS = 1;  // as cpu24_avx512.cpp
  static inline Acc zero() { return Acc{}; }
  static inline XV load_x(const float* p) { XV x; std::memcpy(x.v, p, sizeof x.v); return x; }
  static inline WV expand(const W* v, const uint16_t* b, int64_t) {
    WV w{};
    if constexpr (std::is_same_v<W, DenseI8>) {  // every position: 16 values, no bits
      for (int j = 0; j < 16; ++j) w.v[j] = static_cast<float>(v[j].v);
    } else {
      const unsigned m = *b;
      for (int j = 0, next = 0; j < 16; ++j) w.v[j] = (m >> j) & 1 ? to_float(v[next++]) : 0.0f;
    }
    return w;
  }
  static inline Acc madd(Acc acc, const WV& w, const XV& x) {
    for (int j = 0; j < 16; ++j) acc.v[j] += w.v[j] * x.v[j];
    return acc;
  }
  static inline float sum(const Acc& a) {  // a pairwise tree, as _mm512_reduce_add_ps
    float s[16];
    std::memcpy(s, a.v, sizeof s);
    for (int width = 8; width >= 1; width /= 2)
      for (int j = 0; j < width; ++j) s[j] += s[j + width];
    return s[0];
  }
};

// vpexpandw over 32 positions, then vdpbf16ps: lane i += w[2i+1] x[2i+1], then += w[2i] x[2i]
struct Emulated512Bf16 {
  using WT = uint16_t;
  using XT = uint16_t;
  struct V32 { uint16_t v[32]; };
  using XV = V32;
  using WV = V32;
  using Acc = Vec<16>;
  static constexpr int WORDS = 2, R = 4, TT = 4, STREAMS = 1;
  static inline Acc zero() { return Acc{}; }
  static inline XV load_x(const uint16_t* p) { XV x; std::memcpy(x.v, p, sizeof x.v); return x; }
  static inline WV expand(const uint16_t* v, const uint16_t* b, int64_t words_left) {
    uint16_t kept[16] = {};
    std::memcpy(kept, v, 8 * sizeof(uint16_t));
    uint32_t m = b[0];
    if (words_left >= 2) {  // the next word of this row: one group of rows further on
      std::memcpy(kept + 8, v + NM24_GROUP * 8, 8 * sizeof(uint16_t));
      m |= static_cast<uint32_t>(b[NM24_GROUP]) << 16;
    }
    WV w{};
    for (int j = 0, next = 0; j < 32; ++j) w.v[j] = (m >> j) & 1 ? kept[next++] : 0;
    return w;
  }
  static inline Acc madd(Acc acc, const WV& w, const XV& x) {
    for (int i = 0; i < 16; ++i) {
      acc.v[i] += bf16_to_float(w.v[2 * i + 1]) * bf16_to_float(x.v[2 * i + 1]);
      acc.v[i] += bf16_to_float(w.v[2 * i]) * bf16_to_float(x.v[2 * i]);
    }
    return acc;
  }
  static inline float sum(const Acc& a) { return Emulated512<float, 1, 1>::sum(a); }
};

}  // namespace

void nm24_rows_emulated512(const Nm24Args& a, int64_t r0, int64_t r1) { nm24_rows_by_dtype<Emulated512, 4>(a, r0, r1); }

void nm24_rows_emulated512_bf16(const Nm24Args& a, int64_t r0, int64_t r1) { nm24_rows<Emulated512Bf16>(a, r0, r1); }

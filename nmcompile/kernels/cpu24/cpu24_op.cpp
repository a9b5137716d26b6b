// nmsparse::cpu24_* ops: the 2:4 CPU linear, its ISA report and the dense unpacking of its layout.
//
//   cpu24_linear(x, values, bits, bias, weight, out_features, max_tokens, isa) = F.linear(x, W, bias),
//     W the [out_features, K] 2:4 weight that values/bits hold (layout: cpu24_args.h). Calls with more than max_tokens rows
//     (max_tokens >= 0) take the dense GEMM: on `weight` when it is given, else on W unpacked for the
//     call. isa: "avx512_bf16", "avx512", "avx2", "emulated512", "emulated512_bf16"; the int8 ops also take
//     "avx2_a8": the activations quantized to int8 in blocks of 32 and multiplied as integers (cpu24_a8.cpp).
//   cpu24_linear_q8(x, values, bits, scales, bias, out_features, max_tokens, isa): the same with int8 values,
//     row r scaled by scales[r] (fp32), for fp32, bf16 or fp16 inputs (the output in the input's dtype); calls
//     above max_tokens take the dense GEMM on W dequantized into the input's dtype for the call. No autograd.
//   cpu24_dense_q8(x, values, scales, bias, out_features, max_tokens, isa): F.linear with a dense int8 weight,
//     values [groups, K/16, NM24_GROUP, 16] (the CPU layout with every position kept), row r scaled by scales[r];
//     calls above max_tokens take the dense GEMM on the weight dequantized for the call. No autograd.
//   cpu24_linear_q4(x, values, index, scales, bias, out_features, group, max_tokens, isa): the same with 4-bit codes
//     of the kept values and their positions as an index, an fp16 scale per row and group of `group` positions (64 or 128; NM24_I4 in
//     cpu24_args.h, nmcompile/kernels/cpu24/quantize.py), on isa "avx2_a8" only; calls above max_tokens take
//     the dense GEMM on W dequantized into the input's dtype for the call. No autograd.
//   cpu24_dense_q4(x, values, scales, bias, out_features, group, max_tokens, isa): F.linear with a dense 4-bit weight
//     (NM24_I4_DENSE), an fp16 scale per row and group; on isa "avx2_a8" only. No autograd.
//   cpu24_isa() -> bits of what this CPU runs: 1 avx2+fma+f16c, 2 avx512 f/bw/vl, 4 avx512 vbmi2+bf16.
//   cpu24_unpack(values, bits, out_features) -> the dense [out_features, K] weight.
//   cpu24_split_probe(x, values, bits, out_features, isa, slow_thread, slow_us, route) -> (out, chunks per
//     thread, route, pool calls left): the sparse product with one thread slowed down, for tests of the work split
//     (cpu24_split.h).
#include <cpuid.h>
#include <unistd.h>

#include <string>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu24_args.h"
#include "cpu24_split.h"

namespace {

int64_t detect_isa_flags() {
  int64_t flags = 0;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) flags |= 1;
  if ((flags & 1) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    flags |= 2;
  if ((flags & 2) && __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("avx512bf16")) flags |= 4;
  return flags;
}

// once per process: CPUID traps to the hypervisor in a VM (microseconds), too slow for every call
int64_t isa_flags() {
  static const int64_t flags = detect_isa_flags();
  return flags;
}

// Token panels of 4x this core's L2 of activations. On the 2-core Zen 3 VM (512 KB L2, 32 MB L3),
// fp32 [4096, 11008]: 8 tokens ran 2.0x faster with 512 KB panels than with 128 KB (the weight
// streamed from memory twice instead of four times), and 16 tokens 1.15x faster again with 2 MB
// (one pass; the panel's activations are reread from L3, far cheaper than the weight from memory).
int64_t panel_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);  // 0 or -1 where the OS does not say
    const int64_t per_core = l2 >= 128 * 1024 && l2 <= 8 * 1024 * 1024 ? l2 : 512 * 1024;
    return 4 * per_core;
  }();
  return bytes;
}

// How far ahead the kernel prefetches the weight streams (cpu24_args.h). One token, fp32: on
// the 2-core Zen 3 VM each doubling from 2 KB to 32 KB gained 0-7%, no prefetch was 12-22% slower
// than 16 KB, and 64 KB gained nothing; on a 2-core Sapphire Rapids VM (48 KB L1D) 1-2 KB streamed
// 10.7-11.5 GB/s against 8.6-8.9 at 32 KB and 8.9-10.1 at 4 KB, AVX2 and AVX-512 alike (prefetches
// land in L1, where 32 KB ahead is evicted before it is read).
int64_t prefetch_bytes() {
  static const int64_t bytes = [] {
    unsigned eax = 0, vendor[3] = {0, 0, 0};
    __get_cpuid(0, &eax, &vendor[0], &vendor[2], &vendor[1]);  // ebx, edx, ecx: "Genu" "ineI" "ntel"
    return std::string(reinterpret_cast<const char*>(vendor), 12) == "GenuineIntel" ? 2048 : 32768;
  }();
  return bytes;
}

struct Isa {
  Nm24Rows rows;
  int64_t needs;  // isa_flags() bits
  bool bf16_pairs;
  Nm24Rows few_tokens;  // the rows of a call of at most kFewTokens tokens (same activation layout), null: `rows`
  bool a8 = false;      // int8 weights times activations quantized to int8 in blocks of 32 (cpu24_a8.cpp)
};

// "avx512" runs one or two tokens with the AVX2 rows. On a Zen 5 core (1 thread, 8-16 cold [8192, 2048]
// layers; benchmarks/cpu/cpu24_isa.py): one token tied with AVX2 at 4 streams each (fp32 9.1 against 9.4 ms,
// bf16 4.9 against 4.8); two tokens took 14.6 ms in AVX-512 against 10.6 in AVX2 (fp32; bf16 14.0
// against 6.9); from 3 tokens on, AVX-512 was the faster in fp32 (4 tokens: 13.1 against 16.9 ms; 64:
// 125 against 215 ms).
constexpr int64_t kFewTokens = 2;

Isa isa_of(c10::string_view name) {
  if (name == "avx2") return {nm24_rows_avx2, 1, false, nullptr};
  if (name == "avx512") return {nm24_rows_avx512, 2, false, nm24_rows_avx2};
  if (name == "avx512_bf16") return {nm24_rows_avx512_bf16, 4, true, nullptr};
  if (name == "emulated512") return {nm24_rows_emulated512, 0, false, nullptr};
  if (name == "emulated512_bf16") return {nm24_rows_emulated512_bf16, 0, true, nullptr};
  if (name == "avx2_a8") return {nm24_rows_a8_avx2, 1, false, nullptr, true};
  TORCH_CHECK(false, "nmsparse::cpu24_linear: unknown isa '", std::string(name),
              "'; accepted: avx512_bf16, avx512, avx2, emulated512, emulated512_bf16, avx2_a8 (int8 weights)");
}

// "[2, 48]": shapes in messages are formatted here, not streamed as IntArrayRef (an extension built on a GPU
// machine's host, torch 2.11, crashed while formatting that message for a refused input)
std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

int wdtype_of(at::ScalarType t) {
  if (t == at::kFloat) return NM24_F32;
  if (t == at::kBFloat16) return NM24_BF16;
  if (t == at::kChar) return NM24_I8;
  TORCH_CHECK(t == at::kHalf, "nmsparse::cpu24_linear takes fp32, bf16, fp16 or int8 weights, got ", t);
  return NM24_F16;
}

void check_layout(const at::Tensor& values, const at::Tensor& bits, int64_t n) {
  TORCH_CHECK(values.dim() == 4 && bits.dim() == 3 && values.size(2) == NM24_GROUP && values.size(3) == 8 &&
                  bits.size(0) == values.size(0) && bits.size(1) == values.size(1) && bits.size(2) == NM24_GROUP,
              "nmsparse::cpu24: expected the CPU layout values [groups, K/16, ", NM24_GROUP, ", 8] and bits [groups, "
              "K/16, ", NM24_GROUP, "] (nmcompile.kernels.cpu24.cpu_layout), got ", shape_str(values), " and ", shape_str(bits));
  TORCH_CHECK(n > (values.size(0) - 1) * NM24_GROUP && n <= values.size(0) * NM24_GROUP,
              "nmsparse::cpu24: out_features ", n, " does not fit ", values.size(0), " groups of ", NM24_GROUP, " rows");
  TORCH_CHECK(bits.scalar_type() == at::kShort, "nmsparse::cpu24: bits must be int16, got ", bits.scalar_type());
  TORCH_CHECK(values.device().is_cpu() && bits.device().is_cpu(), "nmsparse::cpu24 runs on CPU tensors");
  TORCH_CHECK(values.is_contiguous() && bits.is_contiguous(), "nmsparse::cpu24: values and bits must be contiguous");
}

// For each 8 position bits: where each position's value sits among the kept ones (8: dropped), and
// how many are kept. Built at compile time.
struct RankTable {
  uint8_t index[256][8];
  uint8_t count[256];
  constexpr RankTable() : index{}, count{} {
    for (int m = 0; m < 256; ++m) {
      int rank = 0;
      for (int j = 0; j < 8; ++j) index[m][j] = static_cast<uint8_t>((m >> j) & 1 ? rank++ : 8);
      count[m] = static_cast<uint8_t>(rank);
    }
  }
};
constexpr RankTable kRank{};

// rows [r0, r1) of the dense weight from the layout, on the values' raw bits (0 is +0.0 in every
// dtype): each position reads its value, or the zero after a word's 8 values, by table, without a
// branch or a popcount call (this unit targets any x86-64). A branch per position and a popcount per
// position ran 12-16 ms for a bf16 [8192, 2048] weight on a Zen 5 core: slower than the dense GEMM of
// 64 tokens it was made for.
struct Same {
  template <typename Raw>
  Raw operator()(Raw v, int64_t) const { return v; }
};

// int8 values times their row's scale, in the output dtype
template <typename Out>
struct Dequant {
  const float* scales;
  Out operator()(int8_t v, int64_t r) const { return static_cast<Out>(static_cast<float>(v) * scales[r]); }
};

// one word of a row: its 8 kept values (word[8] = 0) at their positions of out[0..16) (bits m)
template <typename Raw, typename Out, typename Conv>
inline void place_word(unsigned m, const Raw* word, Out* out, Conv conv, int64_t r) {
  const uint8_t* low = kRank.index[m & 0xFF];
  const uint8_t* high = kRank.index[m >> 8];
  const int before = kRank.count[m & 0xFF];
  for (int j = 0; j < 8; ++j) out[j] = conv(word[low[j]], r);
  for (int j = 0; j < 8; ++j) out[8 + j] = conv(word[high[j] + before < 8 ? high[j] + before : 8], r);
}

template <typename Raw, typename Out = Raw, typename Conv = Same>
void unpack_rows(const Raw* v, const uint16_t* b, Out* d, int64_t words, int64_t r0, int64_t r1, Conv conv = {}) {
  const int64_t k = words * 16;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t group = r / NM24_GROUP, within = r % NM24_GROUP;
    Out* row = d + r * k;
    for (int64_t w = 0; w < words; ++w) {
      const int64_t at = (group * words + w) * NM24_GROUP + within;
      Raw word[9];
      for (int j = 0; j < 8; ++j) word[j] = v[at * 8 + j];
      word[8] = 0;
      place_word(b[at], word, row + w * 16, conv, r);
    }
  }
}

// the 4-bit layout (NM24_I4, cpu24_args.h) dequantized: code times its row's and group's fp16 scale, at the
// position its index gives (kept value j of a word: group of 4 positions j / 2, 2 bits of index within it)
template <typename Out>
void unpack_rows4(const uint8_t* v, const uint8_t* index, const at::Half* scales, Out* d, int64_t steps, int64_t wgroup,
                  int64_t r0, int64_t r1) {
  const int64_t k = steps * 64, per_row = k / wgroup;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t group = r / NM24_GROUP, within = r % NM24_GROUP;
    const int shift = within % 2 ? 4 : 0;  // the pair's second row: the high nibbles
    Out* row = d + r * k;
    for (int64_t i = 0; i < k; ++i) row[i] = static_cast<Out>(0.0f);
    for (int64_t s = 0; s < steps; ++s) {
      const uint8_t* codes = v + ((group * steps + s) * (NM24_GROUP / 2) + within / 2) * 32;
      const uint8_t* at = index + ((group * steps + s) * NM24_GROUP + within) * 8;
      const float scale = static_cast<float>(scales[(group * per_row + s * 64 / wgroup) * NM24_GROUP + within]);
      for (int word = 0; word < 4; ++word)
        for (int j = 0; j < 8; ++j) {
          const int code = ((codes[word / 2 * 16 + word % 2 * 8 + j] >> shift) & 0x0F) - 8;
          const int position = 4 * (j / 2) + ((at[j] >> (2 * word)) & 3);
          row[s * 64 + word * 16 + position] = static_cast<Out>(static_cast<float>(code) * scale);
        }
    }
  }
}

// the layout unpacked into `dense` [n, K] (contiguous, the values' dtype)
void unpack_into(const at::Tensor& values, const at::Tensor& bits, int64_t n, at::Tensor& dense) {
  const int64_t words = bits.size(1);
  const uint16_t* b = reinterpret_cast<const uint16_t*>(bits.data_ptr<int16_t>());
  const int wdtype = wdtype_of(values.scalar_type());  // fp32, bf16, fp16 or int8, else a named error
  const bool wide = wdtype == NM24_F32;
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    if (wdtype == NM24_I8)
      unpack_rows(static_cast<const uint8_t*>(values.data_ptr()), b, static_cast<uint8_t*>(dense.data_ptr()), words, r0, r1);
    else if (wide)
      unpack_rows(static_cast<const uint32_t*>(values.data_ptr()), b, static_cast<uint32_t*>(dense.data_ptr()), words, r0, r1);
    else
      unpack_rows(static_cast<const uint16_t*>(values.data_ptr()), b, static_cast<uint16_t*>(dense.data_ptr()), words, r0, r1);
  });
}

at::Tensor cpu24_unpack(const at::Tensor& values, const at::Tensor& bits, int64_t n) {
  check_layout(values, bits, n);
  auto dense = at::empty({n, bits.size(1) * 16}, values.options());  // every position is written
  unpack_into(values, bits, n, dense);
  return dense;
}

// The dense route of a weight held packed only unpacks it for one GEMM. Fresh memory of that size
// costs a page fault per 4 KB (a bf16 [8192, 2048] weight, 33.5 MB: 7.8 ms on a Zen 5 VM, against 0.3 ms
// to fill memory already mapped), so each calling thread unpacks into one buffer it keeps, the size of
// the largest weight it has unpacked. Only this route uses it; cpu24_unpack returns a tensor of its own.
at::Tensor unpacked_for_gemm(const at::Tensor& values, const at::Tensor& bits, int64_t n) {
  thread_local at::Tensor buffer;
  const int64_t k = bits.size(1) * 16, bytes = n * k * values.element_size();
  if (!buffer.defined() || buffer.numel() < bytes) {
    buffer = at::Tensor();  // the old one freed first
    buffer = at::empty({bytes}, values.options().dtype(at::kByte));
  }
  auto dense = buffer.narrow(0, 0, bytes).view(values.scalar_type()).view({n, k});
  unpack_into(values, bits, n, dense);
  return dense;
}

// the int8 layout dequantized (values times their row's scale) into the kept buffer, in `dtype`: the dense
// route of cpu24_linear_q8
at::Tensor dequantized_for_gemm(const at::Tensor& values, const at::Tensor& bits, const at::Tensor& scales,
                                int64_t n, at::ScalarType dtype) {
  thread_local at::Tensor buffer;
  const int64_t k = bits.size(1) * 16, bytes = n * k * at::elementSize(dtype);
  if (!buffer.defined() || buffer.numel() < bytes) {
    buffer = at::Tensor();
    buffer = at::empty({bytes}, values.options().dtype(at::kByte));
  }
  auto dense = buffer.narrow(0, 0, bytes).view(dtype).view({n, k});
  const int64_t words = bits.size(1);
  const auto* v = static_cast<const int8_t*>(values.data_ptr());
  const auto* b = reinterpret_cast<const uint16_t*>(bits.data_ptr<int16_t>());
  const float* s = scales.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    if (dtype == at::kFloat)
      unpack_rows(v, b, dense.data_ptr<float>(), words, r0, r1, Dequant<float>{s});
    else if (dtype == at::kBFloat16)
      unpack_rows(v, b, dense.data_ptr<at::BFloat16>(), words, r0, r1, Dequant<at::BFloat16>{s});
    else
      unpack_rows(v, b, dense.data_ptr<at::Half>(), words, r0, r1, Dequant<at::Half>{s});
  });
  return dense;
}

// the 4-bit layout dequantized into the kept buffer, in `dtype`: the dense route of cpu24_linear_q4
at::Tensor dequantized4_for_gemm(const at::Tensor& values, const at::Tensor& index, const at::Tensor& scales,
                                 int64_t wgroup, int64_t n, at::ScalarType dtype) {
  thread_local at::Tensor buffer;
  const int64_t steps = values.size(1), k = steps * 64, bytes = n * k * at::elementSize(dtype);
  if (!buffer.defined() || buffer.numel() < bytes) {
    buffer = at::Tensor();
    buffer = at::empty({bytes}, values.options().dtype(at::kByte));
  }
  auto dense = buffer.narrow(0, 0, bytes).view(dtype).view({n, k});
  const auto* v = values.data_ptr<uint8_t>();
  const auto* x = index.data_ptr<uint8_t>();
  const at::Half* s = scales.data_ptr<at::Half>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    if (dtype == at::kFloat)
      unpack_rows4(v, x, s, dense.data_ptr<float>(), steps, wgroup, r0, r1);
    else if (dtype == at::kBFloat16)
      unpack_rows4(v, x, s, dense.data_ptr<at::BFloat16>(), steps, wgroup, r0, r1);
    else
      unpack_rows4(v, x, s, dense.data_ptr<at::Half>(), steps, wgroup, r0, r1);
  });
  return dense;
}

// a dense 4-bit weight (NM24_I4_DENSE) dequantized, in `dtype`: the dense route of cpu24_dense_q4 (a new tensor:
// the output head, the one such weight of a model)
at::Tensor dense4_for_gemm(const at::Tensor& values, const at::Tensor& scales, int64_t wgroup, int64_t n,
                           at::ScalarType dtype) {
  const int64_t steps = values.size(1), k = steps * 64, per_row = k / wgroup;
  auto dense = at::empty({n, k}, values.options().dtype(at::kFloat));
  const auto* v = values.data_ptr<uint8_t>();
  const at::Half* sc = scales.data_ptr<at::Half>();
  float* d = dense.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t group = r / NM24_GROUP, within = r % NM24_GROUP;
      for (int64_t s = 0; s < steps; ++s) {
        const uint8_t* codes = v + ((group * steps + s) * NM24_GROUP + within) * 32;
        const float scale = static_cast<float>(sc[(group * per_row + s * 64 / wgroup) * NM24_GROUP + within]);
        float* out = d + r * k + s * 64;
        for (int i = 0; i < 32; ++i) {  // byte i: words [0 | 2] low, [1 | 3] high
          const int word = 2 * (i / 16), at = i % 16;
          out[word * 16 + at] = static_cast<float>((codes[i] & 0x0F) - 8) * scale;
          out[(word + 1) * 16 + at] = static_cast<float>((codes[i] >> 4) - 8) * scale;
        }
      }
    }
  });
  return dense.to(dtype);
}

// x [tokens, k] (bf16, contiguous) as fp32 [tokens, kp], zero padded; and the fp32 product back in
// bf16 (round to nearest even, as Tensor.to). Plain loops, not Tensor.to and constant_pad_nd: at one
// token those cost some 4 us a call in dispatch and allocation, more than converting a few thousand
// values (a 1B Llama's decoding step makes 112 calls).
constexpr int64_t kLoopElements = int64_t{1} << 16;

at::Tensor widened(const at::Tensor& x, int64_t kp) {
  const int64_t tokens = x.size(0), k = x.size(1);
  auto xs = at::empty({tokens, kp}, x.options().dtype(at::kFloat));
  float* d = xs.data_ptr<float>();
  const at::BFloat16* s = x.data_ptr<at::BFloat16>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < k; ++i) d[t * kp + i] = static_cast<float>(s[t * k + i]);
    for (int64_t i = k; i < kp; ++i) d[t * kp + i] = 0.0f;
  }
  return xs;
}

at::Tensor narrowed(const at::Tensor& out) {
  auto o = at::empty(out.sizes(), out.options().dtype(at::kBFloat16));
  const float* s = out.data_ptr<float>();
  at::BFloat16* d = o.data_ptr<at::BFloat16>();
  for (int64_t i = 0, n = out.numel(); i < n; ++i) d[i] = static_cast<at::BFloat16>(s[i]);
  return o;
}

// the 2:4 product of every row of x (no dense fallback); probe: the split's test hook, else null
// (bits undefined: a dense int8 weight, NM24_I8_DENSE)
at::Tensor sparse_product(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bits,
                          const c10::optional<at::Tensor>& bias, int64_t n, c10::string_view isa_name,
                          SplitProbe* probe, const float* scales = nullptr, const at::Tensor& wscales = {},
                          int64_t wgroup = 0) {
  const bool q4 = values.scalar_type() == at::kByte;  // NM24_I4: the values hold K/64 steps, `bits` the index
  const int64_t k = values.size(1) * (q4 ? 64 : 16);
  const int64_t tokens = k ? x.numel() / k : 0;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  const Isa isa = isa_of(isa_name);
  TORCH_CHECK((isa_flags() & isa.needs) == isa.needs, "nmsparse::cpu24_linear: this CPU cannot run isa '",
              std::string(isa_name), "' (cpu24_isa() = ", isa_flags(), ")");
  TORCH_CHECK(!isa.bf16_pairs || values.scalar_type() == at::kBFloat16,
              "nmsparse::cpu24_linear: isa '", std::string(isa_name), "' takes bf16 weights and inputs");
  TORCH_CHECK(!isa.a8 || values.scalar_type() == at::kChar || q4, "nmsparse::cpu24_linear: isa '", std::string(isa_name),
              "' quantizes the activations for int8 and 4-bit weights (cpu24_linear_q8, cpu24_dense_q8, cpu24_linear_q4); ",
              values.scalar_type(), " weights take avx2, avx512 or avx512_bf16");
  TORCH_CHECK(!q4 || isa.a8, "nmsparse::cpu24_linear_q4, cpu24_dense_q4: 4-bit weights run on isa 'avx2_a8' only, got '",
              std::string(isa_name), "'");
  if (tokens == 0) return at::zeros(out_shape, x.options());
  const int64_t kp = (k + 31) / 32 * 32;
  at::Tensor xs;
  // the plain loops where their cost is smaller than a dispatched op's: bf16 (a shift each way) at
  // decoding sizes; fp16 (no F16C in this unit) and prefill sizes take Tensor.to's vector kernels
  const bool loops = !isa.bf16_pairs && x.scalar_type() == at::kBFloat16 && x.numel() <= kLoopElements &&
                     tokens * n <= kLoopElements;
  if (!loops) {
    xs = x.reshape({tokens, k}).to(isa.bf16_pairs ? at::kBFloat16 : at::kFloat);
    if (kp != k) xs = at::constant_pad_nd(xs, {0, kp - k});
    xs = xs.contiguous();
  } else {
    xs = widened(x.reshape({tokens, k}).contiguous(), kp);
  }
  at::Tensor b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "nmsparse::cpu24_linear: bias ", shape_str(*bias),
                " does not match out_features ", n);
    b32 = bias->to(at::kFloat).contiguous();
  }
  auto out = at::empty({tokens, n}, x.options().dtype(at::kFloat));
  // a dense weight's kernel never reads bits: the pointer is the values' (in bounds, as each step's address is)
  const auto* bits_ptr = bits.defined() ? static_cast<const uint16_t*>(bits.data_ptr())
                                        : static_cast<const uint16_t*>(values.data_ptr());
  Nm24Args a{xs.data_ptr(), tokens, k, kp, values.data_ptr(),
             q4 ? (bits.defined() ? NM24_I4 : NM24_I4_DENSE) : bits.defined() ? wdtype_of(values.scalar_type()) : NM24_I8_DENSE,
             bits_ptr, b32.defined() ? b32.data_ptr<float>() : nullptr,
             out.data_ptr<float>(), n, panel_bytes(), prefetch_bytes(), scales};
  if (q4) {
    a.wscales = reinterpret_cast<const uint16_t*>(wscales.data_ptr<at::Half>());
    a.wgroup = wgroup;
  }
  at::Tensor codes, blocks;  // the avx2_a8 route's activations, int8 in blocks of 32
  if (isa.a8) {
    const int64_t kq = (k + 63) / 64 * 64;
    codes = at::empty({tokens, kq}, x.options().dtype(at::kChar));
    blocks = at::empty({tokens, kq / 8}, x.options().dtype(at::kFloat));
    nm24_quantize_a8(xs.data_ptr<float>(), tokens, k, kp, codes.data_ptr<int8_t>(), blocks.data_ptr<float>(), kq);
    a.x = codes.data_ptr();
    a.kp = kq;
    a.xscales = blocks.data_ptr<float>();
  }
  nm24_split(tokens <= kFewTokens && isa.few_tokens ? isa.few_tokens : isa.rows, a, values.size(0), probe);
  return (loops ? narrowed(out) : out.to(x.scalar_type())).view(out_shape);
}

void check_input(const at::Tensor& x, const at::Tensor& values, int64_t k) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "nmsparse::cpu24_linear: input ", shape_str(x),
              " does not match the weight's in_features ", k);
  TORCH_CHECK(x.scalar_type() == values.scalar_type(), "nmsparse::cpu24_linear: input dtype ", x.scalar_type(),
              " differs from the weight's ", values.scalar_type(), " (as for F.linear, cast one of them)");
}

at::Tensor cpu24_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bits,
                        const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& weight,
                        int64_t n, int64_t max_tokens, c10::string_view isa_name) {
  check_layout(values, bits, n);
  const int64_t k = bits.size(1) * 16;
  check_input(x, values, k);
  const int64_t tokens = k ? x.numel() / k : 0;
  if (max_tokens >= 0 && tokens > max_tokens) {  // the measured range ends here: dense GEMM
    const bool resident = weight.has_value() && weight->defined() && weight->numel() > 0;
    return at::linear(x, resident ? *weight : unpacked_for_gemm(values, bits, n), bias);
  }
  return sparse_product(x, values, bits, bias, n, isa_name, nullptr);
}

void check_q8_input(const at::Tensor& x, const at::Tensor& scales, int64_t n, int64_t k, c10::string_view isa_name,
                    const char* op) {
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.size(0) == n && scales.is_contiguous() &&
                  scales.device().is_cpu(),
              op, ": scales must be a contiguous fp32 CPU tensor [", n, "] (one per output row), got ", shape_str(scales),
              " ", scales.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, op, ": input ", shape_str(x), " does not match the weight's in_features ", k);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              " takes fp32, bf16 or fp16 inputs, got ", dtype);
  TORCH_CHECK(isa_name != "avx512_bf16" && isa_name != "emulated512_bf16", op, ": isa '", std::string(isa_name),
              "' multiplies bf16 pairs; int8 values take avx2, avx512, emulated512 or avx2_a8");
}

at::Tensor cpu24_linear_q8(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bits,
                           const at::Tensor& scales, const c10::optional<at::Tensor>& bias, int64_t n,
                           int64_t max_tokens, c10::string_view isa_name) {
  check_layout(values, bits, n);
  TORCH_CHECK(values.scalar_type() == at::kChar, "nmsparse::cpu24_linear_q8 takes int8 values, got ", values.scalar_type(),
              " (nmsparse::cpu24_linear takes float ones)");
  const int64_t k = bits.size(1) * 16;
  const auto dtype = x.scalar_type();
  check_q8_input(x, scales, n, k, isa_name, "nmsparse::cpu24_linear_q8");
  const int64_t tokens = k ? x.numel() / k : 0;
  if (max_tokens >= 0 && tokens > max_tokens)  // the measured range ends here: dense GEMM
    return at::linear(x, dequantized_for_gemm(values, bits, scales, n, dtype), bias);
  return sparse_product(x, values, bits, bias, n, isa_name, nullptr, scales.data_ptr<float>());
}

at::Tensor cpu24_dense_q8(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias, int64_t n, int64_t max_tokens, c10::string_view isa_name) {
  TORCH_CHECK(values.dim() == 4 && values.size(2) == NM24_GROUP && values.size(3) == 16 && values.scalar_type() == at::kChar &&
                  values.is_contiguous() && values.device().is_cpu(),
              "nmsparse::cpu24_dense_q8: expected contiguous int8 CPU values [groups, K/16, ", NM24_GROUP, ", 16], got ",
              shape_str(values), " ", values.scalar_type());
  TORCH_CHECK(n > (values.size(0) - 1) * NM24_GROUP && n <= values.size(0) * NM24_GROUP,
              "nmsparse::cpu24_dense_q8: out_features ", n, " does not fit ", values.size(0), " groups of ", NM24_GROUP, " rows");
  const int64_t k = values.size(1) * 16;
  check_q8_input(x, scales, n, k, isa_name, "nmsparse::cpu24_dense_q8");
  const int64_t tokens = k ? x.numel() / k : 0;
  if (max_tokens >= 0 && tokens > max_tokens) {  // the dense GEMM on the weight dequantized for the call
    auto w = values.permute({0, 2, 1, 3}).reshape({values.size(0) * NM24_GROUP, k}).narrow(0, 0, n);
    return at::linear(x, (w.to(at::kFloat) * scales.unsqueeze(1)).to(x.scalar_type()), bias);
  }
  return sparse_product(x, values, at::Tensor(), bias, n, isa_name, nullptr, scales.data_ptr<float>());
}

// the checks the two 4-bit ops share: the group, the scales [groups, K/group, NM24_GROUP] (fp16), out_features, the
// input; the number of tokens
int64_t check_q4(const char* op, const at::Tensor& x, const at::Tensor& scales, int64_t groups, int64_t k, int64_t n,
                 int64_t group) {
  TORCH_CHECK(group == 64 || group == 128, op, ": group is 64 or 128 positions, got ", group);
  TORCH_CHECK(k % group == 0, op, ": in_features ", k, " is not a multiple of group ", group);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == groups && scales.size(1) == k / group && scales.size(2) == NM24_GROUP &&
                  scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.device().is_cpu(),
              op, ": expected contiguous fp16 CPU scales [", groups, ", ", k / group, ", ", NM24_GROUP, "], got ",
              shape_str(scales), " ", scales.scalar_type());
  TORCH_CHECK(n > (groups - 1) * NM24_GROUP && n <= groups * NM24_GROUP,
              op, ": out_features ", n, " does not fit ", groups, " groups of ", NM24_GROUP, " rows");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, op, ": input ", shape_str(x), " does not match the weight's in_features ", k);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              " takes fp32, bf16 or fp16 inputs, got ", dtype);
  return k ? x.numel() / k : 0;
}

at::Tensor cpu24_linear_q4(const at::Tensor& x, const at::Tensor& values, const at::Tensor& index,
                           const at::Tensor& scales, const c10::optional<at::Tensor>& bias, int64_t n, int64_t group,
                           int64_t max_tokens, c10::string_view isa_name) {
  const char* op = "nmsparse::cpu24_linear_q4";
  TORCH_CHECK(values.dim() == 4 && values.size(2) == NM24_GROUP / 2 && values.size(3) == 32 &&
                  values.scalar_type() == at::kByte && values.is_contiguous() && values.device().is_cpu(),
              op, ": expected contiguous uint8 CPU values [groups, K/64, ", NM24_GROUP / 2, ", 32], got ",
              shape_str(values), " ", values.scalar_type());
  const int64_t groups = values.size(0), k = values.size(1) * 64;
  TORCH_CHECK(index.dim() == 4 && index.size(0) == groups && index.size(1) == k / 64 && index.size(2) == NM24_GROUP &&
                  index.size(3) == 8 && index.scalar_type() == at::kByte && index.is_contiguous() && index.device().is_cpu(),
              op, ": expected a contiguous uint8 CPU index [", groups, ", ", k / 64, ", ", NM24_GROUP, ", 8], got ",
              shape_str(index), " ", index.scalar_type());
  const int64_t tokens = check_q4(op, x, scales, groups, k, n, group);
  const auto dtype = x.scalar_type();
  if (max_tokens >= 0 && tokens > max_tokens)  // the measured range ends here: dense GEMM
    return at::linear(x, dequantized4_for_gemm(values, index, scales, group, n, dtype), bias);
  return sparse_product(x, values, index, bias, n, isa_name, nullptr, nullptr, scales, group);
}

at::Tensor cpu24_dense_q4(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& bias, int64_t n, int64_t group, int64_t max_tokens,
                          c10::string_view isa_name) {
  const char* op = "nmsparse::cpu24_dense_q4";
  TORCH_CHECK(values.dim() == 4 && values.size(2) == NM24_GROUP && values.size(3) == 32 && values.scalar_type() == at::kByte &&
                  values.is_contiguous() && values.device().is_cpu(),
              op, ": expected contiguous uint8 CPU values [groups, K/64, ", NM24_GROUP, ", 32], got ", shape_str(values),
              " ", values.scalar_type());
  const int64_t groups = values.size(0), k = values.size(1) * 64;
  const int64_t tokens = check_q4(op, x, scales, groups, k, n, group);
  const auto dtype = x.scalar_type();
  if (max_tokens >= 0 && tokens > max_tokens)  // the dense GEMM on the weight dequantized for the call
    return at::linear(x, dense4_for_gemm(values, scales, group, n, dtype), bias);
  return sparse_product(x, values, at::Tensor(), bias, n, isa_name, nullptr, nullptr, scales, group);
}

// cpu24_linear's sparse product with thread `slow_thread` (0 the caller, 1.. the others) sleeping
// slow_us before each chunk it claims, on `route` (-1 as a real call decides, 1 the OpenMP team, 2
// the inter-op pool); returns the output, the chunks each thread computed, the route taken (0 one
// thread, 1, 2) and the calls left that take the pool after this one: tests of the work split
// (cpu24_split.h)
std::tuple<at::Tensor, at::Tensor, int64_t, int64_t> cpu24_split_probe(const at::Tensor& x, const at::Tensor& values,
                                                              const at::Tensor& bits, int64_t n, c10::string_view isa_name,
                                                              int64_t slow_thread, int64_t slow_us, int64_t route) {
  check_layout(values, bits, n);
  check_input(x, values, bits.size(1) * 16);
  TORCH_CHECK(route >= -1 && route <= 2 && route != 0, "nmsparse::cpu24_split_probe: route is -1, 1 or 2, got ", route);
  SplitProbe probe;
  probe.slow_thread = slow_thread;
  probe.slow_us = slow_us;
  probe.route = route;
  auto out = sparse_product(x, values, bits, c10::nullopt, n, isa_name, &probe);
  return {out, at::tensor(probe.chunks, at::kLong), probe.route, probe.pool_calls_left};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nmsparse, m) {
  m.def("cpu24_linear(Tensor x, Tensor values, Tensor bits, Tensor? bias, Tensor? weight, int out_features, int max_tokens, str isa) -> Tensor");
  m.def("cpu24_linear_q8(Tensor x, Tensor values, Tensor bits, Tensor scales, Tensor? bias, int out_features, int max_tokens, str isa) -> Tensor");
  m.def("cpu24_linear_q4(Tensor x, Tensor values, Tensor index, Tensor scales, Tensor? bias, int out_features, int group, int max_tokens, str isa) -> Tensor");
  m.def("cpu24_dense_q4(Tensor x, Tensor values, Tensor scales, Tensor? bias, int out_features, int group, int max_tokens, str isa) -> Tensor");
  m.def("cpu24_dense_q8(Tensor x, Tensor values, Tensor scales, Tensor? bias, int out_features, int max_tokens, str isa) -> Tensor");
  m.def("cpu24_unpack(Tensor values, Tensor bits, int out_features) -> Tensor");
  m.def("cpu24_isa() -> int");
  m.def("cpu24_split_probe(Tensor x, Tensor values, Tensor bits, int out_features, str isa, int slow_thread, int slow_us, int route) -> (Tensor, Tensor, int, int)");
}

TORCH_LIBRARY_IMPL(nmsparse, CPU, m) {
  m.impl("cpu24_linear", cpu24_linear);
  m.impl("cpu24_linear_q8", cpu24_linear_q8);
  m.impl("cpu24_dense_q8", cpu24_dense_q8);
  m.impl("cpu24_linear_q4", cpu24_linear_q4);
  m.impl("cpu24_dense_q4", cpu24_dense_q4);
  m.impl("cpu24_unpack", cpu24_unpack);
  m.impl("cpu24_split_probe", cpu24_split_probe);
}

TORCH_LIBRARY_IMPL(nmsparse, CompositeExplicitAutograd, m) { m.impl("cpu24_isa", isa_flags); }

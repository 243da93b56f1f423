// Linear layers over quantized weights: GGML's block layouts (described in kernels/block_quant.py beside their torch
// reference) and compressed-tensors' groups (kernels/group_quant.py). The weight stays in its bytes; no copy of the
// whole weight is ever made. Each weight is read through a row reader that widens it unit by unit (a block, 32 values
// of a group) into 8-float vectors exactly as the reference dequantizes it; all sums are float32, as HF computes a
// dequantized model.
//
// Up to 4 input rows (decode of a few requests): each unit is widened in registers and used at once by every row,
// one pass over the weight (bandwidth-bound). Up to the caller's limit (64 in the CPU backend): 4 weight rows at a
// time are widened into a buffer that stays in cache and multiplied by 3 input rows at a time in a register tile.
// Past it (prompt chunks): 256 weight rows at a time are widened into a scratch buffer and multiplied by a GEMM.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"

namespace kvserve {
namespace {

// The formats' numbers, as kernels/block_quant.py's FORMATS gives them.
enum Format : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_K = 2, kQ6_K = 3, kF16 = 4, kBF16 = 5, kQ5_0 = 6, kF32 = 7 };

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // one instruction; c10::Half's portable conversion branches on subnormals
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Sub-block j's 6-bit scale and min from the 12 packed bytes (the layout kernels/block_quant.py describes).
inline void q4_k_scale_min(const uint8_t* packed, int j, float* scale, float* min) {
  if (j < 4) {
    *scale = packed[j] & 63;
    *min = packed[j + 4] & 63;
  } else {
    *scale = (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4);
    *min = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
  }
}

// The fused path works in 8-float vectors, one AVX2 register (half of one with AVX-512): arrays of wider generic
// vectors than the machine's registers are kept in memory by GCC, and the sums of a tile must stay in registers.
typedef float Float8 __attribute__((vector_size(8 * sizeof(float))));
typedef uint8_t Uint8x8 __attribute__((vector_size(8)));
typedef int8_t Int8x8 __attribute__((vector_size(8)));
typedef uint16_t Uint16x8 __attribute__((vector_size(8 * sizeof(uint16_t))));
typedef uint32_t Uint32x8 __attribute__((vector_size(8 * sizeof(uint32_t))));
typedef int32_t Int32x8 __attribute__((vector_size(8 * sizeof(int32_t))));

template <typename V>
inline V vector_at(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline Float8 load8(const float* p) { return vector_at<Float8>(p); }

// Bytes to floats. GCC turns __builtin_convertvector from 8 bytes into 8 scalar conversions; AVX2 widens them in two
// instructions, so it is asked for by name where the machine has it.
#if defined(__AVX2__) && defined(__F16C__)
inline Float8 widen8_signed(const uint8_t* p) {
  return (Float8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 16 bytes as floats: bytes 0-7, then 8-15.
inline void widen16(__m128i bytes, Float8 out[2]) {
  out[0] = (Float8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  out[1] = (Float8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
}

// The nibbles of 16 bytes as floats: low nibbles of bytes 0-7 and 8-15, then high nibbles of bytes 0-7 and 8-15.
inline void nibbles16(const uint8_t* p, Float8 out[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  widen16(_mm_and_si128(bytes, mask), out);
  widen16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), out + 2);
}

// q6_k's 6-bit quants of 16 lanes l from bytes a (low nibbles of quants 0 and 2), b (of 1 and 3) and h (two high
// bits of each quant i at bits 2i): out[i] = its 16 values as floats.
inline void six_bit_quants16(const uint8_t* a_bytes, const uint8_t* b_bytes, const uint8_t* h_bytes, Float8 out[4][2]) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a_bytes));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b_bytes));
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h_bytes));
  const __m128i nibble = _mm_set1_epi8(0x0F), pair = _mm_set1_epi8(0x30);
  const __m128i quants[4] = {
      _mm_or_si128(_mm_and_si128(a, nibble), _mm_and_si128(_mm_slli_epi16(h, 4), pair)),
      _mm_or_si128(_mm_and_si128(b, nibble), _mm_and_si128(_mm_slli_epi16(h, 2), pair)),
      _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), nibble), _mm_and_si128(h, pair)),
      _mm_or_si128(_mm_and_si128(_mm_srli_epi16(b, 4), nibble), _mm_and_si128(_mm_srli_epi16(h, 2), pair)),
  };
  for (int i = 0; i < 4; ++i) widen16(quants[i], out[i]);
}

inline Float8 half8(const uint8_t* p) {
  return (Float8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline Float8 bfloat16_8(const uint8_t* p) {  // a bfloat16 is the top half of a float32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (Float8)_mm256_slli_epi32(wide, 16);
}
#else
inline void six_bit_quants16(const uint8_t* a_bytes, const uint8_t* b_bytes, const uint8_t* h_bytes, Float8 out[4][2]) {
  for (int half = 0; half < 2; ++half) {
    const Uint8x8 a = vector_at<Uint8x8>(a_bytes + 8 * half), b = vector_at<Uint8x8>(b_bytes + 8 * half);
    const Uint8x8 h = vector_at<Uint8x8>(h_bytes + 8 * half);
    const Uint8x8 q[4] = {(a & 0x0F) | ((h & 3) << 4), (b & 0x0F) | (((h >> 2) & 3) << 4),
                          (a >> 4) | (((h >> 4) & 3) << 4), (b >> 4) | ((h >> 6) << 4)};
    for (int i = 0; i < 4; ++i) out[i][half] = __builtin_convertvector(q[i], Float8);
  }
}
inline Float8 half8(const uint8_t* p) {
  Float8 v;
  for (int i = 0; i < 8; ++i) v[i] = half_at(p + 2 * i);
  return v;
}
inline void nibbles16(const uint8_t* p, Float8 out[4]) {
  for (int half = 0; half < 2; ++half) {
    const Uint8x8 v = vector_at<Uint8x8>(p + 8 * half);
    out[half] = __builtin_convertvector(v & 0x0F, Float8);
    out[2 + half] = __builtin_convertvector(v >> 4, Float8);
  }
}
inline Float8 widen8_signed(const uint8_t* p) { return __builtin_convertvector(vector_at<Int8x8>(p), Float8); }
inline Float8 bfloat16_8(const uint8_t* p) {
  const Uint32x8 bits = __builtin_convertvector(vector_at<Uint16x8>(p), Uint32x8) << 16;
  return vector_at<Float8>(&bits);
}
#endif

// Each format's blocks as 8-value vectors, in order, handed to `use(offset, values)` where they are made: with the
// format and the use known at compile time the values never leave registers.
template <int64_t Format>
struct Blocks;

template <>
struct Blocks<kQ8_0> {
  static constexpr int64_t kValues = 32, kBytes = 34;
  template <typename Use>
  static void visit(const uint8_t* block, Use&& use) {
    const float d = half_at(block);
    for (int c = 0; c < 4; ++c) use(8 * c, d * widen8_signed(block + 2 + 8 * c));
  }
};

template <>
struct Blocks<kQ4_0> {
  static constexpr int64_t kValues = 32, kBytes = 18;
  template <typename Use>
  static void visit(const uint8_t* block, Use&& use) {
    const float d = half_at(block);
    Float8 q[4];  // values 0-7, 8-15 (low nibbles), 16-23, 24-31 (high)
    nibbles16(block + 2, q);
    for (int c = 0; c < 4; ++c) use(8 * c, d * (q[c] - 8.0f));
  }
};

template <>
struct Blocks<kQ5_0> {
  static constexpr int64_t kValues = 32, kBytes = 22;
  template <typename Use>
  static void visit(const uint8_t* block, Use&& use) {
    const float d = half_at(block);
    uint32_t high_bits;
    std::memcpy(&high_bits, block + 2, sizeof high_bits);
    const Uint32x8 bits = Uint32x8{} + high_bits;
    Float8 q[4];
    nibbles16(block + 6, q);
    for (int c = 0; c < 4; ++c) {  // value 8c + lane takes bit 8c + lane of high_bits as its bit 4
      const Uint32x8 lanes = Uint32x8{0, 1, 2, 3, 4, 5, 6, 7} + 8 * c;
      const Float8 high = __builtin_convertvector((Int32x8)(((bits >> lanes) & 1) << 4), Float8);
      use(8 * c, d * (q[c] + high - 16.0f));
    }
  }
};

template <>
struct Blocks<kQ4_K> {
  static constexpr int64_t kValues = 256, kBytes = 144;
  template <typename Use>
  static void visit(const uint8_t* block, Use&& use) {
    const float d = half_at(block), dmin = half_at(block + 2);
    const uint8_t* packed = block + 4;
    const uint8_t* q = block + 16;
    for (int j = 0; j < 4; ++j, q += 32) {
      float scale_low, min_low, scale_high, min_high;
      q4_k_scale_min(packed, 2 * j, &scale_low, &min_low);
      q4_k_scale_min(packed, 2 * j + 1, &scale_high, &min_high);
      const float d_low = d * scale_low, m_low = dmin * min_low, d_high = d * scale_high, m_high = dmin * min_high;
      for (int half = 0; half < 2; ++half) {  // bytes 16 * half ...: values 16 * half ... of each sub-block
        Float8 v[4];
        nibbles16(q + 16 * half, v);
        use(64 * j + 16 * half, d_low * v[0] - m_low);
        use(64 * j + 16 * half + 8, d_low * v[1] - m_low);
        use(64 * j + 32 + 16 * half, d_high * v[2] - m_high);
        use(64 * j + 32 + 16 * half + 8, d_high * v[3] - m_high);
      }
    }
  }
};

template <>
struct Blocks<kQ6_K> {
  static constexpr int64_t kValues = 256, kBytes = 210;
  template <typename Use>
  static void visit(const uint8_t* block, Use&& use) {
    const uint8_t* low = block;
    const uint8_t* high = block + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    const float d = half_at(block + 208);
    for (int part = 0; part < 2; ++part, low += 64, high += 32, scales += 8) {
      for (int l = 0; l < 32; l += 16) {  // values 32i + l ... 32i + l + 15 of this half, i = 0..3: sub-block 2i + l/16
        Float8 q[4][2];
        six_bit_quants16(low + l, low + l + 32, high + l, q);
        for (int i = 0; i < 4; ++i) {
          const float scale = d * scales[2 * i + l / 16];
          use(128 * part + 32 * i + l, scale * (q[i][0] - 32.0f));
          use(128 * part + 32 * i + l + 8, scale * (q[i][1] - 32.0f));
        }
      }
    }
  }
};

// f32, f16 and bf16: eight values a unit, widened by Widen.
template <int64_t Bytes, Float8 (*Widen)(const uint8_t*)>
struct PlainValues {
  static constexpr int64_t kValues = 8, kBytes = Bytes;
  template <typename Use>
  static void visit(const uint8_t* values, Use&& use) {
    use(0, Widen(values));
  }
};

inline Float8 float8(const uint8_t* p) { return vector_at<Float8>(p); }

template <>
struct Blocks<kF16> : PlainValues<16, half8> {};
template <>
struct Blocks<kBF16> : PlainValues<16, bfloat16_8> {};
template <>
struct Blocks<kF32> : PlainValues<32, float8> {};

// A weight row, read as units of values (a block, a group) each handed out as 8-value vectors by
// `visit(unit, use)`, calling `use(offset in the unit, values)`; `weight.row(n)` gives row n's reader.
template <int64_t Format>
struct BlockRow {
  using B = Blocks<Format>;
  const uint8_t* row;
  static constexpr int64_t unit_values() { return B::kValues; }
  template <typename Use>
  void visit(int64_t unit, Use&& use) const {
    B::visit(row + unit * B::kBytes, use);
  }
};

template <int64_t Format>
struct BlockWeight {
  const uint8_t* data;
  int64_t row_bytes;
  BlockRow<Format> row(int64_t n) const { return {data + n * row_bytes}; }
};

// Group-quantized values (compressed-tensors', kernels/group_quant.py): a scale per group of `group_size` values of
// a row, and with zero points one a group; w = (q - zero point) * scale in the scales' dtype, as the package
// dequantizes (a bfloat16 product is rounded to bfloat16; the difference q - zero point is exact in either).
enum GroupValues : int64_t { kInt8Values = 8, kInt4Values = 4, kFloat8Values = 9 };

// Eight 4-bit values from one little-endian word (value i in bits 4i..4i+3, stored as q + 8), as q.
inline Float8 nibbles8(const uint8_t* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof word);
  const Uint32x8 q = ((Uint32x8{} + word) >> Uint32x8{0, 4, 8, 12, 16, 20, 24, 28}) & 15u;
  return __builtin_convertvector((Int32x8)q, Float8) - 8.0f;
}

// Eight float8 e4m3fn values widened exactly: each byte's sign, exponent and mantissa bits moved into a float16's
// places make a float16 2^8 times too small (its exponent bias is 15, e4m3's 7; subnormals included), which the
// float16 conversion widens and one multiply puts right. Its one NaN pattern is not special-cased: weights hold none.
inline Float8 float8_e4m3_8(const uint8_t* p) {
  const Uint16x8 bytes = __builtin_convertvector(vector_at<Uint8x8>(p), Uint16x8);
  const Uint16x8 halves = ((bytes & 0x80) << 8) | ((bytes & 0x7F) << 7);
  return half8(reinterpret_cast<const uint8_t*>(&halves)) * 256.0f;
}

// Round to the nearest bfloat16 (ties to even), as a float32.
inline Float8 round_to_bfloat16(Float8 w) {
  Uint32x8 bits;
  std::memcpy(&bits, &w, sizeof bits);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&w, &bits, sizeof w);
  return w;
}

// Units of 32 values (groups are a multiple of 32 here), so that each unit's four vectors have offsets known at
// compile time: the dot product then keeps its independent sums in registers (with a whole group a unit, a runtime
// offset picked the sum, which kept them in memory: 2x slower at one row).
template <int64_t Values, bool BFloat16Scales, bool ZeroPoints>
struct GroupRow {
  const uint8_t* values;
  const void* scales;
  const int8_t* zero_points;
  int32_t units_per_group;
  static constexpr int64_t unit_values() { return 32; }
  template <typename Use>
  void visit(int64_t unit, Use&& use) const {
    const int32_t group = static_cast<int32_t>(unit) / units_per_group;
    float scale;
    if constexpr (BFloat16Scales) {
      const uint32_t bits = uint32_t{static_cast<const uint16_t*>(scales)[group]} << 16;
      std::memcpy(&scale, &bits, sizeof scale);
    } else {
      scale = static_cast<const float*>(scales)[group];
    }
    const float zero = ZeroPoints ? zero_points[group] : 0.0f;
    for (int c = 0; c < 4; ++c) {
      Float8 q;
      if constexpr (Values == kInt8Values) {
        q = widen8_signed(values + unit * 32 + 8 * c);
      } else if constexpr (Values == kFloat8Values) {
        q = float8_e4m3_8(values + unit * 32 + 8 * c);
      } else {
        q = nibbles8(values + unit * 16 + 4 * c);
      }
      if constexpr (ZeroPoints) q -= zero;
      const Float8 w = q * scale;
      use(8 * c, BFloat16Scales ? round_to_bfloat16(w) : w);
    }
  }
};

template <int64_t Values, bool BFloat16Scales, bool ZeroPoints>
struct GroupWeight {
  const uint8_t* values;
  int64_t row_value_bytes;
  const uint8_t* scales;
  int64_t row_scale_bytes;
  const int8_t* zero_points;
  int64_t groups;
  int64_t group_size;
  GroupRow<Values, BFloat16Scales, ZeroPoints> row(int64_t n) const {
    return {values + n * row_value_bytes, scales + n * row_scale_bytes,
            ZeroPoints ? zero_points + n * groups : nullptr, static_cast<int32_t>(group_size / 32)};
  }
};

// Input rows of a register tile.
constexpr int64_t kTileRows = 4;

// sums[r] = the weight row times x's rows r < Rows (a row every `in_features` floats).
template <int64_t Rows, typename Row>
inline void dot_tile(const Row& row, const float* x, int64_t in_features, float* sums) {
  // Independent sums per row, so that at least four FMAs are in flight: one chain of dependent FMAs would wait out
  // each one's latency (4 cycles), which halved the one-row speed.
  constexpr int64_t kChains = Rows >= 4 ? 1 : 4 / Rows;
  Float8 acc[Rows][kChains] = {};
  const int64_t unit_values = row.unit_values();
  for (int64_t u = 0; u < in_features / unit_values; ++u) {
    const float* x_unit = x + u * unit_values;
    row.visit(u, [&](int64_t i, Float8 w) {
      const int64_t chain = (i / 8) % kChains;
      for (int64_t r = 0; r < Rows; ++r) acc[r][chain] += w * load8(x_unit + r * in_features + i);
    });
  }
  for (int64_t r = 0; r < Rows; ++r) {
    Float8 v = acc[r][0];
    for (int64_t c = 1; c < kChains; ++c) v += acc[r][c];
    sums[r] = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
  }
}

// A weight row widened into `out` (in_features floats): for many input rows, once, then read from L1 by each tile.
template <typename Row>
void widen_row(const Row& row, int64_t in_features, float* out) {
  const int64_t unit_values = row.unit_values();
  for (int64_t u = 0; u < in_features / unit_values; ++u) {
    float* unit = out + u * unit_values;
    row.visit(u, [&](int64_t i, Float8 w) { std::memcpy(unit + i, &w, sizeof w); });
  }
}

// The register tile of the many-rows path: 4 widened weight rows by 3 input rows, 12 sums, with the 4 weight vectors
// and one input vector of a step that is all 16 AVX2 registers; each vector is loaded once for all the sums it enters.
constexpr int64_t kWeightTile = 4, kInputTile = 3;

// sums[j][r] = widened weight row j (of WeightRows, a row every in_features floats) times x's row r (of Rows).
template <int64_t WeightRows, int64_t Rows>
inline void tile_sums(const float* w, const float* x, int64_t in_features, float sums[kWeightTile][kInputTile]) {
  Float8 acc[WeightRows][Rows] = {};
  for (int64_t k = 0; k < in_features; k += 8) {
    Float8 weights[WeightRows];
    for (int64_t j = 0; j < WeightRows; ++j) weights[j] = load8(w + j * in_features + k);
    for (int64_t r = 0; r < Rows; ++r) {
      const Float8 input = load8(x + r * in_features + k);
      for (int64_t j = 0; j < WeightRows; ++j) acc[j][r] += weights[j] * input;
    }
  }
  for (int64_t j = 0; j < WeightRows; ++j) {
    for (int64_t r = 0; r < Rows; ++r) {
      const Float8 v = acc[j][r];
      sums[j][r] = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
    }
  }
}

template <int64_t WeightRows>
inline void tile_sums(const float* w, const float* x, int64_t in_features, int64_t rows,
                      float sums[kWeightTile][kInputTile]) {
  switch (rows) {
    case 1: return tile_sums<WeightRows, 1>(w, x, in_features, sums);
    case 2: return tile_sums<WeightRows, 2>(w, x, in_features, sums);
    default: return tile_sums<WeightRows, 3>(w, x, in_features, sums);
  }
}

inline void tile_sums(const float* w, const float* x, int64_t in_features, int64_t weight_rows, int64_t rows,
                      float sums[kWeightTile][kInputTile]) {
  switch (weight_rows) {
    case 1: return tile_sums<1>(w, x, in_features, rows, sums);
    case 2: return tile_sums<2>(w, x, in_features, rows, sums);
    case 3: return tile_sums<3>(w, x, in_features, rows, sums);
    default: return tile_sums<4>(w, x, in_features, rows, sums);
  }
}

// out [rows, out_features] (any row stride) = x [rows, in_features] @ widened(weight).T, all in float32. Up to
// kTileRows input rows, each weight unit is widened in registers and used at once. Past that, kWeightTile weight rows
// at a time are widened into a buffer that stays in cache and multiplied by tiles of input rows there.
template <typename scalar_t, typename Weight>
void fused_rows(const at::Tensor& out, const float* x, int64_t num_rows, const Weight& weight, int64_t out_features,
                int64_t in_features) {
  const int64_t out_stride = out.stride(0);
  scalar_t* out_data = out.data_ptr<scalar_t>();
  if (num_rows <= kTileRows) {
    at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
      float sums[kTileRows];
      for (int64_t n = begin; n < end; ++n) {
        const auto row = weight.row(n);
        switch (num_rows) {
          case 1: dot_tile<1>(row, x, in_features, sums); break;
          case 2: dot_tile<2>(row, x, in_features, sums); break;
          case 3: dot_tile<3>(row, x, in_features, sums); break;
          default: dot_tile<4>(row, x, in_features, sums); break;
        }
        for (int64_t r = 0; r < num_rows; ++r) out_data[r * out_stride + n] = static_cast<scalar_t>(sums[r]);
      }
    });
    return;
  }
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(kWeightTile * in_features);
    float sums[kWeightTile][kInputTile];
    for (int64_t n = begin; n < end; n += kWeightTile) {
      const int64_t weight_rows = std::min(kWeightTile, end - n);
      for (int64_t j = 0; j < weight_rows; ++j) widen_row(weight.row(n + j), in_features, widened.data() + j * in_features);
      for (int64_t first = 0; first < num_rows; first += kInputTile) {
        const int64_t rows = std::min(kInputTile, num_rows - first);
        tile_sums(widened.data(), x + first * in_features, in_features, weight_rows, rows, sums);
        for (int64_t j = 0; j < weight_rows; ++j) {
          for (int64_t r = 0; r < rows; ++r) {
            out_data[(first + r) * out_stride + n + j] = static_cast<scalar_t>(sums[j][r]);
          }
        }
      }
    }
  });
}

// Widens weight rows [begin, end) into out (float32, a row every `in_features` values).
template <typename Weight>
void widen_rows(const Weight& weight, int64_t in_features, int64_t begin, int64_t end, float* out) {
  for (int64_t n = begin; n < end; ++n) widen_row(weight.row(n), in_features, out + (n - begin) * in_features);
}

// Rows of the weight widened per GEMM in the many-rows path: 256 rows of 4864 floats are 5 MB.
constexpr int64_t kChunkRows = 256;

template <typename Weight>
void chunked_gemm(const at::Tensor& out, const at::Tensor& x, const Weight& weight, int64_t out_features,
                  int64_t in_features) {
  at::Tensor scratch = at::empty({std::min(kChunkRows, out_features), in_features}, x.options().dtype(at::kFloat));
  for (int64_t first = 0; first < out_features; first += kChunkRows) {
    const int64_t count = std::min(kChunkRows, out_features - first);
    float* widened = scratch.data_ptr<float>();
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      widen_rows(weight, in_features, first + begin, first + end, widened + begin * in_features);
    });
    out.narrow(1, first, count).copy_(at::mm(x, scratch.narrow(0, 0, count).t()));
  }
}

// out [rows, out_features] (a column slice of a wider output may be passed) = x @ weight.T, x [rows, in_features]
// in the model dtype, out in the same dtype; the fused path for up to `max_fused_rows` rows.
template <typename Weight>
void quantized_linear(const at::Tensor& out, const at::Tensor& x, const Weight& weight, int64_t out_features,
                      int64_t in_features, int64_t max_fused_rows) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features && out.dim() == 2 && out.stride(1) == 1 &&
                  out.size(0) == x.size(0) && out.size(1) == out_features && out.scalar_type() == x.scalar_type(),
              "quantized linear: x [rows, in], out [rows, out] in x's dtype with unit column stride");
  const at::Tensor x_float = x.to(at::kFloat).contiguous();
  if (x.size(0) > max_fused_rows) {
    chunked_gemm(out, x_float, weight, out_features, in_features);
    return;
  }
  KVSERVE_DISPATCH_MODEL_DTYPES(x.scalar_type(), "quantized_linear", [&] {
    fused_rows<scalar_t>(out, x_float.data_ptr<float>(), x.size(0), weight, out_features, in_features);
  });
}

// out [rows, in_features] float32: every row of the weight widened (the embedding's lookup, and tests).
template <typename Weight>
void dequantize_rows(const at::Tensor& out, const Weight& weight, int64_t out_features, int64_t in_features) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == out_features &&
                  out.size(1) == in_features, "dequantize: out float32 [rows, in_features]");
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    widen_rows(weight, in_features, begin, end, out.data_ptr<float>() + begin * in_features);
  });
}

// fn(std::integral_constant<int64_t, F>{}) for the format F numbered `format`: one instantiation per format.
template <typename Fn>
decltype(auto) with_format(int64_t format, Fn&& fn) {
  switch (format) {
    case kQ8_0: return fn(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_0: return fn(std::integral_constant<int64_t, kQ4_0>{});
    case kQ5_0: return fn(std::integral_constant<int64_t, kQ5_0>{});
    case kQ4_K: return fn(std::integral_constant<int64_t, kQ4_K>{});
    case kQ6_K: return fn(std::integral_constant<int64_t, kQ6_K>{});
    case kF16: return fn(std::integral_constant<int64_t, kF16>{});
    case kBF16: return fn(std::integral_constant<int64_t, kBF16>{});
    case kF32: return fn(std::integral_constant<int64_t, kF32>{});
  }
  TORCH_CHECK(false, "block_quant: unknown format ", format);
}

// fn(weight) with the block weight of `data` in `format`, its shape checked.
template <typename Fn>
void with_block_weight(const at::Tensor& data, int64_t format, int64_t in_features, Fn&& fn) {
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous(),
              "block_quant: data is contiguous uint8 [rows, row bytes]");
  with_format(format, [&](auto f) {
    using B = Blocks<f()>;
    TORCH_CHECK(in_features % B::kValues == 0 && data.size(1) == in_features / B::kValues * B::kBytes,
                "block_quant: rows of ", in_features, " values do not fit format ", format);
    fn(BlockWeight<f()>{data.data_ptr<uint8_t>(), data.size(1)});
  });
}

void block_quant_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& data, int64_t format,
                        int64_t in_features, int64_t max_fused_rows) {
  with_block_weight(data, format, in_features, [&](const auto& weight) {
    quantized_linear(out, x, weight, data.size(0), in_features, max_fused_rows);
  });
}

void block_quant_dequantize(const at::Tensor& out, const at::Tensor& data, int64_t format, int64_t in_features) {
  with_block_weight(data, format, in_features, [&](const auto& weight) {
    dequantize_rows(out, weight, data.size(0), in_features);
  });
}

// fn(weight) with the group weight of these tensors (kernels/group_quant.py's GroupQuantizedWeight: int8 or float8
// values, or uint8 holding two 4-bit ones; float32 or bfloat16 scales [rows, groups]; int8 zero points like them, or
// none).
template <typename Fn>
void with_group_weight(const at::Tensor& values, int64_t num_bits, const at::Tensor& scales,
                       const std::optional<at::Tensor>& zero_points, int64_t group_size, Fn&& fn) {
  const int64_t rows = values.size(0), groups = scales.size(1);
  const int64_t in_features = groups * group_size;
  TORCH_CHECK(values.dim() == 2 && values.is_contiguous() && scales.dim() == 2 && scales.is_contiguous() &&
                  scales.size(0) == rows && group_size % 32 == 0,
              "group_quant: contiguous values [rows, ...] and scales [rows, groups], groups of a multiple of 32");
  const bool float8 = values.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK((num_bits == 8 && (values.scalar_type() == at::kChar || float8) && values.size(1) == in_features) ||
                  (num_bits == 4 && values.scalar_type() == at::kByte && values.size(1) * 2 == in_features),
              "group_quant: 8-bit values are int8 or float8_e4m3fn [rows, in], 4-bit ones uint8 [rows, in / 2]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16,
              "group_quant: scales are float32 or bfloat16");
  if (zero_points) {
    TORCH_CHECK(zero_points->scalar_type() == at::kChar && zero_points->is_contiguous() &&
                    zero_points->sizes() == scales.sizes(), "group_quant: zero points are int8 like the scales");
  }
  const auto* value_data = static_cast<const uint8_t*>(values.data_ptr());
  const auto* scale_data = static_cast<const uint8_t*>(scales.data_ptr());
  const int8_t* zero_data = zero_points ? zero_points->data_ptr<int8_t>() : nullptr;
  const int64_t row_value_bytes = values.size(1), row_scale_bytes = groups * scales.element_size();
  auto with_layout = [&](auto bits, auto bfloat16_scales, auto has_zero_points) {
    fn(GroupWeight<bits(), bfloat16_scales(), has_zero_points()>{
        value_data, row_value_bytes, scale_data, row_scale_bytes, zero_data, groups, group_size});
  };
  auto with_zero_points = [&](auto bits, auto bfloat16_scales) {
    if (zero_data) {
      with_layout(bits, bfloat16_scales, std::true_type{});
    } else {
      with_layout(bits, bfloat16_scales, std::false_type{});
    }
  };
  auto with_scales = [&](auto bits) {
    if (scales.scalar_type() == at::kBFloat16) {
      with_zero_points(bits, std::true_type{});
    } else {
      with_zero_points(bits, std::false_type{});
    }
  };
  if (float8) {
    with_scales(std::integral_constant<int64_t, kFloat8Values>{});
  } else if (num_bits == 8) {
    with_scales(std::integral_constant<int64_t, kInt8Values>{});
  } else {
    with_scales(std::integral_constant<int64_t, kInt4Values>{});
  }
}

void group_quant_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& values, int64_t num_bits,
                        const at::Tensor& scales, const std::optional<at::Tensor>& zero_points, int64_t group_size,
                        int64_t max_fused_rows) {
  with_group_weight(values, num_bits, scales, zero_points, group_size, [&](const auto& weight) {
    quantized_linear(out, x, weight, values.size(0), scales.size(1) * group_size, max_fused_rows);
  });
}

void group_quant_dequantize(const at::Tensor& out, const at::Tensor& values, int64_t num_bits,
                            const at::Tensor& scales, const std::optional<at::Tensor>& zero_points,
                            int64_t group_size) {
  with_group_weight(values, num_bits, scales, zero_points, group_size, [&](const auto& weight) {
    dequantize_rows(out, weight, values.size(0), scales.size(1) * group_size);
  });
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("block_quant_linear(Tensor(a!) out, Tensor x, Tensor data, int format, int in_features, int max_fused_rows)"
        " -> ()");
  m.def("block_quant_dequantize(Tensor(a!) out, Tensor data, int format, int in_features) -> ()");
  m.def("group_quant_linear(Tensor(a!) out, Tensor x, Tensor values, int num_bits, Tensor scales, "
        "Tensor? zero_points, int group_size, int max_fused_rows) -> ()");
  m.def("group_quant_dequantize(Tensor(a!) out, Tensor values, int num_bits, Tensor scales, Tensor? zero_points, "
        "int group_size) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("block_quant_linear", &kvserve::block_quant_linear);
  m.impl("block_quant_dequantize", &kvserve::block_quant_dequantize);
  m.impl("group_quant_linear", &kvserve::group_quant_linear);
  m.impl("group_quant_dequantize", &kvserve::group_quant_dequantize);
}

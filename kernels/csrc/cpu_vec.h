// What kvserve's C++ CPU kernels share: sixteen-float vectors written with GCC/Clang vector
// extensions (plain arithmetic operators, compiled to AVX-512, AVX2 or NEON by -march=native),
// loads that widen the cache and model dtypes to float32, and a vectorised exp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

namespace kvserve {

constexpr int64_t kLanes = 16;
typedef float FloatVec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t Int32Vec __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t Uint32Vec __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t Uint16Vec __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef int8_t Int8Vec __attribute__((vector_size(kLanes)));

// The model dtypes the engine runs on a CPU: float32, bfloat16, float16.
#define KVSERVE_DISPATCH_MODEL_DTYPES(TYPE, NAME, ...)                                  \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)               \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)        \
                                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

inline FloatVec load(const float* p) {
  FloatVec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline FloatVec load(const int8_t* p) {
  Int8Vec v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, FloatVec);
}

inline FloatVec load(const c10::BFloat16* p) {  // a bfloat16 is the top half of a float32
  Uint16Vec v;
  std::memcpy(&v, p, sizeof v);
  const Uint32Vec bits = __builtin_convertvector(v, Uint32Vec) << 16;
  FloatVec f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline FloatVec load(const c10::Half* p) {
  FloatVec v;
  for (int64_t i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

inline void store(float* p, FloatVec v) { std::memcpy(p, &v, sizeof v); }

template <typename T>
inline void store(T* p, FloatVec v) {  // rounds to nearest even, as tensor.to(dtype) does
  for (int64_t i = 0; i < kLanes; ++i) p[i] = static_cast<T>(v[i]);
}

// A tree of halves: a left-to-right sum would be a chain of 16 dependent additions.
inline float horizontal_sum(FloatVec v) {
  typedef float Half __attribute__((vector_size(sizeof(FloatVec) / 2)));
  typedef float Quarter __attribute__((vector_size(sizeof(FloatVec) / 4)));
  Half low, high;
  std::memcpy(&low, &v, sizeof low);
  std::memcpy(&high, reinterpret_cast<const char*>(&v) + sizeof low, sizeof high);
  const Half halves = low + high;
  Quarter a, b;
  std::memcpy(&a, &halves, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&halves) + sizeof a, sizeof b);
  const Quarter quarters = a + b;
  return (quarters[0] + quarters[2]) + (quarters[1] + quarters[3]);
}

// exp(x) for x <= 0 to about 1 ulp (Cephes' expf polynomial): with n = round(x / ln2) and
// r = x - n ln2 (|r| <= ln2 / 2), exp(x) = 2^n exp(r). Below -87 it gives ~1e-38 instead of 0.
inline FloatVec exp_nonpositive(FloatVec x) {
  x = x < -87.0f ? FloatVec{} - 87.0f : x;
  const FloatVec shifted = x * 1.44269504088896341f + 0.5f;
  Int32Vec n = __builtin_convertvector(shifted, Int32Vec);  // truncates toward zero ...
  n += __builtin_convertvector(n, FloatVec) > shifted;     // ... so step down where that rounded up: floor
  const FloatVec nf = __builtin_convertvector(n, FloatVec);
  const FloatVec r = (x - nf * 0.693359375f) - nf * -2.12194440e-4f;  // ln2 in two parts, for precision
  FloatVec p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const Int32Vec exponent_bits = (n + 127) << 23;
  FloatVec two_to_n;
  std::memcpy(&two_to_n, &exponent_bits, sizeof two_to_n);
  return p * two_to_n;
}

}  // namespace kvserve

// pdkv's vector helpers for the C++ CPU ops: ATen's Vectorized<float> (and Sleef's vector exp)
// for the ISA an op file is compiled for (-march=native at build time; the suite also compiles
// every file for x86-64-v2, x86-64-v3, x86-64-v4 and sapphirerapids, tests/model/test_csrc_isa.py).
// Vector code that differs per ISA lives here, not behind #if in each op, and this header
// includes every ATen vector header it relies on (on AVX-512 vec.h alone does not bring
// vec_reduce_all's Vectorized<float> overload: functional.h does). Include it before any other
// ATen header: CPU_CAPABILITY picks ATen's vec256 / vec512 implementation. Part of the
// extension's build key (pdkv/model/paged_decode_build.py).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

namespace pdkv::vec {

using Vec = at::vec::Vectorized<float>;

// Sum of v's lanes (ATen's pairwise lane reduction: the same order ATen's own sums use).
inline float reduce_sum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, v);
}

// Vec::size() bfloat16 values from p, widened to float32 (exact).
inline Vec load_bf16(const c10::BFloat16* p) {
  Vec v;
  at::vec::load_fp32_from_bf16(p, v);
  return v;
}

// v rounded to bfloat16 (ATen's rounding, as its bfloat16 kernels store a result), stored at p.
inline void store_bf16(c10::BFloat16* p, const Vec& v) {
  at::vec::convert_float_bfloat16(v, v).store(p, Vec::size());
}

// v rounded to bfloat16 (nearest even, as ATen stores a bfloat16 result) and widened back: the
// value a bfloat16 tensor would hold; for one float and for a vector of them.
inline float round_bf16(float v) { return static_cast<float>(static_cast<c10::BFloat16>(v)); }

inline Vec round_bf16(const Vec& v) {
  return std::get<0>(at::vec::convert_bfloat16_float(at::vec::convert_float_bfloat16(v, v)));
}

}  // namespace pdkv::vec

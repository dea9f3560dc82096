// The CPU's float32 FMA rate (and, with AVX512-BF16, its bfloat16 dot-product rate: below) with
// every operand in registers, for the limit rows of
// `pdkv bench offline` (pdkv/bench/offline/limits.py): each of torch's threads runs `iters`
// rounds of kChains independent fused multiply-adds on full vectors (ATen's Vectorized<float> for
// the ISA this file is compiled for: 8 lanes with AVX2, 16 with AVX-512). Twelve chains cover an
// FMA latency of up to 6 cycles on two FMA pipes, so the loop runs at the issue rate and no
// memory is touched: the ceiling a compute-bound kernel cannot pass on this machine.
#include "cpu_vec.h"  // before ATen: its Vectorized<float> for this CPU, pdkv::vec helpers

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using pdkv::vec::Vec;
constexpr int64_t kChains = 12;

// Returns a float64 tensor [flop, checksum]: the FLOP done by all threads (2 per lane per FMA)
// and the sum of the results (kept so the compiler cannot drop the loop).
at::Tensor fma_peak(int64_t iters) {
  TORCH_CHECK(iters > 0, "fma_peak: iters must be positive, got ", iters);
  const int64_t threads = at::get_num_threads();
  std::vector<float> sums(threads, 0.f);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const Vec x(0.9999999f), y(1e-7f);
      Vec a0(1.f), a1(1.001f), a2(1.002f), a3(1.003f), a4(1.004f), a5(1.005f);
      Vec a6(1.006f), a7(1.007f), a8(1.008f), a9(1.009f), a10(1.01f), a11(1.011f);
      for (int64_t i = 0; i < iters; ++i) {
        a0 = at::vec::fmadd(a0, x, y);
        a1 = at::vec::fmadd(a1, x, y);
        a2 = at::vec::fmadd(a2, x, y);
        a3 = at::vec::fmadd(a3, x, y);
        a4 = at::vec::fmadd(a4, x, y);
        a5 = at::vec::fmadd(a5, x, y);
        a6 = at::vec::fmadd(a6, x, y);
        a7 = at::vec::fmadd(a7, x, y);
        a8 = at::vec::fmadd(a8, x, y);
        a9 = at::vec::fmadd(a9, x, y);
        a10 = at::vec::fmadd(a10, x, y);
        a11 = at::vec::fmadd(a11, x, y);
      }
      sums[t] = pdkv::vec::reduce_sum(((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)) +
                                      ((a8 + a9) + (a10 + a11)));
    }
  });
  double checksum = 0.0;
  for (float s : sums) checksum += s;
  const double flop = 2.0 * kChains * static_cast<double>(Vec::size()) * static_cast<double>(iters) *
                      static_cast<double>(threads);
  return at::tensor({flop, checksum}, at::TensorOptions().dtype(at::kDouble));
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The same for AVX512-BF16's VDPBF16PS, the panel kernel's instruction for a bfloat16 x on
// bfloat16 panels: kChains independent chains per thread, each instruction 16 float32 lanes x 2
// bfloat16 products = 64 FLOP. The compute ceiling of a bfloat16 run (pdkv bench offline
// --dtype bfloat16); only built where the CPU has AVX512-BF16.
at::Tensor bf16_dot_peak(int64_t iters) {
  TORCH_CHECK(iters > 0, "bf16_dot_peak: iters must be positive, got ", iters);
  const int64_t threads = at::get_num_threads();
  std::vector<float> sums(threads, 0.f);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
      const __m512bh y = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-4f), _mm512_set1_ps(1e-4f));
      __m512 a0 = _mm512_set1_ps(1.f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
      __m512 a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
      for (int64_t i = 0; i < iters; ++i) {
        a0 = _mm512_dpbf16_ps(a0, x, y);
        a1 = _mm512_dpbf16_ps(a1, x, y);
        a2 = _mm512_dpbf16_ps(a2, x, y);
        a3 = _mm512_dpbf16_ps(a3, x, y);
        a4 = _mm512_dpbf16_ps(a4, x, y);
        a5 = _mm512_dpbf16_ps(a5, x, y);
        a6 = _mm512_dpbf16_ps(a6, x, y);
        a7 = _mm512_dpbf16_ps(a7, x, y);
        a8 = _mm512_dpbf16_ps(a8, x, y);
        a9 = _mm512_dpbf16_ps(a9, x, y);
        a10 = _mm512_dpbf16_ps(a10, x, y);
        a11 = _mm512_dpbf16_ps(a11, x, y);
      }
      const __m512 s = _mm512_add_ps(
          _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                        _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7))),
          _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
      sums[t] = _mm512_reduce_add_ps(s);
    }
  });
  double checksum = 0.0;
  for (float s : sums) checksum += s;
  const double flop = 64.0 * kChains * static_cast<double>(iters) * static_cast<double>(threads);
  return at::tensor({flop, checksum}, at::TensorOptions().dtype(at::kDouble));
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdkv, m) {
  m.def("fma_peak(int iters) -> Tensor", &fma_peak);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  m.def("bf16_dot_peak(int iters) -> Tensor", &bf16_dot_peak);
#endif
}

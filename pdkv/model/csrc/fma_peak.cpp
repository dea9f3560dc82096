// The CPU's float32 FMA rate with every operand in registers, for the limit rows of
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdkv, m) {
  m.def("fma_peak(int iters) -> Tensor", &fma_peak);
}

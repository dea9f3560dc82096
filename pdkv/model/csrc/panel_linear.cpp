// Linear layer on weights packed in panels of 16 output rows (AVX2 + FMA): y = x @ W.T, x and y
// float32, the panels float32 or bfloat16 (widened to float32 in registers, float32 FMA).
// Layout, numerics and the measurements behind it: pdkv/model/panel_linear.py. Built with the
// other csrc/*.cpp into one extension by pdkv/model/paged_decode_build.py; on a CPU without
// AVX2/FMA the op is not defined and the engine keeps oneDNN's packed weights.
//
// panels [P, K, 16]: panels[p, k, j] = W[16 p + j, k] (rows past N are zero). For a block of up
// to 6 rows of x and one panel, the micro-kernel keeps the 6 x 16 outputs in 12 ymm registers and
// per k loads the panel's 16 weights (two vectors, one cache line) and broadcasts 6 x values: the
// classic AVX2 6x16 register blocking. K is walked in one chunk (in chunks of at most kKC when it
// is longer), so each output is stored once, never read back and added to: a panel chunk (up to
// 256 KiB) stays in L2 while a block of up to MB rows of x passes over it. Threads split the panels.
//
// Why one chunk rather than L1-sized ones (256 k, 16 KiB): with 256-k chunks every chunk after the
// first loads and re-stores each output tile, and a y tile's rows, N floats apart, fall in the
// same L1 set when N is a multiple of 1024 (SmolLM2's gate_up, N = 3072): those loads missed.
// Measured over SmolLM2-135M's four projections (both versions in one process, interleaved, 2
// threads, 2-core AMD EPYC, avx2; median GFLOP/s): 155 -> 173 at 512 rows, 153 -> 165 at 2,048,
// 144 -> 160 at 8,192, 47 -> 54 at 8 and 10.0 -> 10.9 at 1. The panel stays in L2: 6 rows of FMAs
// take 6 cycles per k, while its 64-byte row comes from L2 in 2.
//
// Each output is one thread's sequential sum over k (chunk partial sums added in order; the chunks
// depend only on K), the same for a row whatever the other rows of x are: results do not depend on
// the batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kNR = 16;   // outputs per panel
constexpr int64_t kMR = 6;    // rows of x per micro-kernel call
constexpr int64_t kKC = 4096;  // most k per chunk: 4,096 x 16 x 4 B = 256 KiB of a float32 panel
constexpr int64_t kMB = 192;   // rows of x per block
constexpr int64_t kPrefetchRows = 48;  // bfloat16 panels: k rows ahead to prefetch (1.5 KiB)

// k per chunk for a K: K in ceil(K / kKC) equal chunks (one chunk up to kKC). A function of K
// alone, so a row's summation order does not depend on the batch.
inline int64_t chunk_k(int64_t K) {
  const int64_t chunks = (K + kKC - 1) / kKC;
  return (K + chunks - 1) / chunks;
}

// The 16 weights of panel row k as two float32 vectors: float32 panels load directly; bfloat16
// panels (the upper half of a float32's bits) widen to 32 bits and shift left by 16 (exact).
inline void load_row(const float* p, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(p);
  w1 = _mm256_loadu_ps(p + 8);
}

inline void load_row(const uint16_t* p, __m256& w0, __m256& w1) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
  w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
}

// y[r, 0:ncols] (+)= sum_{k < kc} x[r, k] * p[k, 0:16] for r < R; `first` stores, else adds.
template <int R, typename W>
inline void micro(const float* __restrict x, int64_t ldx, const W* __restrict p, int64_t kc,
                  float* __restrict y, int64_t ldy, int64_t ncols, bool first) {
  // Named accumulators: an array of __m256 is written back to the stack on every iteration.
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (std::is_same_v<W, uint16_t>) {
      // bfloat16 panels: a 64-byte line holds two k rows, consumed twice as fast as float32
      // rows for the same work, and the hardware prefetcher alone left batch-1 decode
      // streaming them at ~25 GB/s against ~31 for float32 (docs/SPEED.md). Ask for the line
      // kPrefetchRows ahead (past the chunk's end: the next panel's, which follows in memory).
      if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + (k + kPrefetchRows) * kNR), _MM_HINT_T0);
    }
    __m256 w0, w1;
    load_row(p + k * kNR, w0, w1);
    __m256 b = _mm256_broadcast_ss(x + k);
    c00 = _mm256_fmadd_ps(w0, b, c00);
    c01 = _mm256_fmadd_ps(w1, b, c01);
    if constexpr (R > 1) {
      b = _mm256_broadcast_ss(x + ldx + k);
      c10 = _mm256_fmadd_ps(w0, b, c10);
      c11 = _mm256_fmadd_ps(w1, b, c11);
    }
    if constexpr (R > 2) {
      b = _mm256_broadcast_ss(x + 2 * ldx + k);
      c20 = _mm256_fmadd_ps(w0, b, c20);
      c21 = _mm256_fmadd_ps(w1, b, c21);
    }
    if constexpr (R > 3) {
      b = _mm256_broadcast_ss(x + 3 * ldx + k);
      c30 = _mm256_fmadd_ps(w0, b, c30);
      c31 = _mm256_fmadd_ps(w1, b, c31);
    }
    if constexpr (R > 4) {
      b = _mm256_broadcast_ss(x + 4 * ldx + k);
      c40 = _mm256_fmadd_ps(w0, b, c40);
      c41 = _mm256_fmadd_ps(w1, b, c41);
    }
    if constexpr (R > 5) {
      b = _mm256_broadcast_ss(x + 5 * ldx + k);
      c50 = _mm256_fmadd_ps(w0, b, c50);
      c51 = _mm256_fmadd_ps(w1, b, c51);
    }
  }
  const __m256 lo[kMR] = {c00, c10, c20, c30, c40, c50};
  const __m256 hi[kMR] = {c01, c11, c21, c31, c41, c51};
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
    if (ncols == kNR) {
      if (first) {
        _mm256_storeu_ps(yr, lo[r]);
        _mm256_storeu_ps(yr + 8, hi[r]);
      } else {
        _mm256_storeu_ps(yr, _mm256_add_ps(_mm256_loadu_ps(yr), lo[r]));
        _mm256_storeu_ps(yr + 8, _mm256_add_ps(_mm256_loadu_ps(yr + 8), hi[r]));
      }
    } else {
      alignas(32) float t[kNR];
      _mm256_store_ps(t, lo[r]);
      _mm256_store_ps(t + 8, hi[r]);
      for (int64_t c = 0; c < ncols; ++c) yr[c] = first ? t[c] : yr[c] + t[c];
    }
  }
}

// One panel chunk against rows [0, M) of x, in blocks of kMR rows.
template <typename W>
inline void panel_rows(const float* x, int64_t ldx, int64_t M, const W* p, int64_t kc, float* y,
                       int64_t ldy, int64_t ncols, bool first) {
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR) micro<kMR>(x + m * ldx, ldx, p, kc, y + m * ldy, ldy, ncols, first);
  const float* xm = x + m * ldx;
  float* ym = y + m * ldy;
  switch (M - m) {
    case 1: micro<1>(xm, ldx, p, kc, ym, ldy, ncols, first); break;
    case 2: micro<2>(xm, ldx, p, kc, ym, ldy, ncols, first); break;
    case 3: micro<3>(xm, ldx, p, kc, ym, ldy, ncols, first); break;
    case 4: micro<4>(xm, ldx, p, kc, ym, ldy, ncols, first); break;
    case 5: micro<5>(xm, ldx, p, kc, ym, ldy, ncols, first); break;
    default: break;
  }
}

// One panel chunk (kc rows of 16) against M rows of x. A bfloat16 chunk that three or more
// micro-kernel calls would read (M >= 3 kMR) is widened once into `wide` (exact) and read from
// there as float32, instead of being widened again by each call; the sums are the same either
// way. (At 64 rows this cut the time of bfloat16 SmolLM2's projections by a quarter, to about
// float32's; at 8 rows, two calls, widening first measured no faster.)
template <typename W>
inline void chunk_rows(const float* x, int64_t ldx, int64_t M, const W* p, int64_t kc, float* y,
                       int64_t ldy, int64_t ncols, bool first, std::vector<float>& wide) {
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (M >= 3 * kMR) {
      wide.resize(kc * kNR);
      for (int64_t k = 0; k < kc; ++k) {
        __m256 w0, w1;
        load_row(p + k * kNR, w0, w1);
        _mm256_storeu_ps(&wide[k * kNR], w0);
        _mm256_storeu_ps(&wide[k * kNR + 8], w1);
      }
      panel_rows(x, ldx, M, wide.data(), kc, y, ldy, ncols, first);
      return;
    }
  }
  panel_rows(x, ldx, M, p, kc, y, ldy, ncols, first);
}

// Each thread takes a range of panels. Rows of x go in blocks of kMB, and within a block the
// thread's panels pass one K chunk at a time over the same kMB-row slice of x: x is read from
// memory once per thread and row block instead of once per panel (at 8,192 rows of 576 columns,
// 18.9 MB per panel). Up to kMB rows (every decode step) each panel is walked whole, one after
// the other, so the weights stream in memory order. The order of the k chunks of one output is
// the same either way (first stores, later chunks add): the blocking changes no result bit.
template <typename W>
void panel_gemm(const float* X, const W* Wp, float* Y, int64_t M, int64_t K, int64_t N, int64_t P) {
  const int64_t kc_max = chunk_k(K);
  if (M <= kMB) {  // one row block (every decode step): each panel streamed once, in order
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> wide;
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kNR, ncols = std::min(kNR, N - n0);
        for (int64_t k0 = 0; k0 < K; k0 += kc_max)
          chunk_rows(X + k0, K, M, Wp + (p * K + k0) * kNR, std::min(kc_max, K - k0), Y + n0, N, ncols,
                     k0 == 0, wide);
      }
    });
    return;
  }
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wide;
    for (int64_t m0 = 0; m0 < M; m0 += kMB) {
      const int64_t mb = std::min(kMB, M - m0);
      for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
        const int64_t kc = std::min(kc_max, K - k0);
        for (int64_t p = begin; p < end; ++p) {
          const int64_t n0 = p * kNR, ncols = std::min(kNR, N - n0);
          chunk_rows(X + m0 * K + k0, K, mb, Wp + (p * K + k0) * kNR, kc, Y + m0 * N + n0, N,
                     ncols, k0 == 0, wide);
        }
      }
    }
  });
}

// x [T, K] float32 or bfloat16 -> y [T, N] of x's dtype. A bfloat16 x is widened to float32
// first and y (its float32 sums plus the bias, widened too) rounded to bfloat16 once at the end,
// as torch's bfloat16 matmul accumulates in float32.
at::Tensor panel_linear(const at::Tensor& x_in, const at::Tensor& panels, int64_t out_features,
                        const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "panel_linear: x must be [T, K] float32 or bfloat16, got ", x_in.sizes(), " ", x_in.scalar_type());
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kNR && panels.is_contiguous() &&
                  (panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kBFloat16),
              "panel_linear: panels must be contiguous [P, K, 16] float32 or bfloat16, got ", panels.sizes(), " ",
              panels.scalar_type());
  const int64_t M = x_in.size(0), K = x_in.size(1), P = panels.size(0), N = out_features;
  TORCH_CHECK(panels.size(1) == K, "panel_linear: x has ", K, " columns, the panels ", panels.size(1));
  TORCH_CHECK(N > (P - 1) * kNR && N <= P * kNR, "panel_linear: ", P, " panels cannot hold ", N, " outputs");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y.to(x_in.scalar_type());
  const float* X = x.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  if (panels.scalar_type() == at::kFloat) {
    panel_gemm(X, panels.data_ptr<float>(), Y, M, K, N, P);
  } else {
    panel_gemm(X, reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>()), Y, M, K, N, P);
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdkv, m) {
  m.def("panel_linear(Tensor x, Tensor panels, int out_features, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdkv, CPU, m) { m.impl("panel_linear", &panel_linear); }

#endif  // AVX2 && FMA

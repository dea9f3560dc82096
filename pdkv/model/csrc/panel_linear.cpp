// Linear layer on weights packed in panels of 16 output rows (AVX2 + FMA, or AVX-512): y = x @ W.T,
// x and y float32 or bfloat16, the panels float32 or bfloat16 (widened to float32 in registers,
// float32 FMA; a bfloat16 x on bfloat16 panels runs AVX512-BF16's dot products where the CPU has
// them). Layout, numerics and the measurements behind it: pdkv/model/panel_linear.py. Built with
// the other csrc/*.cpp into one extension by pdkv/model/paged_decode_build.py; on a CPU without
// AVX2/FMA the op is not defined and the engine keeps oneDNN's packed weights.
//
// panels [P, K, 16]: panels[p, k, j] = W[16 p + j, k] (rows past N are zero). AVX2: for a block of
// up to 6 rows of x and one panel, the micro-kernel keeps the 6 x 16 outputs in 12 ymm registers
// and per k loads the panel's 16 weights (two vectors, one cache line) and broadcasts 6 x values:
// the classic AVX2 6x16 register blocking. AVX-512: the 16 weights are one zmm and a block has up
// to 8 rows (8 accumulators). K is walked in one chunk (in chunks of at most kKC when it is
// longer), so each output is stored once, never read back and added to: a panel chunk (up to
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
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kNR = 16;   // outputs per panel
constexpr int64_t kKC = 4096;  // most k per chunk: 4,096 x 16 x 4 B = 256 KiB of a float32 panel
constexpr int64_t kMB = 192;   // rows of x per block
constexpr int64_t kPrefetchRows = 48;  // bfloat16 panels: k rows ahead to prefetch (1.5 KiB)

// k per chunk for a K: K in ceil(K / kKC) equal chunks (one chunk up to kKC). A function of K
// alone, so a row's summation order does not depend on the batch.
inline int64_t chunk_k(int64_t K) {
  const int64_t chunks = (K + kKC - 1) / kKC;
  return (K + chunks - 1) / chunks;
}

#if defined(__AVX512F__)
// AVX-512: a panel row of 16 float32 is one zmm, so the micro-kernel holds up to 8 rows of x (8
// accumulators) and per k loads one vector and broadcasts R x values. Each lane is the same
// sequential FMA sum over k as the AVX2 kernel's: the two give the same bits. 8 rows measured
// ahead of 12 at every batch (docs/SPEED.md, "AVX-512").
constexpr int64_t kMR = 8;  // rows of x per micro-kernel call

inline __m512 load_row(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load_row(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The R accumulators' results stored (first) or added to y's rows (masked past ncols).
#define PDKV_PANEL_STORE(R, ACC)                                                               \
  do {                                                                                         \
    const __mmask16 mask = ncols == kNR ? __mmask16(0xFFFF) : __mmask16((1u << ncols) - 1u);   \
    for (int r = 0; r < R; ++r) {                                                              \
      float* yr = y + r * ldy;                                                                 \
      const __m512 v = first ? ACC[r] : _mm512_add_ps(_mm512_maskz_loadu_ps(mask, yr), ACC[r]); \
      _mm512_mask_storeu_ps(yr, mask, v);                                                      \
    }                                                                                          \
  } while (0)

// y[r, 0:ncols] (+)= sum_{k < kc} x[r, k] * p[k, 0:16] for r < R; `first` stores, else adds.
template <int R, typename W>
inline void micro(const float* __restrict x, int64_t ldx, const W* __restrict p, int64_t kc,
                  float* __restrict y, int64_t ldy, int64_t ncols, bool first) {
  // Named accumulators: an array of vectors is written back to the stack on every iteration.
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
  for (int64_t k = 0; k < kc; ++k) {
    if constexpr (std::is_same_v<W, uint16_t>) {  // as the AVX2 kernel: see there
      if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + (k + kPrefetchRows) * kNR), _MM_HINT_T0);
    }
    const __m512 w = load_row(p + k * kNR);
#define PDKV_STEP(i) \
    if constexpr (R > i) c##i = _mm512_fmadd_ps(w, _mm512_set1_ps(x[i * ldx + k]), c##i);
    PDKV_STEP(0) PDKV_STEP(1) PDKV_STEP(2) PDKV_STEP(3) PDKV_STEP(4) PDKV_STEP(5) PDKV_STEP(6) PDKV_STEP(7)
#undef PDKV_STEP
  }
  const __m512 acc[kMR] = {c0, c1, c2, c3, c4, c5, c6, c7};
  PDKV_PANEL_STORE(R, acc);
}

// A bfloat16 chunk widened to float32 into `wide` [kc, 16] (exact).
inline void widen_chunk(const uint16_t* p, int64_t kc, float* wide) {
  for (int64_t k = 0; k < kc; ++k) _mm512_storeu_ps(wide + k * kNR, load_row(p + k * kNR));
}

#if defined(__AVX512BF16__)
// bfloat16 x on bfloat16 panels with AVX512-BF16's VDPBF16PS: per 32-bit lane j it adds
// w[k][j] * x[k] + w[k + 1][j] * x[k + 1] to a float32 sum (the products are exact in float32;
// Intel SDM, VDPBF16PS: two additions in a fixed order, round to nearest even, denormals
// flushed), twice the multiply-adds of a float32 FMA per instruction and no widening. A panel's
// rows k and k + 1 are one 64-byte line, interleaved into (w[k][j], w[k + 1][j]) pairs by one
// VPERMW (or read already paired from a chunk paired once, see chunk_rows); x's pair
// (x[k], x[k + 1]) is one broadcast 32-bit load. An odd last k pairs with zero. Each output is
// still one thread's sum in a fixed order over k, so it does not depend on the batch; it differs
// from the widened float32 path in the order of the pair's two additions (last bits).
inline __m512i pair_index() {
  // output element 2j <- row k's element j (j), 2j + 1 <- row k + 1's element j (16 + j)
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

inline __m512i x_pair(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return _mm512_set1_epi32(v);
}

// y[r, 0:ncols] (+)= sum_k x[r, k] * p[k, 0:16], x and p bfloat16; `paired`: p is already
// [ceil(kc / 2), 16, 2] pairs (a paired chunk), else the panel's [kc, 16] rows.
template <int R, bool paired>
inline void micro_dp(const uint16_t* __restrict x, int64_t ldx, const uint16_t* __restrict p, int64_t kc,
                     float* __restrict y, int64_t ldy, int64_t ncols, bool first) {
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
  const __m512i idx = pair_index();
  const int64_t kp = kc & ~int64_t(1);
#define PDKV_DP(i, XV) \
  if constexpr (R > i) c##i = _mm512_dpbf16_ps(c##i, w, (__m512bh)(XV));
  for (int64_t k = 0; k < kp; k += 2) {  // no software prefetch: it measured slower here
    const __m512i raw = _mm512_loadu_si512(p + k * kNR);
    const __m512bh w = (__m512bh)(paired ? raw : _mm512_permutexvar_epi16(idx, raw));
    PDKV_DP(0, x_pair(x + k)) PDKV_DP(1, x_pair(x + ldx + k)) PDKV_DP(2, x_pair(x + 2 * ldx + k))
    PDKV_DP(3, x_pair(x + 3 * ldx + k)) PDKV_DP(4, x_pair(x + 4 * ldx + k))
    PDKV_DP(5, x_pair(x + 5 * ldx + k)) PDKV_DP(6, x_pair(x + 6 * ldx + k))
    PDKV_DP(7, x_pair(x + 7 * ldx + k))
  }
  if (kc & 1) {  // the last row paired with zero: (w[k][j], 0), (x[k], 0)
    const int64_t k = kp;
    const __m512bh w = (__m512bh)(
        paired ? _mm512_loadu_si512(p + k * kNR)
               : _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k * kNR))));
#define PDKV_X1(i) _mm512_set1_epi32(int32_t(x[i * ldx + k]))
    PDKV_DP(0, PDKV_X1(0)) PDKV_DP(1, PDKV_X1(1)) PDKV_DP(2, PDKV_X1(2)) PDKV_DP(3, PDKV_X1(3))
    PDKV_DP(4, PDKV_X1(4)) PDKV_DP(5, PDKV_X1(5)) PDKV_DP(6, PDKV_X1(6)) PDKV_DP(7, PDKV_X1(7))
#undef PDKV_X1
  }
#undef PDKV_DP
  const __m512 acc[kMR] = {c0, c1, c2, c3, c4, c5, c6, c7};
  PDKV_PANEL_STORE(R, acc);
}

// A bfloat16 chunk [kc, 16] paired once into `out` [ceil(kc / 2), 16, 2] (an odd last row with zeros).
inline void pair_chunk(const uint16_t* p, int64_t kc, uint16_t* out) {
  const __m512i idx = pair_index();
  int64_t k = 0;
  for (; k + 1 < kc; k += 2)
    _mm512_storeu_si512(out + k * kNR, _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(p + k * kNR)));
  if (k < kc)
    _mm512_storeu_si512(out + k * kNR,
                        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k * kNR))));
}
#endif  // AVX512BF16

#else  // AVX2: two ymm per panel row, the 6 x 16 block
constexpr int64_t kMR = 6;  // rows of x per micro-kernel call

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

// A bfloat16 chunk widened to float32 into `wide` [kc, 16] (exact).
inline void widen_chunk(const uint16_t* p, int64_t kc, float* wide) {
  for (int64_t k = 0; k < kc; ++k) {
    __m256 w0, w1;
    load_row(p + k * kNR, w0, w1);
    _mm256_storeu_ps(wide + k * kNR, w0);
    _mm256_storeu_ps(wide + k * kNR + 8, w1);
  }
}
#endif  // AVX512F

// The micro-kernel for R rows where R < kMR is only known at run time.
template <int R, typename W>
inline void micro_tail(int64_t rows, const float* x, int64_t ldx, const W* p, int64_t kc, float* y,
                       int64_t ldy, int64_t ncols, bool first) {
  if constexpr (R > 0) {
    if (rows == R) return micro<R>(x, ldx, p, kc, y, ldy, ncols, first);
    micro_tail<R - 1>(rows, x, ldx, p, kc, y, ldy, ncols, first);
  }
}

// One panel chunk against rows [0, M) of x, in blocks of kMR rows.
template <typename W>
inline void panel_rows(const float* x, int64_t ldx, int64_t M, const W* p, int64_t kc, float* y,
                       int64_t ldy, int64_t ncols, bool first) {
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR) micro<kMR>(x + m * ldx, ldx, p, kc, y + m * ldy, ldy, ncols, first);
  micro_tail<kMR - 1>(M - m, x + m * ldx, ldx, p, kc, y + m * ldy, ldy, ncols, first);
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
      widen_chunk(p, kc, wide.data());
      panel_rows(x, ldx, M, wide.data(), kc, y, ldy, ncols, first);
      return;
    }
  }
  panel_rows(x, ldx, M, p, kc, y, ldy, ncols, first);
}

#if defined(__AVX512BF16__)
template <int R, bool paired>
inline void micro_dp_tail(int64_t rows, const uint16_t* x, int64_t ldx, const uint16_t* p, int64_t kc,
                          float* y, int64_t ldy, int64_t ncols, bool first) {
  if constexpr (R > 0) {
    if (rows == R) return micro_dp<R, paired>(x, ldx, p, kc, y, ldy, ncols, first);
    micro_dp_tail<R - 1, paired>(rows, x, ldx, p, kc, y, ldy, ncols, first);
  }
}

template <bool paired>
inline void panel_rows_dp(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* p, int64_t kc,
                          float* y, int64_t ldy, int64_t ncols, bool first) {
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR)
    micro_dp<kMR, paired>(x + m * ldx, ldx, p, kc, y + m * ldy, ldy, ncols, first);
  micro_dp_tail<kMR - 1, paired>(M - m, x + m * ldx, ldx, p, kc, y + m * ldy, ldy, ncols, first);
}

// bfloat16 x: the VDPBF16PS kernel; a chunk more than one micro-kernel call reads is paired
// once into `wide` (reused as a uint16 buffer) instead of by every call.
inline void chunk_rows(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* p, int64_t kc,
                       float* y, int64_t ldy, int64_t ncols, bool first, std::vector<float>& wide) {
  if (M > kMR) {
    wide.resize((kc + 1) * kNR / 2);
    uint16_t* paired = reinterpret_cast<uint16_t*>(wide.data());
    pair_chunk(p, kc, paired);
    panel_rows_dp<true>(x, ldx, M, paired, kc, y, ldy, ncols, first);
    return;
  }
  panel_rows_dp<false>(x, ldx, M, p, kc, y, ldy, ncols, first);
}
#endif

// Each thread takes a range of panels. Rows of x go in blocks of kMB, and within a block the
// thread's panels pass one K chunk at a time over the same kMB-row slice of x: x is read from
// memory once per thread and row block instead of once per panel (at 8,192 rows of 576 columns,
// 18.9 MB per panel). Up to kMB rows (every decode step) each panel is walked whole, one after
// the other, so the weights stream in memory order. The order of the k chunks of one output is
// the same either way (first stores, later chunks add): the blocking changes no result bit.
// X is float32, or bfloat16 (uint16) with bfloat16 panels on AVX512-BF16.
template <typename XT, typename W>
void panel_gemm(const XT* X, const W* Wp, float* Y, int64_t M, int64_t K, int64_t N, int64_t P) {
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

// x [T, K] float32 or bfloat16 -> y [T, N] of x's dtype. y is float32 sums plus the bias (widened)
// rounded to x's dtype once at the end, as torch's bfloat16 matmul accumulates in float32. A
// bfloat16 x on bfloat16 panels runs the VDPBF16PS kernel where the CPU has AVX512-BF16 (see
// micro_dp); otherwise a bfloat16 x is widened to float32 first (exact).
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
  at::Tensor y = at::empty({M, N}, x_in.options().dtype(at::kFloat));
  if (M == 0) return y.to(x_in.scalar_type());
  float* Y = y.data_ptr<float>();
  if (panels.scalar_type() == at::kFloat) {
    const at::Tensor x = x_in.to(at::kFloat).contiguous();
    panel_gemm(x.data_ptr<float>(), panels.data_ptr<float>(), Y, M, K, N, P);
  } else {
    const auto* Wp = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (x_in.scalar_type() == at::kBFloat16) {
      const at::Tensor x = x_in.contiguous();
      panel_gemm(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), Wp, Y, M, K, N, P);
    } else {
      const at::Tensor x = x_in.contiguous();
      panel_gemm(x.data_ptr<float>(), Wp, Y, M, K, N, P);
    }
#else
    const at::Tensor x = x_in.to(at::kFloat).contiguous();
    panel_gemm(x.data_ptr<float>(), Wp, Y, M, K, N, P);
#endif
  }
  if (bias.has_value() && bias->defined()) y.add_(bias->to(at::kFloat));
  return x_in.scalar_type() == at::kFloat ? y : y.to(x_in.scalar_type());
}

// Which kernel this build runs: "avx512_bf16" (16-wide float32 FMA, and VDPBF16PS for a
// bfloat16 x on bfloat16 panels), "avx512" (16-wide) or "avx2" (the 6 x 16 block).
std::string panel_linear_isa() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#else
  return "avx2";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdkv, m) {
  m.def("panel_linear(Tensor x, Tensor panels, int out_features, Tensor? bias=None) -> Tensor");
  m.def("panel_linear_isa() -> str", &panel_linear_isa);
}

TORCH_LIBRARY_IMPL(pdkv, CPU, m) { m.impl("panel_linear", &panel_linear); }

#endif  // AVX2 && FMA

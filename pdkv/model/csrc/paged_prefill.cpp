// Varlen paged prefill attention on CPU: all prefill runs of a step in one call, K/V read in place
// from the layer's cache [2, num_blocks, block_size, num_kv_heads, head_size] through each run's
// block table. One task per (run, KV head, tile of TILE query positions) serving the tile's
// positions for every query head of the KV head's group (GQA); per chunk of kKeys keys (aligned to
// multiples of kKeys in the run's positions, gathered from the blocks that hold them) an online
// softmax (Milakov & Gimelshein 2018; FlashAttention's running max / sum) in float32.
// Built with paged_decode.cpp by pdkv/model/paged_decode_build.py; semantics in
// pdkv/model/paged_prefill.py.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t TILE = 32;  // query positions per task
constexpr int64_t kRows = 6;  // query rows per micro-kernel call (Q K^T and P V)
// Keys per online-softmax step. A step's per-row work (the running max's rescale exp, the row
// sum, the accumulator's rescale) is paid once per kKeys keys instead of once per cache block
// (16): at 512 tokens the softmax was a third of the op's cycles with 16 (perf annotate).
// Chunks start at multiples of kKeys of the key position, so a query's chunks, and with them
// its result, do not depend on how its prompt was split into steps or tiles.
constexpr int64_t kKeys = 64;

// Cephes' expf: log2(e), ln 2 split into a high and a low part, and the polynomial's
// coefficients (highest power first), shared by the scalar and the 8-lane exp below.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// exp(x) for x <= 0 (0 below -87), Cephes' expf range reduction and polynomial (~1 ulp).
inline float exp_nonpos(float x) {
  const float xc = std::max(x, -87.f);
  const float n = std::floor(xc * kLog2e + 0.5f);
  const float r = xc - n * kLn2Hi + n * kLn2Lo;
  float p = kExpP[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpP[i];
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < -87.f ? 0.f : p * two_n;
}

struct Task {
  int64_t run, head, q0, q1;  // run, KV head, query rows [q0, q1) of the run
};

// 8 floats (AVX2 on x86 with -march=native; GCC / clang split it where vectors are narrower);
// aligned(4): loads and stores at any float address.
typedef float vf8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32)));

inline vf8 load8(const float* p) { return *reinterpret_cast<const vf8*>(p); }
inline void store8(float* p, vf8 v) { *reinterpret_cast<vf8*>(p) = v; }
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// exp_nonpos on 8 lanes: the same range reduction and polynomial in vector code (GCC / clang
// vector extensions); floor by truncation, exact for the |x| <= 126 the clamp leaves.
inline vf8 exp_nonpos8(vf8 x) {
  const vf8 lo = vf8{} - 87.f;
  const vf8 xc = x < lo ? lo : x;
  const vf8 z = xc * kLog2e + 0.5f;
  const vf8 zt = __builtin_convertvector(__builtin_convertvector(z, vi8), vf8);
  const vf8 n = z < zt ? zt - 1.f : zt;
  const vf8 r = xc - n * kLn2Hi + n * kLn2Lo;
  vf8 p = vf8{} + kExpP[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpP[i];
  p = p * r * r + r + 1.f;
  const vi8 bits = (__builtin_convertvector(n, vi8) + 127) << 23;
  const vf8 res = p * (vf8)bits;  // a vector cast keeps the bits
  return x < lo ? vf8{} : res;
}

template <typename scalar_t>
void prefill_kernel(const at::Tensor& q, const at::Tensor& kv, const std::vector<int64_t>& cu,
                    const std::vector<int64_t>& ctx, const at::Tensor& tables, double scale,
                    int64_t window, at::Tensor& out, at::Tensor& lse) {
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t bs = kv.size(2), KVH = kv.size(3);
  const int64_t G = H / KVH;
  const int64_t R = static_cast<int64_t>(ctx.size());
  // Buffer widths: keys of a chunk (kKeys, a multiple of 16), head dim padded to 16, rows of a
  // tile padded to kRows (the micro-kernels work on kRows rows x 16 columns; padding is zero).
  const int64_t KW = kKeys, DW = round_up(D, 16), RW = round_up(TILE * G, kRows);
  const int64_t q_st = q.stride(0), q_sh = q.stride(1);
  const int64_t o_st = out.stride(0), o_sh = out.stride(1);
  const int64_t kv_s0 = kv.stride(0), kv_sb = kv.stride(1), kv_st = kv.stride(2), kv_sh = kv.stride(3);
  const int64_t t_sr = tables.stride(0), t_sc = tables.stride(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kvp = kv.data_ptr<scalar_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  float* lsep = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Longest tiles first (the last tiles of long runs see the most keys), then balanced dynamically.
  std::vector<Task> tasks;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t q0 = 0; q0 < cu[r + 1] - cu[r]; q0 += TILE)
      for (int64_t h = 0; h < KVH; ++h) tasks.push_back({r, h, q0, std::min(q0 + TILE, cu[r + 1] - cu[r])});
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    return ctx[a.run] + a.q1 > ctx[b.run] + b.q1;
  });
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());

#pragma omp parallel num_threads(std::max(1, at::get_num_threads()))
  {
    // qf: scaled queries [RW][D]; acc [RW][DW]; s: scores then weights [RW][KW];
    // kt: the chunk's keys transposed [D][KW]; vt: its values [KW][DW].
    std::vector<float> qf(RW * D, 0.f), acc(RW * DW), s(RW * KW), kt(D * KW, 0.f), vt(KW * DW, 0.f);
    std::vector<float> m(RW), l(RW), alpha(RW);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < num_tasks; ++ti) {
      const Task& task = tasks[ti];
      const int64_t r = task.run, h = task.head, nq = task.q1 - task.q0, rows = nq * G;
      const int64_t p0 = ctx[r] + task.q0, p1 = ctx[r] + task.q1;  // query positions [p0, p1)
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const scalar_t* qrow = qp + (cu[r] + task.q0 + i) * q_st + (h * G + g) * q_sh;
          float* qd = &qf[(i * G + g) * D];
          for (int64_t d = 0; d < D; ++d) qd[d] = static_cast<float>(qrow[d]) * sc;
        }
      std::fill(qf.begin() + rows * D, qf.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t klo = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
      // One chunk at a time: column t of chunk c holds key position c + t, so a position's lane
      // is the same in every tile. Only keys in [klo, p1) are read (columns before p are zero).
      for (int64_t c = klo / kKeys * kKeys; c < p1; c += kKeys) {
        const int64_t p = std::max(c, klo), t0 = p - c, n = std::min(c + kKeys, p1) - c;
        const int64_t nw = round_up(n, 16);  // columns the micro-kernels and the softmax touch
        for (int64_t t = t0; t < n;) {  // gather the chunk's keys from the blocks holding them
          const int64_t pos = c + t, off = pos % bs, run_n = std::min(bs - off, n - t);
          const scalar_t* kb = kvp + tp[r * t_sr + (pos / bs) * t_sc] * kv_sb + off * kv_st + h * kv_sh;
          const scalar_t* vb = kb + kv_s0;
          for (int64_t u = 0; u < run_n; ++u, ++t) {
            const scalar_t* ku = kb + u * kv_st;
            const scalar_t* vu = vb + u * kv_st;
            float* vd = &vt[t * DW];
            for (int64_t d = 0; d < D; ++d) kt[d * KW + t] = static_cast<float>(ku[d]);
            for (int64_t d = 0; d < D; ++d) vd[d] = static_cast<float>(vu[d]);
          }
        }
        for (int64_t d = 0; d < D; ++d) {
          for (int64_t t = 0; t < t0; ++t) kt[d * KW + t] = 0.f;
          for (int64_t t = n; t < nw; ++t) kt[d * KW + t] = 0.f;
        }
        // S = Q K^T for 6 rows x 16 keys at a time: 12 accumulators, enough independent FMA
        // chains to keep both FMA units busy (4 rows, 8 chains, left them waiting on latency).
        for (int64_t r0 = 0; r0 < RW; r0 += kRows) {
          if (r0 >= rows) break;
          for (int64_t c0 = 0; c0 < nw; c0 += 16) {
            vf8 s00 = {}, s01 = {}, s10 = {}, s11 = {}, s20 = {}, s21 = {}, s30 = {}, s31 = {};
            vf8 s40 = {}, s41 = {}, s50 = {}, s51 = {};
            const float* qq = &qf[r0 * D];
            for (int64_t d = 0; d < D; ++d) {
              const vf8 k0 = load8(&kt[d * KW + c0]), k1 = load8(&kt[d * KW + c0 + 8]);
              const float a0 = qq[d], a1 = qq[D + d], a2 = qq[2 * D + d], a3 = qq[3 * D + d];
              const float a4 = qq[4 * D + d], a5 = qq[5 * D + d];
              s00 += a0 * k0; s01 += a0 * k1; s10 += a1 * k0; s11 += a1 * k1;
              s20 += a2 * k0; s21 += a2 * k1; s30 += a3 * k0; s31 += a3 * k1;
              s40 += a4 * k0; s41 += a4 * k1; s50 += a5 * k0; s51 += a5 * k1;
            }
            float* sr = &s[r0 * KW + c0];
            store8(sr, s00); store8(sr + 8, s01); store8(sr + KW, s10); store8(sr + KW + 8, s11);
            store8(sr + 2 * KW, s20); store8(sr + 2 * KW + 8, s21);
            store8(sr + 3 * KW, s30); store8(sr + 3 * KW + 8, s31);
            store8(sr + 4 * KW, s40); store8(sr + 4 * KW + 8, s41);
            store8(sr + 5 * KW, s50); store8(sr + 5 * KW + 8, s51);
          }
        }
        // Online softmax per row over its visible keys [a, b) of the chunk: weights in s (0
        // elsewhere), alpha rescales the row's accumulator. A row seeing none keeps its state.
        for (int64_t row = 0; row < RW; ++row) {
          float* sr = &s[row * KW];
          const int64_t pq = p0 + row / G;  // sees keys [max(0, pq - W + 1), pq]
          const int64_t lo = window > 0 ? std::max<int64_t>(0, pq - window + 1) : 0;
          const int64_t a = row < rows ? std::max(p, lo) - c : 0;
          const int64_t b = row < rows ? std::min(c + n, pq + 1) - c : 0;
          if (a >= b) {
            std::fill(sr, sr + nw, 0.f);
            alpha[row] = 1.f;
            continue;
          }
          // Scores outside [a, b) become -inf (their exp below is 0), and the max is taken over
          // the rest (the max of floats is exact in any order).
          const vi8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
          const vf8 vneg = vf8{} + neg_inf;
          vf8 vmax = vneg;
          for (int64_t t = 0; t < nw; t += 8) {
            const vi8 idx = lane + static_cast<int32_t>(t);
            const vf8 v = (idx >= static_cast<int32_t>(a)) & (idx < static_cast<int32_t>(b)) ? load8(sr + t) : vneg;
            store8(sr + t, v);
            vmax = vmax > v ? vmax : v;
          }
          float mb = vmax[0];
          for (int i = 1; i < 8; ++i) mb = std::max(mb, vmax[i]);
          const float mnew = std::max(m[row], mb);
          alpha[row] = exp_nonpos(m[row] - mnew);  // 0 on the row's first keys (m = -inf)
          vf8 vsum = {};
          for (int64_t t = 0; t < nw; t += 8) {  // nw is a multiple of 16
            const vf8 w = exp_nonpos8(load8(sr + t) - mnew);  // -inf - mnew: 0
            store8(sr + t, w);
            vsum += w;
          }
          float sum = 0.f;
          for (int i = 0; i < 8; ++i) sum += vsum[i];
          l[row] = l[row] * alpha[row] + sum;
          m[row] = mnew;
        }
        // acc = alpha * acc + P V for 6 rows x 16 head dims at a time (12 accumulators, as above).
        for (int64_t r0 = 0; r0 < RW; r0 += kRows) {
          if (r0 >= rows) break;
          const float* pr = &s[r0 * KW];
          const float* al = &alpha[r0];
          for (int64_t dc = 0; dc < DW; dc += 16) {
            float* ar = &acc[r0 * DW + dc];
            vf8 a00 = load8(ar) * al[0], a01 = load8(ar + 8) * al[0];
            vf8 a10 = load8(ar + DW) * al[1], a11 = load8(ar + DW + 8) * al[1];
            vf8 a20 = load8(ar + 2 * DW) * al[2], a21 = load8(ar + 2 * DW + 8) * al[2];
            vf8 a30 = load8(ar + 3 * DW) * al[3], a31 = load8(ar + 3 * DW + 8) * al[3];
            vf8 a40 = load8(ar + 4 * DW) * al[4], a41 = load8(ar + 4 * DW + 8) * al[4];
            vf8 a50 = load8(ar + 5 * DW) * al[5], a51 = load8(ar + 5 * DW + 8) * al[5];
            for (int64_t t = t0; t < n; ++t) {
              const vf8 v0 = load8(&vt[t * DW + dc]), v1 = load8(&vt[t * DW + dc + 8]);
              const float w0 = pr[t], w1 = pr[KW + t], w2 = pr[2 * KW + t], w3 = pr[3 * KW + t];
              const float w4 = pr[4 * KW + t], w5 = pr[5 * KW + t];
              a00 += w0 * v0; a01 += w0 * v1; a10 += w1 * v0; a11 += w1 * v1;
              a20 += w2 * v0; a21 += w2 * v1; a30 += w3 * v0; a31 += w3 * v1;
              a40 += w4 * v0; a41 += w4 * v1; a50 += w5 * v0; a51 += w5 * v1;
            }
            store8(ar, a00); store8(ar + 8, a01); store8(ar + DW, a10); store8(ar + DW + 8, a11);
            store8(ar + 2 * DW, a20); store8(ar + 2 * DW + 8, a21);
            store8(ar + 3 * DW, a30); store8(ar + 3 * DW + 8, a31);
            store8(ar + 4 * DW, a40); store8(ar + 4 * DW + 8, a41);
            store8(ar + 5 * DW, a50); store8(ar + 5 * DW + 8, a51);
          }
        }
      }
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t row = i * G + g, tok = cu[r] + task.q0 + i, head = h * G + g;
          scalar_t* orow = op + tok * o_st + head * o_sh;
          const float inv = l[row] > 0.f ? 1.f / l[row] : 0.f;
          for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<scalar_t>(acc[row * DW + d] * inv);
          lsep[tok * H + head] = l[row] > 0.f ? m[row] + std::log(l[row]) : neg_inf;
        }
    }
  }
}

std::vector<int64_t> to_vector(const at::Tensor& t) {
  auto c = t.contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& cu_seqlens,
                         const at::Tensor& context_lens, const at::Tensor& block_tables, double scale,
                         int64_t window, at::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_prefill: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "paged_prefill: q [T,H,D], kv_cache [2,N,bs,KVH,D]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "paged_prefill: q and kv_cache dtypes differ");
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == q.size(2), "paged_prefill: head_size mismatch");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "paged_prefill: num_heads not a multiple of num_kv_heads");
  TORCH_CHECK(q.stride(2) == 1 && kv_cache.stride(4) == 1, "paged_prefill: head_size dim must be contiguous");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  block_tables.scalar_type() == at::kLong,
              "paged_prefill: cu_seqlens, context_lens and block_tables must be int64");
  const int64_t R = context_lens.numel(), T = q.size(0), bs = kv_cache.size(2), N = kv_cache.size(1);
  TORCH_CHECK(cu_seqlens.numel() == R + 1 && block_tables.dim() == 2 && block_tables.size(0) == R,
              "paged_prefill: cu_seqlens [R+1], context_lens [R], block_tables [R, max_blocks]");
  const auto cu = to_vector(cu_seqlens), ctx = to_vector(context_lens);
  TORCH_CHECK(cu[0] == 0 && cu[R] == T, "paged_prefill: cu_seqlens must run from 0 to T = ", T);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {  // every table entry the kernel will read, checked up front
    TORCH_CHECK(cu[r + 1] >= cu[r] && ctx[r] >= 0, "paged_prefill: run ", r, " has negative length");
    const int64_t total = ctx[r] + cu[r + 1] - cu[r];
    if (total == ctx[r]) continue;
    TORCH_CHECK((total + bs - 1) / bs <= max_blocks, "paged_prefill: block table row ", r,
                " too short for ", total, " tokens");
    const int64_t first = window > 0 ? std::max<int64_t>(0, ctx[r] - window + 1) / bs : 0;
    for (int64_t i = first; i < (total + bs - 1) / bs; ++i) {
      const int64_t blk = tp[r * block_tables.stride(0) + i * block_tables.stride(1)];
      TORCH_CHECK(blk >= 0 && blk < N, "paged_prefill: block id ", blk, " out of range in row ", r);
    }
  }
  TORCH_CHECK(out.device().is_cpu() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() &&
                  out.stride(2) == 1,
              "paged_prefill: out must have q's shape and dtype, head_size dim contiguous");
  auto lse = at::empty({T, q.size(1)}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] {
    prefill_kernel<scalar_t>(q, kv_cache, cu, ctx, block_tables, scale, window, out, lse);
  });
  return lse;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdkv, m) {
  m.def("paged_prefill(Tensor q, Tensor kv_cache, Tensor cu_seqlens, Tensor context_lens, "
        "Tensor block_tables, float scale, int window, Tensor(a!) out) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdkv, CPU, m) { m.impl("paged_prefill", &paged_prefill); }

// Paged decode attention on CPU: one query token per request, K/V read in place from the
// layer's cache [2, num_blocks, block_size, num_kv_heads, head_size] through the block table.
// Online softmax (Milakov & Gimelshein 2018; FlashAttention's running max / sum) per block of
// keys, in float32, one task per (request, KV head) serving its group of query heads (GQA).
// Built by pdkv/model/paged_decode_build.py; semantics in pdkv/model/paged_decode.py.

#include "cpu_vec.h"  // before ATen: its Vectorized<float> for this CPU, pdkv::vec helpers

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using pdkv::vec::Vec;

// x[i] = exp(x[i] - shift) for i < n, vectorised; returns their sum.
inline float exp_shifted_sum(float* x, int64_t n, float shift) {
  Vec sum(0.f);
  const Vec sh(shift);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec e = (Vec::loadu(x + i) - sh).exp();
    e.store(x + i);
    sum = sum + e;
  }
  if (i < n) {
    // Lanes past n load as 0 and give exp(-shift): stored back only for the first n - i.
    const Vec e = (Vec::loadu(x + i, n - i) - sh).exp();
    e.store(x + i, n - i);
    sum = sum + Vec::set(Vec(0.f), e, n - i);
  }
  return pdkv::vec::reduce_sum(sum);
}

// s[t] = q . k_t for the n <= bs key rows k_t = k + t * ld (float32 or bfloat16 K, D a multiple of the vector
// width): four rows at a time, each with its own accumulator, so the FMAs of four dot products
// interleave instead of waiting on one chain; the sum over d runs in vector lanes and ends in
// one lane reduction per row (the order is fixed by D alone: a row's score does not depend on
// the batch).
// Vec::size() K/V values from p as float32: float32 loads directly, bfloat16 widens (exact).
inline Vec load_kv(const float* p) { return Vec::loadu(p); }
inline Vec load_kv(const c10::BFloat16* p) { return pdkv::vec::load_bf16(p); }

template <typename T>
inline float dot_row(const float* q, const T* k, int64_t D) {
  Vec a(0.f);
  for (int64_t d = 0; d < D; d += Vec::size()) a = at::vec::fmadd(Vec::loadu(q + d), load_kv(k + d), a);
  return pdkv::vec::reduce_sum(a);
}

template <typename T>
inline float scores_vec(const float* q, const T* k, int64_t ld, int64_t n, int64_t D, float* s) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const T* k0 = k + t * ld;
    Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
    for (int64_t d = 0; d < D; d += Vec::size()) {
      const Vec qv = Vec::loadu(q + d);
      a0 = at::vec::fmadd(qv, load_kv(k0 + d), a0);
      a1 = at::vec::fmadd(qv, load_kv(k0 + ld + d), a1);
      a2 = at::vec::fmadd(qv, load_kv(k0 + 2 * ld + d), a2);
      a3 = at::vec::fmadd(qv, load_kv(k0 + 3 * ld + d), a3);
    }
    s[t] = pdkv::vec::reduce_sum(a0);
    s[t + 1] = pdkv::vec::reduce_sum(a1);
    s[t + 2] = pdkv::vec::reduce_sum(a2);
    s[t + 3] = pdkv::vec::reduce_sum(a3);
    mx = std::max({mx, s[t], s[t + 1], s[t + 2], s[t + 3]});
  }
  for (; t < n; ++t) {
    s[t] = dot_row(q, k + t * ld, D);
    mx = std::max(mx, s[t]);
  }
  return mx;
}

// acc[0:D] += sum_t e[t] * v_t for the n value rows v_t = v + t * ld (float32 or bfloat16 V, D a multiple of
// the vector width): four vectors of acc stay in registers while every row passes, so acc is
// loaded and stored once per block instead of once per row. Per element the sum runs over t in
// order, as the scalar loop's.
template <typename T>
inline void accumulate_vec(float* acc, const float* e, const T* v, int64_t ld, int64_t n, int64_t D) {
  constexpr int64_t W = Vec::size();
  int64_t d = 0;
  for (; d + 4 * W <= D; d += 4 * W) {
    Vec a0 = Vec::loadu(acc + d), a1 = Vec::loadu(acc + d + W);
    Vec a2 = Vec::loadu(acc + d + 2 * W), a3 = Vec::loadu(acc + d + 3 * W);
    for (int64_t t = 0; t < n; ++t) {
      const Vec et(e[t]);
      const T* vr = v + t * ld + d;
      a0 = at::vec::fmadd(et, load_kv(vr), a0);
      a1 = at::vec::fmadd(et, load_kv(vr + W), a1);
      a2 = at::vec::fmadd(et, load_kv(vr + 2 * W), a2);
      a3 = at::vec::fmadd(et, load_kv(vr + 3 * W), a3);
    }
    a0.store(acc + d);
    a1.store(acc + d + W);
    a2.store(acc + d + 2 * W);
    a3.store(acc + d + 3 * W);
  }
  for (; d < D; d += W) {
    Vec a = Vec::loadu(acc + d);
    for (int64_t t = 0; t < n; ++t) a = at::vec::fmadd(Vec(e[t]), load_kv(v + t * ld + d), a);
    a.store(acc + d);
  }
}

template <typename scalar_t>
void decode_kernel(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                   const at::Tensor& lens, double scale, int64_t window, at::Tensor& out,
                   at::Tensor& lse) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = kv.size(2), KVH = kv.size(3);
  const int64_t G = H / KVH;
  const int64_t q_sb = q.stride(0), q_sh = q.stride(1);
  const int64_t kv_s0 = kv.stride(0), kv_sb = kv.stride(1), kv_st = kv.stride(2), kv_sh = kv.stride(3);
  const int64_t t_sb = tables.stride(0), t_sc = tables.stride(1);
  const int64_t max_blocks = tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kvp = kv.data_ptr<scalar_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  float* lsep = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // float32 and bfloat16 K/V whose head size fills whole vectors take the vector paths
  // (scores_vec, accumulate_vec; bfloat16 widened on load); float16 and other head sizes the
  // scalar loops.
  constexpr bool kVecType = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;
  const bool vec_d = D % pdkv::vec::Vec::size() == 0;
  const bool vec_path = kVecType && vec_d;

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), s(G * bs), m(G), l(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH;
      const int64_t len = lp[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t base = window > 0 ? lo / bs * bs : 0;  // position of the table's first key
      for (int64_t g = 0; g < G; ++g) {
        const scalar_t* qrow = qp + b * q_sb + (h * G + g) * q_sh;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qrow[d]) * sc;
        m[g] = neg_inf;
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = lo; p < len;) {
        const int64_t idx = (p - base) / bs;
        TORCH_CHECK(idx < max_blocks, "paged_decode: block table row ", b, " too short for seq len ", len);
        const int64_t blk = tp[b * t_sb + idx * t_sc];
        const int64_t off = p % bs;
        const int64_t n = std::min(bs - off, len - p);
        const scalar_t* kb = kvp + blk * kv_sb + off * kv_st + h * kv_sh;
        const scalar_t* vb = kb + kv_s0;
        // Prefetch the next block's K and V rows of this head while this block is computed: a
        // task walks scattered blocks, each a short stream the hardware prefetcher barely ramps
        // up on, so at large batches (KV past the caches) the loads otherwise wait on DRAM.
        if (p + n < len) {
          const int64_t nidx = (p + n - base) / bs;
          if (nidx < max_blocks) {
            const int64_t nn = std::min(bs, len - p - n);
            const char* nk = reinterpret_cast<const char*>(kvp + tp[b * t_sb + nidx * t_sc] * kv_sb + h * kv_sh);
            const int64_t row_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
            const int64_t st_bytes = kv_st * static_cast<int64_t>(sizeof(scalar_t));
            const int64_t s0_bytes = kv_s0 * static_cast<int64_t>(sizeof(scalar_t));
            for (int64_t t = 0; t < nn; ++t) {
              for (int64_t c = 0; c < row_bytes; c += 64) {
                __builtin_prefetch(nk + t * st_bytes + c);
                __builtin_prefetch(nk + s0_bytes + t * st_bytes + c);
              }
            }
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = &qf[g * D];
          float* sg = &s[g * bs];
          float mb = neg_inf;
          if constexpr (kVecType) {
            if (vec_d) mb = scores_vec(qg, kb, kv_st, n, D, sg);
          }
          if (!vec_path) {
            for (int64_t t = 0; t < n; ++t) {
              const scalar_t* kr = kb + t * kv_st;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < D; ++d) dot += qg[d] * static_cast<float>(kr[d]);
              sg[t] = dot;
              mb = std::max(mb, dot);
            }
          }
          const float mnew = std::max(m[g], mb);
          const float alpha = std::exp(m[g] - mnew);  // 0 on the first block (m = -inf)
          float* ag = &acc[g * D];
          if (alpha != 1.f) {
            l[g] *= alpha;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
          }
          l[g] += exp_shifted_sum(sg, n, mnew);  // sg[t] = exp(score - mnew)
          if constexpr (kVecType) {
            if (vec_d) accumulate_vec(ag, sg, vb, kv_st, n, D);
          }
          if (!vec_path) {
            for (int64_t t = 0; t < n; ++t) {
              const float e = sg[t];
              const scalar_t* vr = vb + t * kv_st;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) ag[d] += e * static_cast<float>(vr[d]);
            }
          }
          m[g] = mnew;
        }
        p += n;
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t head = h * G + g;
        scalar_t* orow = op + (b * H + head) * D;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<scalar_t>(acc[g * D + d] * inv);
        lsep[b * H + head] = l[g] > 0.f ? m[g] + std::log(l[g]) : neg_inf;
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& kv_cache,
                                                const at::Tensor& block_tables,
                                                const at::Tensor& seq_lens, double scale,
                                                int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "paged_decode: q [B,H,D], kv_cache [2,N,bs,KVH,D]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "paged_decode: q and kv_cache dtypes differ");
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == q.size(2), "paged_decode: head_size mismatch");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0, "paged_decode: num_heads not a multiple of num_kv_heads");
  TORCH_CHECK(q.stride(2) == 1 && kv_cache.stride(4) == 1, "paged_decode: head_size dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode: block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "paged_decode: block_tables [B, max_blocks], seq_lens [B]");
  auto lens = seq_lens.contiguous();
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q, kv_cache, block_tables, lens, scale, window, out, lse);
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(pdkv, m) {
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale, "
        "int window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pdkv, CPU, m) { m.impl("paged_decode", &paged_decode); }

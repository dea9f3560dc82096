// Fused small ops of a Llama layer on CPU, float32 and bfloat16: RMSNorm, residual add + RMSNorm
// (in place on the residual), rotate-half RoPE on q and k together (in place), SiLU(gate) * up.
// Each op is one pass over its rows (at::parallel_for over rows; float32 with ATen's
// Vectorized<float> within a row) instead of several ATen kernels and temporaries. bfloat16 rows
// are computed in float32 and rounded to bfloat16 where the torch ops round (after each ATen op
// of the reference), so they give the torch path's bits but for RMSNorm's sum order. Semantics
// and tolerances: pdkv/model/fused_ops.py.
// Built with csrc/paged_decode.cpp into one extension by pdkv/model/paged_decode_build.py.

#include "cpu_vec.h"  // before ATen: its Vectorized<float> for this CPU, pdkv::vec helpers

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

// Products and sums are rounded one by one as in the torch reference (no FMA contraction), so
// RoPE and the residual add give the reference's bits.
#pragma GCC optimize("fp-contract=off")

namespace {

using pdkv::vec::Vec;
// Elements per parallel task, at least: ATen's grain for elementwise kernels, so small (decode)
// inputs run on one thread as the torch ops they replace do.
constexpr int64_t kGrainElems = at::internal::GRAIN_SIZE;

int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, row_elems)); }

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), op,
              ": float32 or bfloat16 CPU tensors only, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": expects [T, N] with the last dim contiguous");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), op, ": ", what, " is ", b.scalar_type(), ", the input ",
              a.scalar_type());
}

using bf16 = at::BFloat16;

using pdkv::vec::round_bf16;  // a float or a Vec rounded to bfloat16 and widened back

// bfloat16 RMSNorm of one row as the torch path computes it (pdkv.model.llama.rms_norm, HF's
// LlamaRMSNorm): x * inv in float32 rounded to bfloat16, then weight * that, rounded again.
inline void norm_row(const bf16* x, const bf16* w, bf16* out, int64_t n, float eps, float ss) {
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  const Vec vinv(inv);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size())
    pdkv::vec::store_bf16(out + d, pdkv::vec::load_bf16(w + d) * round_bf16(pdkv::vec::load_bf16(x + d) * vinv));
  for (; d < n; ++d)
    out[d] = static_cast<bf16>(static_cast<float>(w[d]) * round_bf16(static_cast<float>(x[d]) * inv));
}

inline float sum_squares(const bf16* x, int64_t n) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    const Vec v = pdkv::vec::load_bf16(x + d);
    acc = acc + v * v;
  }
  float s = pdkv::vec::reduce_sum(acc);
  for (; d < n; ++d) {
    const float v = static_cast<float>(x[d]);
    s += v * v;
  }
  return s;
}

// out = weight * (x * 1/sqrt(mean(x^2) + eps)) for one row of n floats (HF's LlamaRMSNorm order).
inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps, float ss) {
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  const Vec vinv(inv);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size())
    (Vec::loadu(w + d) * (Vec::loadu(x + d) * vinv)).store(out + d);
  for (; d < n; ++d) out[d] = w[d] * (x[d] * inv);
}

inline float sum_squares(const float* x, int64_t n) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    const Vec v = Vec::loadu(x + d);
    acc = acc + v * v;
  }
  float s = pdkv::vec::reduce_sum(acc);
  for (; d < n; ++d) s += x[d] * x[d];
  return s;
}

// out[t] = RMSNorm(x[t]) * weight for each row t of x [T, N] (rows split over threads).
template <typename S>
void rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, double eps) {
  const S* xp = x.data_ptr<S>();
  const S* wp = weight.data_ptr<S>();
  S* op = out.data_ptr<S>();
  const int64_t n = x.size(1), xs = x.stride(0);
  at::parallel_for(0, x.size(0), grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      norm_row(xp + t * xs, wp, op + t * n, n, static_cast<float>(eps), sum_squares(xp + t * xs, n));
  });
}

at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "fused_rms_norm");
  const int64_t T = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "fused_rms_norm: weight must be [N] contiguous");
  check_same_dtype(x, weight, "fused_rms_norm", "weight");
  auto out = at::empty({T, n}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    rms_norm_rows<bf16>(x, weight, out, eps);
  } else {
    rms_norm_rows<float>(x, weight, out, eps);
  }
  return out;
}

// r += xr in place (float32), then out = RMSNorm(r) * w; the sum of squares taken in the add's pass.
inline void add_norm_row(float* r, const float* xr, const float* w, float* out, int64_t n, float eps) {
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size()) {
    const Vec v = Vec::loadu(r + d) + Vec::loadu(xr + d);
    v.store(r + d);
    acc = acc + v * v;
  }
  float ss = pdkv::vec::reduce_sum(acc);
  for (; d < n; ++d) {
    r[d] = r[d] + xr[d];
    ss += r[d] * r[d];
  }
  norm_row(r, w, out, n, eps, ss);
}

// r = bf16(r + xr) in place, then out = RMSNorm of that r (as the torch path: the sum is a
// bfloat16 tensor before it is normalised).
inline void add_norm_row(bf16* r, const bf16* xr, const bf16* w, bf16* out, int64_t n, float eps) {
  int64_t d = 0;
  for (; d + Vec::size() <= n; d += Vec::size())
    pdkv::vec::store_bf16(r + d, pdkv::vec::load_bf16(r + d) + pdkv::vec::load_bf16(xr + d));
  for (; d < n; ++d) r[d] = static_cast<bf16>(static_cast<float>(r[d]) + static_cast<float>(xr[d]));
  norm_row(r, w, out, n, eps, sum_squares(r, n));
}

// add_norm_row on each row of residual / x [T, N] (rows split over threads).
template <typename S>
void add_rms_norm_rows(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, at::Tensor& out,
                       double eps) {
  S* rp = residual.data_ptr<S>();
  const S* xp = x.data_ptr<S>();
  const S* wp = weight.data_ptr<S>();
  S* op = out.data_ptr<S>();
  const int64_t n = residual.size(1), rs = residual.stride(0), xs = x.stride(0);
  at::parallel_for(0, residual.size(0), grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      add_norm_row(rp + t * rs, xp + t * xs, wp, op + t * n, n, static_cast<float>(eps));
  });
}

at::Tensor fused_add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(residual, "fused_add_rms_norm_");
  check_rows(x, "fused_add_rms_norm_");
  const int64_t T = residual.size(0), n = residual.size(1);
  TORCH_CHECK(x.size(0) == T && x.size(1) == n, "fused_add_rms_norm_: residual and x shapes differ");
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "fused_add_rms_norm_: weight must be [N] contiguous");
  check_same_dtype(residual, x, "fused_add_rms_norm_", "x");
  check_same_dtype(residual, weight, "fused_add_rms_norm_", "weight");
  auto out = at::empty({T, n}, residual.options());
  if (residual.scalar_type() == at::kBFloat16) {
    add_rms_norm_rows<bf16>(residual, x, weight, out, eps);
  } else {
    add_rms_norm_rows<float>(residual, x, weight, out, eps);
  }
  return out;
}

// Runs row(x, cos, sin) on each head of qk [T, H, D] (its D values, in place) with its token's
// cos / sin rows [D]; the T * H heads are split over threads.
template <typename T, typename Row>
void for_each_head(at::Tensor& qk, const at::Tensor& c, const at::Tensor& s, const Row& row) {
  T* xp = qk.data_ptr<T>();
  const T* cp = c.data_ptr<T>();
  const T* sp = s.data_ptr<T>();
  const int64_t H = qk.size(1), D = qk.size(2), st = qk.stride(0), sh = qk.stride(1);
  at::parallel_for(0, qk.size(0) * H, grain_rows(D), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / H, h = task % H;
      row(xp + t * st + h * sh, cp + t * D, sp + t * D);
    }
  });
}

// qk [T, heads, D] (last dim contiguous, any row / head strides): each head's halves (x0, x1)
// become (x0 * cos0 + x1 * ssin0, x1 * cos1 + x0 * ssin1), with ssin's first half = -sin
// (pdkv.model.llama.rope_cos_sin), i.e. HF's x * cos + rotate_half(x) * sin.
void fused_rope_(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qk.device().is_cpu() && (qk.scalar_type() == at::kFloat || qk.scalar_type() == at::kBFloat16),
              "fused_rope_: float32 or bfloat16 CPU tensors only, got ", qk.scalar_type());
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1, "fused_rope_: qk [T, heads, D], D contiguous");
  const int64_t T = qk.size(0), H = qk.size(1), D = qk.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "fused_rope_: head size must be even");
  auto c = cos.reshape({-1, D}).contiguous();
  auto s = sin.reshape({-1, D}).contiguous();
  TORCH_CHECK(c.size(0) == T && s.size(0) == T && c.scalar_type() == qk.scalar_type() &&
                  s.scalar_type() == qk.scalar_type(),
              "fused_rope_: cos / sin must be [T, 1, D] of qk's dtype");
  if (qk.scalar_type() == at::kBFloat16) {
    // Each product and the sum rounded to bfloat16, as x * cos + swapped * sin in bfloat16 does.
    for_each_head<bf16>(qk, c, s, [half](bf16* x, const bf16* ct, const bf16* stt) {
      using pdkv::vec::load_bf16;
      int64_t d = 0;
      for (; d + Vec::size() <= half; d += Vec::size()) {
        const Vec x0 = load_bf16(x + d), x1 = load_bf16(x + half + d);
        const Vec y0 = round_bf16(x0 * load_bf16(ct + d)) + round_bf16(x1 * load_bf16(stt + d));
        const Vec y1 = round_bf16(x1 * load_bf16(ct + half + d)) + round_bf16(x0 * load_bf16(stt + half + d));
        pdkv::vec::store_bf16(x + d, y0);
        pdkv::vec::store_bf16(x + half + d, y1);
      }
      for (; d < half; ++d) {
        const float x0 = x[d], x1 = x[half + d];
        const float a0 = round_bf16(x0 * static_cast<float>(ct[d]));
        const float b0 = round_bf16(x1 * static_cast<float>(stt[d]));
        const float a1 = round_bf16(x1 * static_cast<float>(ct[half + d]));
        const float b1 = round_bf16(x0 * static_cast<float>(stt[half + d]));
        x[d] = static_cast<bf16>(a0 + b0);
        x[half + d] = static_cast<bf16>(a1 + b1);
      }
    });
    return;
  }
  for_each_head<float>(qk, c, s, [half](float* x, const float* ct, const float* stt) {
    int64_t d = 0;
    for (; d + Vec::size() <= half; d += Vec::size()) {
      const Vec x0 = Vec::loadu(x + d), x1 = Vec::loadu(x + half + d);
      const Vec y0 = x0 * Vec::loadu(ct + d) + x1 * Vec::loadu(stt + d);
      const Vec y1 = x1 * Vec::loadu(ct + half + d) + x0 * Vec::loadu(stt + half + d);
      y0.store(x + d);
      y1.store(x + half + d);
    }
    for (; d < half; ++d) {
      const float x0 = x[d], x1 = x[half + d];
      const float a0 = x0 * ct[d], b0 = x1 * stt[d];
      const float a1 = x1 * ct[half + d], b1 = x0 * stt[half + d];
      x[d] = a0 + b0;
      x[half + d] = a1 + b1;
    }
  });
}

// x [T, 2I] = [gate | up] -> [T, I]: silu(gate) * up, silu(g) = g / (1 + exp(-g)) (ATen's form).
at::Tensor fused_silu_mul(const at::Tensor& x) {
  check_rows(x, "fused_silu_mul");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 2 == 0, "fused_silu_mul: last dim must be even [gate | up]");
  auto out = at::empty({T, I}, x.options());
  const int64_t xs = x.stride(0);
  if (x.scalar_type() == at::kBFloat16) {  // silu(gate) rounded to bfloat16, then the product
    const bf16* xp = x.data_ptr<bf16>();
    bf16* op = out.data_ptr<bf16>();
    at::parallel_for(0, T, grain_rows(I), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const bf16* g = xp + t * xs;
        const bf16* u = g + I;
        bf16* o = op + t * I;
        const Vec one(1.f);
        int64_t i = 0;
        for (; i + Vec::size() <= I; i += Vec::size()) {
          const Vec gv = pdkv::vec::load_bf16(g + i);
          const Vec sv = round_bf16(gv / (one + gv.neg().exp()));
          pdkv::vec::store_bf16(o + i, sv * pdkv::vec::load_bf16(u + i));
        }
        for (; i < I; ++i) {
          const float gv = g[i];
          o[i] = static_cast<bf16>(round_bf16(gv / (1.f + std::exp(-gv))) * static_cast<float>(u[i]));
        }
      }
    });
    return out;
  }
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Vec one(1.f);
  at::parallel_for(0, T, grain_rows(I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * xs;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i + Vec::size() <= I; i += Vec::size()) {
        const Vec gv = Vec::loadu(g + i);
        const Vec sv = gv / (one + gv.neg().exp());
        (sv * Vec::loadu(u + i)).store(o + i);
      }
      for (; i < I; ++i) {
        const float sv = g[i] / (1.f + std::exp(-g[i]));
        o[i] = sv * u[i];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdkv, m) {
  m.def("fused_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_rope_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("fused_silu_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdkv, CPU, m) {
  m.impl("fused_rms_norm", &fused_rms_norm);
  m.impl("fused_add_rms_norm_", &fused_add_rms_norm_);
  m.impl("fused_rope_", &fused_rope_);
  m.impl("fused_silu_mul", &fused_silu_mul);
}

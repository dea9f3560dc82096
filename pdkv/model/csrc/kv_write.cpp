// KV write of a step in one op (vLLM's reshape_and_cache, CPU): each token's keys and values go
// to their slot (block id, offset in block) of a layer's paged cache [2, num_blocks, block_size,
// kv_heads, head_size]. Replaces two advanced-index assignments (index_put_) per layer, each with
// its own index tensors and dispatch. Any dtype of the cache (bytes are copied). Used by the
// cpu_paged attention backend: pdkv/model/paged_decode.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

namespace {

void check_rows(const at::Tensor& x, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == cache.size(3) && x.size(2) == cache.size(4), "write_kv: ", name,
              " must be [T, ", cache.size(3), ", ", cache.size(4), "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == cache.scalar_type(), "write_kv: ", name, " is ", x.scalar_type(),
              ", the cache ", cache.scalar_type());
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "write_kv: ", name,
              "'s heads of a token must be contiguous, strides ", x.strides());
}

void write_kv_(const at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& block_ids,
               const at::Tensor& offsets) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.stride(4) == 1 &&
                  kv_cache.stride(3) == kv_cache.size(4),
              "write_kv: kv_cache must be [2, blocks, block_size, heads, head_size] with a slot's heads "
              "contiguous, got sizes ", kv_cache.sizes(), " strides ", kv_cache.strides());
  check_rows(k, kv_cache, "k");
  check_rows(v, kv_cache, "v");
  const int64_t T = k.size(0);
  TORCH_CHECK(v.size(0) == T && block_ids.numel() == T && offsets.numel() == T, "write_kv: ", T,
              " keys, ", v.size(0), " values, ", block_ids.numel(), " block ids, ", offsets.numel(), " offsets");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong,
              "write_kv: block ids and offsets must be int64");
  const at::Tensor blocks = block_ids.contiguous(), offs = offsets.contiguous();
  const int64_t* B = blocks.data_ptr<int64_t>();
  const int64_t* O = offs.data_ptr<int64_t>();
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(B[t] >= 0 && B[t] < num_blocks && O[t] >= 0 && O[t] < block_size, "write_kv: token ", t,
                " has slot (block ", B[t], ", offset ", O[t], ") outside ", num_blocks, " blocks of ", block_size);
  }
  const int64_t elem = kv_cache.element_size();
  const int64_t row_bytes = k.size(1) * k.size(2) * elem;  // one token's heads
  // Strides in bytes: the engine's caches are views of one block-major buffer (a block holds
  // every layer's K and V), so a layer's [2, blocks, ...] view is not contiguous.
  const int64_t s_kv = kv_cache.stride(0) * elem, s_blk = kv_cache.stride(1) * elem, s_tok = kv_cache.stride(2) * elem;
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * elem, vs = v.stride(0) * elem;
  // A few hundred bytes per token: threads only pay off for long prefills.
  at::parallel_for(0, T, 512, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      char* slot = cache + B[t] * s_blk + O[t] * s_tok;
      std::memcpy(slot, kp + t * ks, row_bytes);
      std::memcpy(slot + s_kv, vp + t * vs, row_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdkv, m) {
  m.def("write_kv_(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor block_ids, Tensor offsets) -> ()");
}

TORCH_LIBRARY_IMPL(pdkv, CPU, m) { m.impl("write_kv_", &write_kv_); }

// One Llama decoder layer of a decode step in one call: the same pdkv ops the Python layer
// (pdkv/model/llama.py, LlamaLayer.forward with fused ops, the panel kernel and the cpu_paged
// attention backend) calls one by one, called here in the same order on the same tensors, so the
// result is bit-identical to that path. What it removes is the Python between them: at batch 1 a
// SmolLM2 step is about 300 small calls (slices, views, metadata lookups, op dispatch from
// Python), ~2 ms of a ~19 ms step during which one thread runs the interpreter and the other
// waits. Each op is reached through the dispatcher (a typed handle looked up once), as a
// composite op calls another; they keep their own checks and their own at::parallel_for.
// Used by pdkv/model/decode_layer.py; measured in docs/SPEED.md.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

// The typed handle of pdkv::<name> (looked up on first use: every fragment is registered by
// then, since Python loads the whole extension before calling any op).
template <typename Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&);

at::Tensor& decode_layer_(at::Tensor& hidden, const at::Tensor& input_norm, const at::Tensor& post_norm,
                          double eps, const at::Tensor& qkv, int64_t qkv_out,
                          const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_proj,
                          int64_t o_out, const at::Tensor& gate_up, int64_t gate_up_out,
                          const at::Tensor& down, int64_t down_out, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, const at::Tensor& cos,
                          const at::Tensor& sin, at::Tensor& kv_cache, const at::Tensor& slot_block_ids,
                          const at::Tensor& slot_offsets, const at::Tensor& block_tables,
                          const at::Tensor& seq_lens, double scale, int64_t window) {
  static const auto rms_norm = op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("pdkv::fused_rms_norm");
  static const auto add_rms_norm_ =
      op<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>("pdkv::fused_add_rms_norm_");
  static const auto rope_ = op<void(at::Tensor&, const at::Tensor&, const at::Tensor&)>("pdkv::fused_rope_");
  static const auto silu_mul = op<at::Tensor(const at::Tensor&)>("pdkv::fused_silu_mul");
  static const auto linear = op<Linear>("pdkv::panel_linear");
  static const auto write_kv_ =
      op<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
          "pdkv::write_kv_");
  static const auto paged_decode =
      op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, double, int64_t)>("pdkv::paged_decode");

  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == seq_lens.numel(),
              "decode_layer_: hidden must be [B, hidden] with one token per request, got ", hidden.sizes(),
              " for ", seq_lens.numel(), " requests");
  TORCH_CHECK(qkv_out == (num_heads + 2 * num_kv_heads) * head_dim,
              "decode_layer_: qkv_out ", qkv_out, " is not (num_heads + 2 num_kv_heads) x head_dim");
  const int64_t T = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const std::optional<at::Tensor> no_bias;

  at::Tensor x = rms_norm.call(hidden, input_norm, eps);
  const at::Tensor y = linear.call(x, qkv, qkv_out, qkv_bias);
  at::Tensor qk = y.narrow(1, 0, q_size + kv_size).view({T, num_heads + num_kv_heads, head_dim});
  rope_.call(qk, cos, sin);
  const at::Tensor q = qk.narrow(1, 0, num_heads);
  const at::Tensor k = qk.narrow(1, num_heads, num_kv_heads);
  const at::Tensor v = y.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
  write_kv_.call(kv_cache, k, v, slot_block_ids, slot_offsets);
  const at::Tensor attn = std::get<0>(paged_decode.call(q, kv_cache, block_tables, seq_lens, scale, window));
  const at::Tensor o = linear.call(attn.reshape({T, q_size}), o_proj, o_out, no_bias);
  x = add_rms_norm_.call(hidden, o, post_norm, eps);
  const at::Tensor act = silu_mul.call(linear.call(x, gate_up, gate_up_out, no_bias));
  hidden.add_(linear.call(act, down, down_out, no_bias));
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdkv, m) {
  m.def(
      "decode_layer_(Tensor(a!) hidden, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv, "
      "int qkv_out, Tensor? qkv_bias, Tensor o_proj, int o_out, Tensor gate_up, int gate_up_out, "
      "Tensor down, int down_out, int num_heads, int num_kv_heads, int head_dim, Tensor cos, "
      "Tensor sin, Tensor(b!) kv_cache, Tensor slot_block_ids, Tensor slot_offsets, "
      "Tensor block_tables, Tensor seq_lens, float scale, int window) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(pdkv, CPU, m) { m.impl("decode_layer_", &decode_layer_); }

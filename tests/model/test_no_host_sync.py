"""No device -> host sync inside the model forward (issue 14, GPU readiness): every model family
runs prefill, decode (one request, and a batch) and mixed steps with pdkv.model.host_sync's guard
active around `model.forward`, where `int(t)`, `.item()`, `.tolist()`, `bool(t)`, a tensor index,
`nonzero`, boolean-mask indexing or `torch.tensor(list)` raise. Host numbers come from the step's
metadata instead. The guard itself is checked first (it must catch each kind of call)."""

from __future__ import annotations

import pytest
import torch

from pdkv import LLM, SamplingParams
from pdkv.model.host_sync import HostSyncError, HostSyncGuard

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("call", [
    lambda t: int(t[0]), lambda t: t[0].item(), lambda t: t.tolist(), lambda t: bool(t[0]),
    lambda t: [1, 2, 3][t[1]], lambda t: t[: t[1]], lambda t: t[t > 0], lambda t: t.nonzero(),
    lambda t: torch.tensor([1, 2]), lambda t: float(t[0]),
])
def test_guard_refuses_each_kind_of_host_sync(call):
    t = torch.arange(3)
    with pytest.raises(HostSyncError), HostSyncGuard():
        call(t)
    call(t)  # fine outside the guard


def test_guard_lets_device_side_ops_through():
    t = torch.arange(6)
    with HostSyncGuard():
        out = (t[t[:2]] * 2).sum() + t[1:4].max()
        torch.where(t > 2, t, 0)
    assert int(out) == 5


def _guarded_generate(path: str, prompts: list[list[int]], **kw) -> list[list[int]]:
    """Greedy outputs with the guard around every forward of the engine's model; checks that
    the steps included prefill-only, decode-only (B == 1 and B > 1) and mixed ones."""
    llm = LLM(
        path,
        cpu_linear="torch",
        attention_backend="torch",
        num_kv_blocks=64,
        max_model_len=128,
        max_num_batched_tokens=24,
        **kw,
    )
    runner = llm.llm_engine.runner
    model = runner.model
    inner = model.forward
    kinds: set[str] = set()

    def forward(input_ids, positions, kv_caches, meta, logits_indices):
        m = meta[0] if isinstance(meta, list) else meta
        decodes = getattr(m, "decode_token_idx", None)
        prefills = getattr(m, "prefills", None)
        if prefills is None:  # linear-state group first: use the attention group's metadata
            m = next(x for x in meta if hasattr(x, "prefills"))
            decodes, prefills = m.decode_token_idx, m.prefills
        nd = 0 if decodes is None else decodes.shape[0]
        kinds.add("mixed" if nd and prefills else "prefill" if prefills else f"decode{min(nd, 2)}")
        with HostSyncGuard():
            return inner(input_ids, positions, kv_caches, meta, logits_indices)

    model.forward = forward
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], params)  # B == 1 decodes
    outs += llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)  # chunks + decodes
    assert {"prefill", "decode1", "decode2", "mixed"} <= kinds, kinds
    llm.llm_engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


PROMPTS = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in (20, 9, 33, 17, 40)]


@pytest.mark.parametrize(
    "name", ["tiny_llama_kv2", "tiny_swa", "tiny_mla", "tiny_gdn", "tiny_kda_mla"]
)
def test_forward_has_no_host_sync(name, request):
    path = request.getfixturevalue(name)
    got = _guarded_generate(path, PROMPTS)
    assert all(len(o) == 6 for o in got)

"""Tensor parallelism on tiny-gdn (Qwen3-Next-style Gated DeltaNet + gated full attention), end to
end with two engines: one at tp 1 (in-process) and one at tp 2 (two worker processes), both
P2P kv_both over tcp.

- Colocated, tp 2 gives the greedy tokens of tp 1 (key-head groups split over ranks).
- P tp 1 → D tp 2 and P tp 2 → D tp 1: D's greedy tokens equal the colocated tp-1 engine's. D
  rebuilds each rank's share of the linear-state slot (conv channels per q | k | v segment,
  recurrent state per value head; pdkv/kv_transfer/reshard_state.py) and its KV heads; bytes
  moved = what D stores (every full-attention block of the prompt + one whole slot, summed over
  D's ranks), and P's pool returns to full (every P rank's grant ended).

Issue 12, acceptance 2 (tiny-gdn). The planner's bitwise rebuild:
tests/kv_transfer/test_reshard_state.py."""

from __future__ import annotations

import pytest
from pd_tp_utils import BLOCK, GREEDY, decode, kv_config, prefill, step_until

from pdkv import LLM

pytestmark = pytest.mark.slow  # worker processes: `pdkv matrix --quick` leaves it to the suite

PROMPT_LENS = (9, 37)  # shorter than a block; neither a block nor a multiple
# Full attention: 2 layers x 2 KV heads x 32 x (K, V) x fp32 = 1,024 B a token, 16,384 B a block.
FULL_BLOCK_BYTES = 2 * 2 * 32 * 2 * 4 * BLOCK
# Linear state slot: 2 layers x (conv 256 x 3 + recurrent 4 x 32 x 32) x fp32 = 38,912 B (all
# ranks).
SLOT_BYTES = 2 * (256 * 3 + 4 * 32 * 32) * 4


def _engine(model: str, tp: int) -> LLM:
    return LLM(
        model,
        cpu_linear="torch",
        block_size=BLOCK,
        num_kv_blocks=32,
        max_model_len=128,
        tensor_parallel_size=tp,
        kv_transfer_config=kv_config("kv_both", kv_lease_duration=600),
    )


def free(llm: LLM) -> int:
    return llm.llm_engine.scheduler.kv_cache_manager.num_free_blocks


@pytest.fixture(scope="module")
def engines(tiny_gdn):
    """{tp: engine} for tp 1 and 2, the prompts and the tp-1 engine's colocated greedy tokens."""
    made: dict[int, LLM] = {}
    try:
        for tp in (1, 2):
            made[tp] = _engine(tiny_gdn, tp)
        prompts = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in PROMPT_LENS]
        refs = [list(o.outputs[0].token_ids) for o in made[1].generate(
            [{"prompt_token_ids": q} for q in prompts], GREEDY, use_tqdm=False)]
        yield made, prompts, refs
    finally:
        for e in made.values():
            e.llm_engine.shutdown()


@pytest.mark.matrix("tp", model="tiny-gdn")
def test_colocated_tp2_matches_tp1(engines):
    made, prompts, refs = engines
    outs = made[2].generate([{"prompt_token_ids": q} for q in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == refs


# P tp 2 -> D tp 1 only: the `hetero-tp` cell also asks for D at tp 2, not checked here.
@pytest.mark.parametrize(("p_tp", "d_tp"), [
    pytest.param(1, 2, marks=pytest.mark.matrix("pd-reshard", model="tiny-gdn")), (2, 1)])
def test_pd_across_tp_matches_colocated_and_frees_p(engines, p_tp, d_tp):
    made, prompts, refs = engines
    p, d = made[p_tp], made[d_tp]
    baseline = free(p)
    for prompt, want in zip(prompts, refs):
        params, _ = prefill(p, prompt, tp=p_tp)
        out, _, _, hit = decode(p, d, prompt, params)
        # What D lacks: the blocks past its local prefix hit (the colocated run cached some), one
        # slot.
        blocks = -(-len(prompt) // BLOCK) - hit // BLOCK
        assert out.kv_load_bytes == {"p2p": blocks * FULL_BLOCK_BYTES + SLOT_BYTES}
        assert list(out.outputs[0].token_ids) == want, (
            f"P tp {p_tp} -> D tp {d_tp}, {len(prompt)}-token prompt"
        )
        # P frees the request's blocks and slot only after every P rank's grant ended.
        step_until([p], lambda: free(p) == baseline and not p.llm_engine.has_work(), timeout=30)

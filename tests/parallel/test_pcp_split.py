"""Prefill context parallelism's token split (pdkv.parallel.pcp) against a brute-force reference,
and the start-up refusals of what PCP is not built for (issue 32, step 1)."""

from __future__ import annotations

import json
import random

import pytest

from pdkv.engine.arg_utils import EngineArgs
from pdkv.parallel.pcp import MIN_CHUNK_TOKENS, head_tail_chunks, plan_pcp_step


def brute_force_owner(pos: int, n: int, pcp: int) -> int:
    """vLLM's split, position by position: pad n to a multiple of 2N, cut into 2N equal chunks;
    chunk i < N goes to rank i, chunk i >= N to rank 2N-1-i."""
    k = 2 * pcp
    chunk = pos // (-(-n // k) * k // k)
    return chunk if chunk < pcp else k - 1 - chunk


@pytest.mark.parametrize("pcp", [1, 2, 3, 4])
def test_head_tail_chunks_match_the_brute_force_split(pcp):
    for n in [*range(0, 70), 127, 128, 129, 255, 256, 1000]:
        chunks = head_tail_chunks(n, pcp)
        assert len(chunks) == pcp
        for r, own in enumerate(chunks):
            got = [p for begin, end in own for p in range(begin, end)]
            want = [p for p in range(n) if brute_force_owner(p, n, pcp) == r]
            # the head chunk first, then the tail chunk: both ascending
            assert sorted(got) == want and got == sorted(got), (n, pcp, r)
        if n >= 2 * pcp:  # every rank has a head chunk
            assert all(own and own[0][0] == r * -(-n // (2 * pcp)) for r, own in enumerate(chunks))


def test_plan_positions_and_inverse_permutation_match_brute_force():
    rng = random.Random(32)
    for _ in range(200):
        pcp = rng.choice([2, 3, 4])
        threshold = 2 * pcp * MIN_CHUNK_TOKENS
        sizes = [rng.choice([1, 1, 5, threshold - 1, threshold, threshold + 1,
                             rng.randrange(1, 5 * threshold)])
                 for _ in range(rng.randrange(1, 6))]
        plan = plan_pcp_step(sizes, pcp)
        if not any(n >= threshold for n in sizes):
            assert plan is None
            continue
        assert plan is not None
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        total = sum(sizes)
        # brute force: flat token t of request i at offset o -> its rank
        want_owner = []
        for n in sizes:
            want_owner += ([brute_force_owner(o, n, pcp) for o in range(n)]
                           if n >= threshold else [0] * n)
        locals_ = [plan.local_tokens(r) for r in range(pcp)]
        assert sorted(t for toks in locals_ for t in toks) == list(range(total))
        for r, toks in enumerate(locals_):
            assert all(want_owner[t] == r for t in toks)
            assert plan.num_local(r) == len(toks)
            # local runs: consecutive rows, consecutive positions of one request
            for run in plan.runs[r]:
                rows = toks[run.local_start : run.local_start + run.length]
                first = starts[run.request] + run.offset
                assert rows == list(range(first, first + run.length))
        # the inverse permutation restores flat order from the padded all-gather
        width = max(len(toks) for toks in locals_)
        gathered = [t for toks in locals_ for t in toks + [-1] * (width - len(toks))]
        owner, row = plan.owners()
        assert owner == want_owner
        assert [gathered[o * width + i] for o, i in zip(owner, row)] == list(range(total))


def test_short_steps_are_not_split():
    assert plan_pcp_step([63, 1, 1], 2) is None  # below 2N x 16
    assert plan_pcp_step([1000], 1) is None
    assert plan_pcp_step([64], 2) is not None
    with pytest.raises(ValueError, match="min_split_tokens=3 must be >= 2"):
        plan_pcp_step([64], 2, min_split_tokens=3)


P2P = {"kv_connector": "P2PConnector", "kv_role": "kv_producer"}
POOL = {"kv_connector": "KVPoolConnector", "kv_role": "kv_both"}
OFFLOAD = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
MULTI = {"kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_connector_extra_config":
         {"connectors": [{"kv_connector": "P2PConnector"}]}}


def kvt(d: dict[str, object], **changes: object) -> str:
    return json.dumps({**d, **changes})


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tensor_parallel_size": 2}, "PCP with TP or DCP is not built"),
        ({"decode_context_parallel_size": 2}, "PCP with TP or DCP is not built"),
        ({"tensor_parallel_size": 2, "kv_transfer_config": kvt(P2P)},
         "PCP with TP or DCP is not built"),
        ({"kv_transfer_config": kvt(P2P, kv_role="kv_consumer")},
         "kv_role=kv_consumer is not built"),
        ({"kv_transfer_config": kvt(P2P, kv_role="kv_both")}, "kv_role=kv_both is not built"),
        ({"kv_transfer_config": kvt(P2P, kv_connector_extra_config={"transfer_mode": "push"})},
         "transfer_mode='push' is not built"),
        ({"kv_transfer_config": kvt(POOL)}, "KVPoolConnector is not built yet: the KV pool"),
        ({"kv_transfer_config": kvt(OFFLOAD)}, "OffloadingConnector is not built yet"),
        ({"kv_transfer_config": kvt(MULTI)}, "MultiConnector is not built yet"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype=int8 is not built"),
        ({"nnodes": 2, "master_addr": "127.0.0.1", "master_port": 29500},
         "across nodes (nnodes=2) is not built"),
    ],
    ids=["tp", "dcp", "tp-p2p", "consumer", "kv-both", "push", "pool", "offload", "multi",
         "int8", "nodes"],
)
def test_pcp_refuses_what_is_not_built(tiny_llama_kv2, kw, message):
    args = EngineArgs(model=tiny_llama_kv2, prefill_context_parallel_size=2, **kw)
    with pytest.raises(ValueError, match="prefill_context_parallel_size=2") as err:
        args.create_engine_config()
    assert message in str(err.value)


@pytest.mark.parametrize("fixture", ["tiny_swa", "tiny_mla", "tiny_gdn"])
def test_pcp_refuses_models_it_is_not_built_for(request, fixture):
    path = request.getfixturevalue(fixture)
    args = EngineArgs(model=path, prefill_context_parallel_size=2)
    with pytest.raises(ValueError, match="prefill_context_parallel_size=2 is not built for") as e:
        args.create_engine_config()
    kind = {"tiny_swa": "sliding-window", "tiny_mla": "latent", "tiny_gdn": "linear-attention"}
    assert kind[fixture] in str(e.value)

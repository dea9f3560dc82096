"""P/D with a sliding-window KV cache group: D pulls only the window's blocks (torch-free)."""

from __future__ import annotations

import pytest

from pdkv.cache.block_pool import NULL_BLOCK_ID
from pdkv.cache.kv_layout import KVLayout
from pdkv.cache.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from pdkv.config import KVTransferConfig
from pdkv.kv_transfer.connector.base import KVConnectorRole
from pdkv.kv_transfer.connector.factory import create_connector
from pdkv.kv_transfer.connector.p2p_scheduler import P2PConnectorScheduler
from pdkv.kv_transfer.connector.spec import connector_spec
from pdkv.request import RequestStatus
from tests.kv_transfer.p2p_sched_utils import (
    BS,
    LAYOUT,
    PRODUCER_ADDR,
    blocks,
    consumer_spec,
    remote_params,
    req,
)

W = 10  # window in tokens: the query at p reads keys p - 9 .. p


def consumer() -> P2PConnectorScheduler:
    return P2PConnectorScheduler(consumer_spec(),
                                 KVLayout.from_wire(LAYOUT), BS,
                                 list(PRODUCER_ADDR), num_groups=2, sliding_windows=(None, W))


def brute_force_needed_blocks(n: int) -> set[int]:
    """Blocks holding keys that the query at n - 1 (D's first computed token) or later reads,
    or that a later prefix hit of B = the last block boundary <= n - 1 tokens needs (B - W + 1 ..
    B - 1)."""
    boundary = (n - 1) // BS * BS
    reads = {p // BS for p in range(max(0, n - W), n)}
    hit = {p // BS for p in range(max(0, boundary - W + 1), boundary)}
    return reads | hit


@pytest.mark.parametrize("n, hits", [(25, 0), (25, 8), (24, 0), (9, 0), (12, 4), (40, 16)])
def test_window_group_pulls_exactly_the_blocks_the_resumed_token_reads(n, hits):
    cons = consumer()
    num_blocks = -(-n // BS)
    p_ids = [[100 + i for i in range(num_blocks)], [200 + i for i in range(num_blocks)]]
    r = req("r", n, remote_params(n, remote_block_ids=p_ids))
    r.num_computed_tokens = hits  # local prefix hits, whole blocks
    k0 = hits // BS
    local = blocks([i for i in range(k0, num_blocks)], [50 + i for i in range(k0, num_blocks)])
    cons.update_state_after_alloc(r, local, n - hits)
    (spec,) = cons.build_connector_meta().reqs_to_recv
    full_local, swa_local = spec.local_block_ids
    full_remote, swa_remote = spec.remote_block_ids
    # Full attention: every block from the local hits on, one to one.
    assert full_local == list(range(k0, num_blocks)) and full_remote == [
        100 + i for i in range(k0, num_blocks)
    ]
    # Sliding window: the blocks the resumed token reads (those after the local hits).
    want = sorted(b for b in brute_force_needed_blocks(n) if b >= k0)
    assert swa_local == [50 + b for b in want] and swa_remote == [200 + b for b in want]
    assert spec.group_first_blocks == (k0, want[0] if want else num_blocks)


def test_without_a_window_the_pairs_and_first_blocks_are_unchanged():
    cons = P2PConnectorScheduler(consumer_spec(),
                                 KVLayout.from_wire(LAYOUT), BS,
                                 list(PRODUCER_ADDR), num_groups=2)
    r = req("r", 25, remote_params(25, remote_block_ids=[list(range(7)), list(range(10, 17))]))
    cons.update_state_after_alloc(r, blocks(list(range(7)), list(range(20, 27))), 25)
    (spec,) = cons.build_connector_meta().reqs_to_recv
    assert spec.group_first_blocks == () and spec.remote_block_ids == (
        list(range(7)),
        list(range(10, 17)),
    )


def test_window_count_must_match_the_groups():
    with pytest.raises(ValueError, match="1 sliding windows for 2 groups"):
        P2PConnectorScheduler(consumer_spec(),
                              KVLayout.from_wire(LAYOUT), BS,
                              list(PRODUCER_ADDR), num_groups=2, sliding_windows=(W,))


@pytest.mark.parametrize("name", ["OffloadingConnector", "MultiConnector"])
def test_connectors_that_cannot_move_a_window_group_refuse_it_at_start_up(name):
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8)
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=8, sliding_window=W)
    cfg = connector_spec(KVTransferConfig(name, "kv_both", kv_connector_extra_config=(
        {"connectors": [{"kv_connector": "P2PConnector"}]} if name == "MultiConnector" else {})),
        BS)
    kv = KVCacheConfig(
        num_blocks=8, groups=(KVCacheGroupSpec((0,), full), KVCacheGroupSpec((1,), swa))
    )
    with pytest.raises(ValueError, match=f"{name} does not move sliding-window"):
        create_connector(cfg, KVConnectorRole.SCHEDULER, kv, dict(LAYOUT), {})


def test_producer_counts_no_null_block_of_a_window_group_as_held():
    cfg = connector_spec(KVTransferConfig("P2PConnector", "kv_producer", engine_id="P"), BS)
    prod = P2PConnectorScheduler(cfg, KVLayout.from_wire(LAYOUT), BS, list(PRODUCER_ADDR),
                                 num_groups=2, sliding_windows=(None, W))
    r = req("r", 12, {"do_remote_decode": True}, status=RequestStatus.FINISHED_LENGTH_CAPPED)
    delay, params = prod.request_finished(r, ([0, 1, 2], [NULL_BLOCK_ID, 5, 6]))
    assert (
        delay
        and params is not None
        and params["remote_block_ids"] == [[0, 1, 2], [NULL_BLOCK_ID, 5, 6]]
    )
    assert prod.num_blocks_held == 5  # block 0 of the full group is a real block

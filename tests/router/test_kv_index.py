"""The router's KV event index and the kv_aware policy, torch-free: events in, held prefixes out
(checked against a brute-force model of the same events), and routing decisions by cost."""

from __future__ import annotations

import random

import pytest

from pdkv.block_hashing import hash_request_tokens
from pdkv.kv_events.schema import AllBlocksCleared, BlockRemoved, BlockStored
from pdkv.router.kv_aware import KVAware, KVAwareConfig
from pdkv.router.kv_index import KVIndex, KVIndexConfig, Overlap
from pdkv.router.policies import Backend

BS = 16
PROMPT = list(range(1, 8 * BS + 5))  # 8 full blocks and a partial one
H = hash_request_tokens(PROMPT, BS)


def stored(hashes, medium="GPU", block_size=BS):
    return BlockStored(list(hashes), None, [], block_size, None, medium, None)


def removed(hashes, medium="GPU"):
    return BlockRemoved(list(hashes), medium)


def test_stored_prefix_is_held_up_to_the_first_missing_block():
    idx = KVIndex()
    idx.apply("a", stored(H[:3]))
    idx.apply("a", stored(H[4:6]))  # block 3 missing: the run stops there
    assert idx.overlap("a", H, BS) == Overlap(3, 3, 3.0)
    assert idx.overlap("b", H, BS) == Overlap()  # an instance with no events holds nothing
    idx.apply("a", removed(H[1:2]))
    assert idx.overlap("a", H, BS) == Overlap(1, 1, 1.0)


def test_all_blocks_cleared_and_clear_forget_the_instance_only():
    idx = KVIndex()
    idx.apply("a", stored(H))
    idx.apply("b", stored(H))
    idx.apply("a", AllBlocksCleared())
    assert idx.overlap("a", H, BS).blocks == 0 and idx.overlap("b", H, BS).blocks == len(H)
    # A prefix-cache reset leaves the pool tiers' chunks (the engine still loads them).
    idx.apply("b", stored(H, "DISK"))
    idx.apply("b", AllBlocksCleared())
    assert idx.num_blocks("b") == {"DISK": len(H)}
    assert idx.overlap("b", H, BS) == Overlap(len(H), 0, 0.5 * len(H))
    idx.clear("b")
    assert idx.instances() == []


def test_each_block_counts_its_best_medium_and_engine_blocks_only_the_engines_run():
    idx = KVIndex(KVIndexConfig(medium_weights={"GPU": 1.0, "DISK": 0.5}))
    idx.apply("a", stored(H[:2]))  # engine: blocks 0-1
    idx.apply("a", stored(H[:6], medium="disk"))  # disk tier: 0-5 (case-insensitive medium)
    idx.apply("a", stored(H[3:4]))  # engine again at block 3, not contiguous from 0
    o = idx.overlap("a", H, BS)
    assert o.blocks == 6 and o.engine_blocks == 2
    assert o.weighted_blocks == pytest.approx(1 + 1 + 0.5 + 1 + 0.5 + 0.5)
    assert idx.num_blocks("a") == {"GPU": 3, "DISK": 6}


def test_a_tier_with_bigger_blocks_holds_whole_chunks_by_their_last_block_hash():
    idx = KVIndex(KVIndexConfig(medium_weights={"GPU": 1.0, "DRAM": 0.8}))
    # A pool chunk of 4 engine blocks is named by its last block's hash (pdkv.kvpool.keys).
    idx.apply("a", stored([H[3], H[7]], medium="DRAM", block_size=4 * BS))
    o = idx.overlap("a", H, BS)
    assert (o.blocks, o.engine_blocks) == (8, 0) and o.weighted_blocks == pytest.approx(6.4)
    # A prompt that ends inside the second chunk holds only the first one (no partial chunk).
    assert idx.overlap("a", H[:6], BS).blocks == 4
    # An engine block size the tier's is not a multiple of cannot be matched.
    assert idx.overlap("a", H, 3 * BS).blocks == 0


def test_a_medium_whose_block_size_changes_starts_again():
    idx = KVIndex()
    idx.apply("a", stored(H[:4]))
    idx.apply("a", stored([H[7]], block_size=8 * BS))
    assert idx.overlap("a", H, BS).blocks == 8 and idx.num_blocks("a") == {"GPU": 1}


def test_the_bound_drops_the_oldest_stored_first():
    idx = KVIndex(KVIndexConfig(max_blocks_per_instance=4))
    idx.apply("a", stored(H[:4]))
    idx.apply("a", stored(H[:1]))  # block 0 is stored again: now the newest
    idx.apply("a", stored(H[4:6]))  # 6 > 4: blocks 1 and 2 go
    assert idx.num_blocks("a") == {"GPU": 4}
    assert idx.overlap("a", H, BS).blocks == 1


def test_bad_config_and_block_size_are_refused():
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        KVIndexConfig(medium_weights={"GPU": 1.5})
    with pytest.raises(ValueError, match=">= 1"):
        KVIndexConfig(max_blocks_per_instance=0)
    with pytest.raises(ValueError, match="block_size"):
        KVIndex().overlap("a", H, 0)
    with pytest.raises(ValueError, match="overlap_weight"):
        KVAwareConfig(overlap_weight=-1)


def test_random_event_streams_match_a_brute_force_model():
    """Stored / removed / cleared events at random over two media and two instances; every
    overlap equals the definition computed from plain sets."""
    rng = random.Random(7)
    weights = {"GPU": 1.0, "DISK": 0.5}
    idx = KVIndex(KVIndexConfig(medium_weights=weights))
    model: dict[str, dict[str, set[bytes]]] = {"a": {}, "b": {}}
    for _ in range(2000):
        inst = rng.choice("ab")
        medium = rng.choice(list(weights))
        picked = rng.sample(H, rng.randint(1, 4))
        kind = rng.random()
        if kind < 0.55:
            idx.apply(inst, stored(picked, medium))
            model[inst].setdefault(medium, set()).update(picked)
        elif kind < 0.97:
            idx.apply(inst, removed(picked, medium))
            model[inst].get(medium, set()).difference_update(picked)
        else:
            idx.apply(inst, AllBlocksCleared())
            model[inst].pop("GPU", None)  # a prefix cache reset: the pool tiers keep theirs
        for who in "ab":
            blocks = engine = 0
            weighted = 0.0
            for i, h in enumerate(H):
                held = [m for m, s in model[who].items() if h in s]
                if not held:
                    break
                blocks += 1
                weighted += max(weights[m] for m in held)
                engine += int("GPU" in held and engine == i)
            got = idx.overlap(who, H, BS)
            assert (got.blocks, got.engine_blocks) == (blocks, engine)
            assert got.weighted_blocks == pytest.approx(weighted)


# ------------------------------------------------------------------ kv_aware


def policy(weight: float = 1.0) -> tuple[KVIndex, KVAware]:
    idx = KVIndex(KVIndexConfig(medium_weights={"GPU": 1.0, "DISK": 0.5}))
    return idx, KVAware(idx, KVAwareConfig(overlap_weight=weight))


def same(hashes, backends):
    return {b.url: hashes for b in backends}


def test_a_prompt_goes_to_the_instance_that_holds_it():
    idx, pol = policy()
    a, b, c = Backend("a"), Backend("b"), Backend("c")
    idx.apply("b", stored(H[:6]))
    idx.apply("c", stored(H[:2]))
    d = pol.decide([a, b, c], same(H, [a, b, c]))
    assert (d.backend.url, d.reason, d.matched_chunks, d.load_blocks) == ("b", "kv_hit", 6, 8)


def test_the_engines_own_cache_beats_a_disk_tier_holding_as_much():
    idx, pol = policy()
    a, b = Backend("a"), Backend("b")
    idx.apply("a", stored(H[:6], medium="DISK"))
    idx.apply("b", stored(H[:6]))
    assert pol.decide([a, b], same(H, [a, b])).backend.url == "b"


def test_load_outweighs_a_small_overlap_and_evictions_send_it_to_the_least_loaded():
    idx, pol = policy()
    a, b, c = Backend("a", inflight=3, active_blocks=30), Backend("b", active_blocks=2), \
        Backend("c", active_blocks=5)
    idx.apply("a", stored(H[:8]))  # saves 8 blocks, but carries 28 more than b
    d = pol.decide([a, b, c], same(H, [a, b, c]))
    assert (d.backend.url, d.reason) == ("b", "load")
    a.active_blocks = 4  # now the overlap is worth it: cost a = 0 + 4 + 8, b = 8 + 2 + 8
    assert pol.decide([a, b, c], same(H, [a, b, c])).backend.url == "a"
    idx.apply("a", removed(H[:1]))  # a evicted block 0: its prefix is gone
    d = pol.decide([a, b, c], same(H, [a, b, c]))
    assert (d.backend.url, d.reason, d.matched_chunks) == ("b", "no_match", 0)


def test_without_hashes_or_weight_it_is_least_loaded():
    idx, pol = policy(weight=0.0)
    a, b = Backend("a", active_blocks=10), Backend("b", active_blocks=1)
    idx.apply("a", stored(H))
    assert pol.decide([a, b], same(H, [a, b])).backend.url == "b"  # the overlap is worth 0
    a2, b2 = Backend("a", inflight=0), Backend("b", inflight=2)
    assert pol.decide([a2, b2], None).reason == "fallback"
    assert pol.decide([a2, b2], None).backend.url == "a"

"""Chained, reproducible block hashes (pdkv/block_hashing.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdkv.block_hashing import (
    NONE_HASH,
    block_extra_keys,
    hash_block_tokens,
    hash_request_tokens,
)

BS = 16


def manual_chain(tokens, block_size, cache_salt=None):
    """Reference: hash every full block by hand, parent first."""
    hashes = []
    parent = None
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        extra = ("salt", cache_salt) if (i == 0 and cache_salt) else ()
        parent = hash_block_tokens(parent, block, extra)
        hashes.append(parent)
    return hashes


def test_block_hash_is_32_byte_digest_and_deterministic():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    h2 = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h1, bytes) and len(h1) == 32
    assert h1 == h2
    # Sequence type does not matter, only the values.
    assert hash_block_tokens(None, (1, 2, 3, 4)) == h1


def test_none_parent_is_the_chain_seed():
    assert hash_block_tokens(None, [5, 6]) == hash_block_tokens(NONE_HASH, [5, 6])


def test_different_tokens_parent_or_extra_keys_give_different_hashes():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 5]) != base
    assert hash_block_tokens(None, [4, 3, 2, 1]) != base  # order matters
    other_parent = hash_block_tokens(None, [9, 9, 9, 9])
    assert hash_block_tokens(other_parent, [1, 2, 3, 4]) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt", "a")) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("salt", "a")) != hash_block_tokens(
        None, [1, 2, 3, 4], ("salt", "b")
    )
    # int vs str extra keys are distinct values in the canonical encoding.
    assert hash_block_tokens(None, [1], (1,)) != hash_block_tokens(None, [1], ("1",))


def test_hash_is_chained_over_all_previous_blocks():
    a = list(range(0, 32))
    b = [999] + list(range(1, 32))  # differs only in block 0
    ha, hb = hash_request_tokens(a, BS), hash_request_tokens(b, BS)
    assert len(ha) == len(hb) == 2
    # Block 1 has identical tokens, but its parent differs, so its hash differs.
    assert a[16:] == b[16:]
    assert ha[1] != hb[1]
    assert ha[1] == hash_block_tokens(ha[0], a[16:32])


def test_hash_request_tokens_skips_partial_tail_and_matches_manual_chain():
    tokens = list(range(1000, 1000 + 3 * BS + 5))
    hashes = hash_request_tokens(tokens, BS)
    assert len(hashes) == 3
    assert hashes == manual_chain(tokens, BS)
    # Adding tokens that do not complete a block changes nothing.
    assert hash_request_tokens(tokens + [7] * (BS - 6), BS) == hashes
    # Completing the block adds exactly one hash and keeps the earlier ones.
    longer = hash_request_tokens(tokens + [7] * (BS - 5), BS)
    assert len(longer) == 4 and longer[:3] == hashes
    assert hash_request_tokens(list(range(BS - 1)), BS) == []
    assert hash_request_tokens([], BS) == []


def test_same_tokens_give_same_hashes():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6] * 8
    assert hash_request_tokens(tokens, 8) == hash_request_tokens(list(tokens), 8)


def test_cache_salt_changes_every_block_hash():
    tokens = list(range(4 * BS))
    plain = hash_request_tokens(tokens, BS)
    salted = hash_request_tokens(tokens, BS, cache_salt="tenant-a")
    other = hash_request_tokens(tokens, BS, cache_salt="tenant-b")
    assert len(plain) == len(salted) == len(other) == 4
    for p, s, o in zip(plain, salted, other, strict=True):
        assert len({p, s, o}) == 3
    assert salted == manual_chain(tokens, BS, cache_salt="tenant-a")
    # An empty salt is no salt.
    assert hash_request_tokens(tokens, BS, cache_salt="") == plain


def test_salt_goes_only_into_block_zero_extra_keys():
    assert block_extra_keys(0, "s") == ("salt", "s")
    assert block_extra_keys(1, "s") == ()
    assert block_extra_keys(5, "s") == ()
    assert block_extra_keys(0, None) == ()
    tokens = list(range(2 * BS))
    salted = hash_request_tokens(tokens, BS, cache_salt="s")
    assert salted[0] == hash_block_tokens(None, tokens[:BS], ("salt", "s"))
    # Block 1 is hashed without extra keys; it differs from the unsalted chain via its parent.
    assert salted[1] == hash_block_tokens(salted[0], tokens[BS:], ())


@pytest.mark.parametrize("salt", [None, "x"])
@pytest.mark.parametrize("start", [1, 2, 3, 5])
def test_continuation_equals_hashing_everything_at_once(salt, start):
    tokens = list(range(500, 500 + 5 * BS + 3))
    full = hash_request_tokens(tokens, BS, cache_salt=salt)
    assert len(full) == 5
    rest = hash_request_tokens(
        tokens, BS, cache_salt=salt, parent_block_hash=full[start - 1], start_block=start
    )
    assert full[:start] + rest == full
    # A wrong parent gives a different continuation.
    wrong = hash_request_tokens(
        tokens, BS, cache_salt=salt, parent_block_hash=NONE_HASH, start_block=start
    )
    if start < 5:
        assert wrong != rest


def test_start_block_past_the_end_hashes_nothing():
    tokens = list(range(2 * BS))
    full = hash_request_tokens(tokens, BS)
    assert hash_request_tokens(tokens, BS, parent_block_hash=full[-1], start_block=2) == []


_SNIPPET = (
    "import sys\n"
    "from pdkv.block_hashing import hash_request_tokens\n"
    "salt = sys.argv[1] or None\n"
    "print(','.join(h.hex() for h in hash_request_tokens(list(range(100)), 16, salt)))\n"
)


def _hex_in_subprocess(hash_seed: str, salt: str = "") -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    proc = subprocess.run(
        [sys.executable, "-c", _SNIPPET, salt],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return proc.stdout.strip().split(",")


def test_hashes_are_identical_across_processes_and_hash_seeds():
    in_process = [h.hex() for h in hash_request_tokens(list(range(100)), 16)]
    assert len(in_process) == 6
    seed1 = _hex_in_subprocess("1")
    seed2 = _hex_in_subprocess("2")
    assert seed1 == seed2 == in_process

    salted1 = _hex_in_subprocess("1", "tenant")
    salted2 = _hex_in_subprocess("2", "tenant")
    in_process_salted = [
        h.hex() for h in hash_request_tokens(list(range(100)), 16, cache_salt="tenant")
    ]
    assert salted1 == salted2 == in_process_salted
    assert len(salted1) == 6
    assert all(s != u for s, u in zip(salted1, seed1, strict=True))

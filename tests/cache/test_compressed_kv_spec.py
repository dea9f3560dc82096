"""DeepSeek-V4's compressed-KV spec (pdkv.cache.specs.CompressedKVSpec): entry w lives in the
block of its window's last token, so a prefix of k whole blocks holds exactly the entries of the
windows inside it (the full-attention hit rule), for rates below, equal to and above the block
size; its page bytes; the torch store / gather of the model (pdkv.model.v4_attention) use the
same slots; rates and block sizes that do not divide one another are refused."""

from __future__ import annotations

import pytest
import torch

from pdkv.cache.single_type_manager import FullAttentionManager, get_manager_class
from pdkv.cache.specs import CompressedKVSpec, CompressorStateSpec
from pdkv.model.v4_attention import read_entries, write_entries


@pytest.mark.parametrize("bs, rate", [(16, 4), (16, 16), (8, 16), (4, 16), (16, 1)])
def test_a_prefix_of_blocks_holds_exactly_its_windows_entries(bs, rate):
    spec = CompressedKVSpec(block_size=bs, rate=rate, width=8, dtype="float32")
    assert spec.entries_per_block == max(1, bs // rate)
    assert spec.page_size_bytes == spec.entries_per_block * 8 * 4
    seen = set()
    for w in range(200):
        block, offset = spec.entry_slot(w)
        assert block == ((w + 1) * rate - 1) // bs and 0 <= offset < spec.entries_per_block
        assert (block, offset) not in seen  # no two entries share a slot
        seen.add((block, offset))
    for k in range(1, 30):  # a hit of k blocks = k * bs tokens holds entries w < k * bs // rate
        held = {w for w in range(200) if spec.entry_slot(w)[0] < k}
        assert held == set(range(min(200, k * bs // rate)))
    assert get_manager_class(spec) is FullAttentionManager


def test_the_model_stores_and_gathers_entries_in_the_spec_slots():
    spec = CompressedKVSpec(block_size=8, rate=16, width=4, dtype="float32")
    cache = torch.full((10, spec.entries_per_block, 4), float("nan"))
    table = torch.tensor([7, 2, 9, 0, 5, 1, 3, 4])
    entries = torch.arange(12.0).view(3, 4)
    write_entries(cache, table, 16, 8, 0, entries[:2])
    write_entries(cache, table, 16, 8, 2, entries[2:])
    for w in range(3):
        block, offset = spec.entry_slot(w)
        assert torch.equal(cache[table[block], offset], entries[w])
    assert torch.equal(read_entries(cache, table, 16, 8, 3), entries)


def test_rates_that_straddle_blocks_are_refused():
    with pytest.raises(ValueError, match="must divide one another"):
        CompressedKVSpec(block_size=16, rate=24, width=8)
    state = CompressorStateSpec(block_size=16, conv_shape=(0,), recurrent_shape=(100,))
    assert state.state_slot and state.page_size_bytes == 400 and state.kind == "compressor_state"
    assert not CompressedKVSpec(block_size=16, rate=4, width=8).state_slot

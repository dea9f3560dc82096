"""The model forward's per-layer connector hooks (issue 29, step 1): with a KV connector on the
worker, every step that runs the forward calls `wait_for_layer_load(i)` then `save_kv_layer(i)`
once per layer, in layer order, for every model family, and the outputs are those of the same
engine without a connector. Without a connector the forward gets no hooks at all."""

from __future__ import annotations

import pytest

from pdkv import LLM, SamplingParams
from pdkv.jsontypes import JSONObject
from pdkv.kv_transfer.connector.base import KVConnectorBase, KVConnectorMetadata
from pdkv.model.llama import LlamaForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


class RecordingConnector(KVConnectorBase):
    """A worker half that records the per-step hook calls (no transfers)."""

    def __init__(self) -> None:  # no spec or layout: the runner only calls worker methods
        self._metadata = None
        self.steps: list[list[tuple[str, int]]] = []

    def start_load_kv(self) -> None:
        self.steps.append([])

    def wait_for_layer_load(self, layer_index: int) -> None:
        self.steps[-1].append(("load", layer_index))

    def save_kv_layer(self, layer_index: int) -> None:
        self.steps[-1].append(("save", layer_index))

    # scheduler half: never called (the engine's scheduler has no connector)
    def get_num_new_matched_tokens(self, request, num_computed_tokens):  # type: ignore[no-untyped-def]
        raise AssertionError("scheduler half")

    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # type: ignore[no-untyped-def]
        raise AssertionError("scheduler half")

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:  # type: ignore[no-untyped-def]
        raise AssertionError("scheduler half")

    def request_finished(self, request, block_ids) -> tuple[bool, JSONObject | None]:  # type: ignore[no-untyped-def]
        raise AssertionError("scheduler half")


@pytest.mark.parametrize(
    "family", ["tiny_llama_kv2", "tiny_swa", "tiny_mla", "tiny_gdn", "tiny_kda_mla"]
)
def test_hooks_fire_once_per_layer_in_order_and_change_nothing(family, request):
    path = request.getfixturevalue(family)
    llm = LLM(path, cpu_linear="torch", num_kv_blocks=32, max_model_len=256, block_size=16,
              max_num_batched_tokens=32)
    try:
        prompts = [[(i * 7919 + 13 * n) % 40000 + 100 for i in range(n)] for n in (20, 45)]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        ref = [o.outputs[0].token_ids for o in llm.generate(inputs, GREEDY)]
        runner = llm.llm_engine.runner
        assert runner.connector is None
        rec = RecordingConnector()
        runner.connector = rec
        assert llm.reset_prefix_cache()
        got = [o.outputs[0].token_ids for o in llm.generate(inputs, GREEDY)]
        runner.connector = None
        assert got == ref
        n = runner.model.cfg.num_layers
        want = [(kind, i) for i in range(n) for kind in ("load", "save")]
        ran = [s for s in rec.steps if s]
        # 65 prompt tokens in 32-token chunks, then decodes: several forward steps
        assert len(ran) >= 3 + GREEDY.max_tokens - 1
        assert all(s == want for s in ran), ran[:2]
    finally:
        llm.llm_engine.shutdown()


def test_forward_without_hooks_is_the_default():
    """The model runner passes hooks only when a connector is set (the layer loop's one
    `is not None` test is all a plain step pays)."""
    import inspect

    sig = inspect.signature(LlamaForCausalLM.forward)
    assert sig.parameters["layer_hooks"].default is None

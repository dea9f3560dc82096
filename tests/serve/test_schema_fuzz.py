"""Schema fuzzing of `pdkv serve` (issue 28): every route of its OpenAPI schema (completions,
chat, tokenize, detokenize, models, health, metrics, reset_prefix_cache, /kv_layout, /kv_events),
a few hundred schemathesis cases each, against a tiny model with a P2P producer connector (so
/kv_layout answers and kv_transfer_params reach the connector's checks) and KV events on (so
/kv_events answers); tests/schema_fuzz.py
says what each response must be. The case counts are printed in the run's summary. (The grant
release is not an HTTP route: it goes to the producer's control server, typed msgpack.)"""

from __future__ import annotations

import os

import pytest
from schema_fuzz import fuzz
from server_utils import RemoteServer

from pdkv.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

# Per route and mode (positive, negative); PDKV_FUZZ_CASES sets a longer run (docs/RELIABILITY.md).
CASES = int(os.environ.get("PDKV_FUZZ_CASES", "100"))
MODELS = {"POST /v1/completions": CompletionRequest,
          "POST /v1/chat/completions": ChatCompletionRequest,
          "POST /tokenize": TokenizeRequest, "POST /detokenize": DetokenizeRequest}


@pytest.fixture(scope="module")
def tiny_server():
    kvt = '{"kv_connector": "P2PConnector", "kv_role": "kv_producer"}'
    args = ["serve", "--model", "tiny-llama-kv2", "--num-kv-blocks", "64",
            "--max-model-len", "128", "--max-num-seqs", "16", "--kv-transfer-config", kvt,
            "--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": '
            '"tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}']
    with RemoteServer(args) as srv:
        yield srv


def test_no_input_the_schema_allows_or_forbids_takes_the_server_down(tiny_server,
                                                                    record_property):
    report = fuzz(tiny_server.url, CASES, MODELS)
    for line in report.lines():
        record_property("schema_fuzz", f"pdkv serve: {line}")
    assert sum(sum(c.values()) for c in report.counts.values()) >= 8 * CASES
    assert not report.failures, "\n".join(f"{k}: {v}" for k, v in report.failures.items())

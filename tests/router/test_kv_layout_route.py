"""GET /kv_layout on `pdkv serve` (the app over a stand-in engine: no model needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from pdkv.config import KVTransferConfig
from pdkv.serve.api_server import ServeConfig, build_app
from pdkv.serve.metrics import ServerMetrics

LAYOUT = {"model_digest": "d", "dtype": "float32", "block_size": 16, "num_layers": 30,
          "num_kv_heads": 3, "head_size": 64, "kv_layout": "NHD"}


def _app(kvt: KVTransferConfig | None):
    engine = SimpleNamespace(
        config=SimpleNamespace(kv_transfer_config=kvt, model_config=SimpleNamespace(max_model_len=512, path="m")),
        runner=SimpleNamespace(layout=dict(LAYOUT)), tokenizer=None)
    llm = SimpleNamespace(engine=engine, is_running=True, start=lambda: None, shutdown=lambda: None)
    return build_app(llm, ServeConfig(), ServerMetrics("smollm2"))  # type: ignore[arg-type]


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_kv_layout_reports_role_engine_id_and_layout(role):
    kvt = KVTransferConfig(kv_connector="P2PConnector", kv_role=role, engine_id="engine-7")
    with TestClient(_app(kvt)) as client:
        r = client.get("/kv_layout")
    assert r.status_code == 200
    assert r.json() == {"kv_role": role, "engine_id": "engine-7", "layout": LAYOUT}


def test_kv_layout_is_404_without_a_connector():
    with TestClient(_app(None)) as client:
        r = client.get("/kv_layout")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "NotFoundError" and "no kv connector" in r.json()["error"]["message"]

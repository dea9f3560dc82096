"""GET /kv_layout on `pdkv serve` (the app in-process over small real engines)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from pdkv.engine.arg_utils import EngineArgs
from pdkv.engine.async_llm import AsyncLLM
from pdkv.engine.llm_engine import LLMEngine
from pdkv.serve.api_server import ServeConfig, build_app
from pdkv.serve.metrics import ServerMetrics

pytestmark = pytest.mark.slow


def _client(kv_transfer_config: str | None) -> TestClient:
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model="smollm2",
            num_kv_blocks=16,
            max_model_len=128,
            kv_transfer_config=kv_transfer_config,
        )
    )
    app = build_app(AsyncLLM(engine), ServeConfig(), ServerMetrics("smollm2"))
    return TestClient(app)


def test_kv_layout_reports_role_engine_id_and_layout():
    cfg = json.dumps(
        {
            "kv_connector": "P2PConnector",
            "kv_role": "kv_producer",
            "engine_id": "engine-7",
            "kv_connector_extra_config": {"transfer": "tcp"},
        }
    )
    with _client(cfg) as client:
        r = client.get("/kv_layout")
    assert r.status_code == 200
    body = r.json()
    assert body["kv_role"] == "kv_producer" and body["engine_id"] == "engine-7"
    layout = body["layout"]
    assert layout["block_size"] == 16 and layout["num_layers"] == 30 and layout["num_kv_heads"] == 3
    assert set(layout) >= {"model_digest", "dtype", "head_size", "kv_layout"}


def test_kv_layout_is_404_without_a_connector():
    with _client(None) as client:
        r = client.get("/kv_layout")
    assert r.status_code == 404
    assert (
        r.json()["error"]["type"] == "NotFoundError"
        and "no kv connector" in r.json()["error"]["message"]
    )

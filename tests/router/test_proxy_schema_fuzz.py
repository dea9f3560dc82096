"""Schema fuzzing of `pdkv proxy` in front of a tiny P/D deployment (issue 28): the proxy's
OpenAPI schema declares the same body models as `pdkv serve` (pdkv.router.proxy_openapi), and
every route answers as tests/schema_fuzz.py requires. The case counts are printed in the run's
summary."""

from __future__ import annotations

import json
import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serve"))
from schema_fuzz import fuzz  # noqa: E402
from server_utils import RemoteServer  # noqa: E402

from pdkv.router.proxy_openapi import BODY_MODELS  # noqa: E402

# Per route and mode (positive, negative); PDKV_FUZZ_CASES sets a longer run (docs/RELIABILITY.md).
CASES = int(os.environ.get("PDKV_FUZZ_CASES", "100"))
ENGINE = ["serve", "--model", "tiny-llama-kv2", "--num-kv-blocks", "64", "--max-model-len", "128",
          "--max-num-seqs", "16"]


def _kvt(role: str) -> str:
    return json.dumps({"kv_connector": "P2PConnector", "kv_role": role,
                       "kv_connector_extra_config": {"kv_lease_duration": 30}})


@pytest.fixture(scope="module")
def proxy():
    servers: list[RemoteServer] = []
    try:
        p = RemoteServer([*ENGINE, "--kv-transfer-config", _kvt("kv_producer")])
        servers.append(p)
        d = RemoteServer([*ENGINE, "--kv-transfer-config", _kvt("kv_consumer")], avoid=(p.port,))
        servers.append(d)
        px = RemoteServer(["proxy", "--prefill", p.url, "--decode", d.url],
                          avoid=(p.port, d.port))
        servers.append(px)
        yield px
    finally:
        for srv in reversed(servers):
            srv.stop()


def test_the_proxy_schema_declares_serves_body_models(proxy):
    schema = httpx.get(proxy.url + "/openapi.json", timeout=10).json()
    for path, model in BODY_MODELS.items():
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model.__name__}"}
        declared = schema["components"]["schemas"][model.__name__]["properties"]
        assert set(declared) == {f.alias or name for name, f in model.model_fields.items()}


def test_no_input_the_schema_allows_or_forbids_takes_the_proxy_down(proxy, record_property):
    models = {f"POST {path}": model for path, model in BODY_MODELS.items()}
    report = fuzz(proxy.url, CASES, models)
    for line in report.lines():
        record_property("schema_fuzz", f"pdkv proxy: {line}")
    assert sum(sum(c.values()) for c in report.counts.values()) >= 8 * CASES
    assert not report.failures, "\n".join(f"{k}: {v}" for k, v in report.failures.items())

"""A started `pdkv serve` imports none of the tools above the runtime: no `pdkv.bench`,
`pdkv.matrix` or `pdkv.launch` module, at start-up or while it answers a request. The server runs
as usual (`python -m pdkv.cli serve`) with Python's own import log on (PYTHONPROFILEIMPORTTIME,
the environment form of `-X importtime`: one stderr line per module the process imports, child
processes included), so nothing in pdkv has to expose its `sys.modules`."""

from __future__ import annotations

import os
import sys

import httpx

sys.path.insert(0, os.path.dirname(__file__))

from server_utils import RemoteServer  # noqa: E402

TOOLS = ("pdkv.bench", "pdkv.matrix", "pdkv.launch")


def imported_modules(log: str) -> set[str]:
    """The modules named by the `import time: self | cumulative | name` lines of `log`."""
    return {line.rsplit("|", 1)[1].strip() for line in log.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


def test_imported_modules_reads_the_import_log():
    log = ("import time: self [us] | cumulative | imported package\n"
           "import time:       120 |        340 |   pdkv.serve.api_server\n"
           "INFO something else | with | bars\n")
    assert imported_modules(log) == {"imported package", "pdkv.serve.api_server"}


def test_a_serving_server_imports_no_tool(tmp_path, monkeypatch, tiny_llama_kv1):
    log_path = tmp_path / "serve.log"
    monkeypatch.setenv("PDKV_TEST_SERVER_LOG", str(log_path))
    args = ["serve", "--model", tiny_llama_kv1, "--num-kv-blocks", "32", "--max-model-len", "256"]
    with RemoteServer(args, env={"PYTHONPROFILEIMPORTTIME": "1"}) as srv:
        body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
    modules = imported_modules(log_path.read_text())
    assert {"pdkv.cli_parser", "pdkv.serve.api_server", "pdkv.engine.async_llm"} <= modules, modules
    assert sorted(m for m in modules if m.startswith(TOOLS)) == []

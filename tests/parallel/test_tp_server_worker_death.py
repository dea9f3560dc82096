"""`pdkv serve -tp 2`: a worker process killed mid-request ends the request with an error, /health
answers 503 and the server exits with status 1, all within a bounded time (issue 10,
acceptance 6). The worker is found among the server's child processes by its command line."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serve"))
from server_utils import RemoteServer  # noqa: E402

DEADLINE_S = 60.0


def spawned_workers(pid: int) -> list[int]:
    """Children of `pid` started by multiprocessing's spawn (not its resource tracker)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    cmd = c.read().replace(b"\0", b" ")
                if b"multiprocessing.spawn" in cmd and b"resource_tracker" not in cmd:
                    found.append(int(child))
    return sorted(found)


def test_killed_worker_makes_the_server_unhealthy_and_exit(tiny_llama_kv1):
    srv = RemoteServer(
        [
            "serve",
            tiny_llama_kv1,
            "-tp",
            "2",
            "--num-kv-blocks",
            "32",
            "--max-model-len",
            "512",
            "--cpu-linear",
            "torch",
        ]
    )
    try:
        workers = spawned_workers(srv.proc.pid)
        assert len(workers) == 2, workers
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        result: dict[str, object] = {}
        started = threading.Event()

        def stream() -> None:
            try:
                with httpx.stream(
                    "POST", srv.url + "/v1/completions", json=body, timeout=DEADLINE_S
                ) as r:
                    result["status"] = r.status_code
                    lines = []
                    for line in r.iter_lines():
                        lines.append(line)
                        started.set()
                    result["lines"] = lines
            except httpx.HTTPError as e:  # the server may close the stream as it exits
                result["error"] = repr(e)
            finally:
                started.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert started.wait(DEADLINE_S), "no token streamed"
        os.kill(workers[1], signal.SIGKILL)
        t0 = time.monotonic()
        t.join(DEADLINE_S)
        assert not t.is_alive(), "the request did not end"
        text = "\n".join(str(x) for x in result.get("lines", []))  # type: ignore[union-attr]
        assert "error" in result or "error" in text, result
        assert "[DONE]" not in text or "error" in text
        unhealthy = False
        while time.monotonic() - t0 < DEADLINE_S and not unhealthy:
            try:
                unhealthy = httpx.get(srv.url + "/health", timeout=2.0).status_code == 503
            except httpx.HTTPError:
                unhealthy = srv.proc.poll() is not None  # already gone: that is unhealthy too
            time.sleep(0.2)
        assert unhealthy
        assert srv.proc.wait(DEADLINE_S) == 1
        assert all(not os.path.exists(f"/proc/{w}") or _zombie(w) for w in workers)
    finally:
        srv.stop()


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"

"""A real Prometheus (Debian's `prometheus` package) for dashboard tests: scrapes given loopback
targets every second; `query` evaluates PromQL through its HTTP API (/api/v1/query), and
`dashboard_expr` turns a docs/grafana.json target into a query (the dashboard's variables
replaced: `$model_name` and `$instance` by `.*`, `$__rate_interval` by a window of 30 scrapes)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from pdkv.ports import free_port
from pdkv.procgroup import stop_process_group

SCRAPE_INTERVAL_S = 1.0
RATE_WINDOW = "30s"
START_TIMEOUT_S = 60.0


def dashboard_expr(expr: str) -> str:
    """A dashboard target's PromQL with its template variables replaced."""
    return (expr.replace('"$model_name"', '".*"').replace('"$instance"', '".*"')
            .replace("$__rate_interval", RATE_WINDOW))


class Prometheus:
    """A running Prometheus at `url`."""

    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of `expr` now (raises AssertionError on a PromQL error)."""
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def targets_up(self) -> dict[str, str]:
        """{scrape URL: health} of the active targets."""
        data = httpx.get(self.url + "/api/v1/targets", timeout=30).json()["data"]["activeTargets"]
        return {t["scrapeUrl"]: t["health"] for t in data}


@contextmanager
def prometheus(targets: list[str], folder: Path) -> Iterator[Prometheus]:
    """Start Prometheus scraping `targets` (host:port, /metrics) every second; stopped (by PID)
    on exit. Its data and log live in `folder`."""
    port = free_port(set())
    config = folder / "prometheus.yml"
    config.write_text(
        "global:\n"
        f"  scrape_interval: {SCRAPE_INTERVAL_S:g}s\n"
        f"  evaluation_interval: {SCRAPE_INTERVAL_S:g}s\n"
        "scrape_configs:\n"
        "  - job_name: pdkv\n"
        "    static_configs:\n"
        f"      - targets: [{', '.join(repr(t) for t in targets)}]\n")
    log = open(folder / "prometheus.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=folder,
        env=dict(os.environ),
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited: {(folder / 'prometheus.log').read_text()[-2000:]}"
                )
            try:
                if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus not ready in {START_TIMEOUT_S:g} s")
            time.sleep(0.2)
        yield Prometheus(url)
    finally:
        stop_process_group(proc, 15.0)
        log.close()

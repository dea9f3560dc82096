"""docs/grafana.json against a real `pdkv serve` (acceptance: after a short run, every metric a
panel queries is on /metrics, and the panels marked "Always live (any deployment)" show data).
The PromQL is read with a regex (see dashboard_check); the P/D variant is in
tests/kv_transfer/test_pd_proxy.py."""

from __future__ import annotations

import time

import httpx
import pytest
from dashboard_check import (
    listed_metrics,
    live_scope,
    load,
    panel_selectors,
    panels,
    problems,
    selectors,
)

from pdkv.serve.metrics import ServerMetrics


def test_every_panel_lists_its_metrics_and_queries_only_declared_ones():
    dash = load()
    ps = panels(dash)
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in ps:
        names = list(dict.fromkeys(n for n, _ in panel_selectors(p)))
        assert names and listed_metrics(p) == names, p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            assert (
                'model_name=~"$model_name"' in t["expr"] and 'instance=~"$instance"' in t["expr"]
            ), t["expr"]
    scopes = [live_scope(p) for p in ps]
    assert scopes.count("any deployment") >= 6 and scopes.count("P/D") >= 3
    titles = " ".join(p["title"] for p in ps).lower()
    for topic in (
        "first token",
        "per output token",
        "inter-token",
        "end-to-end",
        "throughput",
        "kv cache usage",
        "prefix cache",
        "kv pool",
        "kv transfer",
        "pull time",
        "failures",
    ):
        assert topic in titles, topic
    # Before any request: every queried metric is declared by the server's registry.
    assert problems(dash, [ServerMetrics("m").render().decode()], set()) == []


def test_selector_regex():
    expr = ('sum by (source) (rate(pdkv:prompt_tokens_by_source_total{source="local_compute", '
            'model_name=~"$model_name", engine!="1"}[$__rate_interval])) / '
            'sum(rate(pdkv:prompt_tokens_total[5m]))')
    assert selectors(expr) == [("pdkv:prompt_tokens_by_source_total", {"source": "local_compute"}),
                               ("pdkv:prompt_tokens_total", {})]


@pytest.mark.slow
def test_always_live_panels_have_data_after_a_short_run(server):
    dash = load()
    body = {
        "model": "smollm2",
        "prompt": "A short story about a lighthouse keeper:",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    for _ in range(2):  # the second one hits the prefix cache
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
    # The step observer may run just after the response went out: poll, with a deadline.
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        found = problems(dash, [text], {"any deployment"})
        if not found or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert found == []


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["rename", "never_observed"])
def test_the_check_catches_a_missing_or_dead_metric(server, broken):
    """The check itself: a panel querying a name nobody serves, or a live panel whose metric
    stays 0 (the prefill engine's received bytes in a colocated server), is reported."""
    dash = load()
    target = panels(dash)[0]["targets"][0]
    name = {"rename": "pdkv:time_to_first_token_secs_bucket",
            "never_observed": "pdkv:kv_transfer_bytes_received_total"}[broken]
    target["expr"] = f"sum(rate({name}[1m]))"
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert any(name in p for p in problems(dash, [text], {"any deployment"}))

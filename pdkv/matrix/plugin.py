"""pytest plugin of `pdkv matrix` (`-p pdkv.matrix.plugin --matrix-report PATH`).

With `--matrix-report`, it keeps only the tests tagged `@pytest.mark.matrix(...)` (narrowed by
`--matrix-models`, `--matrix-features` and `--matrix-quick`: no `slow` marker) and appends JSON
lines to PATH, flushed as they happen:
  {"event": "collected", "items": [{"nodeid", "tags": [[model, feature, expect], ...], "slow"}],
   "tagged": {"model/feature": [nodeid, ...]}}   (tagged: every tagged test, selected or not)
  {"event": "result", "nodeid", "outcome": passed|failed|skipped, "message", "detail", "seconds"}
Without the option it does nothing. Marker ids are checked against `pdkv.matrix.catalog`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TypedDict

import pytest

from pdkv.matrix.catalog import (
    DETAIL_PROPERTY,
    EXPECT_UNSUPPORTED,
    EXPECT_VERIFIED,
    FEATURE_IDS,
    MODEL_IDS,
)
from pdkv.matrix.cells import CollectedItem

Tag = tuple[str, str, str]  # (model, feature, expect)


class ResultRecord(TypedDict):
    """The "result" line of one test (its phases summed)."""

    event: str
    nodeid: str
    outcome: str
    message: str
    detail: str
    seconds: float


def item_tags(item: pytest.Item) -> list[Tag]:
    """(model, feature, expect) for every `matrix` marker on `item` (parametrize marks included).

    Raises:
        pytest.UsageError: a feature, model or expect value that the catalog does not know.
    """
    tags: list[Tag] = []
    for mark in item.iter_markers("matrix"):
        model = str(mark.kwargs.get("model", "smollm2"))
        expect = str(mark.kwargs.get("expect", EXPECT_VERIFIED))
        bad = [f for f in mark.args if f not in FEATURE_IDS]
        if (
            not mark.args
            or bad
            or model not in MODEL_IDS
            or expect not in (EXPECT_VERIFIED, EXPECT_UNSUPPORTED)
        ):
            raise pytest.UsageError(
                f"{item.nodeid}: bad matrix marker {mark.args} {mark.kwargs}: features must be in "
                f"{FEATURE_IDS}, model in {MODEL_IDS}, expect 'verified' or 'unsupported'"
            )
        tags += [(model, str(f), expect) for f in mark.args]
    return tags


def _ids(text: str) -> set[str]:
    return {x for x in text.replace(",", " ").split() if x}


class MatrixReporter:
    """Selects the tagged items and writes their tags and outcomes to the report file."""

    def __init__(self, path: str, models: set[str], features: set[str], quick: bool) -> None:
        self.path = path
        self.models = models
        self.features = features
        self.quick = quick
        self._results: dict[str, ResultRecord] = {}
        open(path, "w").close()

    def _write(self, record: Mapping[str, object]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def _wanted(self, tag: Tag) -> bool:
        model, feature, _ = tag
        return (not self.models or model in self.models) and (
            not self.features or feature in self.features
        )

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        keep: list[pytest.Item] = []
        listed: list[CollectedItem] = []
        tagged: dict[str, list[str]] = {}
        for item in items:
            every = item_tags(item)
            for model, feature, _ in every:
                tagged.setdefault(f"{model}/{feature}", []).append(item.nodeid)
            tags = [t for t in every if self._wanted(t)]
            slow = item.get_closest_marker("slow") is not None
            if tags and not (self.quick and slow):
                keep.append(item)
                listed.append(
                    {"nodeid": item.nodeid, "tags": [list(t) for t in tags], "slow": slow}
                )
        dropped = [i for i in items if i not in keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
        self._write({"event": "collected", "items": listed, "tagged": tagged})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        rec = self._results.setdefault(report.nodeid, {
            "event": "result", "nodeid": report.nodeid, "outcome": "passed", "message": "",
            "detail": "", "seconds": 0.0})
        rec["seconds"] += float(report.duration)
        for name, value in report.user_properties:
            if name == DETAIL_PROPERTY:
                rec["detail"] = str(value)
        if report.failed and rec["outcome"] != "failed":
            rec["outcome"] = "failed"
            rec["message"] = _last_line(report.longreprtext) or f"failed in {report.when}"
        elif report.skipped and rec["outcome"] == "passed":
            rec["outcome"] = "skipped"
            rec["message"] = _skip_reason(report.longrepr)
        if report.when == "teardown":
            self._write(self._results.pop(report.nodeid))


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("E ")]
    line = lines[0][1:].strip() if lines else (text.strip().splitlines() or [""])[-1]
    return line[:300]


def _skip_reason(longrepr: object) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")[:300]
    return str(longrepr)[:300]


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("pdkv matrix")
    g.addoption(
        "--matrix-report", default=None, help="run only matrix-tagged tests; JSON lines here"
    )
    g.addoption("--matrix-models", default="", help="comma-separated model ids (default: all)")
    g.addoption("--matrix-features", default="", help="comma-separated feature ids (default: all)")
    g.addoption("--matrix-quick", action="store_true", help="leave out tests marked slow")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--matrix-report")
    if path:
        config.pluginmanager.register(MatrixReporter(
            str(path), _ids(config.getoption("--matrix-models")),
            _ids(config.getoption("--matrix-features")), bool(config.getoption("--matrix-quick"))),
            "pdkv-matrix-reporter")

"""From per-test outcomes to one status per (model, feature) cell (pure, no torch).

Rules, for the tests tagged with a cell:
- any test failed, or never reported (crash, timeout): "failed", with the first reason;
- else, at least one passed: "verified" for `expect="verified"` tests, "not supported" for
  `expect="unsupported"` ones (the detail is the error text the test recorded);
- else every test was skipped: "skipped", with the reason.
A cell whose tests mix both expectations is a tagging error.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypedDict

from pdkv.matrix.catalog import (
    EXPECT_UNSUPPORTED,
    FAILED,
    NOT_SUPPORTED,
    SKIPPED,
    VERIFIED,
    cell_order,
)


class CollectedItem(TypedDict):
    """One selected test as the plugin lists it: node id, its (model, feature, expect) tags and
    whether it is marked slow."""

    nodeid: str
    tags: list[list[str]]
    slow: bool


@dataclass(frozen=True)
class CheckOutcome:
    """One test's result as the plugin reported it.

    Attributes:
        nodeid: pytest node id, relative to the repository root.
        outcome: "passed" | "failed" | "skipped".
        message: failure or skip reason ("" when passed).
        detail: text recorded by the test (`matrix_detail`), e.g. the refusal's error message.
        seconds: setup + call + teardown time.
    """

    nodeid: str
    outcome: str
    message: str = ""
    detail: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix.

    Attributes:
        model, feature: catalog ids.
        status: "verified" | "failed" | "not supported" | "skipped".
        tests: node ids of the checks.
        detail: why (failure / skip reason, refusal text) or what passed.
        seconds: total test time.
        quick: every check runs without the `slow` marker (part of `pdkv matrix --quick`).
    """

    model: str
    feature: str
    status: str
    tests: tuple[str, ...]
    detail: str
    seconds: float
    quick: bool

    @property
    def command(self) -> str:
        """The exact command that re-runs this cell's checks."""
        return "python -m pytest -q " + " ".join(shlex.quote(t) for t in self.tests)


def cell_status(
    expect: str, outcomes: list[CheckOutcome | None], nodeids: list[str]
) -> tuple[str, str]:
    """(status, detail) of one cell from its tests' outcomes (None: the test never reported).

    Raises:
        ValueError: `outcomes` and `nodeids` differ in length.
    """
    if len(outcomes) != len(nodeids):
        raise ValueError("one outcome (or None) per node id")
    for nodeid, o in zip(nodeids, outcomes):
        if o is None:
            return FAILED, f"{nodeid}: no result (the run crashed or timed out)"
        if o.outcome == "failed":
            return FAILED, f"{nodeid}: {o.message}"
    passed = [o for o in outcomes if o is not None and o.outcome == "passed"]
    if passed:
        if expect == EXPECT_UNSUPPORTED:
            return NOT_SUPPORTED, next((o.detail for o in passed if o.detail), "refused")
        return VERIFIED, f"{len(passed)} of {len(outcomes)} checks passed"
    reasons = sorted({o.message for o in outcomes if o is not None})
    return SKIPPED, "; ".join(reasons)


def build_cells(items: Iterable[CollectedItem], results: dict[str, CheckOutcome]) -> list[Cell]:
    """Cells in catalog order (features, then models) from the plugin's collected items
    (`{"nodeid", "tags": [[model, feature, expect]], "slow"}`) and the outcomes by node id.

    Raises:
        ValueError: a cell's tests mix "verified" and "unsupported" expectations.
    """
    by_cell: dict[tuple[str, str], list[tuple[str, str, bool]]] = {}
    for item in items:
        nodeid = str(item["nodeid"])
        for model, feature, expect in item["tags"]:
            by_cell.setdefault((model, feature), []).append((nodeid, expect, bool(item["slow"])))
    cells = []
    for key in sorted(by_cell, key=lambda k: cell_order(k[1], k[0])):
        entries = by_cell[key]
        expects = {e for _, e, _ in entries}
        if len(expects) > 1:
            raise ValueError(f"cell {key}: tests mix expectations {sorted(expects)}")
        nodeids = [n for n, _, _ in entries]
        outcomes = [results.get(n) for n in nodeids]
        status, detail = cell_status(expects.pop(), outcomes, nodeids)
        cells.append(Cell(key[0], key[1], status, tuple(nodeids), detail,
                          round(sum(o.seconds for o in outcomes if o is not None), 1),
                          not any(slow for _, _, slow in entries)))
    return cells

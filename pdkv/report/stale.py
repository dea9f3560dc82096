"""`pdkv report --check`: which figures' data predate a change to the code they measure."""

from __future__ import annotations

import json
from pathlib import Path

from pdkv.report import gitinfo
from pdkv.report.figures import MIN_REQUESTS_FOR_P99, Figure
from pdkv.report.machine import UNKNOWN

# A run that keeps every core busy ends with a 1-minute load average near the core count by its
# own threads, a little above it with the kernel's own work (2.02-2.06 for a 2-thread bench on
# 2 cores, on an otherwise idle box); another job running beside it adds about one per busy
# thread. So a run is flagged when its load after exceeds the cores by more than this factor.
LOAD_AFTER_MARGIN = 1.1


def why_stale(root: Path, figure: Figure) -> str | None:
    """Why `figure` needs a re-run, or None when its data is current: no data file, a data
    commit git does not know (or "unknown"), a commit changing `figure.measures` after the data's
    commit (one that changed only docstrings and comments of Python files does not count:
    `gitinfo.only_docs_changed`), uncommitted changes at the run, a 1-minute load average above
    `LOAD_AFTER_MARGIN` times the core count at its end (a benchmark that keeps every core busy
    ends near the core count by its own load; a FORCED run says so in its block instead; not
    judged for a figure that `overloads` the box by design), or
    fewer requests per point than p99 needs. A record of a past run (`rerun` False) is never
    stale."""
    if not figure.rerun:
        return None
    path = root / figure.data
    if not path.exists():
        return "no data file"
    try:
        machine = json.loads(path.read_text(encoding="utf-8")).get("machine") or {}
    except (OSError, ValueError, AttributeError) as e:
        return f"data unreadable: {e}"
    commit = str(machine.get("commit", UNKNOWN))
    if commit == UNKNOWN:
        return "the run's commit is unknown"
    later = gitinfo.commits_since(root, commit, figure.measures)
    if later is None:
        return f"commit {commit[:7]} is not in this repository"
    for c in later:  # newest first; docstring- and comment-only commits change no measurement
        if not gitinfo.only_docs_changed(root, c, figure.measures):
            return f"code it measures changed in {c[:7]}, after {commit[:7]}"
    if machine.get("dirty"):
        return f"ran with uncommitted changes on {commit[:7]}"
    after, cores = machine.get("load_after"), machine.get("cores")
    if (isinstance(after, list) and after and isinstance(cores, int)
            and not machine.get("forced") and not figure.overloads
            and after[0] > LOAD_AFTER_MARGIN * cores):
        return (f"the load average after the run was {after[0]:.2f}, above {LOAD_AFTER_MARGIN} x "
                f"the {cores} cores: re-run on a quieter box")
    rpp = machine.get("requests_per_point")
    if figure.percentiles and (not isinstance(rpp, int) or rpp < MIN_REQUESTS_FOR_P99):
        return f"{rpp} requests per point: p99 needs at least {MIN_REQUESTS_FOR_P99}"
    return None


def check(root: Path, figures: tuple[Figure, ...]) -> list[tuple[Figure, str]]:
    """Every figure of `figures` that is stale, with why (`why_stale`), in registry order."""
    out = []
    for f in figures:
        reason = why_stale(root, f)
        if reason is not None:
            out.append((f, reason))
    return out

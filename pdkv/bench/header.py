"""The lines printed above a benchmark's table: CPU and its vector flags, cores, load average
before and after, commit, and whether the figures may be published (`pdkv bench hosts`,
`pdkv bench pcp`)."""

from __future__ import annotations

import os
import subprocess

from pdkv.bench.soak.cli import machine


def commit_text(commit: str) -> str:
    """`commit` (HEAD's short hash), "+ uncommitted changes" when the tracked files differ
    from it (git's answer within 10 s; none: as clean)."""
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10,
                               cwd=os.path.dirname(__file__)).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        dirty = ""
    return commit + (" + uncommitted changes" if dirty else "")


def host_facts() -> dict[str, str]:
    """CPU model, vector flags, cores and commit (with "+ uncommitted changes"), read now: before
    the run, so the commit is the one measured."""
    host = machine()
    host["commit"] = commit_text(host["commit"])
    return host


def machine_lines(host: dict[str, str], load_before: tuple[float, float, float],
                  load_after: tuple[float, float, float]) -> tuple[list[str], bool]:
    """The cpu, load average, commit and publishable lines, and whether the figures may be
    published: the 1-minute load average below the core count before and after the run."""
    cores = os.cpu_count() or 1
    quiet = load_before[0] < cores and load_after[0] < cores
    return [
        f"cpu: {host['cpu']}, flags {host['flags'] or '-'}, {host['cores']} cores",
        "load average (1 / 5 / 15 min): before " + " ".join(f"{x:.2f}" for x in load_before)
        + ", after " + " ".join(f"{x:.2f}" for x in load_after),
        f"commit: {host['commit']}",
        ("publishable: yes" if quiet else "publishable: NO") + f" (1-minute load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after; must stay below {cores} "
        "cores)",
    ], quiet

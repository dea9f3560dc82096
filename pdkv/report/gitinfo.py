"""The git facts `pdkv report` needs: HEAD, whether the tree is dirty, the last commit touching
some paths, ancestry (each a `git` call with a 10 s limit; errors read as "don't know")."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None


def head(root: Path) -> str:
    """HEAD's full hash, "" when `root` is not a git work tree."""
    out = _git(root, "rev-parse", "HEAD")
    return out.stdout.strip() if out is not None and out.returncode == 0 else ""


DOC_PATHS = ("docs", "README.md")
"""What `pdkv report` itself writes (the guides' blocks, docs/figures/*.json) and no measured
code lives in: edits there do not make a run's tree dirty, so the second figure of a run is not
marked as measured on uncommitted changes because the first one rewrote its guide."""


def dirty(root: Path) -> bool:
    """Whether tracked files outside DOC_PATHS differ from HEAD."""
    excludes = [f":(exclude){p}" for p in DOC_PATHS]
    out = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", *excludes)
    return bool(out is not None and out.returncode == 0 and out.stdout.strip())


def last_change(root: Path, paths: tuple[str, ...]) -> str:
    """The full hash of the last commit touching any of `paths`, "" when none did."""
    out = _git(root, "log", "-1", "--format=%H", "--", *paths)
    return out.stdout.strip() if out is not None and out.returncode == 0 else ""


def is_ancestor(root: Path, older: str, newer: str) -> bool | None:
    """Whether commit `older` is an ancestor of (or equal to) `newer`; None when git cannot say
    (a commit it does not know)."""
    out = _git(root, "merge-base", "--is-ancestor", older, newer)
    if out is None or out.returncode not in (0, 1):
        return None
    return out.returncode == 0

"""The git facts `pdkv report` needs: HEAD, whether the tree is dirty, the commits touching
some paths, ancestry, and whether a commit changed only docstrings and comments (each a `git`
call with a 10 s limit; errors read as "don't know")."""

from __future__ import annotations

import ast
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


def dirty(root: Path, paths: tuple[str, ...] = ()) -> bool:
    """Whether tracked files outside DOC_PATHS differ from HEAD: those under `paths` (a figure's
    `measures`, as `commits_since` reads them) when given, else any."""
    excludes = [f":(exclude){p}" for p in DOC_PATHS]
    out = _git(root, "status", "--porcelain", "--untracked-files=no", "--", *(paths or (".",)),
               *excludes)
    return bool(out is not None and out.returncode == 0 and out.stdout.strip())


def commits_since(root: Path, since: str, paths: tuple[str, ...]) -> list[str] | None:
    """Full hashes of the commits reachable from HEAD but not from `since` that touch any of
    `paths`, newest first; None when git cannot say (`since` unknown here)."""
    out = _git(root, "rev-list", f"{since}..HEAD", "--", *paths)
    if out is None or out.returncode != 0:
        return None
    return out.stdout.split()


def _code(source: str) -> str | None:
    """`source` as its AST with every docstring removed (comments are not in an AST), dumped
    without positions; None when it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def only_docs_changed(root: Path, commit: str, paths: tuple[str, ...]) -> bool:
    """Whether `commit` changed, under `paths`, nothing but docstrings and comments of Python
    files (against its first parent): their ASTs without docstrings are equal before and after.
    Any other file, an added or removed file, or a file that does not parse counts as a change.
    """
    out = _git(root, "diff", "--name-only", f"{commit}^", commit, "--", *paths)
    if out is None or out.returncode != 0:
        return False
    for name in out.stdout.split():
        if not name.endswith(".py"):
            return False
        old = _git(root, "show", f"{commit}^:{name}")
        new = _git(root, "show", f"{commit}:{name}")
        if old is None or new is None or old.returncode != 0 or new.returncode != 0:
            return False
        before, after = _code(old.stdout), _code(new.stdout)
        if before is None or before != after:
            return False
    return True

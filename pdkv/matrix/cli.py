"""`pdkv matrix`: run the tagged acceptance tests and write docs/SUPPORT_MATRIX.md (+ .json).

A full run writes the page anew. A partial run (`--quick`, `--models`, `--features`) merges its
cells into the page it finds at `--out` (`pdkv.matrix.report.merge`): the cells it did not re-run
keep their status and say when they were last checked; `--no-merge` writes only this run's cells.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

from pdkv.matrix.catalog import FAILED, FEATURE_IDS, MODEL_IDS
from pdkv.matrix.report import json_path, merge, read_json, to_data, write
from pdkv.matrix.runner import MatrixOptions, run_matrix

DEFAULT_OUT = os.path.join("docs", "SUPPORT_MATRIX.md")


def _ids(values: list[str] | None, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    ids = tuple(x for v in values or [] for x in v.split(",") if x)
    unknown = [x for x in ids if x not in known]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; known: {list(known)}")
    return ids


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of `pdkv matrix`."""
    parser.add_argument("--quick", action="store_true",
                        help="only the checks that load neither SmolLM2 nor HF's model (seconds); "
                             "merged into the page at --out like any partial run")
    parser.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help="Markdown path (relative to the current folder); the JSON goes beside it. A full "
        "run rewrites it; a partial run (--quick, --models, --features) merges its cells "
        "into it: cells it did not re-run are kept, re-checked ones are stamped with this "
        "run's date and commit (a page that does not exist yet gets only this run's cells)",
    )
    parser.add_argument("--no-merge", action="store_true",
                        help="a partial run writes only its own cells (every other cell becomes ·)")
    parser.add_argument(
        "--models", nargs="+", help=f"model ids to check (default all: {', '.join(MODEL_IDS)})"
    )
    parser.add_argument(
        "--features", nargs="+", help=f"feature ids (default all: {', '.join(FEATURE_IDS)})"
    )
    parser.add_argument("--tests", nargs="+", default=["tests"], help="where the tagged tests are")
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="deadline of the whole run (s)"
    )
    parser.add_argument("--test-timeout", type=float, default=None,
                        help="per-test limit (s) for pytest-timeout (unset: the project's)")
    return parser


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _commit(root: str) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def main(args: argparse.Namespace) -> int:
    """Run the matrix; exit 0 when no cell failed, 1 otherwise.

    Raises:
        ValueError: an unknown model or feature id.
    """
    root = _repo_root()
    opts = MatrixOptions(
        root=root, tests=tuple(args.tests), models=_ids(args.models, MODEL_IDS, "models"),
        features=_ids(args.features, FEATURE_IDS, "features"), quick=args.quick,
        timeout_s=args.timeout, test_timeout_s=args.test_timeout, python=sys.executable)
    try:
        cells, tagged = run_matrix(opts)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = "pdkv matrix" + (" --quick" if args.quick else "")
    if opts.models:
        command += " --models " + " ".join(opts.models)
    if opts.features:
        command += " --features " + " ".join(opts.features)
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    data = to_data(cells, today, command, _commit(root), tagged)
    partial = args.quick or bool(opts.models) or bool(opts.features)
    kept = ""
    if partial and not args.no_merge and os.path.exists(json_path(args.out)):
        try:
            old = read_json(json_path(args.out))
        except (OSError, ValueError) as e:
            print(
                f"error: cannot merge into {json_path(args.out)} ({e}); use --no-merge or another "
                "--out",
                file=sys.stderr,
            )
            return 2
        data = merge(old, data)
        kept_n = len(data["cells"]) - len(cells)
        kept = f" (merged: {len(cells)} re-checked, {kept_n} kept from the earlier run)"
    write(args.out, data)
    failed = [c for c in cells if c.status == FAILED]
    print(
        f"wrote {args.out} and {json_path(args.out)}: {len(cells)} cells, {len(failed)} "
        f"failed{kept}"
    )
    for c in failed:
        print(f"  failed: {c.feature} × {c.model}: {c.detail}")
    return 1 if failed else 0

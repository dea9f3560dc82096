"""What every recipe starts and stops: a server (`pdkv up` or `pdkv serve`) and the
`pdkv bench serve` runs against it, each a subprocess of the CLI a user types.

Each child runs in its own process group (`start_new_session`), with stdout and stderr in a log
file, so whatever it starts goes with it when it is stopped: SIGTERM to the group, SIGKILL after
a deadline (`pdkv.procgroup.stop_process_group`). Every wait has a deadline (`Deadlines`, s).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from pdkv.procgroup import stop_process_group
from pdkv.report.recipes.steps import pdkv_argv

READY_PREFIX = "ready: "  # what `pdkv up` prints once every process is healthy


@dataclass(frozen=True)
class Deadlines:
    """How long a recipe waits, in seconds: for a server to become ready, for one
    `pdkv bench serve` run, for a stopped group to exit after SIGTERM and after SIGKILL, and
    between two readiness checks."""

    ready_s: float = 600.0
    bench_s: float = 3600.0
    term_s: float = 60.0
    kill_s: float = 10.0
    poll_s: float = 0.5


class RecipeError(RuntimeError):
    """A recipe could not make its figure (the message says which step and where its log is)."""


class NotReady(RecipeError):
    """A server exited, or was not ready within its deadline."""


class BenchFailed(RecipeError):
    """`pdkv bench serve` exited non-zero, ran past its deadline or wrote no result JSON."""


def tail(path: str, lines: int = 15) -> str:
    """The last `lines` lines of the file at `path` ("(no log)" when it cannot be read)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


class Child:
    """A subprocess in its own process group, its stdout and stderr in `log_path` (its folder
    is created)."""

    def __init__(self, argv: Sequence[str], log_path: str) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        with open(log_path, "wb") as log:  # the child holds its own copy of the descriptor
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def pid(self) -> int:
        """The child's PID, also its process group's id."""
        return self.proc.pid

    def wait_ready(self, ready: Callable[[Child], str | None], timeout_s: float,
                   poll_s: float = 0.5) -> str:
        """Call `ready(self)` every `poll_s` s until it returns the server's URL.

        Raises:
            NotReady: the child exited first, or `timeout_s` s passed (the message has the end
                of its log).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            url = ready(self)
            if url is not None:
                return url
            rc = self.proc.poll()
            if rc is not None:
                raise NotReady(f"{' '.join(self.argv[1:4])}... exited with {rc} before it was "
                               f"ready; {self.log_path} ends:\n{tail(self.log_path)}")
            if time.monotonic() >= deadline:
                raise NotReady(f"{' '.join(self.argv[1:4])}... not ready after {timeout_s:.0f} s;"
                               f" {self.log_path} ends:\n{tail(self.log_path)}")
            time.sleep(poll_s)

    def wait_exit(self, timeout_s: float) -> int:
        """The child's exit status once it exits.

        Raises:
            subprocess.TimeoutExpired: it still runs after `timeout_s` s (it is not stopped).
        """
        return self.proc.wait(timeout_s)

    def stop(self, term_s: float, kill_s: float) -> None:
        """SIGTERM the child's group, SIGKILL it after `term_s` s, wait `kill_s` s more; nothing
        when the child has exited.

        Raises:
            subprocess.TimeoutExpired: the child outlived SIGKILL's wait.
        """
        stop_process_group(self.proc, term_s, kill_s)


def ready_line(child: Child) -> str | None:
    """The endpoint of `pdkv up`'s "ready: URL ..." line in the child's log, or None before it."""
    try:
        with open(child.log_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(READY_PREFIX):
                    return line[len(READY_PREFIX):].split()[0]
    except OSError:
        return None
    return None


def healthy(url: str) -> Callable[[Child], str | None]:
    """A readiness check: `url` when GET `url`/health answers 200 (within 2 s), else None."""

    def check(child: Child) -> str | None:
        try:
            return url if httpx.get(url + "/health", timeout=2.0).status_code == 200 else None
        except httpx.HTTPError:
            return None

    return check


@contextlib.contextmanager
def running(argv: Sequence[str], log_path: str, ready: Callable[[Child], str | None],
            deadlines: Deadlines) -> Iterator[str]:
    """Start `argv`, wait until `ready` gives its URL, yield the URL; always stop it on exit.

    Raises:
        NotReady: it exited or was not ready within `deadlines.ready_s` s.
    """
    child = Child(argv, log_path)
    try:
        print(f"started pid {child.pid}: {' '.join(argv[1:])} (log {log_path})",
              file=sys.stderr, flush=True)
        yield child.wait_ready(ready, deadlines.ready_s, deadlines.poll_s)
    finally:
        child.stop(deadlines.term_s, deadlines.kill_s)
        print(f"stopped pid {child.pid}", file=sys.stderr, flush=True)


def up(args: Sequence[str], log_dir: str,
       deadlines: Deadlines) -> contextlib.AbstractContextManager[str]:
    """`pdkv up ARGS --log-dir LOG_DIR` (engine flags, after `--`, last in `args`), ready when
    it prints its "ready:" line; yields the endpoint. Its own output is `LOG_DIR/up.log`.

    Raises:
        NotReady: as `running`.
    """
    args = list(args)
    cut = args.index("--") if "--" in args else len(args)
    engine = args[cut:] if len(args) > cut + 1 else []  # no lone trailing "--"
    argv = pdkv_argv("up", *args[:cut], "--log-dir", log_dir, *engine)
    return running(argv, os.path.join(log_dir, "up.log"), ready_line, deadlines)


def serve(args: Sequence[str], port: int, log_dir: str,
          deadlines: Deadlines) -> contextlib.AbstractContextManager[str]:
    """`pdkv serve ARGS --host 127.0.0.1 --port PORT`, ready when its /health answers 200;
    yields http://127.0.0.1:PORT. Its output is `LOG_DIR/serve.log`.

    Raises:
        NotReady: as `running`.
    """
    url = f"http://127.0.0.1:{port}"
    argv = pdkv_argv("serve", *args, "--host", "127.0.0.1", "--port", str(port))
    return running(argv, os.path.join(log_dir, "serve.log"), healthy(url), deadlines)


def bench_serve(args: Sequence[str], result_path: str, log_path: str,
                deadlines: Deadlines) -> dict[str, Any]:
    """Run `pdkv bench serve ARGS --result-json RESULT_PATH --disable-tqdm` to its end (printed
    output in `log_path`) and return the result dict it wrote (pdkv.bench.serve.report).

    Raises:
        BenchFailed: it exited non-zero, ran past `deadlines.bench_s` s (it is stopped) or
            wrote no JSON object.
    """
    argv = pdkv_argv("bench", "serve", *args, "--result-json", result_path, "--disable-tqdm")
    child = Child(argv, log_path)
    try:
        rc = child.wait_exit(deadlines.bench_s)
    except subprocess.TimeoutExpired:
        raise BenchFailed(f"pdkv bench serve ran past {deadlines.bench_s:.0f} s; {log_path} "
                          f"ends:\n{tail(log_path)}") from None
    finally:
        child.stop(deadlines.term_s, deadlines.kill_s)
    if rc != 0:
        raise BenchFailed(f"pdkv bench serve exited with {rc}; {log_path} ends:\n"
                          f"{tail(log_path)}")
    try:
        with open(result_path, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise BenchFailed(f"pdkv bench serve wrote no result JSON at {result_path}: {e}") from e
    if not isinstance(result, dict):
        raise BenchFailed(f"{result_path} holds no JSON object")
    return result


def failed_requests(result: dict[str, Any]) -> int:
    """Failed requests of a bench serve result (its "failed" key, 0 when absent)."""
    return int(result.get("failed") or 0)

"""Start and stop `pdkv` server processes for tests (127.0.0.1, free ports, killed by PID)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from pdkv.ports import free_port


class RemoteServer:
    """`python -m pdkv.cli <args> --host 127.0.0.1 --port P` as a child process.

    Args:
        args: CLI arguments after `pdkv` (e.g. ["serve", "--model", "smollm2"]).
        health_path: polled until it answers 200.
        timeout: seconds to wait for health.
        env: extra environment variables for the child.
        wait: wait for health here; False starts the process only (call `wait_healthy`), so that
            several servers can start side by side.
        avoid: ports not to take (those of servers started beside this one, not yet bound).
        port: this port instead of a free one (a restart on the same URL).
    """

    def __init__(
        self,
        args: list[str],
        health_path: str = "/health",
        timeout: float = 180.0,
        env: dict[str, str] | None = None,
        wait: bool = True,
        avoid: tuple[int, ...] = (),
        port: int | None = None,
    ) -> None:
        self.port = free_port() if port is None else port
        while self.port in avoid:
            self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(
            os.environ, PDKV_NUM_THREADS=os.environ.get("PDKV_NUM_THREADS", "2"), **(env or {})
        )
        self.log = open(os.environ.get("PDKV_TEST_SERVER_LOG", os.devnull), "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdkv.cli",
                *args,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self._args, self._health_path, self._timeout = args, health_path, timeout
        self._deadline = time.monotonic() + timeout
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        """Poll the health path until 200. Raises RuntimeError when the process exits first,
        TimeoutError (after stopping it) when `timeout` seconds from the start have passed."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self._args}")
            try:
                if httpx.get(self.url + self._health_path, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > self._deadline:
                self.stop()
                raise TimeoutError(f"server not healthy after {self._timeout} s: {self._args}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels` (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_for_metric(url: str, name: str, expected: float, timeout: float = 20.0) -> float:
    """Poll /metrics until `name` equals `expected`; returns the last value seen."""
    deadline = time.monotonic() + timeout
    value = float("nan")
    while time.monotonic() < deadline:
        value = metric_value(httpx.get(url + "/metrics", timeout=5).text, name)
        if value == expected:
            return value
        time.sleep(0.2)
    return value


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a process has used so far, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # After the ")" closing the command name, utime and stime are the 12th and 13th fields.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

"""BackgroundValue: the remote tiers' bytes_in_use, read without waiting for a round trip."""

from __future__ import annotations

import threading
import time

from pdkv.kvpool.tiers.base import BackgroundValue


def test_get_answers_at_once_and_fetches_off_thread_at_most_once_per_max_age():
    now = [0.0]
    gate, popped = threading.Event(), threading.Event()
    answers: list[int | Exception] = [7, RuntimeError("server gone"), 9]
    threads: list[str] = []

    def fetch() -> int:
        threads.append(threading.current_thread().name)
        assert gate.wait(30.0)
        answer = answers.pop(0)
        popped.set()
        if isinstance(answer, Exception):
            raise answer
        return answer

    value = BackgroundValue(fetch, max_age_s=5.0, name="bg-test", clock=lambda: now[0])
    assert value.get() == 0  # the fetch waits on the gate; get does not
    assert value.get() == 0
    gate.set()
    deadline = time.monotonic() + 30.0
    while value.get() != 7:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert threads == ["bg-test"]  # one fetch, however many gets
    now[0] = 4.9
    assert value.get() == 7 and len(threads) == 1  # not stale yet
    popped.clear()
    now[0] = 5.0
    assert value.get() == 7  # stale: a fetch starts, and it fails
    assert popped.wait(30.0)
    assert value.get() == 7  # a failed fetch keeps the last value
    assert value.refresh() == 9 and threads == ["bg-test", "bg-test", "MainThread"]

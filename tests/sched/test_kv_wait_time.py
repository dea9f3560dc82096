"""The scheduler records a request's time in WAITING_FOR_REMOTE_KVS (request.times.kv_wait) on a
fake clock: load admitted → load result applied."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from kv_connector_fakes import (  # noqa: E402
    FakeWorker,
    drain,
    make_scheduler,
    prompt_of,
    remote_req,
    step,
)

from pdkv.kv_transfer.connector.base import KVConnectorOutput  # noqa: E402
from pdkv.outputs import RequestMetrics  # noqa: E402
from pdkv.request import RequestStatus  # noqa: E402
from pdkv.sched import kv_connector_state, scheduler  # noqa: E402


class FakeTime:
    now = 0.0

    @classmethod
    def monotonic(cls) -> float:
        return cls.now


def test_kv_wait_spans_load_admission_to_resumption(monkeypatch):
    monkeypatch.setattr(scheduler, "time", FakeTime)
    monkeypatch.setattr(kv_connector_state, "time", FakeTime)
    sched, _ = make_scheduler()
    worker = FakeWorker()
    FakeTime.now = 100.0
    r = remote_req("r", prompt_of(1, 10), max_tokens=2)
    r.times.arrival = 100.0
    sched.add_request(r)
    FakeTime.now = 101.0
    step(sched, worker)  # admitted: the load starts
    assert r.times.first_scheduled == 101.0 and r.times.kv_wait_started == 101.0
    FakeTime.now = 103.0
    step(sched, worker)  # still loading
    worker.load(sched, r)
    FakeTime.now = 105.0
    step(sched, worker, KVConnectorOutput(finished_recving={"r"}))
    assert r.times.kv_wait == 0.0  # applied at the next schedule()
    FakeTime.now = 106.5
    step(sched, worker)  # resumes and samples its first token
    assert r.times.kv_wait == 5.5 and r.times.kv_wait_started is None
    assert r.times.first_token == 106.5
    m = RequestMetrics(r.times.arrival, r.times.first_scheduled, r.times.first_token, None, None,
                       kv_wait_time=r.times.kv_wait)
    assert (m.queue_time, m.prefill_time) == (1.0, 0.0)
    drain(sched, worker)


def test_abort_while_loading_ends_the_wait(monkeypatch):
    monkeypatch.setattr(scheduler, "time", FakeTime)
    monkeypatch.setattr(kv_connector_state, "time", FakeTime)
    sched, _ = make_scheduler(delay_inflight=False)
    worker = FakeWorker()
    FakeTime.now = 10.0
    r = remote_req("r", prompt_of(2, 10))
    sched.add_request(r)
    step(sched, worker)
    FakeTime.now = 12.0
    sched.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert r.times.kv_wait == 2.0 and r.times.kv_wait_started is None

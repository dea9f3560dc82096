"""Scheduler half of the P2P connector: lease renewals of queued pulls, and the grant identity
(nonce, prompt digest) carried by a consumer's pulls. Torch-free."""

from __future__ import annotations

from types import SimpleNamespace

from p2p_sched_utils import (
    BS,
    LAYOUT,
    PRODUCER_ADDR,
    REMOTE,
    blocks,
    empty_meta,
    make,
    remote_params,
    req,
)

from pdkv.cache.kv_layout import KVLayout
from pdkv.config import KVTransferConfig
from pdkv.kv_transfer.connector import p2p_scheduler as p2p_mod
from pdkv.kv_transfer.connector.p2p_messages import (
    NotifySpec,
    prompt_digest,
)
from pdkv.kv_transfer.connector.p2p_scheduler import P2PConnectorScheduler
from pdkv.kv_transfer.connector.spec import connector_spec
from pdkv.request import Request, RequestStatus
from pdkv.sampling_params import SamplingParams


# --------------------------------------------------------------------------- renewals
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_renewals_are_sent_for_queued_requests_every_third_of_the_lease(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(p2p_mod, "time", SimpleNamespace(monotonic=clock.monotonic))
    cons = make("kv_consumer", lease=30.0)
    a = req("a", 10, remote_params(remote_request_id="p-a"))
    b = req("b", 10, remote_params(remote_request_id="p-b"))
    local = req("l", 10, None)
    for r in (a, b, local):
        cons.on_new_request(r)

    clock.now += 9.9
    assert empty_meta(cons.build_connector_meta())  # before lease/3
    clock.now += 0.2  # 10.1 s after the start
    meta = cons.build_connector_meta()
    assert meta.notifications == [NotifySpec(REMOTE, "p-a", "renew", "nonce-10"),
                                  NotifySpec(REMOTE, "p-b", "renew", "nonce-10")]
    clock.now += 5.0
    assert empty_meta(cons.build_connector_meta())  # the timer restarted
    # a starts pulling: no more renewals for it (its transfer is on its way).
    cons.update_state_after_alloc(a, blocks([1, 2, 3]), 10)
    clock.now += 5.1
    meta = cons.build_connector_meta()
    assert len(meta.reqs_to_recv) == 1
    assert meta.notifications == [NotifySpec(REMOTE, "p-b", "renew", "nonce-10")]
    # b is aborted while queued: one release, then nothing.
    b.status = RequestStatus.FINISHED_ABORTED
    assert cons.request_finished(b, ([],)) == (False, None)
    clock.now += 11.0
    meta = cons.build_connector_meta()
    assert meta.notifications == [NotifySpec(REMOTE, "p-b", "release", "nonce-10")]
    clock.now += 11.0
    assert empty_meta(cons.build_connector_meta())


def test_renewal_interval_follows_the_configured_lease(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(p2p_mod, "time", SimpleNamespace(monotonic=clock.monotonic))
    cons = make("kv_consumer", lease=3.0)
    cons.on_new_request(req("a", 10, remote_params(remote_request_id="p-a")))
    clock.now += 0.9
    assert empty_meta(cons.build_connector_meta())
    clock.now += 0.2
    assert [n.kind for n in cons.build_connector_meta().notifications] == ["renew"]
    # The SendSpec of a producer with this config carries the same lease.
    prod = make("kv_producer", lease=3.0)
    prod.request_finished(req("p", 4, {"do_remote_decode": True},
                              RequestStatus.FINISHED_STOPPED), ([0],))
    assert prod.build_connector_meta().reqs_to_send[0].lease_s == 3.0


def test_default_lease_is_thirty_seconds():
    cfg = connector_spec(KVTransferConfig("P2PConnector", "kv_producer", engine_id="e"), BS)
    assert P2PConnectorScheduler(cfg, KVLayout.from_wire(LAYOUT), BS,
                                 list(PRODUCER_ADDR)).lease_s == 30.0


# --------------------------------------------------------------------------- identity
def test_params_of_another_prompt_become_a_load_error_without_contacting_the_producer():
    cons = make("kv_consumer")
    other = prompt_digest(list(range(21, 31)), None)  # another prompt of the same length
    r = req("r", 10, remote_params(prompt_digest=other))
    cons.validate_request(r)  # not a 400: handled by kv_load_failure_policy
    cons.on_new_request(r)
    assert not cons.has_pending_work()  # no renewals of a grant that is not this prompt's
    cons.update_state_after_alloc(r, blocks([1, 2, 3]), 10)
    meta = cons.build_connector_meta()
    (spec,) = meta.reqs_to_recv
    assert "prompt_digest does not match" in spec.error and meta.notifications == []
    # The same prompt under another cache_salt is another prompt too.
    salted = Request(
        "s",
        list(range(20, 30)),
        SamplingParams(max_tokens=8),
        BS,
        cache_salt="tenant-b",
        kv_transfer_params=remote_params(),
    )
    cons.update_state_after_alloc(salted, blocks([4, 5, 6]), 10)
    assert "prompt_digest does not match" in cons.build_connector_meta().reqs_to_recv[0].error


def test_aborting_a_request_with_foreign_params_releases_nothing():
    cons = make("kv_consumer")
    r = req("r", 10, remote_params(prompt_digest="0" * 64))
    cons.on_new_request(r)
    r.status = RequestStatus.FINISHED_ABORTED
    assert cons.request_finished(r, ([],)) == (False, None)
    assert empty_meta(cons.build_connector_meta())


def test_matching_params_carry_the_nonce_and_the_consumer_digest():
    cons = make("kv_consumer")
    r = req("r", 10, remote_params())
    cons.update_state_after_alloc(r, blocks([1, 2, 3]), 10)
    (spec,) = cons.build_connector_meta().reqs_to_recv
    assert spec.error == "" and spec.remote_nonce == "nonce-10"
    assert spec.prompt_digest == prompt_digest(r.prompt_token_ids, None)

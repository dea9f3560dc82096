"""Worker half of the P2P connector with real sockets and small CPU KV caches (no model): grants
and identities (forged ids, replays, prompt digests, early notices), producer restarts, a black
hole producer, renewals of queued pulls, device and advertised-address checks."""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
import time
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from pd_utils import pause_pulls  # noqa: E402

from pdkv.cache.kv_layout import KVLayout
from pdkv.config import KVTransferConfig  # noqa: E402
from pdkv.kv_transfer.connector import p2p_producer  # noqa: E402
from pdkv.kv_transfer.connector.p2p_messages import (  # noqa: E402
    Ack,
    Claim,
    ClaimReply,
    Notify,
    P2PConnectorMetadata,
    RecvSpec,
    RemoteEngine,
    SendSpec,
    prompt_digest,
)
from pdkv.kv_transfer.connector.p2p_worker import P2PConnectorWorker  # noqa: E402
from pdkv.kv_transfer.connector.spec import connector_spec
from pdkv.kv_transfer.engine.base import ReadOp, TransferError  # noqa: E402
from pdkv.kv_transfer.engine.tcp import TcpTransferEngine  # noqa: E402
from pdkv.kv_transfer.wire import connect, recv_msg, send_msg  # noqa: E402
from pdkv.ports import free_port  # noqa: E402

LAYOUT = {
    "model_digest": "m",
    "dtype": "float32",
    "block_size": 4,
    "num_layers": 1,
    "num_kv_heads": 1,
    "head_size": 8,
    "kv_layout": "cross_layer",
}
NB = 16
SHAPE = (NB, 1, 2, 4, 1, 8)  # blocks, layers, K/V, block tokens, KV heads, head size: 256 B/block
TOKENS = list(range(100, 112))


def make_worker(role: str, engine_id: str, **extra: Any) -> tuple[P2PConnectorWorker, torch.Tensor]:
    cfg = KVTransferConfig("P2PConnector", role, engine_id=engine_id,
                           kv_connector_extra_config={"transfer": "tcp", **extra})
    w = P2PConnectorWorker(connector_spec(cfg, 4), KVLayout.from_wire(LAYOUT), ["127.0.0.1", 0])
    if role == "kv_producer":
        kv = torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE)
    else:
        kv = torch.zeros(SHAPE)
    w.register_kv_caches([kv])
    return w, kv


@pytest.fixture()
def workers():
    made: list[P2PConnectorWorker] = []

    def factory(role: str, engine_id: str, **extra: Any) -> tuple[P2PConnectorWorker, torch.Tensor]:
        w, kv = make_worker(role, engine_id, **extra)
        made.append(w)
        return w, kv

    yield factory
    for w in made:
        w.shutdown()


def hold(prod: P2PConnectorWorker, rid: str, blocks: list[int], tokens: list[int] = TOKENS,
         lease: float = 30.0) -> tuple[str, str]:
    """Hold `blocks` under a new grant; returns (nonce, prompt digest) as P's params carry them."""
    nonce, digest = secrets.token_hex(16), prompt_digest(tokens, None)
    prod.start_load_kv(
        P2PConnectorMetadata(reqs_to_send=[SendSpec(rid, (blocks,), lease, nonce, digest)])
    )
    return nonce, digest


def remote_of(prod: P2PConnectorWorker) -> RemoteEngine:
    host, port = prod.control_address
    return RemoteEngine(prod.spec.engine_id, str(host), int(port))


def spec(
    rid: str,
    remote: RemoteEngine,
    remote_rid: str,
    nonce: str,
    local: list[int],
    remote_ids: list[int],
    tokens: list[int] = TOKENS,
) -> RecvSpec:
    return RecvSpec(rid, remote, remote_rid, (local,), (remote_ids,), dict(LAYOUT), nonce,
                    prompt_digest(tokens, None))


def pull(
    cons: P2PConnectorWorker, specs: list[RecvSpec], timeout: float = 20.0
) -> dict[str, str | None]:
    """Submit pulls and step the consumer until all ended: request id -> error (None = loaded)."""
    cons.start_load_kv(P2PConnectorMetadata(reqs_to_recv=specs))
    return wait_loads(cons, {s.request_id for s in specs}, timeout)


def wait_loads(cons: P2PConnectorWorker, rids: set[str], timeout: float = 20.0,
               results: dict[str, str | None] | None = None) -> dict[str, str | None]:
    out = results if results is not None else {}
    deadline = time.monotonic() + timeout
    while not rids <= set(out):
        assert time.monotonic() < deadline, f"loads {rids - set(out)} did not end"
        _, recved = cons.get_finished()
        errors = cons.get_load_errors()
        for rid in recved:
            out[rid] = errors.get(rid)
        time.sleep(0.01)
    return out


def test_pull_copies_exactly_the_granted_blocks_and_ends_the_grant(workers):
    prod, pkv = workers("kv_producer", "P")
    cons, dkv = workers("kv_consumer", "D")
    nonce, _ = hold(prod, "r", [3, 4, 9])
    assert pull(cons, [spec("d", remote_of(prod), "r", nonce, [0, 1, 2], [3, 4, 9])]) == {"d": None}
    assert torch.equal(dkv[:3], pkv[[3, 4, 9]]) and not dkv[3:].any()
    assert prod.get_finished()[0] == {"r"} and not prod.has_pending()
    assert prod.get_stats()[0]["kv_bytes_sent"] == 3 * 256


def test_forged_block_ids_are_refused_and_nothing_is_written(workers):
    prod, pkv = workers("kv_producer", "P")
    cons, dkv = workers("kv_consumer", "D")
    nonce, digest = hold(prod, "forged", [3, 4])
    errors = pull(cons, [spec("d", remote_of(prod), "forged", nonce, [0, 1], [3, 9])])
    assert "not the blocks the producer holds" in str(errors["d"])
    assert not dkv.any()
    nonce, digest = hold(prod, "r", [3, 4])
    # A client that skips D's check and reads P's data port itself is refused by P's ledger,
    # even with the right nonce and an accepted claim.
    with connect(*prod.control_address, timeout=5) as s:
        send_msg(s, Claim("r", nonce, digest, "P"))
        assert recv_msg(s, ClaimReply).ok
    peer = prod.engine.peer_info()
    raw = TcpTransferEngine()
    try:
        out = bytearray(256)
        with pytest.raises(TransferError, match="outside the blocks held"):
            raw.read(
                peer,
                [ReadOp("g0", 9 * 256, 256, memoryview(out))],
                time.monotonic() + 5,
                ("r", nonce),
            )
        with pytest.raises(TransferError, match="no claimed grant"):
            raw.read(
                peer,
                [ReadOp("g0", 3 * 256, 256, memoryview(out))],
                time.monotonic() + 5,
                ("r", "guess"),
            )
        assert (
            raw.read(
                peer,
                [ReadOp("g0", 3 * 256, 256, memoryview(out))],
                time.monotonic() + 5,
                ("r", nonce),
            )
            == 256
        )
    finally:
        raw.close()


def test_a_replayed_grant_is_refused_after_the_read(workers):
    prod, _ = workers("kv_producer", "P")
    cons, dkv = workers("kv_consumer", "D")
    nonce, _ = hold(prod, "r", [5])
    assert pull(cons, [spec("d1", remote_of(prod), "r", nonce, [0], [5])]) == {"d1": None}
    # P serves another request in the same blocks; the old params must not read them.
    hold(prod, "other", [5])
    errors = pull(cons, [spec("d2", remote_of(prod), "r", nonce, [1], [5])])
    assert "unknown or expired request" in str(errors["d2"])
    assert not dkv[1].any()
    assert prod.has_pending()  # the other request's grant was not touched


def test_a_prompt_digest_mismatch_is_refused_by_the_producer_and_keeps_the_grant(workers):
    prod, _ = workers("kv_producer", "P")
    cons, dkv = workers("kv_consumer", "D")
    nonce, _ = hold(prod, "r", [2, 3])
    other_prompt = [t + 1 for t in TOKENS]  # same length, different tokens
    errors = pull(
        cons, [spec("d1", remote_of(prod), "r", nonce, [0, 1], [2, 3], tokens=other_prompt)]
    )
    assert "prompt digest mismatch" in str(errors["d1"]) and not dkv.any()
    assert prod.has_pending()  # D did not release a grant that is not its own
    assert pull(cons, [spec("d2", remote_of(prod), "r", nonce, [0, 1], [2, 3])]) == {"d2": None}


def test_a_claim_that_overtakes_its_registration_by_seconds_still_reads(workers):
    """P registers a grant at its next step, after its answer left; on a starved CPU that step
    can start seconds later. A claim that arrives first waits for the registration (up to a
    lease) instead of failing the request; a replay of an ended grant is still refused at once."""
    prod, _ = workers("kv_producer", "P")
    cons, dkv = workers("kv_consumer", "D")
    nonce, digest = secrets.token_hex(16), prompt_digest(TOKENS, None)
    cons.start_load_kv(P2PConnectorMetadata(
        reqs_to_recv=[spec("d1", remote_of(prod), "r", nonce, [0], [4])]))
    deadline = time.monotonic() + 20
    while not prod.producer._registered._waiters:  # the claim is waiting at P
        assert time.monotonic() < deadline, "the claim never reached P"
        time.sleep(0.01)
    time.sleep(p2p_producer.REGISTRATION_WAIT_S + 1.0)  # register later than a notice waits
    prod.start_load_kv(P2PConnectorMetadata(
        reqs_to_send=[SendSpec("r", ([4],), 30.0, nonce, digest)]))
    assert wait_loads(cons, {"d1"}) == {"d1": None}
    t0 = time.monotonic()
    errors = pull(cons, [spec("d2", remote_of(prod), "r", nonce, [1], [4])])
    assert "unknown or expired request" in str(errors["d2"])
    assert time.monotonic() - t0 < p2p_producer.CLAIM_REGISTRATION_WAIT_S  # not a full wait


def test_a_spec_refused_by_the_scheduler_fails_without_contacting_anyone(workers):
    cons, _ = workers("kv_consumer", "D")
    nowhere = RemoteEngine("P", "127.0.0.1", free_port())
    refused = RecvSpec(
        "d", nowhere, "r", ([0],), ([1],), dict(LAYOUT), "n", "x", error="digest differs"
    )
    assert pull(cons, [refused], timeout=5) == {"d": "digest differs"}
    assert cons.get_block_ids_with_load_errors() == {(0, 0)}


def _notify(prod: P2PConnectorWorker, msg: Notify) -> Ack:
    with connect(*prod.control_address, timeout=10) as s:
        send_msg(s, msg)
        return recv_msg(s, Ack)


def test_early_notices_apply_only_to_their_own_grant_and_expire(workers):
    prod, _ = workers("kv_producer", "P", kv_lease_duration=0.5)
    cons, _ = workers("kv_consumer", "D")
    # A replayed release for an old grant of request id "x" arrives before x is held again.
    assert not _notify(prod, Notify("x", "release", nonce="old-nonce", engine_id="P")).ok
    nonce, _ = hold(prod, "x", [1])
    assert prod.has_pending()  # the new grant under the same id is untouched
    assert pull(cons, [spec("d", remote_of(prod), "x", nonce, [0], [1])]) == {"d": None}
    # A notice that arrives before its own grant still applies to it ...
    assert not _notify(prod, Notify("y", "release", nonce="n-y", engine_id="P")).ok
    prod.start_load_kv(P2PConnectorMetadata(reqs_to_send=[SendSpec("y", ([2],), 30.0, "n-y", "")]))
    assert "y" in prod.get_finished()[0]
    # ... but not once it is older than a lease.
    assert not _notify(prod, Notify("z", "release", nonce="n-z", engine_id="P")).ok
    time.sleep(0.6)
    prod.get_finished()  # expires stale early notices
    prod.start_load_kv(P2PConnectorMetadata(reqs_to_send=[SendSpec("z", ([3],), 30.0, "n-z", "")]))
    assert "z" not in prod.get_finished()[0] and prod.has_pending()


def test_a_notice_for_another_engine_id_is_refused(workers):
    prod, _ = workers("kv_producer", "P")
    nonce, _ = hold(prod, "r", [1])
    ack = _notify(prod, Notify("r", "release", nonce=nonce, engine_id="P-before-restart"))
    assert not ack.ok and "not 'P-before-restart'" in ack.error and prod.has_pending()


def test_consumer_handshakes_again_after_the_producer_restarts_on_the_same_port(workers):
    port = free_port()
    prod, _ = workers("kv_producer", "P", kv_port=port)
    cons, dkv = workers("kv_consumer", "D")
    nonce, _ = hold(prod, "r1", [1])
    assert pull(cons, [spec("d1", remote_of(prod), "r1", nonce, [0], [1])]) == {"d1": None}
    old_data_port = prod.engine.peer_info()["port"]
    prod.shutdown()  # killed; D still caches its handshake and a data connection
    prod2, pkv2 = workers("kv_producer", "P", kv_port=port)
    assert prod2.engine.peer_info()["port"] != old_data_port
    nonce2, _ = hold(prod2, "r2", [6])
    assert pull(cons, [spec("d2", remote_of(prod2), "r2", nonce2, [2], [6])]) == {"d2": None}
    assert torch.equal(dkv[2], pkv2[6])
    assert cons.get_stats()[0]["kv_bytes_received"] == 2 * 256


class BlackHole:
    """A 'producer' whose port accepts connections and never answers."""

    def __init__(self) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.srv.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.srv.close()
        for c in self.conns:
            c.close()


def test_a_black_hole_producer_stalls_neither_other_pulls_nor_its_own_deadlines(workers):
    timeout = 4.0
    prod, _ = workers("kv_producer", "P")
    cons, _ = workers(
        "kv_consumer", "D", transfer_timeout=timeout, kv_pulls_per_peer=2, kv_pull_threads=4
    )
    hole = BlackHole()
    try:
        dead = RemoteEngine("dead", "127.0.0.1", hole.port)
        t0 = time.monotonic()
        cons.start_load_kv(P2PConnectorMetadata(
            reqs_to_recv=[spec(f"dead{i}", dead, f"x{i}", "n", [i], [i]) for i in range(6)]))
        good = []
        for i in range(2):
            nonce, _ = hold(prod, f"r{i}", [i])
            good.append(spec(f"good{i}", remote_of(prod), f"r{i}", nonce, [8 + i], [i]))
        results = pull(cons, good)
        assert results == {"good0": None, "good1": None}
        assert not any(
            k.startswith("dead") for k in results
        )  # those can only end at their deadline
        wait_loads(cons, {f"dead{i}" for i in range(6)}, timeout=3 * timeout, results=results)
        elapsed = time.monotonic() - t0
        assert all(results[f"dead{i}"] for i in range(6))
        # Deadlines are stamped at submit: the queued ones end with the first, not one timeout
        # later.
        assert elapsed < 2 * timeout
    finally:
        hole.close()


def test_leases_are_renewed_until_the_read_begins(workers):
    prod, _ = workers("kv_producer", "P", kv_lease_duration=30.0)
    cons, dkv = workers("kv_consumer", "D", kv_lease_duration=0.6, kv_pulls_per_peer=1)
    paused = pause_pulls(cons)
    nonce_a, _ = hold(prod, "a", [1])
    # b's grant starts with a 0.6 s lease: only renewals keep it while its pull waits behind a's.
    nonce_b, digest = secrets.token_hex(16), prompt_digest(TOKENS, None)
    prod.start_load_kv(
        P2PConnectorMetadata(reqs_to_send=[SendSpec("b", ([2],), 0.6, nonce_b, digest)])
    )
    cons.start_load_kv(P2PConnectorMetadata(reqs_to_recv=[
        spec("da", remote_of(prod), "a", nonce_a, [0], [1]),
        spec("db", remote_of(prod), "b", nonce_b, [1], [2])]))
    assert paused.entered.wait(10)  # a is reading; b waits for the one slot to this producer
    assert cons.next_deadline() is not None
    end = time.monotonic() + 2.0
    while time.monotonic() < end:  # both engine loops keep stepping
        cons.get_finished()
        assert "b" not in prod.get_finished()[0], "b's lease expired while its pull was queued"
        time.sleep(0.05)
    paused.gate.set()
    assert wait_loads(cons, {"da", "db"}) == {"da": None, "db": None}
    assert dkv[0].any() and dkv[1].any()  # both loaded


def test_a_kv_cache_outside_cpu_memory_is_refused_at_registration():
    cfg = KVTransferConfig(
        "P2PConnector", "kv_consumer", engine_id="D", kv_connector_extra_config={}
    )
    w = P2PConnectorWorker(connector_spec(cfg, 4), KVLayout.from_wire(LAYOUT), ["127.0.0.1", 0])
    try:
        with pytest.raises(ValueError, match="KV cache in CPU memory.*meta"):
            w.register_kv_caches([torch.empty(SHAPE, device="meta")])
    finally:
        w.shutdown()


@pytest.mark.parametrize("advertise", [None, "127.0.0.1"])
def test_a_wildcard_bind_is_never_advertised(workers, advertise):
    extra: dict[str, Any] = {"kv_host": "0.0.0.0"}
    if advertise:
        extra["kv_advertise_host"] = advertise
    prod, _ = workers("kv_producer", "P", **extra)
    cons, _ = workers("kv_consumer", "D")
    host, data_host = prod.control_address[0], prod.engine.peer_info()["host"]
    assert host not in ("0.0.0.0", "") and data_host == host
    if advertise:
        assert host == advertise
        nonce, _ = hold(prod, "r", [1])
        assert pull(cons, [spec("d", remote_of(prod), "r", nonce, [0], [1])]) == {"d": None}

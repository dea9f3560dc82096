"""Fuzzing P's control server, the P/D grant route (handshake, claim, notify: "done", "release",
"renew"; typed msgpack frames, pdkv/kv_transfer/wire.py), issue 28. It is not HTTP, so the schema
fuzzing of the servers does not reach it; hypothesis does here:
- messages of every type with random field values: each is answered with its reply type, and
  none without the grant's nonce claims, renews or ends a held grant;
- frames of random bytes: a frame that does not decode drops its own connection only.
After each run the server still serves: a handshake answers ok and the held grant is claimed with
its nonce."""

from __future__ import annotations

import os
import secrets
import socket
import struct
from collections.abc import Callable, Iterator

import hypothesis
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from pdkv.cache.kv_layout import KVLayout
from pdkv.config import KVTransferConfig
from pdkv.kv_transfer.connector import p2p_producer
from pdkv.kv_transfer.connector.p2p_messages import (
    Ack,
    Claim,
    ClaimReply,
    Handshake,
    HandshakeReply,
    Notify,
    P2PConnectorMetadata,
    SendSpec,
    prompt_digest,
)
from pdkv.kv_transfer.connector.p2p_worker import P2PConnectorWorker
from pdkv.kv_transfer.connector.spec import connector_spec
from pdkv.kv_transfer.wire import WireError, recv_msg, send_msg

LAYOUT = {"model_digest": "m", "dtype": "float32", "block_size": 4, "num_layers": 1,
          "num_kv_heads": 1, "head_size": 8, "kv_layout": "blocks_layers_kv_tokens_heads_dim"}
SHAPE = (8, 1, 2, 4, 1, 8)
TOKENS = list(range(100, 112))
CASES = int(os.environ.get("PDKV_FUZZ_CASES", "200"))

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
JSON = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats(allow_nan=False) | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8)
RIDS = st.sampled_from(["held", "other"]) | st.text(max_size=12)
ENGINES = st.sampled_from(["", "P"]) | st.text(max_size=8)
MESSAGES = st.one_of(
    st.builds(Handshake, engine_id=ENGINES,
              layout=st.one_of(st.just(dict(LAYOUT)),
                               st.dictionaries(st.sampled_from([*LAYOUT, "x"]), JSON,
                                               max_size=8))),
    st.builds(Notify, request_id=RIDS,
              kind=st.sampled_from(["done", "release", "renew"]) | st.text(max_size=8),
              nbytes=INT64, nonce=st.text(max_size=40), engine_id=ENGINES, reader=INT64,
              readers=INT64),
    st.builds(Claim, request_id=RIDS, nonce=st.text(max_size=40),
              prompt_digest=st.text(max_size=40), engine_id=ENGINES, readers=INT64,
              reader=INT64),
)
REPLY = {Handshake: HandshakeReply, Notify: Ack, Claim: ClaimReply}


class Producer:
    """A P2P producer worker (tcp) holding grant "held" of blocks [1, 2]."""

    def __init__(self) -> None:
        cfg = KVTransferConfig("P2PConnector", "kv_producer", engine_id="P",
                               kv_connector_extra_config={"transfer": "tcp"})
        self.worker = P2PConnectorWorker(connector_spec(cfg, 4), KVLayout.from_wire(LAYOUT),
                                         ["127.0.0.1", 0])
        self.worker.register_kv_caches([torch.zeros(SHAPE)])
        self.nonce, self.digest = secrets.token_hex(16), prompt_digest(TOKENS, None)
        self.worker.start_load_kv(P2PConnectorMetadata(
            reqs_to_send=[SendSpec("held", ([1, 2],), 600.0, self.nonce, self.digest)]))
        host, port = self.worker.control_address
        self.address = (str(host), int(port))

    def connect(self) -> socket.socket:
        return socket.create_connection(self.address, timeout=10)

    def ask(self, msg: Handshake | Notify | Claim) -> HandshakeReply | Ack | ClaimReply:
        with self.connect() as sock:
            send_msg(sock, msg)
            return recv_msg(sock, REPLY[type(msg)])

    def still_serves(self) -> None:
        """A handshake answers ok and the held grant is claimed with its nonce."""
        shake = self.ask(Handshake("", dict(LAYOUT)))
        assert isinstance(shake, HandshakeReply) and shake.ok, shake
        claim = self.ask(Claim("held", self.nonce, self.digest, engine_id="P"))
        assert isinstance(claim, ClaimReply) and claim.ok, claim
        assert claim.block_ids == [[1, 2]]


@pytest.fixture()
def producer(monkeypatch: pytest.MonkeyPatch) -> Iterator[Producer]:
    # A notice / claim for an unknown grant waits this long for it to be registered (2 s / up
    # to a lease in service).
    monkeypatch.setattr(p2p_producer, "REGISTRATION_WAIT_S", 0.001)
    monkeypatch.setattr(p2p_producer, "CLAIM_REGISTRATION_WAIT_S", 0.001)
    prod = Producer()
    yield prod
    prod.worker.shutdown()


def test_random_messages_get_their_reply_type_and_never_touch_a_grant_without_its_nonce(
        producer: Producer, record_property: Callable[[str, object], None]) -> None:
    replies: dict[str, int] = {}

    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
    @hypothesis.given(MESSAGES)
    def one(msg: Handshake | Notify | Claim) -> None:
        reply = producer.ask(msg)
        assert isinstance(reply, REPLY[type(msg)])
        key = f"{type(msg).__name__}:{'ok' if reply.ok else 'refused'}"
        replies[key] = replies.get(key, 0) + 1
        if isinstance(msg, (Notify, Claim)) and msg.request_id == "held":
            assert not reply.ok, (msg, reply)  # no random nonce is the grant's

    one()
    record_property("schema_fuzz", f"P's control server: {CASES} messages, replies "
                                   f"{dict(sorted(replies.items()))}")
    assert replies.get("Handshake:ok", 0) > 0 and replies.get("Notify:refused", 0) > 0, replies
    producer.still_serves()


def test_a_frame_that_does_not_decode_drops_only_its_connection(
        producer: Producer, record_property: Callable[[str, object], None]) -> None:
    closed = 0

    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
    @hypothesis.given(st.binary(max_size=96))
    def one(payload: bytes) -> None:
        nonlocal closed
        with producer.connect() as sock:
            sock.sendall(struct.pack("!I", len(payload)) + payload)
            try:
                recv_msg(sock, HandshakeReply | Ack | ClaimReply)  # type: ignore[arg-type]
            except WireError:
                closed += 1

    one()
    record_property("schema_fuzz", f"P's control server: {CASES} raw frames, {closed} dropped "
                                   "their connection")
    assert closed > 0
    producer.still_serves()

"""Scheduler half of the P2P connector (pdkv/kv_transfer/connector/p2p_scheduler.py) on its own:
producer params and sends, consumer pulls and notifications, request validation, lease renewal.
Torch-free: requests and KV blocks are built by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from p2p_sched_utils import (
    BS,
    LAYOUT,
    LEASE,
    PRODUCER_ADDR,
    REMOTE,
    blocks,
    consumer_spec,
    empty_meta,
    make,
    remote_params,
    req,
)

from pdkv.cache.kv_layout import KVLayout
from pdkv.kv_transfer.connector.base import KVConnectorOutput
from pdkv.kv_transfer.connector.p2p_messages import (
    LAYOUT_KEYS,
    NotifySpec,
    P2PConnectorMetadata,
    RecvSpec,
    RemoteEngine,
    SendSpec,
    prompt_digest,
)
from pdkv.kv_transfer.connector.p2p_scheduler import REQUIRED_PARAMS, P2PConnectorScheduler
from pdkv.request import RequestStatus


def test_this_module_imports_without_torch():
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_p2p_scheduler\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- producer
@pytest.mark.parametrize("status", [RequestStatus.FINISHED_LENGTH_CAPPED,
                                    RequestStatus.FINISHED_STOPPED])
def test_producer_request_finished_holds_blocks_and_returns_full_params(status):
    prod = make("kv_producer", engine_id="prefill-0")
    r = req("r1", 10, {"do_remote_decode": True}, status)
    block_ids = ([3, 4, 5], [9, 10, 11])  # two KV cache groups
    assert not prod.has_pending_work()
    delay, params = prod.request_finished(r, block_ids)
    assert delay is True
    assert params is not None
    nonce = params.pop("remote_nonce")
    assert isinstance(nonce, str) and len(nonce) == 32  # 128 random bits, hex
    assert params.pop("prompt_digest") == prompt_digest(r.prompt_token_ids, None)
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-0",
        "remote_request_id": "r1",
        "remote_block_ids": [[3, 4, 5], [9, 10, 11]],
        "remote_host": "10.1.2.3",
        "remote_port": 47001,
        "tp_size": 1,
        "dcp_size": 1,
        "endpoints": [["10.1.2.3", 47001]],
        "block_size": BS,
        "num_tokens": 10,
        "layout": LAYOUT,
    }
    assert all(
        params[k] is not None for k in REQUIRED_PARAMS if k not in ("remote_nonce", "prompt_digest")
    )
    # Copies, not aliases of the scheduler's lists or of the connector's layout.
    block_ids[0].append(99)
    assert params["remote_block_ids"][0] == [3, 4, 5]
    params["layout"]["dtype"] = "x"
    assert prod.layout.dtype == "float16"

    assert prod.num_blocks_held == 6
    assert prod.has_pending_work()
    meta = prod.build_connector_meta()
    assert isinstance(meta, P2PConnectorMetadata)
    assert meta.reqs_to_send == [
        SendSpec("r1", block_ids, LEASE, nonce, prompt_digest(r.prompt_token_ids, None))
    ]
    assert meta.reqs_to_recv == [] and meta.notifications == []
    assert empty_meta(prod.build_connector_meta())  # reset after one step
    # Still held until the worker reports the send finished.
    assert prod.has_pending_work() and prod.num_blocks_held == 6
    prod.update_connector_output(KVConnectorOutput(finished_sending={"other"}))
    assert prod.num_blocks_held == 6
    prod.update_connector_output(KVConnectorOutput(finished_sending={"r1"}))
    assert prod.num_blocks_held == 0 and not prod.has_pending_work()
    # The same request id held again gets a new nonce (its notices can never apply to the old).
    _, again = prod.request_finished(r, ([6],))
    assert again is not None and again["remote_nonce"] != nonce


def test_producer_params_are_accepted_by_a_consumer_with_the_same_layout():
    prod = make("kv_producer", engine_id="prefill-0")
    cons = make("kv_consumer", engine_id="decode-0")
    _, params = prod.request_finished(
        req("r1", 9, {"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED),
        ([7, 8, 2],),
    )
    assert params is not None
    d = req("d1", 9, dict(params))
    cons.validate_request(d)
    cons.on_new_request(d)
    assert cons.get_num_new_matched_tokens(d, 0) == (9, True)
    d.num_computed_tokens = 0
    cons.update_state_after_alloc(d, blocks([0, 1, 2]), 9)
    (spec,) = cons.build_connector_meta().reqs_to_recv
    assert spec.remote == RemoteEngine("prefill-0", "10.1.2.3", 47001)
    assert spec.remote_request_id == "r1"
    assert spec.remote_block_ids == ([7, 8, 2],)
    assert spec.local_block_ids == ([0, 1, 2],)


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR,
                                    RequestStatus.FINISHED_IGNORED])
def test_producer_does_not_hold_blocks_of_requests_that_did_not_complete(status):
    prod = make("kv_producer")
    r = req("r", 10, {"do_remote_decode": True}, status)
    assert prod.request_finished(r, ([1, 2, 3],)) == (False, None)
    assert empty_meta(prod.build_connector_meta())
    assert prod.num_blocks_held == 0 and not prod.has_pending_work()


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": False}, {"foo": 1}])
def test_producer_ignores_requests_without_do_remote_decode(params):
    prod = make("kv_producer")
    r = req("r", 10, params, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert prod.request_finished(r, ([1, 2, 3],)) == (False, None)
    assert empty_meta(prod.build_connector_meta()) and not prod.has_pending_work()


def test_producer_without_blocks_or_without_producer_role_does_not_hold():
    prod = make("kv_producer")
    r = req("r", 10, {"do_remote_decode": True}, RequestStatus.FINISHED_STOPPED)
    assert prod.request_finished(r, ([],)) == (False, None)
    cons = make("kv_consumer")
    assert cons.request_finished(r, ([1, 2, 3],)) == (False, None)
    assert not prod.has_pending_work() and not cons.has_pending_work()


def test_kv_both_engine_is_producer_and_consumer():
    both = make("kv_both", engine_id="e")
    r = req("r", 5, {"do_remote_decode": True}, RequestStatus.FINISHED_STOPPED)
    delay, params = both.request_finished(r, ([1, 2],))
    assert delay and params is not None and params["remote_engine_id"] == "e"
    d = req("d", 10, remote_params())
    both.validate_request(d)
    assert both.get_num_new_matched_tokens(d, 0) == (10, True)


# --------------------------------------------------------------------------- consumer
def test_consumer_matched_tokens():
    cons = make("kv_consumer")
    r = req("r", 10, remote_params())
    assert cons.get_num_new_matched_tokens(r, 0) == (10, True)
    assert cons.get_num_new_matched_tokens(r, 4) == (6, True)
    assert cons.get_num_new_matched_tokens(r, 8) == (2, True)
    assert cons.get_num_new_matched_tokens(r, 0) == (10, True)  # side-effect free
    assert cons.get_num_new_matched_tokens(r, 10) == (0, False)
    for params in (None, {}, {"do_remote_decode": True}, remote_params(do_remote_prefill=False)):
        assert cons.get_num_new_matched_tokens(req("x", 10, params), 0) == (0, False)
    assert empty_meta(cons.build_connector_meta())


def test_update_state_after_alloc_with_local_prefix_hits_maps_remote_blocks_from_the_offset():
    cons = make("kv_consumer")
    params = remote_params(11, [[50, 51, 52]], remote_request_id="p-r")
    r = req("r", 11, params)
    cons.on_new_request(r)
    assert cons.has_pending_work()  # queued: its remote blocks need renewing
    # The scheduler found one block (4 tokens) locally and allocated two new blocks.
    num_hit = 4
    ext, is_async = cons.get_num_new_matched_tokens(r, num_hit)
    assert (ext, is_async) == (7, True)
    r.num_computed_tokens = num_hit
    cons.update_state_after_alloc(r, blocks([12, 13]), ext)
    assert params["do_remote_prefill"] is False  # one transfer per request
    assert cons.get_num_new_matched_tokens(r, num_hit) == (0, False)
    meta = cons.build_connector_meta()
    assert meta.reqs_to_recv == [
        RecvSpec("r", REMOTE, "p-r", ([12, 13],), ([51, 52],), LAYOUT, "nonce-11",
                 prompt_digest(r.prompt_token_ids, None), remote_first_block=1)
    ]
    assert meta.notifications == [] and meta.reqs_to_send == []
    assert empty_meta(cons.build_connector_meta())
    assert cons.has_pending_work()  # the pull is in flight


def test_update_state_after_alloc_two_groups_and_two_block_hit():
    cons = make("kv_consumer")
    params = remote_params(17, [[60, 61, 62, 63, 64], [70, 71, 72, 73, 74]])
    r = req("r", 17, params)
    r.num_computed_tokens = 8
    cons.update_state_after_alloc(r, blocks([1, 2, 3], [4, 5, 6]), 9)
    (spec,) = cons.build_connector_meta().reqs_to_recv
    assert spec.local_block_ids == ([1, 2, 3], [4, 5, 6])
    assert spec.remote_block_ids == ([62, 63, 64], [72, 73, 74])


def test_update_state_after_alloc_without_local_hits_pulls_every_block():
    cons = make("kv_consumer")
    r = req("r", 10, remote_params(10, [[50, 51, 52]]))
    cons.update_state_after_alloc(r, blocks([5, 9, 7]), 10)
    (spec,) = cons.build_connector_meta().reqs_to_recv
    assert spec.local_block_ids == ([5, 9, 7],) and spec.remote_block_ids == ([50, 51, 52],)


def test_zero_external_tokens_releases_the_producer_blocks():
    cons = make("kv_consumer")
    params = remote_params(8, [[50, 51]], remote_request_id="p-z")
    r = req("r", 8, params)
    cons.on_new_request(r)
    cons.update_state_after_alloc(r, blocks([3, 4]), 0)
    assert params["do_remote_prefill"] is False
    meta = cons.build_connector_meta()
    assert meta.reqs_to_recv == []
    assert meta.notifications == [NotifySpec(REMOTE, "p-z", "release", "nonce-8")]
    assert not cons.has_pending_work()
    # Finishing later asks for nothing more.
    r.status = RequestStatus.FINISHED_STOPPED
    assert cons.request_finished(r, ([3, 4],)) == (False, None)
    assert empty_meta(cons.build_connector_meta())


def test_update_state_after_alloc_ignores_local_requests():
    cons = make("kv_consumer")
    r = req("r", 10, None)
    cons.update_state_after_alloc(r, blocks([1, 2, 3]), 0)
    assert empty_meta(cons.build_connector_meta()) and not cons.has_pending_work()


def test_request_finished_during_the_pull_delays_the_free_until_finished_recving():
    cons = make("kv_consumer")
    r = req("r", 10, remote_params())
    cons.on_new_request(r)
    cons.update_state_after_alloc(r, blocks([1, 2, 3]), 10)
    cons.build_connector_meta()
    r.status = RequestStatus.FINISHED_ABORTED
    assert cons.request_finished(r, ([1, 2, 3],)) == (True, None)
    assert empty_meta(cons.build_connector_meta())  # no release: the pull notifies itself
    assert cons.has_pending_work()
    cons.update_connector_output(KVConnectorOutput(finished_recving={"r"}))
    assert not cons.has_pending_work()
    # Once the pull ended the request is an ordinary one again.
    assert cons.request_finished(r, ([1, 2, 3],)) == (False, None)
    assert empty_meta(cons.build_connector_meta())


def test_request_finished_before_pulling_releases_the_producer():
    cons = make("kv_consumer")
    r = req("r", 10, remote_params(remote_request_id="p-never"))
    cons.on_new_request(r)
    assert cons.has_pending_work()
    r.status = RequestStatus.FINISHED_ABORTED
    assert cons.request_finished(r, ([],)) == (False, None)
    meta = cons.build_connector_meta()
    assert meta.notifications == [NotifySpec(REMOTE, "p-never", "release", "nonce-10")]
    assert meta.reqs_to_recv == []
    assert not cons.has_pending_work()  # no more renewals for it


def test_finished_recving_of_one_request_does_not_end_another_pull():
    cons = make("kv_consumer")
    a, b = req("a", 10, remote_params()), req("b", 10, remote_params())
    cons.update_state_after_alloc(a, blocks([1, 2, 3]), 10)
    cons.update_state_after_alloc(b, blocks([4, 5, 6]), 10)
    assert [s.request_id for s in cons.build_connector_meta().reqs_to_recv] == ["a", "b"]
    cons.update_connector_output(KVConnectorOutput(finished_recving={"a"}))
    assert cons.request_finished(b, ([4, 5, 6],)) == (True, None)
    assert cons.request_finished(a, ([1, 2, 3],)) == (False, None)
    cons.update_connector_output(KVConnectorOutput(finished_recving={"b"}))
    assert not cons.has_pending_work()


# --------------------------------------------------------------------------- validation
def test_validate_accepts_good_params_and_requests_without_params():
    cons = make("kv_consumer")
    cons.validate_request(req("r", 10, remote_params()))
    cons.validate_request(req("r", 10, None))
    cons.validate_request(req("r", 10, {}))
    make("kv_producer").validate_request(req("r", 10, {"do_remote_decode": True}))


@pytest.mark.parametrize(("key", "theirs", "mine"), [
    ("head_size", 16, 8),
    ("dtype", "bfloat16", "float16"),
    ("num_kv_heads", 8, 2),
    ("model_digest", "sha-other", "sha-abc"),
])
def test_validate_rejects_a_layout_mismatch_naming_both_values(key, theirs, mine):
    cons = make("kv_consumer")
    layout = dict(LAYOUT, **{key: theirs})
    with pytest.raises(ValueError) as e:
        cons.validate_request(req("r", 10, remote_params(layout=layout)))
    msg = str(e.value)
    assert key in msg and repr(theirs) in msg and repr(mine) in msg
    assert f"producer={theirs!r}" in msg and f"consumer={mine!r}" in msg
    assert [k for k in LAYOUT_KEYS if f"{k}:" in msg] == [key]  # only the differing field


@pytest.mark.parametrize(("hit", "first_block", "remote", "local"), [
    (0, 0, [50, 51, 52, 53, 54], [12, 13, 14]),  # 18 tokens: P blocks of 4, D blocks of 8
    (8, 2, [52, 53, 54], [13, 14]),  # a local hit of one D block: from P block 2 on
])
def test_a_producer_with_another_block_size_is_re_blocked_by_token(hit, first_block, remote, local):
    cons = P2PConnectorScheduler(consumer_spec(),
                                 KVLayout.from_wire(dict(LAYOUT, block_size=8)),
                                 8, list(PRODUCER_ADDR))
    params = remote_params(18, [[50, 51, 52, 53, 54]], layout=dict(LAYOUT))  # P: block_size 4
    r = req("r", 18, params)
    cons.validate_request(r)  # block_size is converted: accepted
    r.num_computed_tokens = hit
    ext, _ = cons.get_num_new_matched_tokens(r, hit)
    cons.update_state_after_alloc(r, blocks([12, 13, 14][hit // 8 :]), ext)
    (spec,) = cons.build_connector_meta().reqs_to_recv
    assert (spec.remote_block_size, spec.first_token, spec.end_token) == (4, hit, 18)
    assert spec.remote_first_block == first_block
    assert spec.remote_block_ids == (remote,) and spec.local_block_ids == (local,)


def test_same_block_size_leaves_the_re_blocking_fields_unset():
    cons = make("kv_consumer")
    r = req("r", 10, remote_params())
    cons.update_state_after_alloc(r, blocks([1, 2, 3]), 10)
    (spec,) = cons.build_connector_meta().reqs_to_recv
    assert (spec.remote_block_size, spec.first_token, spec.end_token) == (0, 0, 0)


def test_re_blocking_into_dcp_or_several_groups_is_refused_naming_both_sizes():
    dcp = P2PConnectorScheduler(consumer_spec(),
                                KVLayout.from_wire(dict(LAYOUT, block_size=8, dcp_size=2,
                                                        tp_size=2)),
                                16, list(PRODUCER_ADDR))
    with pytest.raises(ValueError, match="block_size=8 .*dcp_size=2.*block_size=4"):
        dcp.validate_request(req("r", 10, remote_params()))
    groups = P2PConnectorScheduler(consumer_spec(),
                                   KVLayout.from_wire(dict(LAYOUT, block_size=8)),
                                   8, list(PRODUCER_ADDR), num_groups=2)
    with pytest.raises(ValueError, match="block_size=8 .*block_size=4.*one KV cache group"):
        groups.validate_request(
            req("r", 10, remote_params(remote_block_ids=[[1, 2, 3], [4, 5, 6]]))
        )


def test_validate_rejects_params_without_a_layout():
    cons = make("kv_consumer")
    p = remote_params()
    del p["layout"]
    with pytest.raises(ValueError, match="kv_transfer_params.layout must be an object"):
        cons.validate_request(req("r", 10, p))


@pytest.mark.parametrize("missing", REQUIRED_PARAMS)
def test_validate_rejects_missing_params_naming_them(missing):
    cons = make("kv_consumer")
    p = remote_params()
    del p[missing]
    with pytest.raises(ValueError, match=missing):
        cons.validate_request(req("r", 10, p))
    p[missing] = None
    with pytest.raises(ValueError, match=missing):
        cons.validate_request(req("r", 10, p))


def test_validate_rejects_a_token_count_mismatch_naming_both_values():
    cons = make("kv_consumer")
    with pytest.raises(ValueError) as e:
        cons.validate_request(req("r", 10, remote_params(n=12)))
    assert "12" in str(e.value) and "10" in str(e.value)


def test_validate_rejects_roles_that_cannot_honour_the_params():
    with pytest.raises(ValueError, match="do_remote_prefill.*kv_consumer"):
        make("kv_producer").validate_request(req("r", 10, remote_params()))
    with pytest.raises(ValueError, match="do_remote_decode.*kv_producer"):
        make("kv_consumer").validate_request(req("r", 10, {"do_remote_decode": True}))


@pytest.mark.parametrize(
    "over, match",
    [
        (
            {"layout": {**LAYOUT, "block_size": 8}, "block_size": 8},
            r"remote_block_ids\[0\] lists 3 blocks .* = 2 blocks",
        ),
        ({"remote_block_ids": [[50, 51]]}, r"remote_block_ids\[0\] lists 2 blocks .* = 3 blocks"),
        ({"remote_block_ids": [[50, -1, 52]]}, "non-negative integer block ids"),
        ({"remote_block_ids": [[50, True, 52]]}, "non-negative integer block ids"),
        ({"layout": {**LAYOUT, "block_size": 2.0}}, "layout.block_size must be a positive integer"),
        # a layout block size whose count happens to fit, but not the params' own block_size
        (
            {"layout": {**LAYOUT, "block_size": 5}},
            "kv_transfer_params.block_size=4 and layout.block_size=5 differ",
        ),
    ],
)
def test_validate_rejects_params_that_contradict_themselves(over, match):
    """10 tokens in blocks of 4 are 3 blocks: a layout claiming 8 (or a list of 2) does not fit."""
    assert LAYOUT["block_size"] == 4
    with pytest.raises(ValueError, match=match):
        make("kv_consumer").validate_request(req("r", 10, remote_params(**over)))

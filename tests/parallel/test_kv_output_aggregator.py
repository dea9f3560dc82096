"""The executor reports a request's KV load finished only once every rank has reported it."""

from __future__ import annotations

from pdkv.executor.aggregate import KVOutputAggregator
from pdkv.kv_transfer.connector.base import KVConnectorOutput as Out


def test_finished_only_when_every_rank_reported_across_steps():
    agg = KVOutputAggregator(2)
    step1 = agg.aggregate([Out(finished_recving={"a", "b"}), Out(finished_recving={"b"})])
    assert step1 is not None and step1.finished_recving == {"b"}
    step2 = agg.aggregate([Out(), Out(finished_recving={"a"}, finished_sending={"s"})])
    assert step2 is not None and step2.finished_recving == {"a"} and step2.finished_sending == set()
    step3 = agg.aggregate([Out(finished_sending={"s"}), Out()])
    assert step3 is not None and step3.finished_sending == {"s"}


def test_failures_of_any_rank_count_and_bytes_add_up():
    agg = KVOutputAggregator(2)
    out = agg.aggregate(
        [
            Out(
                invalid_block_ids={(0, 3)},
                load_errors={"a": "rank 0 broke"},
                request_bytes={"a": {"p2p": 10.0}},
                stats={"bytes": 10.0},
                transfer_seconds=[0.1],
            ),
            Out(
                invalid_block_ids={(0, 4)},
                request_bytes={"a": {"p2p": 5.0}},
                stats={"bytes": 5.0},
                transfer_seconds=[0.2],
            ),
        ]
    )
    assert out is not None
    assert out.invalid_block_ids == {(0, 3), (0, 4)} and out.load_errors == {"a": "rank 0 broke"}
    assert out.request_bytes == {"a": {"p2p": 15.0}} and out.stats == {"bytes": 15.0}
    assert out.transfer_seconds == [0.1, 0.2]
    assert agg.aggregate([None, None]) is None

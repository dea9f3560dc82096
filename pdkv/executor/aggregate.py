"""Merge the KV connector reports of every worker rank into the one the scheduler sees.

Each rank runs its own connector worker half (with DCP each pulls only its shard of a request's
blocks), so a request's load is finished only when every rank has reported it, possibly in
different steps (vLLM's KVOutputAggregator plays the same role). Failures of any rank count:
invalid blocks and errors are united; byte counters and samples are summed or concatenated.
"""

from __future__ import annotations

from collections import Counter

from pdkv.sched.output import KVConnectorOutput


class KVOutputAggregator:
    """Args:
        world_size: worker ranks that each report every request they touch.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._sending: Counter[str] = Counter()
        self._recving: Counter[str] = Counter()

    def _complete(self, counts: Counter[str], reports: list[set[str]]) -> set[str]:
        for ids in reports:
            counts.update(ids)
        done = {rid for rid, n in counts.items() if n >= self.world_size}
        for rid in done:
            del counts[rid]
        return done

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """One step's reports, one per rank (None = that rank has no connector) -> the merged
        report: finished_* only for requests every rank has now reported."""
        outs = [o for o in outputs if o is not None]
        if not outs:
            return None
        merged = KVConnectorOutput(
            finished_sending=self._complete(self._sending, [o.finished_sending for o in outs]),
            finished_recving=self._complete(self._recving, [o.finished_recving for o in outs]),
        )
        for o in outs:
            merged.invalid_block_ids |= o.invalid_block_ids
            for rid, err in o.load_errors.items():
                merged.load_errors.setdefault(rid, err)
            for rid, policy in o.load_failure_policies.items():
                merged.load_failure_policies.setdefault(rid, policy)
            for key, value in o.stats.items():
                merged.stats[key] = merged.stats.get(key, 0.0) + value
            merged.transfer_seconds.extend(o.transfer_seconds)
            for key, samples in o.observations.items():
                merged.observations.setdefault(key, []).extend(samples)
            for rid, by_path in o.request_bytes.items():
                into = merged.request_bytes.setdefault(rid, {})
                for path, nbytes in by_path.items():
                    into[path] = into.get(path, 0.0) + nbytes
        return merged

"""One side of `pdkv bench handoff`, as its own process: a prefill (P) or decode (D) engine with
the P2P connector, driven by JSON lines on stdin, answering JSON lines on stdout.

    python -m pdkv.bench.handoff.peer p --transfer tcp --host 127.0.0.1 --num-kv-blocks 520 ...
    python -m pdkv.bench.handoff.peer d --transfer tcp ...

Both print {"ready": true} once the engine is built. P reads {"prompt_token_ids": [...]} and
answers {"kv_transfer_params": {...}, "prefill_s": seconds} (the proxy's prefill leg: max_tokens=1,
do_remote_decode); between requests it keeps stepping its engine (leases, releases). D reads
{"prompt_token_ids": [...], "kv_transfer_params": {...}} and runs the decode leg with max_tokens=1;
it answers {"transfer_seconds": [...], "bytes": kv_bytes_received of this request,
"wall_s": add_request → finished, "num_cached_tokens": ...}. transfer_seconds is what the P2P
consumer reports per pull (KVConnectorOutput.transfer_seconds): from the pull thread taking the
pull (right after D's scheduler submits it) to the producer acknowledging the read, i.e. claim
round trip + data read + done round trip. Any failure answers {"error": "..."}. EOF on stdin
shuts the engine down.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypedDict

from pdkv.jsontypes import JSONObject

if TYPE_CHECKING:
    from pdkv.engine.llm_engine import LLMEngine
    from pdkv.outputs import RequestOutput

STEP_IDLE_S = 0.005
STEP_WAIT_S = 0.001
REQUEST_TIMEOUT_S = 900.0



class _Prompt(TypedDict):
    prompt_token_ids: list[int]


class HandoffRequest(_Prompt, total=False):
    """A line the driver sends: the prompt (P and D) and, for D, P's kv_transfer_params."""

    kv_transfer_params: JSONObject | None


class PrefillReply(TypedDict):
    """P's answer: the kv_transfer_params for D and the prefill leg's seconds."""

    kv_transfer_params: JSONObject | None
    prefill_s: float


class DecodeReply(TypedDict):
    """D's answer: the consumer's transfer seconds per pull, the bytes it received, the decode
    leg's wall seconds and the request's cached tokens."""

    transfer_seconds: list[float]
    bytes: float
    wall_s: float
    num_cached_tokens: int


def _config(role: str, args: argparse.Namespace) -> str:
    # Long leases and deadlines: a long prompt's prefill takes minutes on a CPU. (A kept data
    # connection the producer closed while idle is replaced by the tcp engine, so the server's
    # idle timeout stays at its default.)
    extra: dict[str, str | float] = {"transfer": args.transfer, "kv_lease_duration": 900.0,
                             "transfer_timeout": 300.0}
    if role == "kv_producer":
        extra.update(kv_host=args.host, kv_advertise_host=args.host)
    return json.dumps({"kv_connector": "P2PConnector", "kv_role": role,
                       "kv_load_failure_policy": "fail", "kv_connector_extra_config": extra})


def _reply(obj: Mapping[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _stdin_lines() -> queue.Queue[str | None]:
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            if line.strip():
                lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True, name="handoff-stdin").start()
    return lines


def _finish(eng: LLMEngine, request_id: str, deadline: float) -> RequestOutput:
    while time.monotonic() < deadline:
        outs = eng.step()
        for out in outs:
            if out.finished and out.request_id == request_id:
                return out
        if not outs:  # e.g. waiting for the pull: leave the CPU to the transfer threads
            time.sleep(STEP_WAIT_S)
    raise TimeoutError(f"request {request_id} did not finish in {REQUEST_TIMEOUT_S} s")


def _prefill(eng: LLMEngine, msg: HandoffRequest) -> PrefillReply:
    from pdkv import SamplingParams

    t0 = time.monotonic()
    req, text = eng.make_request({"prompt_token_ids": msg["prompt_token_ids"]},
                                 SamplingParams(temperature=0, max_tokens=1),
                                 kv_transfer_params={"do_remote_decode": True})
    eng.add_request(req, text)
    out = _finish(eng, req.request_id, t0 + REQUEST_TIMEOUT_S)
    return {"kv_transfer_params": out.kv_transfer_params, "prefill_s": time.monotonic() - t0}


def _decode(eng: LLMEngine, msg: HandoffRequest) -> DecodeReply | dict[str, str]:
    from pdkv import SamplingParams

    sched = eng.scheduler
    sched.stats()  # drain samples of earlier requests
    before = sched.kv_stats.get("kv_bytes_received", 0.0)
    t0 = time.monotonic()
    req, text = eng.make_request({"prompt_token_ids": msg["prompt_token_ids"]},
                                 SamplingParams(temperature=0, max_tokens=1),
                                 kv_transfer_params=msg.get("kv_transfer_params"))
    eng.add_request(req, text)
    out = _finish(eng, req.request_id, t0 + REQUEST_TIMEOUT_S)
    wall = time.monotonic() - t0
    got = sched.kv_stats.get("kv_bytes_received", 0.0) - before
    seconds = list(sched.stats().transfer_seconds or [])
    if not seconds or got <= 0:
        return {"error": f"no KV was pulled (bytes {got}, transfers {seconds}): see D's log"}
    return {"transfer_seconds": seconds, "bytes": got, "wall_s": wall,
            "num_cached_tokens": out.num_cached_tokens}


def serve(args: argparse.Namespace) -> int:
    """Build the engine, answer requests from stdin until EOF (see the module doc)."""
    from pdkv import LLM

    role = "kv_producer" if args.side == "p" else "kv_consumer"
    llm = LLM(args.model, num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
              enable_prefix_caching=args.side == "p", kv_transfer_config=_config(role, args))
    eng = llm.llm_engine
    lines = _stdin_lines()
    _reply({"ready": True})
    try:
        while True:
            try:
                line = lines.get(timeout=STEP_IDLE_S)
            except queue.Empty:
                if eng.has_work():
                    eng.step()
                continue
            if line is None:
                return 0
            try:
                msg: HandoffRequest = json.loads(line)
                _reply(_prefill(eng, msg) if args.side == "p" else _decode(eng, msg))
            except Exception as e:  # noqa: BLE001 - reported to the driver, which fails the run
                _reply({"error": f"{type(e).__name__}: {e}"})
    finally:
        eng.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("side", choices=("p", "d"))
    p.add_argument("--transfer", default="tcp", choices=("tcp", "shm", "mooncake"))
    p.add_argument("--host", default="127.0.0.1", help="P's kv_host and kv_advertise_host")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-kv-blocks", type=int, required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

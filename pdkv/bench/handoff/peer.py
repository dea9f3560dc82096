"""One side of `pdkv bench handoff`, as its own process: a prefill (P) or decode (D) engine with
the P2P connector, driven by JSON lines on stdin, answering JSON lines on stdout.

    python -m pdkv.bench.handoff.peer p --transfer tcp --host 127.0.0.1 --num-kv-blocks 520 ...
    python -m pdkv.bench.handoff.peer d --transfer tcp ...

Both print {"ready": true} once the engine is built. P reads {"prompt_token_ids": [...]} and
answers {"kv_transfer_params": {...}, "prefill_s": seconds} (the proxy's prefill leg: max_tokens=1,
do_remote_decode); between requests it keeps stepping its engine (leases, releases). D reads
{"prompt_token_ids": [...], "kv_transfer_params": {...}} and runs the decode leg with max_tokens=1;
it answers {"transfer_seconds": [...], "bytes": kv_bytes_received of this request,
"wall_s": add_request → finished, "num_cached_tokens": ..., "first_step_s": D's own compute}.
transfer_seconds is what the P2P consumer reports per pull (KVConnectorOutput.transfer_seconds):
from the pull thread taking the pull (right after D's scheduler submits it) to the producer
acknowledging the read, i.e. claim round trip + data read + done round trip. Any failure answers
{"error": "..."}. EOF on stdin shuts the engine down.

Push mode (`--transfer-mode push`, issue 29): D reads {"open": true, "prompt_token_ids": [...]}:
it adds the request with {"do_remote_prefill": true, "transfer_mode": "push"}, steps until the
scheduler opened its write window and answers {"request_id": ..., "push_grant": {...}}; it keeps
stepping between requests. P reads the prompt with "push_grant" and pushes each layer into D's
blocks during its prefill. D then reads {"finish": request_id} and answers as for a decode leg
once that request ended (transfer_seconds: its window's open → last layer landed).
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
    """A line the driver sends: the prompt (P and D) and, for D, P's kv_transfer_params; push
    mode: "open" (D), "push_grant" (P), "finish" (D: a request id)."""

    kv_transfer_params: JSONObject | None
    open: bool
    push_grant: JSONObject
    finish: str


class PrefillReply(TypedDict, total=False):
    """P's answer: the kv_transfer_params for D and the prefill leg's seconds; push mode: per
    layer write [layer, its forward ended, write started, write ended] in seconds from the
    leg's start."""

    kv_transfer_params: JSONObject | None
    prefill_s: float
    push_timeline: list[list[float]]


class DecodeReply(TypedDict):
    """D's answer: the consumer's transfer seconds per pull, the bytes it received, the decode
    leg's wall seconds and the request's cached tokens."""

    transfer_seconds: list[float]
    bytes: float
    wall_s: float
    num_cached_tokens: int
    first_step_s: float  # D's own compute of the request (its first step), KV wait excluded


def _config(role: str, args: argparse.Namespace) -> str:
    # Long leases and deadlines: a long prompt's prefill takes minutes on a CPU. (A kept data
    # connection the producer closed while idle is replaced by the tcp engine, so the server's
    # idle timeout stays at its default.)
    extra: dict[str, str | float] = {"transfer": args.transfer, "kv_lease_duration": 900.0,
                                     "transfer_timeout": 300.0,
                                     "transfer_mode": args.transfer_mode}
    if role == "kv_producer" or args.transfer_mode == "push":  # (D's push data server too)
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
    params: JSONObject = {"do_remote_decode": True}
    if msg.get("push_grant") is not None:
        params["push_grant"] = msg["push_grant"]
    req, text = eng.make_request({"prompt_token_ids": msg["prompt_token_ids"]},
                                 SamplingParams(temperature=0, max_tokens=1),
                                 kv_transfer_params=params)
    eng.add_request(req, text)
    out = _finish(eng, req.request_id, t0 + REQUEST_TIMEOUT_S)
    reply: PrefillReply = {"kv_transfer_params": out.kv_transfer_params,
                           "prefill_s": time.monotonic() - t0}
    connector = eng.runner.connector if eng.runner is not None else None
    sender = getattr(getattr(connector, "worker", None), "push_sender", None)
    if sender is not None and "push_grant" in params:  # per layer, seconds from the leg's start
        reply["push_timeline"] = [[layer, q - t0, a - t0, b - t0]
                                  for _, layer, q, a, b in sender.take_timeline()]
    return reply


class _Opened(TypedDict):
    request_id: str
    t0: float
    before: float
    done: RequestOutput | None  # its final output, when an idle step between messages ended it


def _open(eng: LLMEngine, msg: HandoffRequest, opened: dict[str, _Opened]) -> JSONObject:
    """Push mode: admit D's request and answer its write window (D first)."""
    from pdkv import SamplingParams

    sched = eng.scheduler
    sched.stats()  # drain samples of earlier requests
    before = sched.kv_stats.get("kv_bytes_received", 0.0)
    t0 = time.monotonic()
    req, text = eng.make_request({"prompt_token_ids": msg["prompt_token_ids"]},
                                 SamplingParams(temperature=0, max_tokens=1),
                                 kv_transfer_params={"do_remote_prefill": True,
                                                     "transfer_mode": "push"})
    eng.add_request(req, text)
    connector = sched.connector
    deadline = t0 + REQUEST_TIMEOUT_S
    while (grant := connector.push_grant(req.request_id)) is None:  # type: ignore[union-attr]
        if time.monotonic() > deadline:
            raise TimeoutError("no write window opened")
        eng.step()
    opened[req.request_id] = {"request_id": req.request_id, "t0": t0, "before": before,
                              "done": None}
    import msgspec

    return {"request_id": req.request_id, "push_grant": msgspec.to_builtins(grant)}


def _decode(eng: LLMEngine, msg: HandoffRequest,
            opened: dict[str, _Opened] | None = None) -> DecodeReply | dict[str, str]:
    from pdkv import SamplingParams

    sched = eng.scheduler
    rid = str(msg.get("finish") or "")
    if rid:  # push mode: the request `_open` added
        if opened is None or rid not in opened:
            return {"error": f"no opened request {rid!r}"}
        mine = opened.pop(rid)
        t0, before, done = mine["t0"], mine["before"], mine["done"]
    else:
        sched.stats()  # drain samples of earlier requests
        before = sched.kv_stats.get("kv_bytes_received", 0.0)
        t0 = time.monotonic()
        req, text = eng.make_request({"prompt_token_ids": msg["prompt_token_ids"]},
                                     SamplingParams(temperature=0, max_tokens=1),
                                     kv_transfer_params=msg.get("kv_transfer_params"))
        eng.add_request(req, text)
        rid = req.request_id
        done = None
    out = done if done is not None else _finish(eng, rid, t0 + REQUEST_TIMEOUT_S)
    wall = (out.metrics.finished_time if done is not None and out.metrics is not None
            and out.metrics.finished_time is not None else time.monotonic()) - t0
    got = sched.kv_stats.get("kv_bytes_received", 0.0) - before
    seconds = list(sched.stats().transfer_seconds or [])
    if not seconds or got <= 0:
        return {"error": f"no KV was pulled (bytes {got}, transfers {seconds}): see D's log"}
    first_step = out.metrics.prefill_time if out.metrics is not None else None
    first_at = out.metrics.first_token_time if out.metrics is not None else None
    return {"transfer_seconds": seconds, "bytes": got, "wall_s": wall,
            "num_cached_tokens": out.num_cached_tokens,
            "first_step_s": float(first_step or 0.0),
            "first_token_at": float(first_at if first_at is not None else time.monotonic())}


def serve(args: argparse.Namespace) -> int:
    """Build the engine, answer requests from stdin until EOF (see the module doc)."""
    from pdkv import LLM

    role = "kv_producer" if args.side == "p" else "kv_consumer"
    llm = LLM(args.model, num_kv_blocks=args.num_kv_blocks, max_model_len=args.max_model_len,
              enable_prefix_caching=args.side == "p", kv_transfer_config=_config(role, args),
              kv_cache_prefault=args.kv_cache_prefault)
    eng = llm.llm_engine
    lines = _stdin_lines()
    opened: dict[str, _Opened] = {}
    _reply({"ready": True})
    try:
        while True:
            try:
                line = lines.get(timeout=STEP_IDLE_S)
            except queue.Empty:
                if eng.has_work():
                    for out in eng.step():  # a pushed request may end before its "finish"
                        if out.finished and out.request_id in opened:
                            opened[out.request_id]["done"] = out
                continue
            if line is None:
                return 0
            try:
                msg: HandoffRequest = json.loads(line)
                if args.side == "p":
                    _reply(_prefill(eng, msg))
                elif msg.get("open"):
                    _reply(_open(eng, msg, opened))
                else:
                    _reply(_decode(eng, msg, opened))
            except Exception as e:  # noqa: BLE001 - reported to the driver, which fails the run
                _reply({"error": f"{type(e).__name__}: {e}"})
    finally:
        eng.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("side", choices=("p", "d"))
    p.add_argument("--transfer", default="tcp", choices=("tcp", "shm", "mooncake"))
    p.add_argument("--host", default="127.0.0.1",
                   help="kv_host and kv_advertise_host (P; D in push mode: its data server)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-kv-blocks", type=int, required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--transfer-mode", default="pull", choices=("pull", "push"))
    p.add_argument("--kv-cache-prefault", action="store_true",
                   help="write the whole KV cache at start (the engine flag of that name)")
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

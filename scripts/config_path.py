"""Follow an engine's configuration through the code that builds the engine (issue 25).

Builds an `LLMEngine` on a tiny test model (CPU, float32; `tiny-llama-kv2` unless --model says
otherwise) under `sys.settrace` and lists, in call order, every pdkv frame that holds the
engine's configuration.

Definitions (what the numbers printed mean):
- Config objects: the `EngineConfig` given to `LLMEngine` and every dataclass instance reachable
  from it through dataclass fields (model_config, cache_config, scheduler_config,
  parallel_config, kv_transfer_config when set). Identity counts, not equality: a copy made by
  `dataclasses.replace` is a new object and is not followed.
- A frame holds the configuration when one of its local variables (arguments included) IS one of
  the config objects, at the frame's call or at its return (so locals assigned in its body
  count). Only frames whose code lies in a file under pdkv/ count; frames are ordered by when
  they were called (pre-order of the call tree), in this process only: worker processes of a
  TP/DCP engine are not traced (they receive copies over a pipe, never the objects).
- The path: the files of those frames in call order, runs of the same file collapsed into one
  entry. "Files entered" is the number of distinct files on the path.
- A return: an entry of the path whose file already appeared earlier on the path (the path had
  left that file for another and came back). "Returns" counts them; a one-way path has none.

Usage (the repository root on PYTHONPATH):
    python scripts/config_path.py [--model tiny-llama-kv2] [--tp 1] [--dcp 1] [--frames]
        [--kv-transfer-config '{"kv_connector": "P2PConnector", "kv_role": "kv_producer"}']
Exits 0; prints the counts and the path (with --frames, every frame: file, function).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "pdkv") + os.sep


def config_objects(config: object) -> dict[int, str]:
    """The config object and every dataclass instance reachable through its fields, by id, with
    the attribute path that reaches it ("config", "config.cache_config", ...)."""
    found: dict[int, str] = {}

    def walk(obj: object, name: str) -> None:
        if id(obj) in found or not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            return
        found[id(obj)] = name
        for f in dataclasses.fields(obj):
            walk(getattr(obj, f.name), f"{name}.{f.name}")

    walk(config, "config")
    return found


class ConfigTracer:
    """A `sys.settrace` function recording the pdkv frames that hold one of `targets`.

    Attributes:
        frames: (call index, file relative to the repository, function, what it holds) per frame.
    """

    def __init__(self, targets: dict[int, str]) -> None:
        self.targets = targets
        self.frames: list[tuple[int, str, str, str]] = []
        self._calls = 0
        self._index: dict[int, int] = {}  # id(frame) -> call index, while the frame runs
        self._recorded: set[int] = set()  # id(frame) of frames recorded and still running
        self._lock = threading.Lock()

    def _holds(self, frame: FrameType) -> str | None:
        for name, value in frame.f_locals.items():
            hit = self.targets.get(id(value))
            if hit is not None:
                return f"{name} is {hit}"
        return None

    def _record(self, frame: FrameType, index: int, what: str) -> None:
        rel = os.path.relpath(frame.f_code.co_filename, ROOT)
        code = frame.f_code
        name = code.co_qualname if hasattr(code, "co_qualname") else code.co_name
        self.frames.append((index, rel, name, what))
        self._recorded.add(id(frame))

    def __call__(self, frame: FrameType, event: str, arg: object) -> Callable[..., Any] | None:
        if event != "call" or not frame.f_code.co_filename.startswith(PKG):
            return None
        with self._lock:
            key = id(frame)
            if key not in self._index:
                self._calls += 1
                self._index[key] = self._calls
            what = self._holds(frame) if key not in self._recorded else None
            if what is not None:
                self._record(frame, self._index[key], what)
        frame.f_trace_lines = False
        return self._local

    def _local(self, frame: FrameType, event: str, arg: object) -> Callable[..., Any] | None:
        if event == "return":
            with self._lock:
                key = id(frame)
                if key not in self._recorded:
                    what = self._holds(frame)
                    if what is not None:
                        self._record(frame, self._index[key], what)
                if not (frame.f_code.co_flags & 0x2A0):  # not a generator / coroutine: done
                    self._index.pop(key, None)
                    self._recorded.discard(key)
        return self._local


def path_of(frames: list[tuple[int, str, str, str]]) -> list[str]:
    """Files of the frames in call order, runs of one file collapsed."""
    path: list[str] = []
    for _, rel, _, _ in sorted(frames):
        if not path or path[-1] != rel:
            path.append(rel)
    return path


def returns(path: list[str]) -> int:
    """Entries of `path` whose file appeared earlier on it."""
    return sum(1 for i, rel in enumerate(path) if rel in path[:i])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama-kv2")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--dcp", type=int, default=1, help="decode_context_parallel_size")
    parser.add_argument("--kv-transfer-config", default=None,
                        help="vLLM's --kv-transfer-config JSON (e.g. a P2PConnector producer)")
    parser.add_argument("--frames", action="store_true", help="print every frame recorded")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from pdkv.engine.arg_utils import EngineArgs
    from pdkv.engine.llm_engine import LLMEngine

    config = EngineArgs(model=args.model, dtype="float32", device="cpu", max_model_len=256,
                        num_kv_blocks=64, tensor_parallel_size=args.tp,
                        decode_context_parallel_size=args.dcp,
                        kv_transfer_config=args.kv_transfer_config).create_engine_config()
    tracer = ConfigTracer(config_objects(config))
    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        engine = LLMEngine(config)
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
    engine.shutdown()

    path = path_of(tracer.frames)
    kvt = config.kv_transfer_config
    conn = f"{kvt.kv_connector} {kvt.kv_role}" if kvt else "no connector"
    print(f"model {args.model}, tp {args.tp}, dcp {args.dcp}, {conn}: {len(tracer.frames)} "
          "frames hold the config")
    print(f"files entered: {len(set(path))}")
    print(f"returns: {returns(path)}")
    print("path:")
    for rel in path:
        print(f"  {rel}")
    if args.frames:
        print("frames (call index, file, function, what it holds):")
        for index, rel, name, what in sorted(tracer.frames):
            print(f"  {index:6d} {rel} {name}: {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

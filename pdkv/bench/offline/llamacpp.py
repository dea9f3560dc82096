"""llama.cpp as a peer of `pdkv bench offline`, through llama-cpp-python's low-level C API.

The batch of B prompts runs as B llama.cpp sequences (seq_id 0..B-1) in one context whose KV cache
holds exactly them: n_ctx = B * (prompt_len + output_len), n_seq_max = B, n_batch = n_ubatch =
all prompt tokens of the batch. So the whole prefill is ONE `llama_decode` (the last prompt token of
each sequence asks for logits) and every later step is ONE `llama_decode` of B tokens; the next
token of each sequence is the argmax of its `llama_get_logits_ith` row (greedy, like pdkv's
temperature 0). The token ids are the caller's (no tokenizer, no BOS added), so all systems of the
benchmark see the same ids. K/V are cached in the model's dtype (F32, or BF16 for a BF16 GGUF)
rather than llama.cpp's default F16, like pdkv and HF. n_threads = n_threads_batch = the
benchmark's thread count.

Timing (the same formulas as `pdkv.bench.offline.cli`): `run(prompts, max_tokens)` returns the
seconds from the prefill's `llama_decode` to the last argmax and those to the first tokens'
argmaxes, so prefill tok/s = B * prompt_len / t(1) and decode tok/s = B * (output_len - 1) /
(t(output_len) - t(first tokens)) inside one run (pdkv.bench.offline.measure). Creating a
context (when the batch shape changes) and clearing its KV cache are outside the timed part.

The GGUF comes from `make llama-cpp` (`pdkv.bench.offline.llamacpp_gguf`); `unavailable_reason`
says why the peer cannot run (binding not installed, GGUF missing, no GGUF for the dtype).
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import os
import time
from typing import Any

import numpy as np

from pdkv.bench.offline.llamacpp_gguf import GGUF_OUTTYPES, MAKE_TARGET, gguf_path

# ggml.h `enum ggml_type` values for the KV cache (the binding names F32/F16 but not BF16).
_GGML_KV_TYPES = {"float32": 0, "bfloat16": 30}


def unavailable_reason(
    model: str, dtype: str, cache: str | None = None, module_available: bool | None = None
) -> str | None:
    """Why the llama.cpp peer cannot run for `model` in `dtype`, or None when it can.

    Args:
        model: pdkv model alias or folder (names the GGUF, see `gguf_path`).
        dtype: benchmark dtype; llama.cpp runs float32 and bfloat16 GGUFs.
        cache: base cache folder (None: $PDKV_CACHE or ~/.cache/pdkv).
        module_available: whether `import llama_cpp` works (None: look it up).

    Returns:
        A one-line message naming the fix (`make llama-cpp`), or None.
    """
    if dtype not in GGUF_OUTTYPES:
        return (f"llama.cpp skipped: no GGUF for --dtype {dtype} "
                f"(`{MAKE_TARGET}` converts {', '.join(sorted(GGUF_OUTTYPES))})")
    if module_available is None:
        module_available = importlib.util.find_spec("llama_cpp") is not None
    if not module_available:
        return (f"llama.cpp skipped: the llama_cpp module (llama-cpp-python) is not installed; "
                f"`{MAKE_TARGET}` builds it from its sdist (many minutes on 2 cores) and converts "
                "the GGUF")
    path = gguf_path(model, dtype, cache)
    if not os.path.isfile(path):
        return f"llama.cpp skipped: GGUF {path} is missing; `{MAKE_TARGET}` converts it"
    return None


class LlamaCppPeer:
    """One llama.cpp model, run on batches of token-id prompts with greedy decoding.

    Args:
        gguf: path of the GGUF file.
        dtype: "float32" | "bfloat16": the KV cache type.
        n_threads: CPU threads for prefill and decode.
        output_len: most tokens a `run` generates per sequence (sizes the KV cache).

    Raises:
        RuntimeError: the model or a context could not be created, or a decode failed.
    """

    def __init__(self, gguf: str, dtype: str, n_threads: int, output_len: int) -> None:
        import llama_cpp

        self._ll: Any = llama_cpp
        self._kv_type = _GGML_KV_TYPES[dtype]
        self._n_threads = int(n_threads)
        self._output_len = int(output_len)
        ll = self._ll
        ll.llama_backend_init()
        # Silence llama.cpp's per-context log lines (the callback must outlive the model).
        self._log_cb = ll.llama_log_callback(lambda level, text, user: None)
        ll.llama_log_set(self._log_cb, ctypes.c_void_p())
        self._model = ll.llama_model_load_from_file(gguf.encode(), ll.llama_model_default_params())
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self._n_vocab = int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self._model)))
        self._ctx: Any = None
        self._batch: Any = None
        self._shape: tuple[int, int, int] | None = None

    def _prepare(self, n_seqs: int, seq_len: int, n_tokens: int) -> None:
        """A context for n_seqs sequences of at most seq_len tokens and a batch of n_tokens."""
        ll = self._ll
        if self._shape != (n_seqs, seq_len, n_tokens):
            self._free_context()
            p = ll.llama_context_default_params()
            p.n_ctx = n_seqs * seq_len
            p.n_seq_max = n_seqs
            p.n_batch = p.n_ubatch = max(n_tokens, n_seqs)
            p.n_threads = p.n_threads_batch = self._n_threads
            p.type_k = p.type_v = self._kv_type
            p.no_perf = True
            ctx = ll.llama_init_from_model(self._model, p)
            if not ctx:
                raise RuntimeError(f"llama.cpp context failed: n_ctx={p.n_ctx} n_seq_max={n_seqs} "
                                   f"n_batch={p.n_batch}")
            self._ctx = ctx
            self._batch = ll.llama_batch_init(max(n_tokens, n_seqs), 0, 1)
            self._shape = (n_seqs, seq_len, n_tokens)
        ll.llama_memory_clear(ll.llama_get_memory(self._ctx), True)

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[int],
                outputs: list[bool]) -> None:
        b = self._batch
        n = len(tokens)
        b.n_tokens = n
        np.ctypeslib.as_array(b.token, shape=(n,))[:] = tokens
        np.ctypeslib.as_array(b.pos, shape=(n,))[:] = positions
        np.ctypeslib.as_array(b.n_seq_id, shape=(n,))[:] = 1
        np.ctypeslib.as_array(b.logits, shape=(n,))[:] = outputs
        seq_id = b.seq_id
        for i, s in enumerate(seqs):
            seq_id[i][0] = s
        rc = self._ll.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for {n} tokens")

    def _argmax(self, i: int) -> int:
        row = self._ll.llama_get_logits_ith(self._ctx, i)
        return int(np.ctypeslib.as_array(row, shape=(self._n_vocab,)).argmax())

    def run(
        self, prompts: list[list[int]], max_tokens: int
    ) -> tuple[float, list[list[int]], float]:
        """Seconds to prefill `prompts` and generate `max_tokens` greedy tokens for each, each
        prompt's generated token ids, and the seconds until the first tokens (the prefill
        `llama_decode` and its argmaxes); a `pdkv.bench.offline.measure.Timed`.

        Raises:
            ValueError: max_tokens outside 1..output_len, or an empty prompt.
            RuntimeError: a `llama_decode` failed.
        """
        if not 1 <= max_tokens <= self._output_len:
            raise ValueError(f"max_tokens must be in 1..{self._output_len}, got {max_tokens}")
        if not prompts or min(len(p) for p in prompts) < 1:
            raise ValueError("prompts must be non-empty token-id lists")
        n_seqs = len(prompts)
        lens = [len(p) for p in prompts]
        self._prepare(n_seqs, max(lens) + self._output_len, sum(lens))
        tokens = [t for p in prompts for t in p]
        positions = [j for n in lens for j in range(n)]
        seqs = [s for s, n in enumerate(lens) for _ in range(n)]
        last = np.cumsum(lens) - 1
        outputs = [False] * len(tokens)
        for i in last:
            outputs[int(i)] = True
        seq_ids = list(range(n_seqs))
        out: list[list[int]] = [[] for _ in prompts]
        gc.collect()
        t0 = time.perf_counter()
        self._decode(tokens, positions, seqs, outputs)
        for s, i in enumerate(last):
            out[s].append(self._argmax(int(i)))
        first = time.perf_counter() - t0
        for step in range(1, max_tokens):
            self._decode([o[-1] for o in out], [n + step - 1 for n in lens], seq_ids,
                         [True] * n_seqs)
            for s in seq_ids:
                out[s].append(self._argmax(s))
        dt = time.perf_counter() - t0
        return dt, out, first

    def _free_context(self) -> None:
        if self._batch is not None:
            self._ll.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            self._ll.llama_free(self._ctx)
            self._ctx = None
        self._shape = None

    def close(self) -> None:
        """Free the context, batch and model (idempotent)."""
        self._free_context()
        if self._model is not None:
            self._ll.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> LlamaCppPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_peer(model: str, dtype: str, n_threads: int, output_len: int) -> LlamaCppPeer:
    """The peer for `model`'s GGUF in `dtype` (check `unavailable_reason` first).

    Raises:
        RuntimeError: llama.cpp could not load the GGUF.
    """
    return LlamaCppPeer(gguf_path(model, dtype), dtype, n_threads, output_len)


def binding_version() -> str | None:
    """llama-cpp-python's version, or None when it is not installed."""
    try:
        from importlib.metadata import version

        return version("llama_cpp_python")
    except Exception:  # PackageNotFoundError
        return None

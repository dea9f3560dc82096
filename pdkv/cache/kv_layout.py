"""What an engine's KV cache looks like to a peer (torch-free): `KVLayout`, built once by the
model runner and handed to both connector halves, and the linear-attention state geometry it may
carry (`StateGeometry`).

On the wire (P2P handshakes, kv_transfer_params "layout", `GET /kv_layout`, the executor's
WorkerReady) a layout is a JSON object with vLLM-style field names; `KVLayout.to_wire` /
`KVLayout.from_wire` convert at that edge. A field that is None here is absent on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from pdkv.jsontypes import JSONObject, as_int

LAYOUT_KEY = "linear_state"
"""Key of the state geometry in an engine's layout (wire form)."""


@dataclass(frozen=True)
class StateGeometry:
    """The whole model's (all ranks') linear-attention state slot geometry (Gated DeltaNet).

    Attributes:
        group: index of the linear-state group among the KV cache groups.
        num_layers: linear layers (pages per slot).
        conv_segments: channels of each conv segment (q, k, v), every rank's together.
        conv_row_bytes: bytes of one channel's window: (K - 1) × model dtype bytes.
        rec_heads: value heads of the recurrent state, every rank's together.
        rec_head_bytes: bytes of one head's recurrent state: dk × dv × 4.
    """

    group: int
    num_layers: int
    conv_segments: tuple[int, ...]
    conv_row_bytes: int
    rec_heads: int
    rec_head_bytes: int

    @staticmethod
    def from_layout(layout: Mapping[str, object]) -> StateGeometry | None:
        """The geometry a layout (wire form) carries under LAYOUT_KEY, or None.

        Raises:
            ValueError: a malformed entry.
        """
        d = layout.get(LAYOUT_KEY)
        if d is None:
            return None
        try:
            if not isinstance(d, Mapping) or not isinstance(d["conv_segments"], list | tuple):
                raise TypeError("not an object with a list of conv_segments")
            return StateGeometry(as_int(d["group"]), as_int(d["num_layers"]),
                                 tuple(as_int(s) for s in d["conv_segments"]),
                                 as_int(d["conv_row_bytes"]), as_int(d["rec_heads"]),
                                 as_int(d["rec_head_bytes"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed {LAYOUT_KEY} layout entry {d!r:.120}: {e!r}") from None

    def to_layout(self) -> JSONObject:
        """The layout entry (wire form: plain ints and lists)."""
        return {"group": self.group, "num_layers": self.num_layers,
                "conv_segments": list(self.conv_segments), "conv_row_bytes": self.conv_row_bytes,
                "rec_heads": self.rec_heads, "rec_head_bytes": self.rec_head_bytes}

    def conv_bytes(self, tp: int) -> int:
        """Bytes of one layer's conv window on one of `tp` ranks."""
        return sum(self.conv_segments) // tp * self.conv_row_bytes

    def page_bytes(self, tp: int) -> int:
        """Bytes of one layer's state on one of `tp` ranks."""
        return self.conv_bytes(tp) + self.rec_heads // tp * self.rec_head_bytes

    def slot_bytes(self, tp: int) -> int:
        """Bytes of one slot (every linear layer) on one of `tp` ranks."""
        return self.num_layers * self.page_bytes(tp)


@dataclass(frozen=True)
class KVLayout:
    """This engine's KV cache as a peer must know it (P/D identity, re-blocking, re-sharding,
    the KV pool's namespace).

    Attributes:
        model_digest: digest of the model's weights and config (pdkv.model.registry).
        dtype: the model dtype ("float32", "bfloat16", ...).
        block_size: tokens per KV block (per rank under DCP).
        num_layers: the model's layers.
        num_kv_heads: the model's KV heads (all ranks together).
        head_size: elements per head.
        kv_layout: the page layout's name ("cross_layer", MLA's "blocks_layers_tokens_latent").
        kv_cache_dtype: "auto" (the model dtype) or a quantized dtype ("int8", "fp8_e4m3");
            None: not stated (a layout from before quantized KV), read as "auto".
        linear_state: the linear-attention state geometry (Gated DeltaNet), or None.
        kv_quant: the pool namespace's quantization ("int8:per_token_head_absmax"); None: not
            quantized.
        tp_size, dcp_size, interleave, dcp_replicated, num_local_kv_heads: the engine's
            tensor / decode-context parallelism (pdkv.parallel.layout) and KV heads per rank;
            None when not stated (an engine of one rank states none of them).
    """

    model_digest: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    kv_layout: str
    kv_cache_dtype: str | None = None
    linear_state: StateGeometry | None = None
    kv_quant: str | None = None
    tp_size: int | None = None
    dcp_size: int | None = None
    interleave: int | None = None
    dcp_replicated: bool | None = None
    num_local_kv_heads: int | None = None

    @property
    def cache_dtype(self) -> str:
        """kv_cache_dtype, "auto" when not stated."""
        return self.kv_cache_dtype if self.kv_cache_dtype is not None else "auto"

    @property
    def tp(self) -> int:
        """Tensor-parallel size (1 when not stated)."""
        return self.tp_size if self.tp_size is not None else 1

    @property
    def dcp(self) -> int:
        """Decode-context-parallel size (1 when not stated)."""
        return self.dcp_size if self.dcp_size is not None else 1

    @property
    def world_size(self) -> int:
        """Worker ranks, each storing its share of every block: tp, × dcp in replicated mode
        (pdkv.parallel.layout; 1 when not stated)."""
        return self.tp * (self.dcp if self.dcp_replicated else 1)

    @property
    def local_kv_heads(self) -> int:
        """KV heads one rank stores (num_kv_heads when not stated)."""
        return self.num_local_kv_heads if self.num_local_kv_heads is not None else self.num_kv_heads

    def to_wire(self) -> JSONObject:
        """The wire form: every stated field by name (None fields left out), the state geometry
        as a nested object. `KVLayout.from_wire(x.to_wire()) == x`."""
        out: JSONObject = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            out[f.name] = value.to_layout() if isinstance(value, StateGeometry) else value
        return out

    @staticmethod
    def from_wire(d: Mapping[str, object]) -> KVLayout:
        """Parse and check a wire form (`to_wire`'s).

        Raises:
            ValueError: an unknown or missing field, a field of the wrong type, a block size
                below 1, a negative count or a malformed state geometry (the message names it).
        """
        unknown = sorted(set(d) - {f.name for f in fields(KVLayout)})
        if unknown:
            raise ValueError(f"unknown KV layout fields {unknown}")
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"KV layout lacks {missing}")
        return KVLayout(
            model_digest=_str(d, "model_digest"), dtype=_str(d, "dtype"),
            block_size=_count(d, "block_size", 1), num_layers=_count(d, "num_layers"),
            num_kv_heads=_count(d, "num_kv_heads"), head_size=_count(d, "head_size"),
            kv_layout=_str(d, "kv_layout"),
            kv_cache_dtype=_opt_str(d, "kv_cache_dtype"),
            linear_state=StateGeometry.from_layout(d),
            kv_quant=_opt_str(d, "kv_quant"),
            tp_size=_opt_count(d, "tp_size", 1), dcp_size=_opt_count(d, "dcp_size", 1),
            interleave=_opt_count(d, "interleave", 1),
            dcp_replicated=_opt_bool(d, "dcp_replicated"),
            num_local_kv_heads=_opt_count(d, "num_local_kv_heads"),
        )


_REQUIRED = ("model_digest", "dtype", "block_size", "num_layers", "num_kv_heads", "head_size",
             "kv_layout")


def _str(d: Mapping[str, object], key: str) -> str:
    value = d[key]
    if not isinstance(value, str):
        raise ValueError(f"KV layout {key} must be a string, got {value!r:.40}")
    return value


def _opt_str(d: Mapping[str, object], key: str) -> str | None:
    return _str(d, key) if d.get(key) is not None else None


def _count(d: Mapping[str, object], key: str, minimum: int = 0) -> int:
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"KV layout {key} must be an integer >= {minimum}, got {value!r:.40}")
    return value


def _opt_count(d: Mapping[str, object], key: str, minimum: int = 0) -> int | None:
    return _count(d, key, minimum) if d.get(key) is not None else None


def _opt_bool(d: Mapping[str, object], key: str) -> bool | None:
    value = d.get(key)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"KV layout {key} must be true or false, got {value!r:.40}")
    return value


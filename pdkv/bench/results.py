"""Writing benchmark results as strict JSON (shared by every `pdkv bench` command)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping


def jsonable(value: object) -> object:
    """inf/nan floats -> strings, so the file stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_result_json(result: Mapping[str, object], path: str) -> None:
    """Write `result` to `path` as strict JSON (inf as the string "inf")."""
    with open(path, "w") as f:
        json.dump(jsonable(result), f, indent=2)
        f.write("\n")


def parse_ints(text: str) -> list[int]:
    """Comma-separated integers of a benchmark flag ("1024,4096" -> [1024, 4096]; blanks skipped).

    Raises:
        ValueError: an item is not an integer.
    """
    return [int(x) for x in text.split(",") if x.strip()]

"""Types for JSON data: HTTP bodies, kv_transfer_params, benchmark reports.

A value decoded by `json.loads` / `msgspec.json.decode` (RFC 8259: object, array, string, number,
true/false, null) is a `JSONValue`; an object is a `JSONObject`. Use them where the data really is
JSON that crosses a process or file boundary; give typed structures (dataclasses, msgspec Structs)
to anything pdkv itself builds and reads field by field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    JSONValue: TypeAlias = (
        "None | bool | int | float | str | list[JSONValue] | dict[str, JSONValue]")
    JSONObject: TypeAlias = "dict[str, JSONValue]"
else:
    # At run time the names are plain types that msgspec and pydantic can resolve (they cannot
    # follow the recursive alias): a field typed JSONValue decodes any JSON value, JSONObject any
    # object, as the checked alias says.
    JSONValue = object
    JSONObject = dict[str, object]


def as_int(value: object) -> int:
    """`int(value)` of a JSON number or numeric string (a boolean is an int, as for int()).

    Raises:
        TypeError: null, an array or an object.
        ValueError: a string that is not an integer.
    """
    if isinstance(value, int | float | str):
        return int(value)
    raise TypeError(f"int() argument must be a string or a number, not {type(value).__name__!r}")


def as_object(value: object, what: str) -> JSONObject:
    """`value` as a JSON object.

    Raises:
        TypeError: `value` is not a dict (the message names `what`).
    """
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value

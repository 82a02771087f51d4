"""The checks a segment's JSON object passes before it is read: its keys and their types.

A segment has two JSON forms, the batch form (`PayloadSegment.from_json`) and the form
servers send (``orchestrator.wire.segments``); they differ in their keys, never in how
keys and types are checked, which is done here for both.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from ._errors import BadSegment


def is_json_int(value: object) -> bool:
    """Whether a parsed JSON value is an integer (booleans are not)."""
    # JSON booleans parse as Python bools, which are ints: never accept them as numbers.
    return isinstance(value, int) and not isinstance(value, bool)


def segment_object(
    obj: object, *, required: Collection[str], optional: Collection[str]
) -> tuple[dict[str, Any], str]:
    """`obj` as a segment's JSON object, and the file name to show in its errors.

    The object must have every `required` key and no key outside `required` and
    `optional`: a key from a newer writer might change what the bytes mean, so a segment
    that has one is never half-read. The file shown is the ``file`` value when it is a
    string, else ``""``.

    Raises `BadSegment` with reason ``malformed``.
    """
    if not isinstance(obj, dict):
        raise BadSegment("malformed", "", f"expected a JSON object, got {type(obj).__name__}")
    file = obj.get("file")
    shown = file if isinstance(file, str) else ""
    missing = [key for key in required if key not in obj]
    if missing:
        raise BadSegment("malformed", shown, f"missing key(s) {', '.join(missing)}")
    unknown = sorted(str(key) for key in obj if key not in required and key not in optional)
    if unknown:
        raise BadSegment("malformed", shown, f"unknown key(s) {', '.join(unknown)}")
    return obj, shown


def check_json_types(
    obj: dict[str, Any],
    shown: str,
    *,
    strings: Iterable[str] = (),
    ints: Iterable[str] = (),
    nullable: Collection[str] = (),
) -> None:
    """Check that each key of `strings` holds a string and each of `ints` an integer.

    A key of `nullable` may also be absent or ``null``. Raises `BadSegment` with reason
    ``malformed`` naming the first key that fails, and `shown` as its file.
    """
    for key in strings:
        value = obj.get(key)
        if not isinstance(value, str) and not (value is None and key in nullable):
            raise BadSegment("malformed", shown, f"{key} must be a string")
    for key in ints:
        value = obj.get(key)
        if not is_json_int(value) and not (value is None and key in nullable):
            raise BadSegment("malformed", shown, f"{key} must be an integer")

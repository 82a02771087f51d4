"""Writing TOML: the few value types a config holds, spelled so that `tomllib` reads them back.

The standard library reads TOML but does not write it, and a config needs only scalars,
paths and flat arrays, so a small writer beats a dependency.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from pathlib import PurePath

# TOML's short escapes; every other control character is written as \uXXXX.
_SHORT_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def format_toml_value(value: object) -> str:
    """`value` as a TOML value: bool, int, float, str, path, date/time, or a list of those.

    Raises TypeError for anything else (a table, None: TOML has no null).
    """
    # bool before int: True is an int in Python, but `true` in TOML.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _format_float(value)
    if isinstance(value, str):
        return quote_toml_string(value)
    if isinstance(value, PurePath):
        return quote_toml_string(str(value))
    if isinstance(value, datetime.date | datetime.time):
        # isoformat is TOML's date/time syntax (RFC 3339).
        return value.isoformat()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(format_toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as a TOML value")


def format_toml_table(name: str, values: Mapping[str, object]) -> str:
    """A `[name]` table (or the top level when `name` is empty) of `key = value` lines."""
    lines = [f"[{name}]"] if name else []
    lines.extend(f"{key} = {format_toml_value(value)}" for key, value in values.items())
    return "\n".join(lines) + "\n"


def quote_toml_string(text: str) -> str:
    """`text` as a TOML basic string (double quotes, escapes where TOML requires them)."""
    out = ['"']
    for char in text:
        if char in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def _format_float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    # repr is the shortest text that reads back to the same float; it is valid TOML
    # ("0.5", "1e-05", "600.0") except that a whole number needs its ".0", which repr keeps.
    return repr(value)

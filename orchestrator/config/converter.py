"""A cattrs converter that builds config objects from TOML dicts without guessing.

cattrs' defaults are lenient in ways a config must not be: `int("64")` turns a quoted
string into a number, `True` passes as an int, and a string is a fine iterable of
characters for a list field. These hooks accept exactly the TOML types each field
declares (an integer also passes where a float is expected, as TOML users write
`timeout = 600`) and raise InvalidValue naming what was found instead.
"""

from __future__ import annotations

import difflib
import math
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import attrs
import cattrs
from cattrs.errors import BaseValidationError, IterableValidationError, IterableValidationNote
from cattrs.gen import make_dict_structure_fn

from orchestrator.config.errors import InvalidValue, format_toml_value

Hook = Callable[[Any, Any], Any]


def make_config_converter() -> cattrs.Converter:
    """A converter with strict hooks for every type a config section may declare."""
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook(Path, _structure_path)
    converter.register_structure_hook_factory(_is_literal, _literal_hook)
    converter.register_structure_hook_factory(
        _is_homogeneous_tuple, lambda cls: _tuple_hook(cls, converter)
    )
    converter.register_structure_hook_factory(attrs.has, lambda cls: _table_hook(cls, converter))
    return converter


def describe_type(value: object) -> str:
    """'a string', 'an integer'...: what a TOML value is, for error messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    # tomllib also produces dates and times, which no config key takes.
    return f"a {type(value).__name__}"


def _wrong_type(expected: str, value: object) -> InvalidValue:
    return InvalidValue(f"must be {expected}, not {describe_type(value)}", value=value)


def _structure_int(value: object, _: type) -> int:
    # `type(...) is int` because bool is a subclass of int.
    if type(value) is not int:
        raise _wrong_type("an integer", value)
    return value


def _structure_float(value: object, _: type) -> float:
    if type(value) not in (int, float):
        raise _wrong_type("a number", value)
    number = float(typing.cast(float, value))
    if not math.isfinite(number):
        raise InvalidValue("must be a finite number", value=value)
    return number


def _structure_bool(value: object, _: type) -> bool:
    if not isinstance(value, bool):
        raise _wrong_type("true or false", value)
    return value


def _structure_str(value: object, _: type) -> str:
    if not isinstance(value, str):
        raise _wrong_type("a string", value)
    return value


def _structure_path(value: object, _: type) -> Path:
    if not isinstance(value, str):
        raise _wrong_type("a path string", value)
    if not value.strip():
        raise InvalidValue("must be a path, not an empty string", value=value)
    # Paths are made absolute by the fields' converters, which also serve Python callers.
    return Path(value)


def _is_literal(cls: Any) -> bool:
    return typing.get_origin(cls) is Literal


def _literal_hook(cls: Any) -> Hook:
    choices = typing.get_args(cls)
    spelled = ", ".join(format_toml_value(str(choice)) for choice in choices)

    def structure_literal(value: object, _: type) -> object:
        if not isinstance(value, str):
            raise _wrong_type(f"one of {spelled}", value)
        if value not in choices:
            close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
            hint = f" (did you mean {format_toml_value(close[0])}?)" if close else ""
            raise InvalidValue(f"must be one of {spelled}{hint}", value=value)
        return value

    return structure_literal


def _is_homogeneous_tuple(cls: Any) -> bool:
    args = typing.get_args(cls)
    return typing.get_origin(cls) is tuple and len(args) == 2 and args[1] is Ellipsis


def _tuple_hook(cls: Any, converter: cattrs.Converter) -> Hook:
    item_type = typing.get_args(cls)[0]
    structure_item = converter.get_structure_hook(item_type)

    def structure_tuple(value: object, _: type) -> tuple[Any, ...]:
        # Not any iterable: a string would otherwise become a tuple of characters.
        if not isinstance(value, list | tuple):
            raise _wrong_type("an array", value)
        items = []
        for index, item in enumerate(value):
            try:
                items.append(structure_item(item, item_type))
            except InvalidValue as exc:
                raise exc.under(f"[{index}]") from None
            except BaseValidationError as exc:
                # A table of an array of tables (`[[env]]`): its problems keep their index.
                exc.add_note(IterableValidationNote(f"@ index {index}", index, item_type))
                raise IterableValidationError(f"in {describe_type(value)}", [exc], cls) from None
        return tuple(items)

    return structure_tuple


def _table_hook(cls: Any, converter: cattrs.Converter) -> Hook:
    structure_fields = make_dict_structure_fn(cls, converter)

    def structure_table(value: object, _: type) -> Any:
        if not isinstance(value, dict):
            raise _wrong_type("a table of keys", value)
        return structure_fields(value, cls)

    return structure_table

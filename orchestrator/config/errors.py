"""Config errors: the exceptions, and turning cattrs' exception groups into one line.

cattrs collects every problem it meets into nested exception groups whose notes say which
attribute (or list index) each came from. A person fixing a file wants one precise line,
so `first_problem` walks the groups, rebuilds the dotted key of each leaf and picks the most
useful one: a misspelt key first (it often explains the errors that follow), then the rest
in the order the fields are declared. Values in messages are spelled as TOML
(`format_toml_value`), the way the user writes them.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import PurePath
from typing import Any

import attrs
import tomli_w
from cattrs.errors import (
    AttributeValidationNote,
    ForbiddenExtraKeysError,
    IterableValidationNote,
)

from orchestrator.errors import UserError

_NO_VALUE: Any = object()


class ConfigError(UserError):
    """A config file, a `--set` override or a config value is wrong (one line, names the key)."""


class InvalidValue(ConfigError, ValueError):
    """A key holds a value it cannot take; raised by structure hooks and validators.

    `key` is relative to the class being built ("" when cattrs' notes already name it, a
    field name in a validator, "[2]" for a list item). `reason` completes the sentence
    "<key> = <value> ...". When `siblings` is given, `reason` holds `{0}`, `{1}`...
    placeholders that are filled with the siblings' dotted keys, so a section's rule can
    name a neighbouring key without knowing which section it sits in.
    """

    def __init__(
        self,
        reason: str,
        *,
        value: object = _NO_VALUE,
        key: str = "",
        siblings: Sequence[str] = (),
    ) -> None:
        self.reason = reason
        self.value = value
        self.key = key
        self.siblings = tuple(siblings)
        super().__init__(self.describe(key))

    def describe(self, dotted_key: str) -> str:
        """The one-line message, with this error's key spelled as `dotted_key`."""
        reason = self.reason
        if self.siblings:
            section = dotted_key.rpartition(".")[0]
            reason = reason.format(*(_join(section, sibling) for sibling in self.siblings))
        if self.value is _NO_VALUE:
            return f"{dotted_key} {reason}"
        return f"{dotted_key} = {_show(self.value)} {reason}"

    def under(self, part: str) -> InvalidValue:
        """The same error, one level deeper: at `part` (a field name or "[index]")."""
        return InvalidValue(
            self.reason, value=self.value, key=_join(part, self.key), siblings=self.siblings
        )


@attrs.frozen
class Problem:
    """One thing wrong with a config: the dotted key it concerns, and the full message."""

    key: str
    message: str


def first_problem(error: BaseException, root: type) -> Problem:
    """The most useful single problem among those cattrs collected while building `root`."""
    problems = [
        (rank, problem)
        for path, leaf in _leaves(error, "")
        for rank, problem in _describe(path, leaf, root)
    ]
    if not problems:
        return Problem(key="", message=str(error) or type(error).__name__)
    # A stable sort keeps the declaration order among problems of the same rank.
    problems.sort(key=lambda ranked: ranked[0])
    return problems[0][1]


def dotted_keys(cls: type, prefix: str = "") -> Iterator[str]:
    """Every key `cls` accepts, sections and their keys, spelled as dotted paths."""
    hints = typing.get_type_hints(cls)
    for field in attrs.fields(cls):
        key = _join(prefix, field.name)
        yield key
        field_type = hints[field.name]
        if attrs.has(field_type):
            yield from dotted_keys(field_type, key)


def unknown_key_message(key: str, root: type) -> str:
    """'unknown key ...', with the closest valid key suggested when one is close."""
    valid = list(dotted_keys(root))
    leaf = key.rpartition(".")[2]
    # A key put in the wrong section is the commonest slip: suggest where it belongs.
    same_leaf = [candidate for candidate in valid if candidate.rpartition(".")[2] == leaf]
    close = same_leaf or difflib.get_close_matches(key, valid, n=1, cutoff=0.75)
    if close:
        return f"unknown key '{key}' (did you mean '{close[0]}'?)"
    return f"unknown key '{key}'"


def format_toml_value(value: object) -> str:
    """`value` spelled as TOML on one line, for messages: tomli-w writes each scalar (a path
    as its string), and an array is kept inline (tomli-w spreads one over several lines).

    Raises TypeError for what TOML cannot hold as a value (None, a table).
    """
    if isinstance(value, list | tuple):
        return "[" + ", ".join(format_toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        raise TypeError("a table is not a TOML value")
    if isinstance(value, PurePath):
        value = str(value)
    return tomli_w.dumps({"v": value}).removeprefix("v = ").removesuffix("\n")


def _join(prefix: str, part: str) -> str:
    if not prefix:
        return part
    if not part:
        return prefix
    if part.startswith("["):
        return prefix + part
    return f"{prefix}.{part}"


def _show(value: object) -> str:
    """A value as it would be written in TOML, shortened to stay on one line."""
    try:
        text = format_toml_value(value)
    except TypeError:
        text = repr(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= 80 else text[:77] + "..."


def _leaves(error: BaseException, path: str) -> Iterator[tuple[str, BaseException]]:
    for note in getattr(error, "__notes__", ()):
        if isinstance(note, AttributeValidationNote):
            path = _join(path, note.name)
        elif isinstance(note, IterableValidationNote):
            path = _join(path, f"[{note.index}]")
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner, path)
    else:
        yield path, error


def _describe(path: str, leaf: BaseException, root: type) -> Iterator[tuple[int, Problem]]:
    if isinstance(leaf, ForbiddenExtraKeysError):
        for name in sorted(leaf.extra_fields):
            key = _join(path, name)
            yield 0, Problem(key=key, message=unknown_key_message(key, root))
    elif isinstance(leaf, InvalidValue):
        key = _join(path, leaf.key)
        yield 1, Problem(key=key, message=leaf.describe(key))
    elif isinstance(leaf, KeyError):
        # cattrs raises KeyError for a required key that is absent; the note names it.
        yield 1, Problem(key=path, message=f"missing required key '{path}'")
    else:
        yield 1, Problem(key=path, message=f"{path or 'config'}: {leaf}".replace("\n", " "))

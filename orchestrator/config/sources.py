"""Where config values come from: the TOML file, and `--set KEY=VALUE` overrides on top.

Both produce plain nested dicts (what `tomllib` returns); turning them into typed config
objects is the converter's job.
"""

from __future__ import annotations

import copy
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from orchestrator.config.errors import ConfigError

# A dotted key of TOML bare keys: `run_dir`, `staleness.max_off_policy_steps`.
_DOTTED_KEY = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")
# tomllib ends each message with where it stopped reading.
_TOML_WHERE = re.compile(r"\s*\((at line \d+, column \d+|at end of document)\)$")
# A value that starts like a TOML string, array or table was meant as TOML, so a syntax
# error in it is reported rather than the text being taken as a bare string.
_LOOKS_LIKE_TOML = ('"', "'", "[", "{")


@attrs.frozen
class Override:
    """One `--set KEY=VALUE`: the dotted key and the TOML value it parsed to."""

    key: str
    value: object

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.key.split("."))


def read_toml_file(path: Path) -> dict[str, Any]:
    """The TOML document in `path`, as nested dicts.

    Raises ConfigError (one line naming the file, and for bad TOML the line, column and
    the parser's reason) when the file is missing, unreadable, not UTF-8 or not TOML.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (bad byte at offset {exc.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {describe_toml_error(exc)}") from None


def describe_toml_error(error: tomllib.TOMLDecodeError) -> str:
    """'invalid TOML at line L, column C: <reason>' from tomllib's message."""
    message = str(error)
    where = _TOML_WHERE.search(message)
    if where is None:
        return f"invalid TOML: {message}"
    return f"invalid TOML {where.group(1)}: {message[: where.start()]}"


def parse_override(text: str) -> Override:
    """Parse one `KEY=VALUE`, VALUE in TOML syntax (a bare word that is not TOML is a string).

    Raises ConfigError when there is no `=`, the key is not a dotted key, or a value that
    starts like a TOML string, array or table does not parse.
    """
    key, equals, raw = text.partition("=")
    key = key.strip()
    if not equals or not _DOTTED_KEY.fullmatch(key):
        raise ConfigError(
            f"--set {text!r}: expected KEY=VALUE with a dotted key, "
            'e.g. --set staleness.max_off_policy_steps=3 or --set run_dir="/tmp/run"'
        )
    raw = raw.strip()
    try:
        document = tomllib.loads(f"value = {raw}")
    except tomllib.TOMLDecodeError as exc:
        if raw.startswith(_LOOKS_LIKE_TOML):
            reason = describe_toml_error(exc).replace("invalid TOML", "invalid TOML value")
            raise ConfigError(f"--set {key}={raw}: {reason}") from None
        return Override(key=key, value=raw)
    # A value with a newline could smuggle in more keys ("1\nrun_dir = ..."): refuse it.
    if set(document) != {"value"}:
        raise ConfigError(f"--set {key}=...: the value must be a single TOML value")
    return Override(key=key, value=document["value"])


def apply_overrides(
    document: dict[str, Any], overrides: Iterable[Override], source: Path
) -> dict[str, Any]:
    """A copy of `document` (read from `source`) with each override set at its dotted key.

    Overrides apply in order, so a later one wins. Missing tables on the way are created
    (an unknown one is reported later, like any unknown key). A number part indexes an
    array of tables (`env.0.max_tokens`: the first `[[env]]`). Raises ConfigError when a
    key goes through a value that is not a table, or indexes past an array's end.
    """
    merged = copy.deepcopy(document)
    for override in overrides:
        table: dict[str, Any] | list[Any] = merged
        for depth, part in enumerate(override.parts[:-1]):
            above = ".".join(override.parts[: depth + 1])
            table = _step(table, part, above, source, override.key)
        last = override.parts[-1]
        if isinstance(table, list):
            raise ConfigError(
                f"{source} (--set {override.key}): '{last}' must name a key of one of the "
                f"array's tables, e.g. --set {override.key}.0.<key>=..."
            )
        table[last] = override.value
    return merged


def _step(
    table: dict[str, Any] | list[Any], part: str, above: str, source: Path, key: str
) -> dict[str, Any] | list[Any]:
    """What `part` names inside `table`: a table (created when missing), or an array of
    tables (indexed by a number part next)."""
    if isinstance(table, list):
        if not part.isdigit() or int(part) >= len(table):
            raise ConfigError(
                f"{source} (--set {key}): '{above}' is past the array of tables "
                f"(it has {len(table)}: index 0 .. {len(table) - 1})"
            )
        inner = table[int(part)]
    else:
        inner = table.setdefault(part, {})
    is_tables = isinstance(inner, list) and all(isinstance(item, dict) for item in inner)
    if not isinstance(inner, dict) and not is_tables:
        raise ConfigError(f"{source} (--set {key}): '{above}' is a value, not a table of keys")
    return inner  # type: ignore[no-any-return]

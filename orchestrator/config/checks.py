"""attrs validators for config values: limits, ranges, URLs, addresses.

Each raises InvalidValue, whose reason completes "<key> = <value> ...", so the message
that reaches the user names the key, the value and what it must be.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs

from orchestrator.config.errors import InvalidValue, format_toml_value

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def at_least(minimum: float, why: str = "") -> Validator:
    """The value must be >= `minimum` (`why`, when given, says why after a colon)."""

    def check(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
        if value < minimum:
            suffix = f": {why}" if why else ""
            raise InvalidValue(f"must be >= {minimum}{suffix}", value=value, key=attribute.name)

    return check


def greater_than(minimum: float) -> Validator:
    """The value must be > `minimum`."""

    def check(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
        if not value > minimum:
            raise InvalidValue(f"must be > {minimum}", value=value, key=attribute.name)

    return check


def fraction(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    """The value must be a probability: in [0, 1]."""
    if not 0.0 <= value <= 1.0:
        raise InvalidValue("must be in [0, 1]", value=value, key=attribute.name)


def not_below_sibling(sibling: str, why: str = "") -> Validator:
    """The value must be >= the value of the `sibling` field in the same section."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
        other = getattr(instance, sibling)
        if value < other:
            suffix = f": {why}" if why else ""
            raise InvalidValue(
                f"must be >= {{0}} ({other}){suffix}",
                value=value,
                key=attribute.name,
                siblings=[sibling],
            )

    return check


def not_above_sibling(sibling: str, why: str = "") -> Validator:
    """The value must be <= the value of the `sibling` field in the same section."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
        other = getattr(instance, sibling)
        if value > other:
            suffix = f": {why}" if why else ""
            raise InvalidValue(
                f"must be <= {{0}} ({other}){suffix}",
                value=value,
                key=attribute.name,
                siblings=[sibling],
            )

    return check


def one_of(choices: tuple[str, ...]) -> Validator:
    """The value must be one of `choices`. Loading a file checks a Literal-typed key
    already (orchestrator.config.converter); this also checks a section built directly."""
    spelled = ", ".join(format_toml_value(choice) for choice in choices)

    def check(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
        if value not in choices:
            raise InvalidValue(f"must be one of {spelled}", value=value, key=attribute.name)

    return check


def distinct_items(_: object, attribute: attrs.Attribute[Any], value: tuple[Any, ...]) -> None:
    """No item may appear twice."""
    seen: set[object] = set()
    for item in value:
        if item in seen:
            raise InvalidValue(
                f"lists {format_toml_value(item)} twice", value=value, key=attribute.name
            )
        seen.add(item)


def http_urls(_: object, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    """Every item must be an http:// or https:// URL with a host (and a valid port)."""
    for index, url in enumerate(value):
        problem = http_url_problem(url)
        if problem:
            raise InvalidValue(problem, value=url, key=f"{attribute.name}[{index}]")


def http_url_problem(url: str) -> str:
    """Why `url` is not a usable inference server URL, or "" when it is."""
    if any(char.isspace() for char in url):
        return "must not contain spaces"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"is not a valid URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return "must start with http:// or https://"
    if not parts.hostname:
        return "must name a host (http://HOST:PORT)"
    if port == 0:
        return "must not use port 0"
    return ""


def listen_address(_: object, attribute: attrs.Attribute[Any], value: str) -> None:
    """Empty (off) or "host:port" with a port in 0..65535 ("[::1]:9464" for IPv6)."""
    if not value:
        return
    host, colon, port = value.rpartition(":")
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidValue(
            'must be "" (off) or "host:port", e.g. "127.0.0.1:9464"',
            value=value,
            key=attribute.name,
        )


def dangerous_root_problem(path: Path) -> str:
    """Why wiping or collecting under `path` could destroy unrelated data, or "" if fine.

    Refuses `/` and the user's home directory or any directory above it. `path` is
    absolute; symbolic links are not followed here (the collector refuses a linked root).
    """
    if path == Path(path.anchor):
        return "must not be the filesystem root"
    home = _home_directory()
    if home is not None and (path == home or path in home.parents):
        return f"must not be the home directory ({home}) or above it"
    return ""


def _home_directory() -> Path | None:
    try:
        return Path(os.path.normpath(Path.home()))
    except (RuntimeError, KeyError):
        # No HOME and no passwd entry (some containers): there is no home to protect.
        return None

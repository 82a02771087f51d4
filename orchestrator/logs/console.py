"""The console's lines: what a person at a terminal reads, one short line per event.

`human_line` is a structlog processor that turns an event into one sentence in the event
key, for `structlog.dev.ConsoleRenderer` to print after the time and level. The daemon's
busiest events have their own forms (a shipped step, an applied version, a collection,
a trained batch, an eval); every other event becomes `event: key value; key value`, keys
in words, durations in seconds, byte counts in KiB/MiB, paths under the working
directory relative to it, counts by reason without their zeros. The per-server
`weights updated` line of the local servers is left out: the daemon's `applied version`
line names the servers. JSON lines (files, pipes, journald) never pass through here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import structlog
from payload_gc import human_bytes

# Keys the renderer itself uses (time, level, tracebacks): kept as they are.
_RENDERER_KEYS = ("timestamp", "level", "exc_info", "exception", "stack")
# Mappings of counts by reason or kind: shown without their zero entries.
_COUNTS = frozenset({"discards", "failures", "files_deleted", "rollouts", "kinds", "pass_at"})
# The longest value shown whole; longer ones end in an ellipsis.
_VALUE_MAX = 160

Fields = Mapping[str, Any]


def human_line(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """The structlog processor: `event_dict` reduced to its renderer keys and one
    sentence as its event. Raises `structlog.DropEvent` for events the console leaves
    out (`weights updated`, a collection of nothing)."""
    kept = {key: event_dict[key] for key in _RENDERER_KEYS if key in event_dict}
    event = str(event_dict.get("event", ""))
    fields = {k: v for k, v in event_dict.items() if k not in kept and k != "event"}
    form = _FORMS.get(event)
    text: str | None
    try:
        text = form(fields) if form is not None else generic_line(event, fields)
    except (KeyError, TypeError, ValueError):
        # An event without the fields its form expects (an older or a foreign emitter).
        text = generic_line(event, fields)
    if text is None:
        raise structlog.DropEvent
    return {**kept, "event": text}


def generic_line(event: str, fields: Fields) -> str:
    """`event: key value; key value`, each key and value in words."""
    parts = [_field(key, value) for key, value in fields.items()]
    return f"{event}: {'; '.join(parts)}" if parts else event


def _field(key: str, value: Any) -> str:
    if key.endswith("_s") and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{_words(key[:-2])} {value} s"
    if key.endswith("bytes") and isinstance(value, int) and not isinstance(value, bool):
        return f"{_words(key)} {human_bytes(value)}"
    if key in _COUNTS and isinstance(value, Mapping):
        return f"{_words(key)} {counts(value)}"
    return f"{_words(key)} {_value(value)}"


def _words(key: str) -> str:
    return key.replace("_", " ")


def _value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, Mapping):
        return ", ".join(f"{_words(str(k))} {_value(v)}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        return ", ".join(_value(v) for v in value) or "none"
    text = _short_path(value) if isinstance(value, str) else str(value)
    return text if len(text) <= _VALUE_MAX else text[: _VALUE_MAX - 1] + "…"


def _short_path(text: str) -> str:
    """An absolute path under the working directory, relative to it; else as it is."""
    if not text.startswith("/"):
        return text
    try:
        cwd = os.getcwd()
    except OSError:
        return text
    if text == cwd:
        return "."
    return text[len(cwd) + 1 :] if text.startswith(cwd + os.sep) else text


def counts(values: Mapping[str, Any]) -> str:
    """Counts by reason without the zeros, largest first: `no_signal 12, stale 3`;
    `none` when all are zero."""
    nonzero = sorted(((k, v) for k, v in values.items() if v), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{k} {v}" for k, v in nonzero) or "none"


def plural(count: int, noun: str) -> str:
    """`1 file`, `2 files`."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _server(url: str) -> str:
    return url.removeprefix("http://").removeprefix("https://")


def _version(version: int) -> str:
    return f"v{version}" if version >= 0 else "none"


def _shipped(f: Fields) -> str:
    parts = [
        f"v{f['version']}",
        f"{f['samples']} samples ({f['groups']} groups, staleness {f['staleness']})",
    ]
    if f.get("dropped"):
        parts.append(f"{f['dropped']} dropped")
    discards = counts(f["discards"])
    # The discards and deletions are the run's totals, not this batch's.
    so_far = "no discards" if discards == "none" else f"discards {discards}"
    so_far += f", {plural(f['files_deleted'], 'file')} deleted"
    disk = f"{plural(f['payload_files'], 'file')} / {human_bytes(f['payload_bytes'])}"
    return f"step {f['step']} shipped: {', '.join(parts)}; run so far: {so_far}; disk {disk}"


def _applied(f: Fields) -> str:
    servers = f.get("servers")
    where = (
        "" if servers is None else f" on {', '.join(_server(s) for s in servers) or 'no server'}"
    )
    return f"{_version(f['version'])} applied{where}; collection bound {_version(f['bound'])}"


def _collected(f: Fields) -> str | None:
    if not f["dirs"] and not f["files"]:
        return None
    return (
        f"collected below {_version(f['bound'])}: {plural(f['dirs'], 'dir')}, "
        f"{plural(f['files'], 'file')}, "
        f"{human_bytes(f['bytes'])} in {f['duration_s']} s; disk {human_bytes(f['payload_bytes'])}"
    )


def _trained(f: Fields) -> str:
    dropped = f", {f['dropped']} dropped" if f.get("dropped") else ""
    return (
        f"step {f['step']} trained: {f['samples']} samples, {f['violations']} violations{dropped}"
    )


def _eval(f: Fields) -> str:
    passes = "".join(f", {k} {v}" for k, v in (f.get("pass_at") or {}).items())
    return (
        f"eval {f['env']} v{f['version']}: mean reward {f['reward_mean']} over "
        f"{f['samples']} samples{passes}; {f['failed']} failed, {f['duration_s']} s"
    )


def _inflight(f: Fields) -> str:
    return (
        f"in-flight limit {f['previous']} -> {f['limit']} (group turnaround p90 "
        f"{f['turnaround_p90_s']} s, step {f['step_time_s']} s)"
    )


def _listening(f: Fields) -> str:
    model = f["model"]
    return (
        f"inference server listening at {_server(f['url'])} ({f['role']}, "
        f"{f['served_model_name']}, {f['reply_form']} replies; {model['layers']} layers, "
        f"top-{model['top_k']} of {model['num_experts']} experts, vocabulary "
        f"{model['vocab_size']}, eos {model['eos_token_id']})"
    )


def _dropped(_f: Fields) -> None:
    return None


_FORMS: dict[str, Callable[[Fields], str | None]] = {
    "shipped batch": _shipped,
    "applied version": _applied,
    "collected": _collected,
    "trained": _trained,
    "eval": _eval,
    "inflight limit": _inflight,
    "inference server listening": _listening,
    # One per local server per version: the `applied version` line names the servers.
    "weights updated": _dropped,
}

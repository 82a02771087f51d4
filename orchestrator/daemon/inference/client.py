"""Talking to inference servers: the generate request, the weight update's requests
(`orchestrator.wire.weight_updates`), and the check of a turn's payload files on disk
(blocking: run in a worker thread).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs
import msgspec
import structlog
import trio
from payload_gc import PayloadRootFiles, VersionDir

from orchestrator.core.turns import TurnOutput
from orchestrator.daemon.inference.credentials import unauthorized_detail
from orchestrator.daemon.inference.http11 import HTTP11Client, HTTPFailure, Reply, Requester
from orchestrator.payload import (
    CHECKED_ROUTING_ROWS,
    PayloadError,
    PayloadSegment,
    check_within,
    open_version_dir,
    overlap_problem,
    read_rows,
    regular_file_size,
    repeated_ids_problem,
)
from orchestrator.wire import (
    GENERATE_PATH,
    ControlCall,
    InferenceFailure,
    WeightUpdate,
    WeightUpdatePlan,
    refusal_hint,
)

JSON_HEADERS = (("content-type", "application/json"),)

log = structlog.get_logger(__name__)

#: How long the clean-up of a weight update (vLLM's `/resume`) may take, even when the
#: update itself was cancelled.
CLEANUP_TIMEOUT_S = 30.0


@attrs.frozen
class TurnFiles:
    """A turn's payload files as found on disk: what is wrong with them (`None` when
    nothing is, or when the turn was poisoned already) and the size of each of its files
    that exists as a regular file, by name."""

    problem: str | None
    sizes: Mapping[str, int]


def check_turn_files(
    turn: TurnOutput, *, files: PayloadRootFiles, version: int, read: bool = True
) -> TurnFiles:
    """Look at the turn's files in `v<version>` of the open payload root (payload_gc's
    fd-relative, no-follow access: a version directory that is a link or a mount point
    is refused): each must be a regular file holding its segments' bytes. With `read`,
    the routing's first rows are read and checked (`repeated_ids_problem`), and under
    disaggregated prefill/decode the routing rows both sides wrote must agree: they are
    read from both files and compared (`overlap_problem`). Blocking: one `lstat` per file,
    and with `read` one small read from each routing segment's file."""
    prefill = turn.prefill_routing
    checked = turn.poisoned is None and (bool(turn.segments) or prefill is not None)
    try:
        directory = open_version_dir(files, version)
    except PayloadError as exc:
        return TurnFiles(str(exc) if checked else None, {})
    sizes: dict[str, int] = {}
    problem: str | None = None
    for path in sorted(turn.files):
        name = path.rpartition("/")[2]
        try:
            sizes[name] = regular_file_size(directory, name)
        except PayloadError as exc:
            problem = problem or str(exc)
    if not checked:
        return TurnFiles(None, sizes)
    if problem is None:
        segments = [*turn.segments.values(), *([prefill] if prefill is not None else [])]
        decode = turn.segments.get("routed_experts")
        try:
            for segment in segments:
                check_within(segment, sizes[segment.file])
            if not read:
                return TurnFiles(None, sizes)
            if prefill is not None and decode is not None:
                problem = overlap_problem(directory, prefill, decode)
            for routing in (prefill, decode):
                if problem is None and routing is not None:
                    problem = _routing_sample_problem(directory, routing)
        except PayloadError as exc:
            problem = str(exc)
    return TurnFiles(problem, sizes)


def _routing_sample_problem(directory: VersionDir, segment: PayloadSegment) -> str | None:
    """`repeated_ids_problem` over the segment's first rows (one small read): a server's
    broken capture is the same in every row, and the trainer's reader checks the rest."""
    if segment.fill is not None or not segment.rows:
        return None
    head = read_rows(directory, segment, 0, min(segment.rows, CHECKED_ROUTING_ROWS))
    return repeated_ids_problem(head, segment.pos)


async def _post_json(client: Requester, url: str, body: Mapping[str, Any] | None) -> Reply:
    """POST `body` as compact JSON (an empty body for None). Raises `InferenceFailure`
    ("connect", "transport" or "oversized") when no answer could be read."""
    data = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
    try:
        return await client.request("POST", url, data, JSON_HEADERS)
    except HTTPFailure as exc:
        raise InferenceFailure(exc.kind, exc.detail) from None


def encode_generate_request(body: Mapping[str, Any]) -> bytes:
    """The request's JSON bytes: msgspec encodes a 4,500-token body in tens of
    microseconds on the event loop, where the standard library takes hundreds."""
    return msgspec.json.encode(body)


async def post_generate(client: HTTP11Client, url: str, body: bytes | Mapping[str, Any]) -> bytes:
    """POST one generate request (`body` encoded already, or a JSON object); the caller
    puts the deadline around it.

    Raises `InferenceFailure` for connection errors and non-200 answers ("unauthorized"
    for a 401: a missing or refused bearer token).
    """
    data = body if isinstance(body, bytes) else encode_generate_request(body)
    try:
        reply = await client.request("POST", url.rstrip("/") + GENERATE_PATH, data, JSON_HEADERS)
    except HTTPFailure as exc:
        raise InferenceFailure(exc.kind, exc.detail) from None
    if reply.status == 401:
        sent = client.authorization is not None
        raise InferenceFailure("unauthorized", unauthorized_detail(url, sent_token=sent))
    if reply.status >= 500:
        raise InferenceFailure("http_5xx", f"{url}: HTTP {reply.status}")
    if reply.status != 200:
        raise InferenceFailure("http_4xx", f"{url}: HTTP {reply.status} {reply.text()!r}")
    return reply.body


async def load_weights(client: Requester, url: str, plan: WeightUpdatePlan) -> None:
    """Tell one server to load a version: `plan`'s calls in order (the caller puts the
    deadline around them), then its `finally_` calls whatever happened, shielded, within
    `CLEANUP_TIMEOUT_S`. Raises `InferenceFailure` naming the call that failed, with
    what the refusal most likely means (`refusal_hint`)."""
    try:
        for call in plan.calls:
            await _control_call(client, url, call, plan.protocol)
    finally:
        with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
            for call in plan.finally_:
                try:
                    await _control_call(client, url, call, plan.protocol)
                except InferenceFailure as exc:
                    log.warning("weight update clean-up failed", url=url, error=str(exc))


async def _control_call(
    client: Requester, url: str, call: ControlCall, protocol: WeightUpdate
) -> None:
    response = await _post_json(client, url.rstrip("/") + call.path, call.body)
    if response.status == 401:
        sent = client.authorization is not None
        detail = unauthorized_detail(url, sent_token=sent)
        raise InferenceFailure("unauthorized", f"{call.name}: {detail}")
    if response.status != 200:
        kind = "http_5xx" if response.status >= 500 else "http_4xx"
        hint = refusal_hint(protocol, call, response.status)
        answer = " ".join(response.text().split())
        raise InferenceFailure(
            kind,
            f"{url}: {call.name} HTTP {response.status}: {answer}" + (f" ({hint})" if hint else ""),
        )

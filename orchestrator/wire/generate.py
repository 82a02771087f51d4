"""The generate API: the request body, and the reply parsed into a `TurnOutput`.

One dialect, the real one (docs/protocol.md): vLLM's tokens-in/tokens-out
`GenerateRequest`, answered as upstream vLLM answers it or as prime-rl's extension does
(packed arrays inline, or segments by handle). Parsing is pure, so every malformed or
hostile reply is testable without a socket: a reply that cannot be read raises
`InferenceFailure("malformed")`; a payload that cannot be trusted comes back as a poisoned
turn (docs/design.md §4).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from orchestrator.core.arrays import TOKEN_DTYPE, handed_over
from orchestrator.core.environments import Sampling
from orchestrator.core.turns import TurnOutput
from orchestrator.payload import BadSegment, PayloadSegment, RoutingShape, repeated_ids_problem
from orchestrator.wire.arrays import (
    ROUTING_DTYPES,
    WireFormatError,
    decode_mask,
    decode_npy,
    decode_packed,
    decode_packed_routing,
)
from orchestrator.wire.segments import decode_segments, segment_from_wire

#: The top-level keys vLLM's `GenerateRequest` defines that this client may send.
REQUEST_KEYS = frozenset({"request_id", "model", "token_ids", "sampling_params"})
#: The `SamplingParams` keys this client sends (`extra_args.payload_dir` by handle).
SAMPLING_KEYS = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "n",
        "stop_token_ids",
        "logprobs",
        "routed_experts_prompt_start",
        "extra_args",
    }
)


_MAX_TOKEN_ID = int(np.iinfo(TOKEN_DTYPE).max)


class InferenceFailure(Exception):
    """A request that did not produce a usable answer.

    `kind` is one of "connect" (the server refused or could not be reached: it is
    probably down), "transport" (a connection broke mid-request, e.g. a reused keep-alive
    connection the server had closed), "timeout", "http_5xx", "http_4xx",
    "unauthorized" (a 401: the bearer token is missing or not the server's), "malformed"
    (a reply that cannot be read: asking the same server again would get the same),
    "oversized" (a body longer than the generate client's cap: it was not read, and its
    connection closed). "connect", "transport", "timeout" and "http_5xx" are transient:
    the same request may succeed when tried again.
    """

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail

    @property
    def transient(self) -> bool:
        return self.kind in {"connect", "transport", "timeout", "http_5xx"}


def encoded_token_ids(token_ids: Sequence[int] | np.ndarray) -> msgspec.Raw:
    """`token_ids` as the JSON a request carries them in, encoded once: the members of a
    group send the same prompt, and a 4,000-token prompt's ids take about 90 µs to turn
    into Python ints and JSON (`build_generate_request` takes the result as it is)."""
    return msgspec.Raw(msgspec.json.encode(np.asarray(token_ids).tolist()))


def build_generate_request(
    *,
    request_id: str,
    token_ids: Sequence[int] | np.ndarray | msgspec.Raw,
    seed: int,
    payload_dir: Path | None,
    routing_start: int | None,
    sampling: Sampling | None = None,
    max_tokens: int | None = None,
    model: str = "",
    choices: int = 1,
) -> dict[str, Any]:
    """The JSON body of a generate request: only keys vLLM's `GenerateRequest` defines.

    `choices` above 1 asks for that many completions of the prompt (`n`: a group's
    first turn); vLLM runs choice i as a request of its own, `f"{i}_{request_id}"`,
    seeded with `seed + i`, and answers the choices in index order.

    `sampling` (the prompt's: vLLM's defaults when None) gives `max_tokens` (unless
    `max_tokens` overrides it), `temperature`, `top_p`, `top_k` and `stop_token_ids` (sent
    when not empty). `routing_start` (sent only when the daemon wants routing) asks for
    routing rows from that position on: the daemon holds the earlier ones from the
    rollout's previous turns. Whether a server captures routing and masks at all is its
    own setting, not a request field; `payload_dir` asks prime-rl's extension to write
    them by handle.
    """
    params = Sampling() if sampling is None else sampling
    sampling_params: dict[str, Any] = {
        "max_tokens": params.max_tokens if max_tokens is None else max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "seed": seed,
        # The sampled token's logprob (vLLM returns it with the top-1).
        "logprobs": 1,
    }
    if choices > 1:
        sampling_params["n"] = choices
    if params.stop_token_ids:
        sampling_params["stop_token_ids"] = list(params.stop_token_ids)
    if routing_start is not None:
        sampling_params["routed_experts_prompt_start"] = routing_start
    if payload_dir is not None:
        sampling_params["extra_args"] = {"payload_dir": str(payload_dir)}
    body: dict[str, Any] = {"request_id": request_id}
    if model:
        body["model"] = model
    # Raw JSON (`encoded_token_ids`) goes out as it is: only msgspec encodes such a body.
    raw = isinstance(token_ids, msgspec.Raw)
    body["token_ids"] = token_ids if raw else np.asarray(token_ids).tolist()
    body["sampling_params"] = sampling_params
    return body


def _malformed(detail: str) -> InferenceFailure:
    return InferenceFailure("malformed", detail)


class _Logprob(msgspec.Struct):
    """One `logprobs.content` entry (upstream vLLM); its other keys are not needed."""

    logprob: float


class _Logprobs(msgspec.Struct):
    content: list[_Logprob] | None = None


class _Choice(msgspec.Struct):
    """A reply's choice as the parser needs it: tokens, logprobs and finish reason typed
    (a wrong one makes the reply malformed), the payload values kept as raw JSON text and
    decoded on their own (a wrong one poisons the turn, and the megabytes of base64 in
    inline routing are decoded once, into bytes, never into a Python string)."""

    token_ids: list[int]
    finish_reason: str
    logprobs: _Logprobs | None = None
    completion_logprobs: msgspec.Raw = msgspec.Raw()
    routed_experts: msgspec.Raw = msgspec.Raw()
    sampling_mask: msgspec.Raw = msgspec.Raw()
    payload: msgspec.Raw = msgspec.Raw()
    payload_error: msgspec.Raw = msgspec.Raw()


class _Response(msgspec.Struct):
    choices: list[msgspec.Raw]


_RESPONSE = msgspec.json.Decoder(_Response)
_CHOICE = msgspec.json.Decoder(_Choice)
_NULL = msgspec.Raw(b"null")
_EMPTY_LIST = msgspec.Raw(b"[]")


def _given(raw: msgspec.Raw) -> bool:
    """Whether a key was present with a value other than null."""
    return len(raw) > 0 and raw != _NULL


class TooFewChoices(InferenceFailure):
    """A reply with fewer choices than the request's `n` asked for (`asked`), each of
    them readable as any choice (`choices`): a server or proxy that ignores `n`. A
    "malformed" failure to whoever does not look further."""

    def __init__(self, choices: list[msgspec.Raw], asked: int) -> None:
        super().__init__("malformed", f"response has {len(choices)} choices for n = {asked}")
        self.choices = choices
        self.asked = asked


def reply_choices(body: bytes, count: int = 1) -> list[msgspec.Raw]:
    """The first `count` choices of a reply, each as its JSON text (`parse_choice` reads
    one); raises `InferenceFailure("malformed")` when the reply is not JSON or holds
    none, `TooFewChoices` when it holds fewer (at least one)."""
    try:
        response = _RESPONSE.decode(body)
    except msgspec.DecodeError as exc:
        raise _malformed(f"response is not JSON ({_one_line(exc)})") from None
    except msgspec.ValidationError as exc:
        raise _malformed(f"response has no choices ({_one_line(exc)})") from None
    if not response.choices:
        raise _malformed("response has no choices")
    if len(response.choices) < count:
        raise TooFewChoices(list(response.choices), count)
    return response.choices[:count]


def _choice(raw: msgspec.Raw, index: int) -> _Choice:
    """Choice `index` typed; raises `InferenceFailure("malformed")` with msgspec's
    one-line reason (which names the key: `$.token_ids[3]`)."""
    try:
        return _CHOICE.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _malformed(f"choices[{index}]: {_one_line(exc)}") from None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:200]


def _token_ids(value: list[int]) -> np.ndarray:
    try:
        # numpy refuses a Python int that does not fit the dtype (OverflowError).
        ids = np.array(value, dtype=TOKEN_DTYPE)
    except OverflowError:
        raise _malformed(f"token_ids must be in 0..{_MAX_TOKEN_ID}") from None
    if ids.size and int(ids.min()) < 0:
        raise _malformed(f"token_ids must be in 0..{_MAX_TOKEN_ID}")
    return handed_over(ids)


def _logprobs(choice: _Choice, tokens: int) -> np.ndarray:
    """The sampled tokens' logprobs: prime-rl's packed ``completion_logprobs``, else
    upstream's ``logprobs.content[i].logprob``."""
    if _given(choice.completion_logprobs):
        try:
            values = decode_packed(
                choice.completion_logprobs, "completion_logprobs", dtypes=("float32",), ndim=1
            )
        except WireFormatError as exc:
            raise _malformed(str(exc)) from None
    elif choice.logprobs is not None and choice.logprobs.content is not None:
        content = choice.logprobs.content
        values = np.fromiter((entry.logprob for entry in content), np.float64, len(content))
    else:
        raise _malformed(
            "no logprobs: neither completion_logprobs nor logprobs.content "
            "(does the request's sampling_params.logprobs reach the server?)"
        )
    if not np.isfinite(values).all():
        raise _malformed("a logprob is not a finite number")
    if len(values) != tokens:
        raise _malformed(f"{len(values)} logprobs for {tokens} completion tokens")
    # Fresh: decoded from the reply's bytes (a copy of them), or converted.
    return handed_over(values.astype(np.float32, copy=False))


def parse_generate_response(
    body: bytes,
    *,
    prompt_len: int,
    routing_start: int,
    payload_dir: Path | None,
    fields: Sequence[str],
    routing_shape: RoutingShape | None = None,
) -> TurnOutput:
    """Parse and validate a generate response's first choice (pure: no file is touched).

    `routing_start` is what the request asked for; `fields` are the payload fields the
    run trains with. Malformed JSON or a malformed choice raises
    `InferenceFailure("malformed")`. A bad or missing payload does not raise: the turn
    comes back `poisoned`, so the rollout is counted and dropped, never trained on and
    never a crash. Routing that contradicts `routing_shape` (the model's, when known) is
    poisoned too.
    """
    return parse_choice(
        reply_choices(body)[0],
        0,
        prompt_len=prompt_len,
        routing_start=routing_start,
        payload_dir=payload_dir,
        fields=fields,
        routing_shape=routing_shape,
    )


def parse_choice(
    raw: msgspec.Raw,
    index: int,
    *,
    prompt_len: int,
    routing_start: int,
    payload_dir: Path | None,
    fields: Sequence[str],
    routing_shape: RoutingShape | None = None,
) -> TurnOutput:
    """Choice `index` of a reply (`reply_choices`), parsed and validated as
    `parse_generate_response` does: a malformed choice raises, a bad payload poisons it.
    The choices of one reply are apart: one that fails leaves the others whole."""
    choice = _choice(raw, index)
    completion = _token_ids(choice.token_ids)
    turn = TurnOutput(completion, _logprobs(choice, len(completion)), choice.finish_reason)
    if not fields:
        return turn
    rows = _Rows(prompt_len, len(completion), routing_start)
    if payload_dir is None:
        return _inline_turn(turn, choice, fields, rows, routing_shape)
    return _by_handle_turn(turn, choice, fields, rows, payload_dir, routing_shape)


class _Rows:
    """Where a turn's payload rows must lie: routing from at most the requested start to
    the last token run forward (every token but the last sampled one); masks over the
    completion tokens."""

    def __init__(self, prompt_len: int, completion_len: int, routing_start: int) -> None:
        self.prompt_len = prompt_len
        self.completion_len = completion_len
        self.routing_start = routing_start
        self.routing_end = prompt_len + completion_len - 1

    def routing_problem(self, pos: int, rows: int) -> str | None:
        if pos < 0 or pos + rows != self.routing_end or pos > self.routing_start:
            hint = ""
            if pos == self.prompt_len - 1 and pos + rows == self.routing_end:
                # Where a decode server's first forward pass starts (docs/protocol.md).
                hint = (
                    ": they start where a disaggregated decode server's do; does the "
                    "prefill/decode router drop the prefill side's rows?"
                )
            return (
                f"routed_experts rows {pos}..{pos + rows} do not span positions "
                f"{self.routing_start}..{self.routing_end} (requested start to the last "
                f"token run forward){hint}"
            )
        return None

    def split_routing_problem(
        self, prefill: PayloadSegment | None, decode: PayloadSegment | None
    ) -> str | None:
        """Disaggregated prefill/decode by handle: the prefill side's rows must start at or
        before the requested start and lie in the prompt; the decode side's must reach the
        last token run forward with no gap after the prefill's (they may overlap, the
        shared rows are checked on disk). A decode side without routing is a router that
        clipped it away: then the prefill's rows must reach the end themselves."""
        if prefill is None:
            return f"the prefill side sent no routed_experts segment: {_NO_ROUTING}"
        prefill_end = prefill.pos + prefill.rows
        if prefill.pos > self.routing_start or prefill_end > self.prompt_len:
            return (
                f"prefill routed_experts rows {prefill.pos}..{prefill_end} do not lie in "
                f"the prompt (0..{self.prompt_len}) from the requested start "
                f"{self.routing_start}"
            )
        if decode is None:
            if prefill_end != self.routing_end:
                return (
                    f"no decode routed_experts segment, and the prefill's rows end at "
                    f"{prefill_end}, not at the last token run forward ({self.routing_end})"
                )
            return None
        decode_end = decode.pos + decode.rows
        if decode_end != self.routing_end or decode.pos > prefill_end:
            return (
                f"decode routed_experts rows {decode.pos}..{decode_end} do not continue "
                f"the prefill's rows (up to {prefill_end}) to the last token run forward "
                f"({self.routing_end})"
            )
        return None

    def mask_problem(self, pos: int, rows: int) -> str | None:
        if pos != self.prompt_len or rows != self.completion_len:
            return (
                f"sampling_mask rows {pos}..{pos + rows} are not the "
                f"{self.completion_len} completion tokens from {self.prompt_len}"
            )
        return None


_NO_ROUTING = (
    "the reply carries no routed_experts: is routing capture on in the server "
    "(vLLM's enable_return_routed_experts)?"
)


def _inline_turn(
    turn: TurnOutput,
    choice: _Choice,
    fields: Sequence[str],
    rows: _Rows,
    routing_shape: RoutingShape | None,
) -> TurnOutput:
    arrays: dict[str, tuple[np.ndarray, int]] = {}
    if _given(choice.payload) and choice.payload != _EMPTY_LIST:
        # Files nobody asked for: their names are not trusted, the collector removes them.
        return _poisoned(turn, "the reply is by handle, but the request was inline")
    try:
        if "routed_experts" in fields:
            if not _given(choice.routed_experts):
                return _poisoned(turn, _NO_ROUTING)
            ids, pos = _inline_routing(choice.routed_experts, rows)
            wrong = (
                rows.routing_problem(pos, len(ids))
                or _ids_problem(ids, routing_shape)
                or repeated_ids_problem(ids, pos)
            )
            if wrong is not None:
                return _poisoned(turn, wrong)
            arrays["routed_experts"] = (ids, pos)
        if "sampling_mask" in fields and _given(choice.sampling_mask):
            mask = decode_mask(choice.sampling_mask, "sampling_mask", tokens=rows.completion_len)
            # Zero wide: the server kept no set for any token (every position falls back
            # to the full vocabulary), as when it sends null.
            if mask.shape[1]:
                arrays["sampling_mask"] = (mask, rows.prompt_len)
    except WireFormatError as exc:
        return _poisoned(turn, f"inline {exc}")
    return TurnOutput(turn.completion_ids, turn.logprobs, turn.finish_reason, inline=arrays)


def _inline_routing(value: msgspec.Raw, rows: _Rows) -> tuple[np.ndarray, int]:
    """Routing ids and the position of their first row, from prime-rl's packed form (its
    ``start`` says where the rows begin) or upstream vLLM's ``.npy`` (the rows end at the
    last token run forward, so their count says where they begin)."""
    if memoryview(value)[:1].tobytes() == b'"':
        ids = decode_npy(value, "routed_experts", dtypes=ROUTING_DTYPES, ndim=3)
        return ids, rows.routing_end - len(ids)
    return decode_packed_routing(value, "routed_experts", dtypes=ROUTING_DTYPES, ndim=3)


def _ids_problem(ids: np.ndarray, routing_shape: RoutingShape | None) -> str | None:
    if ids.size and int(ids.min()) < 0:
        return f"negative routed expert id {int(ids.min())}"
    if routing_shape is None:
        return None
    return routing_shape.problem(ids.shape[1:]) or routing_shape.ids_problem(ids)


def _by_handle_turn(
    turn: TurnOutput,
    choice: _Choice,
    fields: Sequence[str],
    rows: _Rows,
    payload_dir: Path,
    routing_shape: RoutingShape | None,
) -> TurnOutput:
    """The turn with its segments, the files they name (the only files the daemon ever
    deletes on a server's word), and what is wrong with them.

    A server writes one file per choice. Two files are the two sides of disaggregated
    prefill/decode, forwarded by the router: the prefill side's segments first, then the
    decode side's. The decode side's are the turn's (its completion, its mask); the
    prefill side's routing covers the prompt, and its other segments (the mask of the one
    token it sampled and the router threw away) are not trained on, though their file is
    deleted with the rollout like any other.
    """
    raw: object = None
    if _given(choice.payload):
        raw = decode_segments(choice.payload)
    files: set[str] = set()
    problem: str | None = None
    if _given(choice.payload_error):
        error = msgspec.json.decode(choice.payload_error)
        problem = f"payload_error: {str(error)[:200]}"
    if raw is not None and not isinstance(raw, list):
        problem = problem or "payload must be a list of segments"
    if not isinstance(raw, list):
        inline = _given(choice.routed_experts) or _given(choice.sampling_mask)
        if problem is None and inline:
            problem = (
                "the server answered inline, not by handle: it ignores "
                "extra_args.payload_dir (upstream vLLM?); set payload.mode = 'inline'"
            )
        raw = []
    directory = str(payload_dir)
    # Each file's segments, files in the order they first appear.
    by_file: dict[str, list[PayloadSegment]] = {}
    for item in raw:
        try:
            segment = segment_from_wire(item, payload_dir)
        except BadSegment as exc:
            problem = problem or f"bad segment: {exc}"
            continue
        files.add(f"{directory}/{segment.file}")
        by_file.setdefault(segment.file, []).append(segment)
    sides = list(by_file.values())
    if len(sides) > 2:
        problem = problem or (
            f"the segments name {len(sides)} files: a choice has one, or two under "
            "disaggregated prefill/decode (the prefill side's, then the decode side's)"
        )
    split = len(sides) == 2
    segments, problem = _one_per_field(sides[-1] if sides else [], problem, "")
    prefill, problem = _one_per_field(sides[0] if split else [], problem, " from the prefill side")
    if problem is None:
        problem = _segments_problem(
            segments, prefill if split else None, fields, rows, routing_shape
        )
    kept = {field: s for field, s in segments.items() if field in fields}
    return TurnOutput(
        turn.completion_ids,
        turn.logprobs,
        turn.finish_reason,
        segments=kept,
        files=frozenset(files),
        poisoned=problem,
        prefill_routing=prefill.get("routed_experts") if "routed_experts" in fields else None,
    )


def _one_per_field(
    side: Sequence[PayloadSegment], problem: str | None, whose: str
) -> tuple[dict[str, PayloadSegment], str | None]:
    """One side's segments by field, and the problem so far (two for one field is one)."""
    segments: dict[str, PayloadSegment] = {}
    for segment in side:
        if segment.field in segments:
            problem = problem or f"two segments for {segment.field}{whose}"
        segments[segment.field] = segment
    return segments, problem


def _segments_problem(
    segments: Mapping[str, PayloadSegment],
    prefill: Mapping[str, PayloadSegment] | None,
    fields: Sequence[str],
    rows: _Rows,
    routing_shape: RoutingShape | None,
) -> str | None:
    """What is wrong with a turn's segments: the decode side's (or the only side's) in
    `segments`, the prefill side's in `prefill` under disaggregated prefill/decode."""
    if "routed_experts" in fields:
        routing = segments.get("routed_experts")
        if prefill is not None:
            prefill_routing = prefill.get("routed_experts")
            problem = rows.split_routing_problem(prefill_routing, routing)
            shapes = [s for s in (prefill_routing, routing) if s is not None]
        elif routing is None:
            return _NO_ROUTING
        else:
            problem = rows.routing_problem(routing.pos, routing.rows)
            shapes = [routing]
        for segment in shapes:
            if problem is None and routing_shape is not None:
                problem = routing_shape.problem(segment.shape[1:])
        if problem is not None:
            return problem
    mask = segments.get("sampling_mask")
    if "sampling_mask" in fields and mask is not None:
        return rows.mask_problem(mask.pos, mask.rows)
    return None


def _poisoned(turn: TurnOutput, problem: str) -> TurnOutput:
    return TurnOutput(turn.completion_ids, turn.logprobs, turn.finish_reason, poisoned=problem)

"""The daemon's own model endpoint, on loopback, for environments that drive their own
turns (a verifiers environment: `orchestrator.core.environments.DrivenEpisode`).

Such an environment calls the model itself. It is given a URL of this endpoint for one
rollout, `<endpoint>/rollouts/<key>`, and speaks there the token-in/token-out form of
vLLM's and prime-rl's generate API: `POST .../inference/v1/generate` with the whole
conversation's `token_ids` (it renders its own chat template), and `GET .../v1/models`
for the model's name and `max_model_len`. The endpoint runs no turn itself: it hands each
call to the rollout that opened the key (`ModelDesk.rollout`), which runs it as a turn of
its own, in its own task and cancel scope (the policy version, the payload directory, the
routing, retries, the in-flight limit: `daemon/rollout_runner.py`), and answers with the
tokens sampled and their logprobs, as vLLM would.

The key is 16 random bytes per rollout: another process on the machine cannot call into
a rollout it was not given. A call for a key no rollout holds (it ended) is answered 404;
one the rollout refuses with vLLM's error body and the reason: 400 for a call that is
wrong (too many turns, a conversation that does not extend the last turn), 410 once the
rollout is over (failed, its group stopped or cancelled, the fleet failing it), which
OpenAI's clients do not retry (they retry 408, 409, 429 and 5xx). The
server starts with the first rollout that needs it, so a run without such an
environment serves nothing.
"""

from __future__ import annotations

import functools
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import numpy as np
import structlog
import trio

from orchestrator.asgi_server import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    read_body,
    send_json,
    serve_asgi,
    serve_lifespan,
)
from orchestrator.core.arrays import TOKEN_DTYPE
from orchestrator.core.turns import TurnOutput
from orchestrator.wire import GENERATE_PATH, error_body

log = structlog.get_logger(__name__)

#: Where a rollout's URL lies under the endpoint: `/rollouts/<key>`.
ROLLOUTS_PREFIX = "/rollouts/"
MODELS_PATH = "/v1/models"
# A conversation of a million tokens is ~8 MB of JSON: anything past this is a bug.
MAX_BODY_BYTES = 64 * 2**20


class CallRefused(Exception):
    """A call the rollout will not run: answered `status` with `message` (vLLM's body)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@attrs.frozen
class GenerateCall:
    """One call of a driven rollout: the conversation so far as the environment rendered
    it, and what it asked for (`max_tokens`, extra `stop_token_ids`)."""

    token_ids: np.ndarray
    max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@attrs.define(eq=False)
class _Pending:
    """A call handed to its rollout, and its answer once the rollout has it."""

    call: GenerateCall
    done: trio.Event = attrs.field(factory=trio.Event)
    turn: TurnOutput | None = None
    refused: CallRefused | None = None

    def answer(self, turn: TurnOutput | None, refused: CallRefused | None) -> None:
        if not self.done.is_set():
            self.turn, self.refused = turn, refused
            self.done.set()


#: What a rollout does with each call: run it as a turn, or raise `CallRefused`.
TurnRunner = Callable[[GenerateCall], Awaitable[TurnOutput]]


@attrs.define(eq=False)
class ModelDesk:
    """The rollouts open for calls, and the endpoint that serves them (see the module
    docstring). `attach` gives it the nursery its server runs in (started on first use)."""

    model: str
    max_model_len: int
    _rollouts: dict[str, trio.MemorySendChannel[_Pending]] = attrs.field(factory=dict)
    _nursery: trio.Nursery | None = None
    _url: str | None = None
    _starting: trio.Lock = attrs.field(factory=trio.Lock)

    def attach(self, nursery: trio.Nursery) -> None:
        """Serve, once a rollout needs it, in `nursery` (the run's)."""
        self._nursery = nursery

    async def url(self) -> str:
        """The endpoint's base URL, starting its server the first time."""
        async with self._starting:
            if self._url is None:
                if self._nursery is None:
                    raise RuntimeError("the model endpoint has no nursery to serve in")
                address = await self._nursery.start(functools.partial(serve_asgi, self.app))
                self._url = address.url
                log.info("model endpoint for driven environments", url=self._url)
            return self._url

    @asynccontextmanager
    async def rollout(self, run_turn: TurnRunner) -> AsyncIterator[tuple[str, _Calls]]:
        """Open a key for one rollout: its URL, and the calls that arrive there, which
        the rollout runs one at a time (`_Calls.serve`) in its own task. Closing the key
        refuses what is still queued (404 for later calls)."""
        base_url = await self.url()
        key = secrets.token_urlsafe(16)
        send, receive = trio.open_memory_channel[_Pending](0)
        self._rollouts[key] = send
        try:
            yield f"{base_url}{ROLLOUTS_PREFIX}{key}", _Calls(receive, run_turn)
        finally:
            del self._rollouts[key]
            send.close()

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app: `/rollouts/<key>` + `/inference/v1/generate` or `/v1/models`."""
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        key, _, route = path.removeprefix(ROLLOUTS_PREFIX).partition("/")
        route = "/" + route
        channel = self._rollouts.get(key) if path.startswith(ROLLOUTS_PREFIX) else None
        if route not in (GENERATE_PATH, MODELS_PATH) or not path.startswith(ROLLOUTS_PREFIX):
            await _refuse(send, 404, f"no such path: {path}")
        elif channel is None:
            await _refuse(send, 404, "no such rollout: it has ended, or the key is wrong")
        elif route == MODELS_PATH:
            await send_json(send, 200, self._models())
        elif scope["method"] != "POST":
            await _refuse(send, 405, f"{scope['method']} is not allowed; use POST")
        else:
            await self._generate(channel, receive, send)

    def _models(self) -> dict[str, Any]:
        model = {
            "id": self.model,
            "object": "model",
            "owned_by": "rollout-orchestrator",
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [model]}

    async def _generate(
        self, channel: trio.MemorySendChannel[_Pending], receive: Receive, send: Send
    ) -> None:
        try:
            body = await read_body(receive, limit=MAX_BODY_BYTES)
        except ClientGone:
            return
        except BodyTooLarge:
            await _refuse(send, 413, f"body larger than {MAX_BODY_BYTES} bytes")
            return
        try:
            call = parse_generate_call(body)
        except CallRefused as refused:
            await _refuse(send, refused.status, str(refused))
            return
        pending = _Pending(call)
        try:
            await channel.send(pending)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await _refuse(send, 404, "no such rollout: it has ended")
            return
        await pending.done.wait()
        if pending.refused is not None:
            await _refuse(send, pending.refused.status, str(pending.refused))
            return
        assert pending.turn is not None
        await send_json(send, 200, generate_answer(call, pending.turn))


@attrs.define(eq=False)
class _Calls:
    """The calls arriving at one rollout's key."""

    _receive: trio.MemoryReceiveChannel[_Pending]
    _run_turn: TurnRunner

    async def serve(self) -> None:
        """Run each call as it comes (one at a time: a conversation is sequential) until
        cancelled; a call cut short by the cancellation is refused (410)."""
        async with self._receive:
            async for pending in self._receive:
                try:
                    turn = await self._run_turn(pending.call)
                except CallRefused as refused:
                    pending.answer(None, refused)
                else:
                    pending.answer(turn, None)
                finally:
                    pending.answer(None, CallRefused(410, "the rollout ended during the call"))


async def _refuse(send: Send, status: int, message: str) -> None:
    await send_json(send, status, error_body(status, message))


def parse_generate_call(body: bytes) -> GenerateCall:
    """A generate request's fields the daemon takes: `token_ids` (a non-empty list of
    token ids), `sampling_params.max_tokens` and `.stop_token_ids`. The rest (the
    environment's temperature, logprobs, its routing start) is the daemon's to decide.
    Raises `CallRefused(400)` naming what is wrong."""
    try:
        request = json.loads(body)
    except ValueError as exc:
        raise CallRefused(400, f"the body is not JSON ({exc})") from None
    if not isinstance(request, dict):
        raise CallRefused(400, "the body is not a JSON object")
    ids = request.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(_token_id(i) for i in ids):
        raise CallRefused(400, "token_ids must be a non-empty list of token ids")
    params = request.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise CallRefused(400, "sampling_params must be an object")
    max_tokens = params.get("max_tokens")
    if max_tokens is not None and not (_token_id(max_tokens) and max_tokens > 0):
        raise CallRefused(400, "sampling_params.max_tokens must be a positive integer")
    stops = params.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(_token_id(i) for i in stops):
        raise CallRefused(400, "sampling_params.stop_token_ids must be a list of token ids")
    return GenerateCall(np.asarray(ids, dtype=TOKEN_DTYPE), max_tokens, tuple(stops))


def _token_id(value: object) -> bool:
    return type(value) is int and 0 <= value < 2**31


def generate_answer(call: GenerateCall, turn: TurnOutput) -> dict[str, Any]:
    """vLLM's generate response for a turn: the sampled tokens with their logprobs (as
    `token_id:<id>` entries, the form a tokens-in/tokens-out client reads), no payload
    (the daemon keeps the routing and the masks)."""
    completion = turn.completion_ids.tolist()
    content = [
        {"token": f"token_id:{token}", "logprob": logprob}
        for token, logprob in zip(completion, turn.logprobs.tolist(), strict=True)
    ]
    prompt_tokens = len(call.token_ids)
    return {
        "request_id": "orchestrator",
        "choices": [
            {
                "index": 0,
                "token_ids": completion,
                "logprobs": {"content": content},
                "finish_reason": turn.finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(completion),
            "total_tokens": prompt_tokens + len(completion),
        },
    }

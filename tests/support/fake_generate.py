"""A stand-in for the daemon's loopback endpoint of driven episodes, for the verifiers
worker's tests: `model_url(name)` is one rollout's endpoint, answering
`POST .../inference/v1/generate` (vLLM's token-in/token-out form, as prime-rl's
extension answers it) with fixed tokens, and `GET .../v1/models` with the context length.
Every request is kept (`seen`). A rollout can be made to fail (`fail`: 500) or to hang
until released (`hold`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from orchestrator.asgi_server import (
    Receive,
    Scope,
    Send,
    read_body,
    send_json,
    serve_asgi,
    serve_lifespan,
)

#: demo/model's ids: "42" then <|im_end|>; "17" "3" then <|im_end|> (sampled by turn).
TURNS: tuple[tuple[int, ...], ...] = ((478, 2), (621, 17, 2))


@attrs.frozen
class Seen:
    """One request as the endpoint saw it."""

    rollout: str
    method: str
    path: str  # below the rollout's model_url
    session: str | None  # X-Session-ID
    body: Any  # the JSON body (None for a GET)


@attrs.define(eq=False)
class FakeGenerate:
    """See the module docstring. `turns[k]` is what a rollout's call k samples (cycling),
    unless `sample(rollout, prompt_ids, k)` says."""

    turns: Sequence[Sequence[int]] = TURNS
    sample: Callable[[str, list[int], int], Sequence[int]] | None = None
    model: str = "policy"
    max_model_len: int = 4096
    url: str = ""
    seen: list[Seen] = attrs.field(factory=list)
    failing: dict[str, int] = attrs.field(factory=dict)
    held: dict[str, tuple[trio.Event, trio.Event]] = attrs.field(factory=dict)
    _calls: dict[str, int] = attrs.field(factory=dict)

    def model_url(self, rollout: str) -> str:
        return f"{self.url}/r/{rollout}"

    def fail(self, rollout: str, status: int = 500) -> None:
        """Answer the rollout's calls with `status`."""
        self.failing[rollout] = status

    def hold(self, rollout: str) -> tuple[trio.Event, trio.Event]:
        """Hold the rollout's calls: (set when one arrives, set it to answer)."""
        events = (trio.Event(), trio.Event())
        self.held[rollout] = events
        return events

    def calls(self, rollout: str) -> list[Seen]:
        return [seen for seen in self.seen if seen.rollout == rollout and seen.body is not None]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        parts = scope["path"].split("/", 3)  # "", "r", name, rest
        if len(parts) < 4 or parts[1] != "r":
            await send_json(send, 404, {"error": "no such path"})
            return
        rollout, path = parts[2], "/" + parts[3]
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        body = await read_body(receive, limit=1 << 26)
        parsed = json.loads(body) if body else None
        self.seen.append(Seen(rollout, scope["method"], path, headers.get("x-session-id"), parsed))
        if path == "/v1/models":
            card = {"id": self.model, "object": "model", "max_model_len": self.max_model_len}
            await send_json(send, 200, {"object": "list", "data": [card]})
            return
        if path != "/inference/v1/generate" or parsed is None:
            await send_json(send, 404, {"error": "no such path"})
            return
        if rollout in self.held:
            arrived, release = self.held[rollout]
            arrived.set()
            await release.wait()
        if rollout in self.failing:
            status = self.failing[rollout]
            error = {"message": "injected failure", "code": status}
            await send_json(send, status, {"error": error})
            return
        call = self._calls.get(rollout, 0)
        self._calls[rollout] = call + 1
        if self.sample is not None:
            ids = list(self.sample(rollout, parsed["token_ids"], call))
        else:
            ids = list(self.turns[call % len(self.turns)])
        await send_json(
            send,
            200,
            {
                "request_id": f"{rollout}-{call}",
                "prompt_token_ids": parsed["token_ids"],
                "choices": [
                    {
                        "index": 0,
                        "token_ids": ids,
                        "finish_reason": "stop",
                        "logprobs": {
                            "content": [{"token": f"token_id:{i}", "logprob": -0.5} for i in ids]
                        },
                    }
                ],
                "usage": {
                    "prompt_tokens": len(parsed["token_ids"]),
                    "completion_tokens": len(ids),
                    "total_tokens": len(parsed["token_ids"]) + len(ids),
                },
            },
        )


@asynccontextmanager
async def open_fake_generate(**kwargs: Any) -> AsyncIterator[FakeGenerate]:
    """A `FakeGenerate` serving on loopback until the block ends."""
    fake = FakeGenerate(**kwargs)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve_asgi, fake)
        fake.url = address.url
        yield fake
        nursery.cancel_scope.cancel()

"""The local fleet's disaggregated prefill/decode (P/D): a router in front of a prefill and
a decode server, over loopback HTTP like the rest of the fleet.

The router behaves as PrimeIntellect-ai/router's vLLM P/D router does
(`vllm_pd_router.rs`, `routed_experts_merge.rs`; docs/protocol.md § Disaggregated
prefill/decode), the pure parts in `orchestrator.sim._pd`:

- `POST /inference/v1/generate`: the request goes to the prefill server with
  `max_tokens = 1` and `kv_transfer_params.do_remote_decode = true`; a prefill that fails
  or answers other than 2xx is a 500 naming it. Then the original request, with the
  prefill's `kv_transfer_params`, goes to the decode server, whose status and body are
  passed on when it is not 2xx. A 2xx reply is answered with the prefill's routing merged
  in (inline), or with both sides' segments (by handle); replies that cannot be merged
  are a 500. When the client leaves, the requests to the sides are abandoned.
- `POST /update_weights` goes to both sides at once: 200 when both answered 200.
- `GET /health`: 200 when both sides answer 200, else 503.

`serve_pd_router` serves the router alone; `orchestrator.sim.inference.serve_pd_deployment`
starts the two sides and the router in front of them (what `serve_inference` serves for a
config with `disaggregated = true`).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import httpx
import msgspec
import trio

from orchestrator.asgi_server import (
    Receive,
    Scope,
    Send,
    send_bytes,
    send_json,
    serve_asgi,
    wait_for_disconnect,
)
from orchestrator.httpx_body import request_bytes
from orchestrator.wire import GENERATE_PATH, HEALTH_PATH, UPDATE_WEIGHTS_PATH, VLLM_DEV_PATHS
from orchestrator.wire.errors import error_body

from ._pd import PDMergeError, decode_request, merge_choices, prefill_request
from ._routes import request_body, route_request

__all__ = ["PDRouterConfig", "serve_pd_router"]

_JSON = {"content-type": "application/json"}
# Health and weight updates of the sides; generate requests wait as long as the client.
_CONTROL_TIMEOUT_S = 30.0


@attrs.frozen
class PDRouterConfig:
    """Where the sides are, and where the router listens (port 0: a free port)."""

    prefill_url: str
    decode_url: str
    host: str = "127.0.0.1"
    port: int = attrs.field(
        default=0, validator=[attrs.validators.ge(0), attrs.validators.le(65535)]
    )
    # The bearer token clients must send (vLLM's --api-key); "": none.
    api_key: str = attrs.field(default="", repr=False)


class _Refused(Exception):
    """A generate request the router answers itself: status and vLLM's error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _decode_json(data: bytes, what: str) -> Any:
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise _Refused(500, f"failed to parse {what} as JSON: {exc}") from None


def _merged(prefill: dict[str, Any], decode_body: bytes) -> bytes:
    """The decode reply with the prefill's routing merged in (CPU-bound: a worker thread)."""
    decode = _decode_json(decode_body, "decode response")
    choices = decode.get("choices") if isinstance(decode, dict) else None
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise _Refused(500, "decode response choices must be a list of objects")
    prefill_choices = prefill.get("choices")
    first = prefill_choices[0] if isinstance(prefill_choices, list) and prefill_choices else None
    try:
        merge_choices(first if isinstance(first, dict) else None, choices)
    except PDMergeError as exc:
        raise _Refused(500, f"cannot merge routed_experts: {exc}") from None
    merged: bytes = msgspec.json.encode(decode)
    return merged


@attrs.define
class _RouterApp:
    config: PDRouterConfig
    client: httpx.AsyncClient

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await route_request(
            scope,
            receive,
            send,
            generate=self._generate,
            update_weights=self._update_weights,
            health=self._health,
            # vLLM's dev-mode weight update goes to both sides as prime-rl's does.
            control={path: functools.partial(self._to_both, path) for path in VLLM_DEV_PATHS},
            api_key=self.config.api_key,
        )

    async def _generate(self, receive: Receive, send: Send) -> None:
        body = await request_body(receive, send)
        if body is None:
            return
        answer: tuple[int, bytes] | None = None
        async with trio.open_nursery() as nursery:

            async def abandon_when_the_client_leaves() -> None:
                await wait_for_disconnect(receive)
                nursery.cancel_scope.cancel()

            nursery.start_soon(abandon_when_the_client_leaves)
            try:
                answer = await self._two_stages(body)
            except _Refused as exc:
                answer = exc.status, msgspec.json.encode(error_body(exc.status, str(exc)))
            nursery.cancel_scope.cancel()
        if answer is not None:
            await send_bytes(send, *answer)

    async def _two_stages(self, body: bytes) -> tuple[int, bytes]:
        """Prefill, then decode; the status and body to answer."""
        request = _decode_json(body, "request")
        if not isinstance(request, dict):
            raise _Refused(400, "body must be a JSON object")
        prefill_url = self.config.prefill_url + GENERATE_PATH
        try:
            prefill = await request_bytes(
                self.client,
                "POST",
                prefill_url,
                msgspec.json.encode(prefill_request(request)),
                headers=_JSON,
            )
        except httpx.HTTPError as exc:
            raise _Refused(500, f"prefill request failed to {prefill_url}: {exc!r}") from None
        if not prefill.is_success:
            raise _Refused(500, f"prefill server error {prefill.status_code}: {prefill.text[:500]}")
        prefill_json = await trio.to_thread.run_sync(
            _decode_json, prefill.content, "prefill response"
        )
        if not isinstance(prefill_json, dict):
            raise _Refused(500, "prefill response must be a JSON object")
        decode_url = self.config.decode_url + GENERATE_PATH
        try:
            decode = await request_bytes(
                self.client,
                "POST",
                decode_url,
                msgspec.json.encode(decode_request(request, prefill_json)),
                headers=_JSON,
            )
        except httpx.HTTPError as exc:
            raise _Refused(500, f"decode request failed to {decode_url}: {exc!r}") from None
        if not decode.is_success:
            return decode.status_code, decode.content
        merged = await trio.to_thread.run_sync(_merged, prefill_json, decode.content)
        return decode.status_code, merged

    async def _both(self, method: str, path: str, body: bytes | None) -> list[httpx.Response | str]:
        """The same request to both sides at once: each answer, or why there is none."""
        answers: list[httpx.Response | str] = ["", ""]

        async def ask(index: int, url: str) -> None:
            answers[index] = f"{url}: no answer within {_CONTROL_TIMEOUT_S:g} s"
            with trio.move_on_after(_CONTROL_TIMEOUT_S):
                try:
                    answers[index] = await request_bytes(
                        self.client, method, url + path, body, headers=_JSON
                    )
                except httpx.HTTPError as exc:
                    answers[index] = f"{url}: {exc!r}"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, 0, self.config.prefill_url)
            nursery.start_soon(ask, 1, self.config.decode_url)
        return answers

    async def _update_weights(self, receive: Receive, send: Send) -> None:
        await self._to_both(UPDATE_WEIGHTS_PATH, receive, send)

    async def _to_both(self, path: str, receive: Receive, send: Send) -> None:
        """`POST path` to both sides with the same body; 200 only when both answer 200."""
        body = await request_body(receive, send)
        if body is None:
            return
        answers = await self._both("POST", path, body)
        for answer in answers:
            if isinstance(answer, str):
                await send_json(send, 503, error_body(503, f"a side is unreachable: {answer}"))
                return
            if answer.status_code != 200:
                await send_bytes(send, answer.status_code, answer.content)
                return
        await send_json(send, 200, _sides_json(answers))

    async def _health(self, send: Send) -> None:
        answers = await self._both("GET", HEALTH_PATH, None)
        health = _sides_json(answers)
        await send_json(send, 200 if health["status"] == "ok" else 503, health)


def _sides_json(answers: list[httpx.Response | str]) -> dict[str, Any]:
    def side(answer: httpx.Response | str) -> Any:
        if isinstance(answer, str):
            return {"error": answer}
        try:
            return answer.json()
        except ValueError:
            return {"status_code": answer.status_code}

    healthy = all(not isinstance(a, str) and a.status_code == 200 for a in answers)
    return {
        "status": "ok" if healthy else "unavailable",
        "role": "router",
        "prefill": side(answers[0]),
        "decode": side(answers[1]),
    }


async def serve_pd_router(
    config: PDRouterConfig, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve the router until cancelled; reports its URL (`nursery.start`). Raises
    `OSError` when the address cannot be bound."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with (
        httpx.AsyncClient(timeout=None, limits=limits) as client,
        trio.open_nursery() as nursery,
    ):
        app = _RouterApp(config, client)
        address = await nursery.start(
            functools.partial(serve_asgi, app, host=config.host, port=config.port)
        )
        task_status.started(address.url)

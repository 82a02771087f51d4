"""The inference API's routes as every local server answers them, in one place: the
aggregated, prefill and decode servers (`inference.py`) and the P/D router
(`pd_router.py`) differ in their handlers only, not in paths, methods, body limits or
errors (vLLM's error body)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from orchestrator.asgi_server import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    read_body,
    send_json,
    serve_lifespan,
)
from orchestrator.wire import (
    GENERATE_PATH,
    HEALTH_PATH,
    MODELS_PATH,
    UPDATE_WEIGHTS_PATH,
    VERSION_PATH,
)
from orchestrator.wire.errors import error_body

# 8,000 prompt tokens are ~50 kB of JSON; anything near this is a client bug.
MAX_BODY_BYTES = 64 * 2**20
# The paths vLLM's `--api-key` closes (its AuthenticationMiddleware): the generate
# endpoint is one of them; /health and the dev-mode control endpoints are not.
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")

Handler = Callable[[Receive, Send], Awaitable[None]]


async def send_error(send: Send, status: int, message: str) -> None:
    """Answer `status` with vLLM's error body."""
    await send_json(send, status, error_body(status, message))


async def request_body(receive: Receive, send: Send) -> bytes | None:
    """The request body, or None after answering 413 (or seeing the client leave)."""
    try:
        return await read_body(receive, limit=MAX_BODY_BYTES)
    except ClientGone:
        return None
    except BodyTooLarge:
        await send_error(send, 413, f"body larger than {MAX_BODY_BYTES} bytes")
        return None


async def route_request(
    scope: Scope,
    receive: Receive,
    send: Send,
    *,
    generate: Handler,
    update_weights: Handler,
    health: Callable[[Send], Awaitable[None]],
    control: Mapping[str, Handler] | None = None,
    api_key: str = "",
    version: str | None = None,
    models: Mapping[str, Any] | None = None,
) -> None:
    """Serve one ASGI call: the lifespan protocol, and for an HTTP request the handler of
    its path and method (`control`: more `POST` paths, vLLM's dev-mode endpoints); 405
    for a known path with another method, 404 for any other path. With `api_key`, a
    request to a path vLLM's `--api-key` guards without `Authorization: Bearer <api_key>`
    is answered 401 `{"error": "Unauthorized"}`, as vLLM answers it. With `version`,
    `GET /version` answers `{"version": version}` as vLLM does (else 404); with `models`,
    `GET /v1/models` answers it (vLLM's model list). Other scope types (websockets) are
    ignored."""
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    if scope["type"] != "http":
        return
    if api_key and _refused_credentials(scope, api_key):
        await send_json(send, 401, {"error": "Unauthorized"})
        return
    route = (scope["method"], scope["path"])
    extra = control or {}
    if scope["method"] == "POST" and scope["path"] in extra:
        await extra[scope["path"]](receive, send)
    elif route == ("POST", GENERATE_PATH):
        await generate(receive, send)
    elif route == ("POST", UPDATE_WEIGHTS_PATH):
        await update_weights(receive, send)
    elif route == ("GET", HEALTH_PATH):
        await health(send)
    elif version is not None and route == ("GET", VERSION_PATH):
        await send_json(send, 200, {"version": version})
    elif models is not None and route == ("GET", MODELS_PATH):
        await send_json(send, 200, dict(models))
    elif scope["path"] in (
        GENERATE_PATH,
        UPDATE_WEIGHTS_PATH,
        HEALTH_PATH,
        *((VERSION_PATH,) if version is not None else ()),
        *extra,
    ):
        await send_error(send, 405, f"Method {scope['method']} not allowed")
    else:
        await send_error(send, 404, f"No route {scope['path']}")


def _refused_credentials(scope: Scope, api_key: str) -> bool:
    if scope["method"] == "OPTIONS" or not scope["path"].startswith(GUARDED_PREFIXES):
        return False
    headers = dict(scope["headers"])
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    if scheme.lower() != "bearer":
        return True
    return not hmac.compare_digest(token.encode("latin-1"), api_key.encode("latin-1"))

"""A hostile inference server: a loopback HTTP proxy in front of a real local server that
rewrites every generate reply (and may plant traps in the payload root) before the daemon
sees it. Everything else (health, weight updates) passes through unchanged.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import attrs
import httpx
import trio

from orchestrator.asgi_server import Receive, Scope, Send, read_body, send_bytes, serve_lifespan
from orchestrator.httpx_body import request_bytes
from orchestrator.wire import GENERATE_PATH


@attrs.frozen
class Exchange:
    """One generate request as the daemon sent it, and the honest server's reply."""

    request: dict[str, Any]
    reply: dict[str, Any]

    @property
    def payload_dir(self) -> Path | None:
        extra = self.request["sampling_params"].get("extra_args") or {}
        directory = extra.get("payload_dir")
        return None if directory is None else Path(directory)

    @property
    def choice(self) -> dict[str, Any]:
        choice: dict[str, Any] = self.reply["choices"][0]
        return choice

    @property
    def segments(self) -> list[dict[str, Any]]:
        segments: list[dict[str, Any]] = self.choice.get("payload") or []
        return segments


#: An attack: what the daemon receives instead of the honest reply (JSON, or raw bytes).
Rewrite = Callable[[Exchange], dict[str, Any] | bytes]


def rewriting(change: Callable[[Exchange], None]) -> Rewrite:
    """An attack that edits a copy of each reply carrying segments in place (`change`);
    replies without segments pass unchanged."""

    def rewrite(exchange: Exchange) -> dict[str, Any]:
        exchange = Exchange(exchange.request, copy.deepcopy(exchange.reply))
        if exchange.segments:
            change(exchange)
        return exchange.reply

    return rewrite


@attrs.define
class _ProxyApp:
    upstream: str
    rewrite: Rewrite
    client: httpx.AsyncClient
    rewritten: int = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        body = await read_body(receive, limit=1 << 30)
        response = await request_bytes(
            self.client,
            scope["method"],
            self.upstream + scope["path"],
            body,
            headers={"content-type": "application/json"},
        )
        data = response.content
        if scope["path"] == GENERATE_PATH and response.status_code == 200:
            exchange = Exchange(json.loads(body), json.loads(data))
            # Attacks may touch the filesystem: off the event loop, like a real server.
            changed = await trio.to_thread.run_sync(self.rewrite, exchange)
            data = changed if isinstance(changed, bytes) else json.dumps(changed).encode()
            self.rewritten += 1
        await send_bytes(send, response.status_code, data)


async def serve_hostile_proxy(
    upstream: str, rewrite: Rewrite, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve the proxy on a free loopback port until cancelled; reports its URL."""
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve
    from hypercorn.typing import ASGIFramework

    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    async with httpx.AsyncClient(timeout=60) as client, trio.open_nursery() as nursery:
        app = cast("ASGIFramework", _ProxyApp(upstream.rstrip("/"), rewrite, client))
        binds: list[str] = await nursery.start(functools.partial(serve, app, config))
        task_status.started(binds[0])

"""The daemon's two HTTP clients: a lean one for generate requests, httpx for the rest.

Generate requests are the daemon's hot path, hundreds in flight: they go through
`orchestrator.daemon.inference.http11`, whose per-request cost is a fraction of httpx's
(docs/benchmarks.md). Weight updates and health probes are a few requests per step: they
use httpx, on a client of their own so they never queue behind generate requests.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator

import attrs
import httpx
import trio

from orchestrator.daemon.inference.credentials import BearerToken
from orchestrator.daemon.inference.http11 import HTTP11Client


@attrs.frozen
class Clients:
    generate: HTTP11Client
    control: httpx.AsyncClient


def control_client(tls: ssl.SSLContext, token: BearerToken | None) -> httpx.AsyncClient:
    """The httpx client of the control calls (health, weight updates, `/version`): no
    timeout of its own (deadlines are the callers'), `token` sent with every request."""
    headers = {} if token is None else {"authorization": token.authorization}
    return httpx.AsyncClient(timeout=None, verify=tls, headers=headers)


@contextlib.asynccontextmanager
async def open_clients(
    max_inflight: int,
    *,
    max_reply_bytes: int,
    max_buffered_reply_bytes: int,
    token: BearerToken | None = None,
) -> AsyncIterator[Clients]:
    """Both clients, closed on exit. `max_inflight` bounds the idle generate connections
    kept per server; a generate reply may hold `max_reply_bytes`, and all of them together
    `max_buffered_reply_bytes` (`Config.max_reply_bytes`, `Config.max_buffered_reply_bytes`).
    Both send `token` (when given) with every request.

    The TLS context (loading the trust store blocks for up to a second) is built once, in
    a worker thread, and shared.
    """
    tls: ssl.SSLContext = await trio.to_thread.run_sync(ssl.create_default_context)
    authorization = None if token is None else token.authorization
    async with (
        HTTP11Client(
            tls=tls,
            max_idle=max_inflight,
            max_response_bytes=max_reply_bytes,
            max_buffered_bytes=max_buffered_reply_bytes,
            authorization=authorization,
        ) as generate,
        control_client(tls, token) as control,
    ):
        yield Clients(generate, control)

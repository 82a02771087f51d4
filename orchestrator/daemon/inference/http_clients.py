"""The daemon's two HTTP clients, both `orchestrator.daemon.inference.http11`'s lean one:
generate requests on one, the control calls (weight updates, health probes, `/version`)
on the other.

Generate requests are the daemon's hot path, hundreds in flight; a weight update is one
request per server and step. On httpx a control call cost the loop 1.0 to 1.3 ms of CPU,
on the lean client about 0.2 ms (docs/design.md §12). The control calls have a client of
their own so that their small answers never wait for the generate replies' shared byte
budget.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator

import attrs
import trio

from orchestrator.daemon.inference.credentials import BearerToken
from orchestrator.daemon.inference.http11 import HTTP11Client


@attrs.frozen
class Clients:
    generate: HTTP11Client
    control: HTTP11Client


#: The longest answer a control call reads (a weight update's, `/health`, `/version`, or
#: a server's error body): a few hundred bytes in practice.
MAX_CONTROL_REPLY_BYTES = 1 << 20


def control_client(tls: ssl.SSLContext, token: BearerToken | None) -> HTTP11Client:
    """The client of the control calls (health, weight updates, `/version`): deadlines
    are the callers', `token` sent with every request. A few idle connections per server
    (the control calls to one server are one at a time but for a probe beside an update)."""
    return HTTP11Client(
        tls=tls,
        max_idle=4,
        max_response_bytes=MAX_CONTROL_REPLY_BYTES,
        max_buffered_bytes=MAX_CONTROL_REPLY_BYTES * 64,
        authorization=None if token is None else token.authorization,
    )


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

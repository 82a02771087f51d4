"""HTTP clients for talking to inference servers, sharded to keep each pool small.

httpcore's connection pool re-examines every connection it holds each time it assigns a
request, and does so once per idle connection: the bookkeeping per request grows with the
square of the pool's size. With `max_inflight` in the hundreds that, not the network,
becomes the daemon's ceiling (docs/benchmarks.md: 340 rollouts per CPU-second with one
pool of 64 connections, 600 with 16). So generate requests are spread over several
clients of at most `SHARD_CONNECTIONS` connections each, always to the least busy one;
weight updates and health probes have a client of their own, so they never queue behind
generate requests.
"""

from __future__ import annotations

import contextlib
import math
import ssl
from collections.abc import AsyncIterator, Iterator

import attrs
import httpx
import trio

#: Connections per client: small enough that a pool's bookkeeping stays cheap, large
#: enough that a handful of clients covers a few hundred requests in flight.
SHARD_CONNECTIONS = 16


@attrs.define
class ClientShards:
    """Clients for generate requests (`lease()` lends the least busy one for one
    request) and a `control` client for weight updates and health probes."""

    clients: tuple[httpx.AsyncClient, ...]
    control: httpx.AsyncClient
    _busy: list[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._busy = [0] * len(self.clients)

    @contextlib.contextmanager
    def lease(self) -> Iterator[httpx.AsyncClient]:
        index = min(range(len(self.clients)), key=self._busy.__getitem__)
        self._busy[index] += 1
        try:
            yield self.clients[index]
        finally:
            self._busy[index] -= 1


@contextlib.asynccontextmanager
async def open_client_shards(max_inflight: int) -> AsyncIterator[ClientShards]:
    """Enough clients for `max_inflight` concurrent requests; closed on exit.

    The TLS context (loading the trust store blocks for up to a second) is built once, in
    a worker thread, and shared.
    """
    tls: ssl.SSLContext = await trio.to_thread.run_sync(ssl.create_default_context)
    count = max(1, math.ceil(max_inflight / SHARD_CONNECTIONS))
    limits = httpx.Limits(
        max_connections=SHARD_CONNECTIONS, max_keepalive_connections=SHARD_CONNECTIONS
    )
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(timeout=None, limits=limits, verify=tls)
            )
            for _ in range(count)
        ]
        control = await stack.enter_async_context(httpx.AsyncClient(timeout=None, verify=tls))
        yield ClientShards(tuple(clients), control)

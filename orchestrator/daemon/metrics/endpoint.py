"""The metrics endpoint: `GET /metrics` answers `generate_latest(registry)`, served by
hypercorn on the daemon's own trio loop.

Why this design: hypercorn is already the local fleet's HTTP server and runs on trio, so
it serves here too (it owns HTTP/1.1 parsing, keep-alive, timeouts and error answers),
through `orchestrator.asgi_server.serve_asgi` like the fleet's servers, taking over the
sockets `orchestrator.daemon.preflight` bound. The app in front of the registry
is a few lines rather than prometheus-client's `make_asgi_app`, to answer only
`/metrics` (404 elsewhere, 405 for methods other than GET and HEAD) in the text format
`generate_latest` writes. It encodes on the trio thread, not in a worker thread, because
the collectors read the run's state, which only the trio thread may touch (a worker
would race the tasks that mutate it); encoding two dozen families takes well under a
millisecond, which the event loop lag monitor would show if it ever grew.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import attrs
import structlog
import trio
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest

# How long a connection may sit idle: every server's (orchestrator.asgi_server).
from orchestrator.asgi_server import IDLE_DEADLINE_S as IDLE_DEADLINE_S
from orchestrator.asgi_server import bind_socket, serve_asgi

log = structlog.get_logger(__name__)

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

_LOOPBACK = "127.0.0.1"

Message = MutableMapping[str, Any]


class BadListenAddress(ValueError):
    """A listen address that is not `host:port` with a port in 0..65535."""


def parse_listen_address(listen: str) -> tuple[str, int]:
    """Split `"host:port"` into its parts: `"[::1]:9464"` for IPv6, and `":9464"` (no
    host) means loopback, never every interface: metrics are not for the whole network
    unless the config says so.

    Raises `BadListenAddress` naming the value.
    """
    host, colon, port = listen.rpartition(":")
    if not colon or not port.isdigit() or int(port) > 65535:
        raise BadListenAddress(f'metrics listen address {listen!r} is not "host:port"')
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or _LOOPBACK, int(port)


@attrs.frozen
class MetricsApp:
    """The ASGI app serving `registry`."""

    registry: CollectorRegistry

    async def __call__(
        self,
        scope: Message,
        receive: Callable[[], Awaitable[Message]],
        send: Callable[[Message], Awaitable[None]],
    ) -> None:
        if scope["type"] == "lifespan":  # nothing to set up or tear down
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        headers = [(b"content-type", b"text/plain; charset=utf-8")]
        if scope["path"] != "/metrics":
            status, body = 404, b"not found: the metrics are at /metrics\n"
        elif scope["method"] not in ("GET", "HEAD"):
            status, body = 405, f"{scope['method']} is not allowed; use GET\n".encode()
            headers.append((b"allow", b"GET, HEAD"))
        else:
            # An exception here becomes a 500 (hypercorn logs it); the server lives on.
            status, body = 200, generate_latest(self.registry)
            headers = [(b"content-type", CONTENT_TYPE.encode())]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})  # none for HEAD


async def serve_metrics(
    listen: str,
    registry: CollectorRegistry,
    *,
    sockets: Sequence[socket.socket] = (),
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `registry` in the Prometheus text format at `GET /metrics` on `listen` until
    cancelled.

    Reports the bound `(host, port)` through `task_status` (port 0 picks a free port).
    Raises `BadListenAddress` for a bad `listen`, `OSError` when it cannot listen there.

    `sockets`, when given, are listening sockets already bound to `listen` (by
    `orchestrator.daemon.preflight`, so that a port in use is found before the run changes
    anything): the server takes them over and closes them when it stops.
    """
    if not sockets:
        # Bound here rather than by serve_asgi, so that a port in use is raised as itself,
        # not inside the nursery's exception group.
        sockets = [await trio.to_thread.run_sync(bind_socket, *parse_listen_address(listen))]
    app = MetricsApp(registry)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(functools.partial(serve_asgi, app, sockets=sockets))
        log.info("serving metrics", url=f"{address.url}/metrics")
        task_status.started((address.host, address.port))

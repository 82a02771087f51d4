"""Serve an ASGI app with hypercorn on the running trio loop (`serve_asgi`), and the little
of ASGI the apps need: read a body, send bytes or JSON, see a client leave, answer the
lifespan protocol.

Every HTTP server of this project (the daemon's metrics endpoint, the local fleet's
inference servers and P/D router) is a small hand-written ASGI app that hypercorn serves
the same way: on sockets this module binds (or a caller bound earlier, to find a port in
use before anything else starts), with hypercorn's logs going through stdlib logging
(which `orchestrator.logs.configure_logging` renders like everything else) and no access
log. A leaf: it imports nothing of the orchestrator.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import socket
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs
import trio

if TYPE_CHECKING:
    from hypercorn.typing import ASGIFramework

__all__ = [
    "IDLE_DEADLINE_S",
    "ASGIApp",
    "BodyTooLarge",
    "ClientGone",
    "ListenAddress",
    "Receive",
    "Scope",
    "Send",
    "bind_socket",
    "read_body",
    "send_bytes",
    "send_json",
    "serve_asgi",
    "serve_lifespan",
    "wait_for_disconnect",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
#: An ASGI 3 application over plain-dict messages (https://asgi.readthedocs.io).
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# How long a connection may sit idle, or stall before its request head is complete.
# hypercorn also holds a connection the client closed between requests open until then,
# so it stays short (hypercorn's default); a client reconnecting per request costs nothing.
IDLE_DEADLINE_S = 5.0


@attrs.frozen
class ListenAddress:
    """Where a server listens: the bound host and port (the real one for port 0)."""

    host: str
    port: int

    @property
    def url(self) -> str:
        """`http://host:port`, an IPv6 host in brackets."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket listening on `host:port` (port 0: a free port). Blocking: a host name is
    looked up, so call it from a worker thread under trio.

    Raises `OSError` when it cannot listen there.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_asgi(
    app: ASGIApp,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    sockets: Sequence[socket.socket] = (),
    task_status: trio.TaskStatus[ListenAddress] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on `host:port` until cancelled; start it with `nursery.start`, which
    returns the `ListenAddress` (the real port when `port` is 0).

    `sockets`, when given, are listening sockets already bound (`host` and `port` are then
    unused): the server takes them over. Either way it closes its sockets when it stops.
    Raises `OSError` when it cannot listen on `host:port`.
    """
    # Imported here: the CLI builds its parser from every command module, and hypercorn
    # is only needed by a process that actually serves. First in a worker thread: a
    # server started mid-run (the daemon's model endpoint) would otherwise stall the
    # loop for the import (50 ms and more).
    await trio.to_thread.run_sync(importlib.import_module, "hypercorn.trio.run")
    from hypercorn.app_wrappers import ASGIWrapper
    from hypercorn.config import Config, Sockets
    from hypercorn.trio.run import worker_serve

    if not sockets:
        sockets = [await trio.to_thread.run_sync(bind_socket, host, port)]
    try:
        config = Config()
        config.accesslog = None
        # Through stdlib logging, which `configure_logging` renders like everything else.
        config.errorlog = logging.getLogger("hypercorn.error")
        config.keep_alive_timeout = IDLE_DEADLINE_S
        bound_host, bound_port = sockets[0].getsockname()[:2]
        async with trio.open_nursery() as nursery:
            # The apps speak plain-dict ASGI rather than hypercorn's TypedDicts.
            wrapped = ASGIWrapper(cast("ASGIFramework", app))
            await nursery.start(
                functools.partial(
                    worker_serve, wrapped, config, sockets=Sockets([], [*sockets], [])
                )
            )
            task_status.started(ListenAddress(bound_host, bound_port))
    finally:
        for sock in sockets:
            sock.close()


class ClientGone(Exception):
    """The client disconnected before the request body was complete."""


class BodyTooLarge(Exception):
    """The request body is larger than the server accepts."""


async def read_body(receive: Receive, *, limit: int) -> bytes:
    """Read the whole request body.

    Raises `ClientGone` if the client disconnects first, `BodyTooLarge` past `limit` bytes.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def wait_for_disconnect(receive: Receive) -> None:
    """Wait until the client closes the connection (call after the body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_bytes(
    send: Send, status: int, body: bytes, content_type: bytes = b"application/json"
) -> None:
    """Send a complete response with `status` and `body`."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode("ascii")),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(send: Send, status: int, obj: object) -> None:
    """Send `obj` as a JSON response with `status`."""
    await send_bytes(send, status, json.dumps(obj).encode())


async def serve_lifespan(receive: Receive, send: Send) -> None:
    """Answer the server's lifespan protocol: nothing to set up or tear down."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return

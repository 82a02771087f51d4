"""The little of ASGI the simulated server needs: read a body, send bytes, see a client leave.

A hand-written app keeps the simulator free of a web framework dependency; hypercorn
speaks ASGI to it (https://asgi.readthedocs.io/en/latest/specs/www.html).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = [
    "BodyTooLarge",
    "ClientGone",
    "Receive",
    "Scope",
    "Send",
    "read_body",
    "send_bytes",
    "send_json",
    "serve_lifespan",
    "wait_for_disconnect",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


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

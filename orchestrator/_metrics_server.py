"""The metrics endpoint: a small HTTP/1.1 server on trio answering `GET /metrics`."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from functools import partial
from http import HTTPStatus

import attrs
import structlog
import trio

from orchestrator._metrics_format import CONTENT_TYPE
from orchestrator._metrics_http_protocol import (
    HEAD_END,
    MAX_HEAD_BYTES,
    MalformedRequest,
    RequestHead,
    Response,
    encode_response,
    parse_request_head,
    plain_response,
    route,
)

log = structlog.get_logger("orchestrator.metrics")

# A kept-alive connection may sit idle this long between requests: longer than a minute,
# Prometheus's default scrape interval, so a scraper can reuse its connection.
IDLE_DEADLINE_S = 75.0
# Once a request has started, its head must arrive and its response leave within this.
REQUEST_DEADLINE_S = 10.0
# How long a connection the server closes may drain what the client still sends.
LINGER_DEADLINE_S = 2.0

_LOOPBACK = "127.0.0.1"


class _HeadTooLarge(Exception):
    """A request head longer than `MAX_HEAD_BYTES` (answered 431)."""


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


async def serve_metrics(
    listen: str,
    render: Callable[[], str],
    *,
    sockets: Sequence[socket.socket] = (),
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `render()` as Prometheus text at `GET /metrics` on `listen` until cancelled.

    Reports the bound `(host, port)` through `task_status` (port 0 picks a free port).
    Another path gets 404, another method 405, a malformed request 400 and a closed
    connection; an exception from `render` gets 500. None of them stops the server.
    Raises `BadListenAddress` for a bad `listen`, `OSError` when it cannot listen there.

    `sockets`, when given, are listening sockets already bound to `listen` (by
    `orchestrator.preflight`, so that a port in use is found before the run changes
    anything): the server takes them over and closes them when it stops.
    """
    if sockets:
        listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(s)) for s in sockets]
    else:
        host, port = parse_listen_address(listen)
        listeners = await trio.open_tcp_listeners(port, host=host)
    bound_host, bound_port = listeners[0].socket.getsockname()[:2]
    shown_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    log.info("serving metrics", url=f"http://{shown_host}:{bound_port}/metrics")
    task_status.started((bound_host, bound_port))
    await trio.serve_listeners(partial(_serve_connection, render), listeners)


async def _serve_connection(render: Callable[[], str], stream: trio.SocketStream) -> None:
    async with stream:
        try:
            await _answer_requests(render, stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
            # The client went away or stalled; there is no one left to answer.
            pass
        except Exception:
            # A bug here must not end the server, nor the daemon whose nursery runs it:
            # metrics are an observer. Log it loudly and drop this one connection.
            log.exception("metrics connection failed")


async def _answer_requests(render: Callable[[], str], stream: trio.SocketStream) -> None:
    """Answer requests on one connection until it closes, goes idle or must be closed."""
    buffer = bytearray()
    while True:
        with trio.move_on_after(IDLE_DEADLINE_S):
            if not buffer and not await _receive_into(stream, buffer):
                return  # closed between requests: the normal end of a connection
        if not buffer:
            return  # idle too long
        with trio.fail_after(REQUEST_DEADLINE_S):
            request = await _read_request(stream, buffer)
            if isinstance(request, Response):
                response, head_only, keep_alive = request, False, False
            else:
                response = _respond(request, render)
                head_only, keep_alive = request.method == "HEAD", request.keep_alive
            await stream.send_all(
                encode_response(response, head_only=head_only, keep_alive=keep_alive)
            )
        if not keep_alive:
            await _close_gracefully(stream)
            return


async def _read_request(stream: trio.SocketStream, buffer: bytearray) -> RequestHead | Response:
    """The next request on the connection, or the error response to a bad one."""
    try:
        return parse_request_head(await _read_head(stream, buffer))
    except MalformedRequest as exc:
        log.debug("bad metrics request", error=str(exc))
        return plain_response(HTTPStatus.BAD_REQUEST, str(exc))
    except _HeadTooLarge:
        log.debug("bad metrics request", error="request head too large")
        return plain_response(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)


async def _close_gracefully(stream: trio.SocketStream) -> None:
    """Half-close, then discard what the client still sends until it closes its side.

    Closing a socket with unread input makes the kernel reset the connection, which can
    destroy the response before the client has read it (RFC 9112 §9.6, "lingering close").
    """
    await stream.send_eof()
    with trio.move_on_after(LINGER_DEADLINE_S):
        while await stream.receive_some(65536):
            pass


async def _receive_into(stream: trio.SocketStream, buffer: bytearray) -> bool:
    """Append what the peer sent next to `buffer`; `False` when it closed its side."""
    data = await stream.receive_some(MAX_HEAD_BYTES)
    buffer += data
    return bool(data)


async def _read_head(stream: trio.SocketStream, buffer: bytearray) -> bytes:
    """Take the next request head off `buffer`, receiving more as needed.

    Raises `MalformedRequest` when the peer closes mid-head, `_HeadTooLarge` past
    `MAX_HEAD_BYTES`.
    """
    while True:
        # RFC 9112 §2.2: ignore empty lines before a request line.
        while buffer.startswith((b"\r", b"\n")):
            del buffer[:1]
        end = HEAD_END.search(buffer)
        if end is not None:
            head = bytes(buffer[: end.start()])
            del buffer[: end.end()]
            return head
        if len(buffer) > MAX_HEAD_BYTES:
            raise _HeadTooLarge
        if not await _receive_into(stream, buffer):
            raise MalformedRequest("the connection closed before the request head ended")


def _respond(request: RequestHead, render: Callable[[], str]) -> Response:
    status = route(request)
    if status is HTTPStatus.METHOD_NOT_ALLOWED:
        response = plain_response(status, f"{request.method} is not allowed; use GET")
        return attrs.evolve(response, headers=(("Allow", "GET, HEAD"),))
    if status is not None:
        return plain_response(status)
    try:
        text = render()
    except Exception:
        # A broken metric must not take the endpoint down: the next scrape may succeed.
        log.exception("rendering metrics failed")
        return plain_response(HTTPStatus.INTERNAL_SERVER_ERROR)
    return Response(HTTPStatus.OK, CONTENT_TYPE, text.encode("utf-8"))

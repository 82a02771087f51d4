"""A lean HTTP/1.1 client for the daemon's requests: trio streams, h11, idle connections
kept per origin.

The daemon makes one small POST per turn, hundreds in flight, to a handful of servers.
httpx and httpcore spend more CPU on that than everything else the daemon does: their
pool re-examines every connection it holds each time it assigns a request
(docs/benchmarks.md). Here a request takes the most recently used idle connection to its
origin (after one `poll` to see that the server has not closed it), or opens a new one;
after a complete exchange the connection goes back to its origin's idle stack. There is
no connection limit: the dispatcher already bounds the requests in flight.

Deadlines are the caller's (a cancel scope around `request`). A connection whose exchange
was cancelled or broke is closed, never reused. Failures are `HTTPFailure` with `kind`
"connect" (the server could not be reached), "transport" (the connection broke, or the
answer was not HTTP/1.1 the client could read) or "oversized" (the answer's body is longer
than `max_response_bytes`).

Answers are buffered whole, so memory is bounded twice: each body by `max_response_bytes`
(a `Content-Length` above it is refused before any of the body is read; a longer chunked
or close-delimited body when it gets there), and all bodies being read at once by
`max_buffered_bytes`. Before reading a body a request reserves what it may need, its
`Content-Length` or else `max_response_bytes`, from a budget shared by the client's
requests, and gives it back when it returns. A request that does not fit waits, first
come first served, while holding nothing: the requests it waits for hold their whole
reservation and need nothing more, so each of them finishes (or fails, or reaches its
deadline) and frees its share. Nothing can deadlock, and since a reservation never
exceeds the budget a request alone always proceeds. The wait is inside the caller's
deadline.
"""

from __future__ import annotations

import collections
import functools
import ssl
import urllib.parse
from collections.abc import Sequence
from typing import Protocol

import attrs
import h11
import trio

#: Bytes asked of the socket per read (the buffer is allocated at this size, then shrunk
#: to what arrived: small enough to stay off mmap for the common answer of a few KiB).
RECEIVE_BYTES = 64 * 1024
#: The default bound on one answer's body (the daemon sets a tighter one: see
#: `orchestrator.config.reply_limits`), and on all bodies being read at once.
MAX_RESPONSE_BYTES = 1 << 30
MAX_BUFFERED_BYTES = 1 << 30
USER_AGENT = "rollout-orchestrator"


class HTTPFailure(Exception):
    """The request got no usable HTTP answer. `kind` is "connect", "transport" or
    "oversized"."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


@attrs.frozen
class Origin:
    scheme: str
    host: str
    port: int

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


@functools.lru_cache(maxsize=1024)
def split_url(url: str) -> tuple[Origin, str]:
    """(origin, request target) of an http or https URL. Raises `ValueError` for others."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Origin(parts.scheme, parts.hostname, port), target


@attrs.frozen
class Reply:
    status: int
    body: bytes

    def text(self, limit: int = 200) -> str:
        return self.body[:limit].decode("utf-8", "replace")


class Requester(Protocol):
    """What sends a request and reads its whole answer: `HTTP11Client`, or a test's
    scripted servers. `authorization` is the bearer header it sends, if any."""

    @property
    def authorization(self) -> str | None: ...

    async def request(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        headers: Sequence[tuple[str, str]] = (),
    ) -> Reply: ...


@attrs.define(eq=False)
class ByteBudget:
    """Bytes shared by concurrent readers: `reserve` waits (first come, first served)
    until the amount fits under `capacity`, `release` gives it back. A waiter holds
    nothing, and a waiter whose wait is cancelled takes nothing. `peak` is the most ever
    reserved at once."""

    capacity: int
    reserved: int = attrs.field(init=False, default=0)
    peak: int = attrs.field(init=False, default=0)
    _waiters: collections.deque[_Waiter] = attrs.field(init=False, factory=collections.deque)

    async def reserve(self, nbytes: int) -> None:
        if nbytes > self.capacity:
            raise ValueError(f"cannot reserve {nbytes} of {self.capacity} bytes")
        if not self._waiters and self.reserved + nbytes <= self.capacity:
            self._take(nbytes)
            return
        waiter = _Waiter(nbytes)
        self._waiters.append(waiter)
        try:
            await waiter.granted.wait()
        except BaseException:
            if waiter.granted.is_set():  # granted, then interrupted before it could be used
                self.release(nbytes)
            else:
                self._waiters.remove(waiter)
                self._grant()  # it may have been first in line, blocking smaller ones
            raise

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes
        self._grant()

    def _take(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak = max(self.peak, self.reserved)

    def _grant(self) -> None:
        while self._waiters and self.reserved + self._waiters[0].nbytes <= self.capacity:
            waiter = self._waiters.popleft()
            self._take(waiter.nbytes)
            waiter.granted.set()


@attrs.define(eq=False)
class _Waiter:
    nbytes: int
    granted: trio.Event = attrs.field(factory=trio.Event)


@attrs.define(eq=False)
class _Connection:
    stream: trio.abc.Stream
    socket: trio.socket.SocketType
    protocol: h11.Connection = attrs.field(factory=lambda: h11.Connection(h11.CLIENT))

    def server_hung_up(self) -> bool:
        """An idle connection with something to read: the server closed it (or broke the
        protocol by sending unasked bytes). Either way it cannot carry a request."""
        return self.socket.is_readable()

    def close(self) -> None:
        """Close at once, without a checkpoint (so a loop of closes cannot be cut short
        by cancellation). A TLS connection is dropped without a close_notify, as
        `trio.aclose_forcefully` would."""
        self.socket.close()


@attrs.define(eq=False)
class HTTP11Client:
    """Keep-alive HTTP/1.1 client; close it with `aclose` (or use `async with`).

    `max_idle` bounds the idle connections kept per origin; extra ones are closed. An
    answer whose body is longer than `max_response_bytes` is an "oversized" failure; the
    bodies being read at once hold at most `max_buffered_bytes` (at least
    `max_response_bytes`), see the module docstring. `authorization`, when given, is sent
    as the `Authorization` header of every request (and left out of the repr).
    """

    tls: ssl.SSLContext | None = None
    max_idle: int = 64
    max_response_bytes: int = attrs.field(
        default=MAX_RESPONSE_BYTES, validator=attrs.validators.ge(0)
    )
    max_buffered_bytes: int = MAX_BUFFERED_BYTES
    authorization: str | None = attrs.field(default=None, repr=False)
    budget: ByteBudget = attrs.field(init=False)
    _idle: dict[Origin, list[_Connection]] = attrs.field(init=False, factory=dict)
    _closed: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        if self.max_buffered_bytes < self.max_response_bytes:
            raise ValueError(
                f"max_buffered_bytes ({self.max_buffered_bytes}) must be at least "
                f"max_response_bytes ({self.max_response_bytes})"
            )
        self.budget = ByteBudget(self.max_buffered_bytes)

    async def __aenter__(self) -> HTTP11Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()
        await trio.lowlevel.checkpoint()

    async def request(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        headers: Sequence[tuple[str, str]] = (),
    ) -> Reply:
        """One request and its whole answer. Raises `HTTPFailure` or `ValueError` (a
        URL that is not http or https)."""
        if self._closed:
            raise RuntimeError("the client is closed")
        origin, target = split_url(url)
        connection = self._checkout(origin) or await self._connect(origin)
        try:
            if self.authorization is not None:
                headers = (("authorization", self.authorization), *headers)
            reply = await _exchange(connection, origin, method, target, body, headers, self)
        except BaseException:
            connection.close()
            raise
        self._checkin(origin, connection)
        return reply

    def _checkout(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if not connection.server_hung_up():
                return connection
            connection.close()
        return None

    def _checkin(self, origin: Origin, connection: _Connection) -> None:
        protocol = connection.protocol
        idle = self._idle.setdefault(origin, [])
        if (
            self._closed
            or len(idle) >= self.max_idle
            or protocol.our_state is not h11.DONE
            or protocol.their_state is not h11.DONE
            # Bytes the server sent past its answer, already read, would be taken for the
            # answer to the next request on this connection.
            or protocol.trailing_data[0]
        ):
            connection.close()
            return
        protocol.start_next_cycle()
        idle.append(connection)

    async def _connect(self, origin: Origin) -> _Connection:
        where = f"{origin.scheme}://{origin.host_header}"
        try:
            tcp = await trio.open_tcp_stream(origin.host, origin.port)
        except OSError as exc:
            raise HTTPFailure("connect", f"{where}: {exc.strerror or exc}") from None
        if origin.scheme == "http":
            return _Connection(tcp, tcp.socket)
        tls = self.tls if self.tls is not None else ssl.create_default_context()
        stream = trio.SSLStream(tcp, tls, server_hostname=origin.host, https_compatible=True)
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError as exc:
            tcp.socket.close()
            cause = exc.__cause__ or exc
            raise HTTPFailure("connect", f"{where}: TLS handshake failed: {cause}") from None
        except BaseException:
            tcp.socket.close()
            raise
        return _Connection(stream, tcp.socket)


async def _exchange(
    connection: _Connection,
    origin: Origin,
    method: str,
    target: str,
    body: bytes,
    headers: Sequence[tuple[str, str]],
    client: HTTP11Client,
) -> Reply:
    protocol = connection.protocol
    where = f"{origin.scheme}://{origin.host_header}{target}"
    request = h11.Request(
        method=method,
        target=target,
        headers=[
            ("host", origin.host_header),
            ("user-agent", USER_AGENT),
            ("content-length", str(len(body))),
            *headers,
        ],
    )
    try:
        parts = [protocol.send(request) or b""]
        if body:
            parts.extend(protocol.send_with_data_passthrough(h11.Data(data=body)) or ())
        parts.append(protocol.send(h11.EndOfMessage()) or b"")
        # One write for a small request; a large body is not copied into one buffer.
        if len(body) <= RECEIVE_BYTES:
            await connection.stream.send_all(b"".join(parts))
        else:
            for part in parts:
                await connection.stream.send_all(part)
        return await _receive_reply(
            connection, where, method, client.max_response_bytes, client.budget
        )
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise HTTPFailure("transport", f"{where}: connection lost ({exc})") from None
    except h11.ProtocolError as exc:
        raise HTTPFailure("transport", f"{where}: bad HTTP/1.1 answer ({exc})") from None


async def _receive_reply(
    connection: _Connection,
    where: str,
    method: str,
    max_response_bytes: int,
    budget: ByteBudget,
) -> Reply:
    """The answer, its body reserved from `budget` while it is read (module docstring)."""
    protocol, stream = connection.protocol, connection.stream
    status: int | None = None
    chunks: list[bytes] = []
    size = 0
    reserved = 0
    try:
        while True:
            event = protocol.next_event()
            if event is h11.NEED_DATA:
                protocol.receive_data(bytes(await stream.receive_some(RECEIVE_BYTES)))
            elif isinstance(event, h11.Response):
                status = event.status_code
                announced = _announced_length(event, method)
                if announced is not None and announced > max_response_bytes:
                    raise HTTPFailure(
                        "oversized",
                        f"{where}: answer of {announced} bytes announced, "
                        f"longer than {max_response_bytes} bytes",
                    )
                need = max_response_bytes if announced is None else announced
                if need:
                    await budget.reserve(need)
                    reserved = need
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > max_response_bytes:
                    raise HTTPFailure(
                        "oversized", f"{where}: answer longer than {max_response_bytes} bytes"
                    )
                chunks.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                assert status is not None  # h11 sends a Response before any EndOfMessage
                return Reply(status, b"".join(chunks))
            elif isinstance(event, h11.ConnectionClosed):
                raise HTTPFailure("transport", f"{where}: the server closed the connection")
            # h11.InformationalResponse (100 Continue and the like) carries nothing we need.
    finally:
        if reserved:
            budget.release(reserved)


def _announced_length(response: h11.Response, method: str) -> int | None:
    """The body length the head announces, or None: chunked, or delimited by a close."""
    if method == "HEAD" or response.status_code in (204, 304):
        return 0
    length = None
    for name, value in response.headers:
        if name == b"transfer-encoding":  # h11 accepts only chunked, and it overrides
            return None
        if name == b"content-length":  # h11 has checked it: digits, one value
            length = int(value)
    return length

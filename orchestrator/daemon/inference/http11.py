"""A lean HTTP/1.1 client for the daemon's requests: trio streams, httptools (llhttp, the
C parser under Node.js and uvicorn) for the answers, idle connections kept per origin.

The daemon makes one small POST per turn, hundreds in flight, to a handful of servers.
httpx and httpcore spend more CPU on that than everything else the daemon does: their
pool re-examines every connection it holds each time it assigns a request
(docs/benchmarks.md). Here a request takes the most recently used idle connection to its
origin (after one `poll` to see that the server has not closed it), or opens a new one;
after a complete exchange the connection goes back to its origin's idle stack. There is
no connection limit: the dispatcher already bounds the requests in flight.

A request's head is written here: a request line and a few known headers, checked to
hold no line break. Answers are parsed by llhttp, strictly (no leniency is turned on).
With h11, the pure-Python state machine this client used before, one small exchange cost
the loop about 400 µs of CPU on loopback, most of it h11's validation and events; with
llhttp about 210 µs (docs/design.md §12). HEAD is not supported: llhttp cannot know that
an answer to it has no body.

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

import functools
import ssl
import urllib.parse
from collections.abc import Sequence
from typing import Protocol

import attrs
import httptools
import trio

from orchestrator.fair_budget import FairBudget

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
class _Connection:
    stream: trio.abc.Stream
    socket: trio.socket.SocketType

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
    budget: FairBudget = attrs.field(init=False)
    _idle: dict[Origin, list[_Connection]] = attrs.field(init=False, factory=dict)
    _closed: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        if self.max_buffered_bytes < self.max_response_bytes:
            raise ValueError(
                f"max_buffered_bytes ({self.max_buffered_bytes}) must be at least "
                f"max_response_bytes ({self.max_response_bytes})"
            )
        self.budget = FairBudget(self.max_buffered_bytes)

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
        if method == "HEAD":
            raise ValueError("HEAD is not supported: its answer's length cannot be parsed")
        origin, target = split_url(url)
        if self.authorization is not None:
            headers = (("authorization", self.authorization), *headers)
        head = _request_head(method, target, origin, len(body), headers)
        connection = self._checkout(origin) or await self._connect(origin)
        try:
            reply, reusable = await _exchange(connection, origin, target, head, body, self)
        except BaseException:
            connection.close()
            raise
        if reusable:
            self._checkin(origin, connection)
        else:
            connection.close()
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
        idle = self._idle.setdefault(origin, [])
        if self._closed or len(idle) >= self.max_idle:
            connection.close()
            return
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


def _request_head(
    method: str, target: str, origin: Origin, length: int, headers: Sequence[tuple[str, str]]
) -> bytes:
    """The request line and headers, up to the blank line. Raises `ValueError` for a
    header that holds a line break (it would end the head or start another header), or a
    target with one or a space (it would end the request line)."""
    if _BREAKS.intersection(target) or " " in target:
        raise ValueError(f"request target {target!r} holds a space or a line break")
    lines = [
        f"{method} {target} HTTP/1.1",
        f"host: {origin.host_header}",
        f"user-agent: {USER_AGENT}",
        f"content-length: {length}",
    ]
    for name, value in headers:
        if _BREAKS.intersection(name) or _BREAKS.intersection(value):
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    lines.append("\r\n")
    return "\r\n".join(lines).encode("latin-1")


_BREAKS = frozenset("\r\n\0")


@attrs.define(eq=False)
class _Answer:
    """llhttp's callbacks for one answer: its status, what its head announces, its body
    (kept up to `limit` bytes), and whether it is complete. An informational answer
    (1xx) before it is passed over."""

    parser: httptools.HttpResponseParser = attrs.field(init=False)
    limit: int
    status: int = 0
    announced: int | None = None
    chunked: bool = False
    head_done: bool = False
    done: bool = False
    keep_alive: bool = False
    switched: bool = False
    #: Bytes past the answer: another answer's start (or a 1xx's) the server sent unasked.
    extra: bool = False
    size: int = 0
    chunks: list[bytes] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        if self.done:
            self.extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.done:
            return
        lowered = name.lower()
        if lowered == b"content-length":  # llhttp has checked it: digits, one value
            self.announced = int(value)
        elif lowered == b"transfer-encoding":  # llhttp accepts chunked last only
            self.chunked = True

    def on_headers_complete(self) -> None:
        if self.done:
            return
        status = self.parser.get_status_code()
        if status == 101:
            self.switched = True  # llhttp stops there: a protocol nobody asked for
            return
        if 100 <= status < 200:
            self.announced, self.chunked = None, False
            return
        self.status = status
        self.head_done = True
        if status in (204, 304):
            self.announced = 0

    def on_body(self, body: bytes) -> None:
        if self.done:
            return
        self.size += len(body)
        if self.size <= self.limit:
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.head_done and not self.done:
            self.done = True
            # Read here: llhttp forgets the answer's flags once it is complete.
            self.keep_alive = self.parser.should_keep_alive()

    @property
    def length(self) -> int | None:
        """The body's length as announced: None when chunked or delimited by a close."""
        return None if self.chunked else self.announced

    @property
    def delimited_by_close(self) -> bool:
        return self.head_done and not self.chunked and self.announced is None


async def _exchange(
    connection: _Connection,
    origin: Origin,
    target: str,
    head: bytes,
    body: bytes,
    client: HTTP11Client,
) -> tuple[Reply, bool]:
    """The answer to one request, and whether its connection can carry another."""
    where = f"{origin.scheme}://{origin.host_header}{target}"
    try:
        # One write for a small request; a large body is not copied into one buffer.
        if len(body) <= RECEIVE_BYTES:
            await connection.stream.send_all(head + body)
        else:
            await connection.stream.send_all(head)
            await connection.stream.send_all(body)
        return await _receive_reply(connection, where, client.max_response_bytes, client.budget)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise HTTPFailure("transport", f"{where}: connection lost ({exc})") from None


async def _receive_reply(
    connection: _Connection,
    where: str,
    max_response_bytes: int,
    budget: FairBudget,
) -> tuple[Reply, bool]:
    """The answer, its body reserved from `budget` while it is read (module docstring),
    and whether the connection can be reused."""
    answer = _Answer(max_response_bytes)
    reserved = 0
    try:
        while True:
            data = await connection.stream.receive_some(RECEIVE_BYTES)
            if not data:
                if answer.delimited_by_close:
                    break  # its end is the close: complete, and the connection is gone
                raise HTTPFailure("transport", f"{where}: the server closed the connection")
            try:
                answer.parser.feed_data(data)
            except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
                if answer.switched:
                    raise HTTPFailure(
                        "transport", f"{where}: bad HTTP/1.1 answer (it switches protocols)"
                    ) from None
                if not answer.done:
                    detail = " ".join(str(exc).split())[:200]
                    raise HTTPFailure(
                        "transport", f"{where}: bad HTTP/1.1 answer ({detail})"
                    ) from None
                answer.extra = True  # complete, then bytes that are no answer
            if answer.size > max_response_bytes:
                raise HTTPFailure(
                    "oversized", f"{where}: answer longer than {max_response_bytes} bytes"
                )
            if answer.head_done and not reserved:
                announced = answer.length
                if announced is not None and announced > max_response_bytes:
                    raise HTTPFailure(
                        "oversized",
                        f"{where}: answer of {announced} bytes announced, "
                        f"longer than {max_response_bytes} bytes",
                    )
                need = max_response_bytes if announced is None else announced
                if need and not answer.done:
                    await budget.reserve(need)
                    reserved = need
            if answer.done:
                break
        reusable = answer.done and answer.keep_alive and not answer.extra
        return Reply(answer.status, b"".join(answer.chunks)), reusable
    finally:
        if reserved:
            budget.release(reserved)

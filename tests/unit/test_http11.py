"""The lean HTTP/1.1 client against real servers on 127.0.0.1: keep-alive reuse, stale and
closed connections, chunked and fragmented answers, misbehaving servers, size limits,
cancellation and closing, plus `split_url` and `post_generate`'s failure kinds.

The servers are small trio servers written here: they parse requests with h11 and answer
with hand-written bytes, so an answer can be as wrong as a test needs. Real sockets do not
mix with the autojump clock, so every test runs in real time under a `GUARD`-second
deadline and waits for events (never for a duration).
"""

from __future__ import annotations

import contextlib
import functools
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from http import HTTPStatus

import attrs
import h11
import pytest
import trio
import trio.testing

from orchestrator.daemon.inference.client import post_generate
from orchestrator.daemon.inference.http11 import (
    RECEIVE_BYTES,
    USER_AGENT,
    HTTP11Client,
    HTTPFailure,
    Origin,
    split_url,
)
from orchestrator.fair_budget import FairBudget
from orchestrator.wire import GENERATE_PATH, InferenceFailure

#: Seconds any one test may spend on real I/O before it fails.
GUARD = 5.0


@attrs.frozen
class Received:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


@attrs.define(eq=False)
class Server:
    """What a test server saw: connections accepted, connections the client closed
    (`hangups`), connections the server closed itself, and every request."""

    port: int = 0
    accepts: int = 0
    hangups: int = 0
    server_closes: int = 0
    received: list[Received] = attrs.field(factory=list)
    _changed: trio.lowlevel.ParkingLot = attrs.field(factory=trio.lowlevel.ParkingLot)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def note(self) -> None:
        self._changed.unpark_all()

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Return once `condition()` holds (checked after every change the server notes)."""
        while not condition():
            await self._changed.park()


Handler = Callable[[Server, trio.SocketStream], Awaitable[None]]
Respond = Callable[[Received], Sequence[bytes]]


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[Server]:
    """A server on 127.0.0.1, an ephemeral port, calling `handler` per connection (the
    connection is closed when it returns). Everything inside is bounded by `GUARD`."""
    server = Server()

    async def on_connection(stream: trio.SocketStream) -> None:
        server.accepts += 1
        server.note()
        await handler(server, stream)

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, on_connection, 0, host="127.0.0.1")
            )
            server.port = listeners[0].socket.getsockname()[1]
            yield server
            nursery.cancel_scope.cancel()


async def read_request(server: Server, stream: trio.SocketStream) -> Received | None:
    """The next whole request on `stream`, recorded; None once the client hung up.

    The client never pipelines, so a fresh parser per request loses nothing (and the raw
    answers the servers write never go through a server-side h11 state machine)."""
    protocol = h11.Connection(h11.SERVER)
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = protocol.next_event()
        if event is h11.NEED_DATA:
            protocol.receive_data(await _receive(stream))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            received = Received(
                method=request.method.decode(),
                target=request.target.decode(),
                headers={name.decode(): value.decode() for name, value in request.headers},
                body=bytes(body),
            )
            server.received.append(received)
            server.note()
            return received
        elif isinstance(event, h11.ConnectionClosed):
            server.hangups += 1
            server.note()
            return None


async def wait_for_hangup(server: Server, stream: trio.SocketStream) -> None:
    """Read (and drop) whatever comes until the client closes the connection."""
    while await _receive(stream):
        pass
    server.hangups += 1
    server.note()


async def hang_up(server: Server, stream: trio.SocketStream) -> None:
    await stream.aclose()
    server.server_closes += 1
    server.note()


async def _receive(stream: trio.SocketStream) -> bytes:
    try:
        return bytes(await stream.receive_some(1 << 16))
    except trio.BrokenResourceError:  # a reset is a hangup too
        return b""


async def send_pieces(stream: trio.SocketStream, pieces: Sequence[bytes]) -> None:
    """Send each piece in its own write; before the next one, wait until every other task
    (the client) is blocked again, so the client reads each piece separately."""
    for number, piece in enumerate(pieces):
        if number:
            await trio.testing.wait_all_tasks_blocked()
        try:
            await stream.send_all(piece)
        except trio.BrokenResourceError:  # the client gave up on the answer
            return


def answering(respond: Respond, *, then_hang_up: bool = False) -> Handler:
    """A keep-alive server answering each request with `respond(request)`'s pieces. It
    never closes first unless `then_hang_up` (it closes after its first answer)."""

    async def handle(server: Server, stream: trio.SocketStream) -> None:
        while (received := await read_request(server, stream)) is not None:
            await send_pieces(stream, respond(received))
            if then_hang_up:
                await hang_up(server, stream)
                return

    return handle


def gathering(count: int, respond: Respond, *, then_hang_up: bool = False) -> Handler:
    """Like `answering`, but the first `count` requests are all answered only once all of
    them have arrived: so `count` concurrent requests need `count` connections."""
    everyone_is_here = trio.Event()

    async def handle(server: Server, stream: trio.SocketStream) -> None:
        while (received := await read_request(server, stream)) is not None:
            if len(server.received) >= count:
                everyone_is_here.set()
            await everyone_is_here.wait()
            await send_pieces(stream, respond(received))
            if then_hang_up:
                await hang_up(server, stream)
                return

    return handle


def answer(status: int = 200, body: bytes = b"", headers: Sequence[tuple[str, str]] = ()) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        f"content-length: {len(body)}",
        *(f"{name}: {value}" for name, value in headers),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def echo(received: Received) -> Sequence[bytes]:
    return [answer(200, received.body)]


def ok(received: Received) -> Sequence[bytes]:
    return [answer(200, b"ok")]


def idle_count(client: HTTP11Client, url: str) -> int:
    return len(client._idle.get(split_url(url)[0], []))


def refused_port() -> int:
    """A port nothing listens on: bound for a moment, then released."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def pieces_of(data: bytes, size: int) -> list[bytes]:
    return [data[start : start + size] for start in range(0, len(data), size)]


# --- one exchange ---------------------------------------------------------------------


async def test_a_post_gets_the_status_and_whole_body_and_sends_the_headers() -> None:
    made = answering(lambda r: [answer(201, b"made:" + r.body)])
    async with serving(made) as server, HTTP11Client() as client:
        reply = await client.request(
            "POST",
            f"{server.url}/v1/things?x=1&y=2",
            b'{"a": 1}',
            [("content-type", "application/json")],
        )
    assert (reply.status, reply.body) == (201, b'made:{"a": 1}')
    [received] = server.received
    assert received.method == "POST"
    assert received.target == "/v1/things?x=1&y=2"
    assert received.body == b'{"a": 1}'
    assert received.headers["host"] == f"127.0.0.1:{server.port}"
    assert received.headers["content-length"] == "8"
    assert received.headers["content-type"] == "application/json"
    assert received.headers["user-agent"] == USER_AGENT


async def test_a_body_larger_than_one_read_arrives_whole() -> None:
    body = bytes(range(256)) * (RECEIVE_BYTES // 256 + 7)
    async with serving(answering(echo)) as server, HTTP11Client() as client:
        reply = await client.request("POST", f"{server.url}/big", body)
    assert reply.status == 200
    assert reply.body == body
    assert server.received[0].headers["content-length"] == str(len(body))


async def test_an_empty_get_sends_a_zero_length_and_reads_an_empty_body() -> None:
    async with serving(answering(lambda r: [answer(204)])) as server, HTTP11Client() as client:
        reply = await client.request("GET", server.url)
    assert (reply.status, reply.body) == (204, b"")
    [received] = server.received
    assert (received.method, received.target, received.body) == ("GET", "/", b"")
    assert received.headers["content-length"] == "0"


# --- keep-alive -----------------------------------------------------------------------


async def test_sequential_requests_to_one_origin_reuse_one_connection() -> None:
    async with serving(answering(echo)) as server, HTTP11Client() as client:
        bodies = [
            (await client.request("POST", f"{server.url}/n", b"%d" % n)).body for n in range(4)
        ]
        assert bodies == [b"0", b"1", b"2", b"3"]
        assert server.accepts == 1
        assert idle_count(client, server.url) == 1
    await server.wait_until(lambda: server.hangups == 1)  # closed by aclose


async def test_concurrent_requests_open_several_and_keep_at_most_max_idle() -> None:
    async with (
        serving(gathering(5, echo)) as server,
        HTTP11Client(max_idle=2) as client,
    ):
        replies: list[bytes] = []

        async def call(n: int) -> None:
            replies.append((await client.request("POST", server.url, b"%d" % n)).body)

        async with trio.open_nursery() as nursery:
            for n in range(5):
                nursery.start_soon(call, n)
        assert sorted(replies) == [b"0", b"1", b"2", b"3", b"4"]
        assert server.accepts == 5
        await server.wait_until(lambda: server.hangups >= 3)
        assert server.hangups == 3
        assert idle_count(client, server.url) == 2

        # The two kept are reused: no new connection.
        for _ in range(3):
            await client.request("POST", server.url, b"again")
        assert server.accepts == 5
        await client.aclose()
        await server.wait_until(lambda: server.hangups == 5)


async def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async with (
        serving(answering(ok, then_hang_up=True)) as server,
        HTTP11Client() as client,
    ):
        assert (await client.request("GET", server.url)).body == b"ok"
        await server.wait_until(lambda: server.server_closes == 1)
        assert idle_count(client, server.url) == 1  # the client has not looked yet
        assert (await client.request("GET", server.url)).body == b"ok"
        assert server.accepts == 2


async def test_every_stale_idle_connection_is_skipped() -> None:
    async with (
        serving(gathering(3, ok, then_hang_up=True)) as server,
        HTTP11Client() as client,
    ):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(client.request, "GET", server.url)
        await server.wait_until(lambda: server.server_closes == 3)
        assert idle_count(client, server.url) == 3
        assert (await client.request("GET", server.url)).body == b"ok"
        assert server.accepts == 4
        # The stale three are gone; the fresh one is kept until the client next looks.
        assert idle_count(client, server.url) == 1


async def test_a_connection_close_answer_is_not_reused() -> None:
    # The server keeps its side open: the client must close the connection itself.
    closing = answering(lambda r: [answer(200, b"bye", [("connection", "close")])])
    async with serving(closing) as server, HTTP11Client() as client:
        for _ in range(2):
            assert (await client.request("GET", server.url)).body == b"bye"
        assert server.accepts == 2
        await server.wait_until(lambda: server.hangups == 2)
        assert idle_count(client, server.url) == 0


async def test_an_http_1_0_answer_delimited_by_close_is_read_and_not_reused() -> None:
    async def handle(server: Server, stream: trio.SocketStream) -> None:
        if await read_request(server, stream) is not None:
            await stream.send_all(b"HTTP/1.0 200 OK\r\n\r\nuntil the end")
            await hang_up(server, stream)

    async with serving(handle) as server, HTTP11Client() as client:
        for _ in range(2):
            assert (await client.request("GET", server.url)).body == b"until the end"
        assert server.accepts == 2
        assert idle_count(client, server.url) == 0


async def test_bytes_sent_past_an_answer_are_never_read_as_the_next_answer() -> None:
    # A broken server sends two answers to one request. The second must not be taken
    # for the answer to the next request: that connection cannot be reused.
    doubled = answering(lambda r: [answer(200, b"first") + answer(200, b"stale")])
    async with serving(doubled) as server, HTTP11Client() as client:
        bodies = [(await client.request("GET", server.url)).body for _ in range(2)]
        assert bodies == [b"first", b"first"]
        assert server.accepts == 2


# --- how an answer arrives ------------------------------------------------------------


CHUNKED = (
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n"
    b"1;name=value\r\n,\r\n"
    b"a\r\n two words\r\n"
    b"0\r\nx-trailer: yes\r\n\r\n"
)


@pytest.mark.parametrize("piece_size", [len(CHUNKED), 7, 1])
async def test_a_chunked_answer_is_assembled(piece_size: int) -> None:
    async with (
        serving(answering(lambda r: pieces_of(CHUNKED, piece_size))) as server,
        HTTP11Client() as client,
    ):
        for _ in range(2):  # the end of a chunked answer leaves the connection reusable
            reply = await client.request("GET", server.url)
            assert (reply.status, reply.body) == (200, b"hello, two words")
        assert server.accepts == 1


async def test_an_answer_in_many_small_writes_is_assembled() -> None:
    body = bytes(range(256)) * 8
    whole = answer(200, body, [("content-type", "application/octet-stream")])
    async with (
        serving(answering(lambda r: pieces_of(whole, 37))) as server,
        HTTP11Client() as client,
    ):
        reply = await client.request("GET", server.url)
        assert (reply.status, reply.body) == (200, body)
        assert (await client.request("GET", server.url)).body == body
        assert server.accepts == 1


# --- failures -------------------------------------------------------------------------


async def test_a_refused_connection_is_a_connect_failure() -> None:
    url = f"http://127.0.0.1:{refused_port()}/x"
    with trio.fail_after(GUARD):
        async with HTTP11Client() as client:
            with pytest.raises(HTTPFailure) as failure:
                await client.request("GET", url)
    assert failure.value.kind == "connect"
    assert url.removesuffix("/x") in str(failure.value)
    assert "\n" not in str(failure.value)


async def _read_then(server: Server, stream: trio.SocketStream, then: bytes) -> None:
    if await read_request(server, stream) is not None and then:
        await stream.send_all(then)


async def _closes_at_once(server: Server, stream: trio.SocketStream) -> None:
    await hang_up(server, stream)


async def _garbage_then_waits(server: Server, stream: trio.SocketStream) -> None:
    if await read_request(server, stream) is not None:
        await stream.send_all(b"SSH-2.0-OpenSSH_9.6\r\nnot http at all\r\n\r\n")
        await wait_for_hangup(server, stream)


MISBEHAVING: dict[str, Handler] = {
    "closes at once": _closes_at_once,
    "reads the request, then closes": functools.partial(_read_then, then=b""),
    "sends garbage and waits": _garbage_then_waits,
    "sends garbage, then closes": functools.partial(_read_then, then=b"garbage"),
    "closes mid-head": functools.partial(_read_then, then=b"HTTP/1.1 200 OK\r\ncontent-le"),
    "truncates the body": functools.partial(
        _read_then, then=b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten.."
    ),
    "truncates a chunked body": functools.partial(
        _read_then, then=b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel"
    ),
    "switches protocols unasked": functools.partial(
        _read_then, then=b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n"
    ),
}


@pytest.mark.parametrize("behaviour", MISBEHAVING)
async def test_a_misbehaving_server_is_a_one_line_transport_failure(behaviour: str) -> None:
    async with serving(MISBEHAVING[behaviour]) as server, HTTP11Client() as client:
        url = f"{server.url}/v1/generate?id=7"
        with pytest.raises(HTTPFailure) as failure:
            await client.request("POST", url, b"{}")
        assert failure.value.kind == "transport"
        message = str(failure.value)
        assert message.startswith("transport: ")
        assert url in message
        assert "\n" not in message
        assert idle_count(client, server.url) == 0


def chunked(*chunks: bytes) -> list[bytes]:
    """A chunked 200 answer, the head and each chunk in its own piece, then the end."""
    return [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        *(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks),
        b"0\r\n\r\n",
    ]


@pytest.mark.parametrize(
    ("pieces", "fits"),
    [
        ([answer(200, b"x" * 99)], True),
        ([answer(200, b"x" * 100)], True),
        ([answer(200, b"x" * 101)], False),
        (chunked(b"y" * 50, b"y" * 49), True),
        (chunked(b"y" * 50, b"y" * 50), True),
        (chunked(b"y" * 50, b"y" * 50, b"y"), False),
    ],
    ids=[
        "just under the limit",
        "at the limit",
        "one byte over",
        "chunked just under",
        "chunked at the limit",
        "chunked one byte over",
    ],
)
async def test_an_answer_longer_than_the_limit_is_an_oversized_failure(
    pieces: list[bytes], fits: bool
) -> None:
    # The limit is also the whole budget: a reply alone can always be read.
    async with (
        serving(answering(lambda r: pieces)) as server,
        HTTP11Client(max_response_bytes=100, max_buffered_bytes=100) as client,
    ):
        if fits:
            for _ in range(2):
                assert len((await client.request("GET", server.url)).body) in (99, 100)
            assert server.accepts == 1  # reused
            assert client.budget.reserved == 0
            return
        with pytest.raises(HTTPFailure) as failure:
            await client.request("GET", server.url)
        assert failure.value.kind == "oversized"
        assert "longer than 100 bytes" in str(failure.value)
        # The connection that carried the refused answer is closed, never reused.
        await server.wait_until(lambda: server.hangups == 1)
        assert idle_count(client, server.url) == 0
        assert client.budget.reserved == 0


@pytest.mark.parametrize("announced", [101, 1 << 40], ids=["one byte over", "a terabyte"])
async def test_a_content_length_over_the_limit_fails_before_the_body_is_read(
    announced: int,
) -> None:
    # The server announces the body and then sends nothing: a client that waited for the
    # body would wait forever.
    head = f"HTTP/1.1 200 OK\r\ncontent-length: {announced}\r\n\r\n".encode()

    async def handle(server: Server, stream: trio.SocketStream) -> None:
        if await read_request(server, stream) is not None:
            await stream.send_all(head)
            await wait_for_hangup(server, stream)

    async with serving(handle) as server, HTTP11Client(max_response_bytes=100) as client:
        url = f"{server.url}/v1/generate"
        with pytest.raises(HTTPFailure) as failure:
            await client.request("POST", url, b"{}")
        assert failure.value.kind == "oversized"
        assert str(failure.value) == (
            f"oversized: {url}: answer of {announced} bytes announced, longer than 100 bytes"
        )
        await server.wait_until(lambda: server.hangups == 1)
        assert idle_count(client, server.url) == 0
        assert client.budget.peak == 0  # nothing was reserved for it


async def test_an_endless_chunked_answer_is_cut_off_at_the_limit() -> None:
    # The server streams chunks until the client hangs up: without a limit the client
    # would buffer all of them.
    limit = 4 * RECEIVE_BYTES
    chunk = b"%x\r\n%s\r\n" % (RECEIVE_BYTES, b"z" * RECEIVE_BYTES)
    sent = 0

    async def handle(server: Server, stream: trio.SocketStream) -> None:
        nonlocal sent
        if await read_request(server, stream) is None:
            return
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:
                await stream.send_all(chunk)
                sent += RECEIVE_BYTES
        except trio.BrokenResourceError:
            server.hangups += 1
            server.note()

    async with serving(handle) as server, HTTP11Client(max_response_bytes=limit) as client:
        with pytest.raises(HTTPFailure) as failure:
            await client.request("GET", server.url)
        assert failure.value.kind == "oversized"
        assert f"longer than {limit} bytes" in str(failure.value)
        await server.wait_until(lambda: server.hangups == 1)
        assert idle_count(client, server.url) == 0
        assert client.budget.reserved == 0
    # What got past the limit is what the sockets' buffers held when the client hung up.
    assert limit < sent < 256 * limit


async def test_a_body_is_read_only_while_it_fits_in_the_shared_budget() -> None:
    # Three answers of 1,000 bytes each, a budget of 2,000: two bodies are read while the
    # third waits, holding nothing; every body arrives once the first two are done.
    halves: set[str] = set()
    finish = trio.Event()

    async def handle(server: Server, stream: trio.SocketStream) -> None:
        while (received := await read_request(server, stream)) is not None:
            body = received.target.encode() * 1000
            whole = answer(200, body[:1000])
            await stream.send_all(whole[: len(whole) - 600])
            halves.add(received.target)
            server.note()
            await finish.wait()
            await stream.send_all(whole[len(whole) - 600 :])

    async with (
        serving(handle) as server,
        HTTP11Client(max_response_bytes=1000, max_buffered_bytes=2000) as client,
    ):
        bodies: dict[str, bytes] = {}

        async def call(name: str) -> None:
            bodies[name] = (await client.request("GET", f"{server.url}/{name}")).body

        async with trio.open_nursery() as nursery:
            for name in "abc":
                nursery.start_soon(call, name)
            await server.wait_until(lambda: len(halves) == 3)
            await trio.testing.wait_all_tasks_blocked()
            # Every head has arrived: two bodies are being read, one waits for room.
            assert client.budget.reserved == 2000
            assert len(client.budget._waiters) == 1
            finish.set()
        assert bodies == {name: f"/{name}".encode() * 500 for name in "abc"}
        assert client.budget.peak == 2000
        assert client.budget.reserved == 0
        assert server.accepts == 3
        assert idle_count(client, server.url) == 3


async def test_a_chunked_answer_reserves_the_whole_limit() -> None:
    # Its length is unknown until it ends: two short chunked answers cannot share a
    # budget of 1.5 limits, so the second is read after the first.
    release = trio.Event()

    async def handle(server: Server, stream: trio.SocketStream) -> None:
        while await read_request(server, stream) is not None:
            head, *rest = chunked(b"short")
            await stream.send_all(head)
            server.note()
            await release.wait()
            await stream.send_all(b"".join(rest))

    async with (
        serving(handle) as server,
        HTTP11Client(max_response_bytes=1000, max_buffered_bytes=1500) as client,
    ):
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(client.request, "GET", server.url)
            await server.wait_until(lambda: len(server.received) == 2)
            await trio.testing.wait_all_tasks_blocked()
            assert (client.budget.reserved, len(client.budget._waiters)) == (1000, 1)
            release.set()
        assert (client.budget.peak, client.budget.reserved) == (1000, 0)


async def test_a_request_cancelled_while_it_waits_for_the_budget_takes_nothing() -> None:
    release = trio.Event()

    async def handle(server: Server, stream: trio.SocketStream) -> None:
        while (received := await read_request(server, stream)) is not None:
            whole = answer(200, received.target.encode() * 50)
            await stream.send_all(whole[:-10])
            server.note()
            await release.wait()
            await stream.send_all(whole[-10:])

    async with (
        serving(handle) as server,
        HTTP11Client(max_response_bytes=100, max_buffered_bytes=100) as client,
    ):
        async with trio.open_nursery() as nursery:
            replies: list[bytes] = []

            async def first() -> None:
                replies.append((await client.request("GET", f"{server.url}/a")).body)

            waiting = trio.CancelScope()

            async def second() -> None:
                with waiting:
                    await client.request("GET", f"{server.url}/b")

            nursery.start_soon(first)
            await server.wait_until(lambda: len(server.received) == 1)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(second)
            await server.wait_until(lambda: len(server.received) == 2)
            await trio.testing.wait_all_tasks_blocked()
            assert (client.budget.reserved, len(client.budget._waiters)) == (100, 1)
            waiting.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert (client.budget.reserved, len(client.budget._waiters)) == (100, 0)
            release.set()
        assert replies == [b"/a" * 50]
        assert waiting.cancelled_caught
        assert client.budget.reserved == 0
        # The cancelled request's connection is closed, the other one kept.
        await server.wait_until(lambda: server.hangups == 1)
        assert idle_count(client, server.url) == 1


async def test_the_budget_serves_waiters_in_order_and_skips_a_cancelled_one() -> None:
    budget = FairBudget(10)
    order: list[str] = []

    async def take(name: str, nbytes: int, scope: trio.CancelScope | None = None) -> None:
        with scope or trio.CancelScope():
            await budget.reserve(nbytes)
            order.append(name)

    with trio.fail_after(GUARD):
        async with trio.open_nursery() as nursery:
            await budget.reserve(8)
            cancelled = trio.CancelScope()
            nursery.start_soon(take, "big", 9, cancelled)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(take, "small", 2)  # fits, but waits behind "big"
            await trio.testing.wait_all_tasks_blocked()
            assert order == []
            cancelled.cancel()  # "big" leaves the line: "small" fits and goes
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["small"]
            assert budget.reserved == 10
            nursery.start_soon(take, "third", 5)
            await trio.testing.wait_all_tasks_blocked()
            budget.release(8)
            await trio.testing.wait_all_tasks_blocked()
        assert order == ["small", "third"]
        assert (budget.reserved, budget.peak) == (7, 10)
    with pytest.raises(ValueError, match="cannot reserve 11 of 10"):
        await budget.reserve(11)


def test_a_budget_smaller_than_one_answer_is_refused() -> None:
    with pytest.raises(ValueError, match="max_buffered_bytes"):
        HTTP11Client(max_response_bytes=100, max_buffered_bytes=99)


async def test_a_url_that_is_not_http_is_a_value_error() -> None:
    async with HTTP11Client() as client:
        with pytest.raises(ValueError, match="not an http"):
            await client.request("GET", "ftp://127.0.0.1/x")


@pytest.mark.parametrize(
    ("method", "url", "headers", "match"),
    [
        ("GET", "http://127.0.0.1:1/x", [("x-a", "one\r\nx-b: two")], "line break"),
        ("GET", "http://127.0.0.1:1/x", [("x-a\n", "one")], "line break"),
        ("GET", "http://127.0.0.1:1/a b", [], "space or a line break"),
        ("HEAD", "http://127.0.0.1:1/x", [], "HEAD is not supported"),
    ],
    ids=["a value", "a name", "the target", "HEAD"],
)
async def test_a_request_that_would_break_its_head_is_refused_before_connecting(
    method: str, url: str, headers: list[tuple[str, str]], match: str
) -> None:
    # Nothing listens on port 1: a request that got as far as connecting would fail there.
    async with HTTP11Client() as client:
        with pytest.raises(ValueError, match=match):
            await client.request(method, url, b"", headers)


# --- cancellation and closing ---------------------------------------------------------


@pytest.mark.parametrize("unanswered", [1, 2], ids=["fresh connection", "reused connection"])
async def test_a_cancelled_request_closes_its_connection(unanswered: int) -> None:
    async def handle(server: Server, stream: trio.SocketStream) -> None:
        while (received := await read_request(server, stream)) is not None:
            if len(server.received) == unanswered:
                await wait_for_hangup(server, stream)
                return
            await stream.send_all(answer(200, received.target.encode()))

    async with serving(handle) as server, HTTP11Client() as client:
        for n in range(1, unanswered):
            assert (await client.request("GET", f"{server.url}/{n}")).body == b"/%d" % n

        async with trio.open_nursery() as nursery:
            doomed = trio.CancelScope()

            async def request_in(scope: trio.CancelScope) -> None:
                with scope:
                    await client.request("GET", f"{server.url}/{unanswered}")

            nursery.start_soon(request_in, doomed)
            await server.wait_until(lambda: len(server.received) == unanswered)
            await trio.testing.wait_all_tasks_blocked()  # the client waits for its answer
            doomed.cancel()
        assert doomed.cancelled_caught
        await server.wait_until(lambda: server.hangups == 1)
        assert idle_count(client, server.url) == 0

        later = unanswered + 1
        assert (await client.request("GET", f"{server.url}/{later}")).body == b"/%d" % later
        assert server.accepts == 2


async def test_aclose_in_a_cancelled_scope_closes_every_idle_connection() -> None:
    async with serving(gathering(3, ok)) as server:
        client = HTTP11Client()
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(client.request, "GET", server.url)
        assert idle_count(client, server.url) == 3

        with trio.CancelScope() as scope:
            scope.cancel()
            await client.aclose()
        assert scope.cancelled_caught
        await server.wait_until(lambda: server.hangups == 3)
        assert idle_count(client, server.url) == 0

        with pytest.raises(RuntimeError, match="closed"):
            await client.request("GET", server.url)
        assert server.accepts == 3


async def test_a_request_in_flight_during_aclose_completes_and_closes_its_connection() -> None:
    release = trio.Event()

    async def handle(server: Server, stream: trio.SocketStream) -> None:
        while await read_request(server, stream) is not None:
            await release.wait()
            await stream.send_all(answer(200, b"late"))

    async with serving(handle) as server:
        client = HTTP11Client()
        async with trio.open_nursery() as nursery:
            replies: list[bytes] = []

            async def call() -> None:
                replies.append((await client.request("GET", server.url)).body)

            nursery.start_soon(call)
            await server.wait_until(lambda: len(server.received) == 1)
            await client.aclose()
            release.set()
        assert replies == [b"late"]
        await server.wait_until(lambda: server.hangups == 1)
        assert idle_count(client, server.url) == 0


# --- split_url ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "origin", "target", "host_header"),
    [
        ("http://h/x", Origin("http", "h", 80), "/x", "h"),
        ("https://h", Origin("https", "h", 443), "/", "h"),
        ("http://h:8080/a/b?x=1&y=2", Origin("http", "h", 8080), "/a/b?x=1&y=2", "h:8080"),
        ("https://h:8443?q=1", Origin("https", "h", 8443), "/?q=1", "h:8443"),
        ("http://h:443/", Origin("http", "h", 443), "/", "h:443"),
        ("https://h:443/", Origin("https", "h", 443), "/", "h"),
        ("https://h:80/", Origin("https", "h", 80), "/", "h:80"),
        (
            "http://H.Example.COM/p#fragment",
            Origin("http", "h.example.com", 80),
            "/p",
            "h.example.com",
        ),
        ("http://[::1]:9000/g?k", Origin("http", "::1", 9000), "/g?k", "[::1]:9000"),
        ("http://[::1]/", Origin("http", "::1", 80), "/", "[::1]"),
        ("https://[2001:db8::7]/", Origin("https", "2001:db8::7", 443), "/", "[2001:db8::7]"),
    ],
)
def test_split_url(url: str, origin: Origin, target: str, host_header: str) -> None:
    assert split_url(url) == (origin, target)
    assert origin.host_header == host_header


@pytest.mark.parametrize(
    "url",
    ["ftp://h/x", "h:80/x", "/relative", "http:///no-host", "http://h:port/", "http://h:99999/"],
)
def test_split_url_refuses_what_is_not_an_http_url(url: str) -> None:
    with pytest.raises(ValueError):  # urllib's own messages vary
        split_url(url)


# --- post_generate --------------------------------------------------------------------


def _generate_server(status: int, body: bytes) -> Handler:
    return answering(lambda r: [answer(status, body, [("content-type", "application/json")])])


async def test_post_generate_posts_compact_json_and_returns_the_body() -> None:
    async with (
        serving(_generate_server(200, b'{"choices": []}')) as server,
        HTTP11Client() as client,
    ):
        body = await post_generate(client, server.url + "/", {"prompt": [1, 2], "n": 1})
    assert body == b'{"choices": []}'
    [received] = server.received
    assert (received.method, received.target) == ("POST", GENERATE_PATH)
    assert received.headers["content-type"] == "application/json"
    assert received.body == b'{"prompt":[1,2],"n":1}'
    assert json.loads(received.body) == {"prompt": [1, 2], "n": 1}


async def test_post_generate_names_a_5xx() -> None:
    async with serving(_generate_server(503, b"overloaded")) as server, HTTP11Client() as client:
        with pytest.raises(InferenceFailure) as failure:
            await post_generate(client, server.url, {})
    assert failure.value.kind == "http_5xx"
    assert failure.value.transient
    assert "503" in failure.value.detail


async def test_post_generate_names_a_4xx_with_a_short_excerpt() -> None:
    error = b'{"error": "prompt too long"}' + b" " * 5000 + b"tail"
    async with serving(_generate_server(400, error)) as server, HTTP11Client() as client:
        with pytest.raises(InferenceFailure) as failure:
            await post_generate(client, server.url, {})
    assert failure.value.kind == "http_4xx"
    assert not failure.value.transient
    detail = failure.value.detail
    assert "400" in detail
    assert "prompt too long" in detail
    assert "tail" not in detail
    assert len(detail) < 400
    assert "\n" not in detail


async def test_post_generate_names_an_oversized_answer_and_it_is_not_retried() -> None:
    async with (
        serving(_generate_server(200, b'{"choices": []}' + b" " * 100)) as server,
        HTTP11Client(max_response_bytes=100) as client,
    ):
        with pytest.raises(InferenceFailure) as failure:
            await post_generate(client, server.url, {})
    assert failure.value.kind == "oversized"
    # The same server would answer the same request as long again: not retried.
    assert not failure.value.transient
    assert "longer than 100 bytes" in failure.value.detail


async def test_post_generate_names_a_refused_connection() -> None:
    with trio.fail_after(GUARD):
        async with HTTP11Client() as client:
            with pytest.raises(InferenceFailure) as failure:
                await post_generate(client, f"http://127.0.0.1:{refused_port()}", {})
    assert failure.value.kind == "connect"
    assert failure.value.transient

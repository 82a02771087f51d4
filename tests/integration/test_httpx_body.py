"""`request_bytes`: a request cancelled while its body is being sent leaves nothing for
trio's async-generator finalizer to warn about (httpx's own bytes body does)."""

from __future__ import annotations

import gc
import warnings

import h11
import httpx
import trio
import trio.lowlevel

from orchestrator.httpx_body import request_bytes

# Larger than loopback's socket buffers on both sides: the send blocks until cancelled.
BODY = b"x" * (64 << 20)


async def _server_that_never_reads(
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    async with listener:
        task_status.started(listener.socket.getsockname()[1])
        async with await listener.accept():
            await trio.sleep_forever()


async def test_a_request_cancelled_mid_send_leaves_no_unfinished_generator() -> None:
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        port = await nursery.start(_server_that_never_reads)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with trio.move_on_after(1) as scope:
                await request_bytes(client, "POST", f"http://127.0.0.1:{port}/", BODY, headers={})
            gc.collect()
            await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    assert scope.cancelled_caught, "the body was sent whole: the server read it"
    assert [str(w.message) for w in caught if w.category is ResourceWarning] == []


async def _server_that_echoes_one_request(
    received: list[h11.Request | bytes],
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    async with listener:
        task_status.started(listener.socket.getsockname()[1])
        async with await listener.accept() as stream:
            connection = h11.Connection(h11.SERVER)
            body = b""
            while True:
                event = connection.next_event()
                if event is h11.NEED_DATA:
                    connection.receive_data(await stream.receive_some())
                elif isinstance(event, h11.Request):
                    received.append(event)
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
            received.append(body)
            reply = h11.Response(status_code=200, headers=[("content-length", "2")])
            await stream.send_all(connection.send(reply) + connection.send(h11.Data(data=b"ok")))
            await stream.send_all(connection.send(h11.EndOfMessage()))


async def test_the_body_and_its_length_arrive_as_sent() -> None:
    received: list[h11.Request | bytes] = []
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as client:
        port = await nursery.start(_server_that_echoes_one_request, received)
        response = await request_bytes(
            client, "PUT", f"http://127.0.0.1:{port}/x", b"abc", headers={"x-kind": "test"}
        )
    assert response.content == b"ok"
    request, body = received
    assert isinstance(request, h11.Request)
    assert request.method == b"PUT"
    headers = dict(request.headers)
    assert headers[b"content-length"] == b"3"
    assert headers[b"x-kind"] == b"test"
    assert b"transfer-encoding" not in headers
    assert body == b"abc"

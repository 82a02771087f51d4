"""httpx requests whose body is one bytes object, sent without an async generator.

httpx wraps a bytes body in a stream whose `__aiter__` is an async generator. When a
request is cancelled while its body is being sent (a stale group stopped, a client that
left), the generator is dropped unfinished and trio's finalizer warns about it
(encode/httpx#3686, open upstream). A plain iterator object has nothing to finalize. Every
httpx request of the project that may be cancelled mid-send and carries a body goes
through `request_bytes`.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx


class _OneChunk(httpx.AsyncByteStream):
    def __init__(self, data: bytes) -> None:
        self._data = data

    def __aiter__(self) -> _OneChunkIterator:
        return _OneChunkIterator(self._data)


class _OneChunkIterator:
    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    def __aiter__(self) -> _OneChunkIterator:
        return self

    async def __anext__(self) -> bytes:
        if self._data is None:
            raise StopAsyncIteration
        data, self._data = self._data, None
        return data


async def request_bytes(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    data: bytes | None,
    *,
    headers: Mapping[str, str],
) -> httpx.Response:
    """Send one request with `data` as its body (Content-Length set, as httpx sets it for
    bytes) and read the whole response, under the client's timeouts."""
    request = client.build_request(method, url, content=data, headers=headers)
    if data is not None:
        request.stream = _OneChunk(data)
    return await client.send(request)

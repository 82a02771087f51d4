"""Servers scripted by a function, for the daemon's control calls (weight updates, health
probes) in virtual time: a `Requester` whose answers `handler` gives, with no socket."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import attrs
import trio

from orchestrator.daemon.inference.http11 import HTTPFailure, Reply


@attrs.frozen
class Call:
    """One request as the scripted servers saw it."""

    method: str
    origin: str  # scheme://host:port
    path: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def answer(status: int = 200, body: Any = None) -> Reply:
    """A reply with `body` as JSON (`{}` when None)."""
    return Reply(status, json.dumps({} if body is None else body).encode())


def refused(call: Call) -> NoReturn:
    """A handler's answer for a server that is down: the connection is refused."""
    raise HTTPFailure("connect", f"{call.origin}: Connection refused")


@attrs.define
class ScriptedServers:
    """`handler(call)` answers each request (it may raise `HTTPFailure`); a checkpoint
    first, as a real exchange has."""

    handler: Callable[[Call], Reply]
    authorization: str | None = None

    async def __aenter__(self) -> ScriptedServers:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        pass

    async def request(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        headers: Sequence[tuple[str, str]] = (),
    ) -> Reply:
        await trio.lowlevel.checkpoint()
        parts = urllib.parse.urlsplit(url)
        return self.handler(Call(method, f"{parts.scheme}://{parts.netloc}", parts.path, body))

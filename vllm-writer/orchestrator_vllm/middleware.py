"""`PayloadWriter`: the ASGI middleware that turns vLLM's inline routing into payloads by
handle.

Only `POST /inference/v1/generate` (below the app's `root_path`) is looked at; every other
request, and a generate request without `sampling_params.extra_args.payload_dir`, reaches
vLLM as it came (the body read is handed on byte for byte). For one with it:

1. the `payload_dir` is checked without touching the filesystem (`files.lexical_problem`);
   a refusal is a 400 with vLLM's error body, before vLLM sees the request (the
   middleware runs outside vLLM's `--api-key` check, so nothing it answers there may
   depend on the filesystem);
2. the request goes to vLLM unchanged; an answer other than a 200 goes back as it is;
3. in a worker thread (the event loop never waits on the filesystem or on the reply's
   JSON): the reply is parsed, the directory opened below the payload root without
   following links (refused with a 400 when it cannot be), each choice's arrays written
   into one new file, closed (fsynced with `--payload-fsync`) before the reply is sent,
   and the choice's `routed_experts` and `sampling_mask` replaced by `payload`, its
   segments (`[]` when it captured nothing). A choice whose file cannot be written keeps
   its tokens and carries `payload: null` with `payload_error` (one line): the daemon
   then never trains on it.

Settings come from the environment the command sets (`WriterSettings.from_environ`):
vLLM builds its middleware with the app as the only argument.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import os
import posixpath
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from orchestrator_vllm.errors import error_body
from orchestrator_vllm.files import PayloadDirRefused, lexical_problem, open_payload_dir, write_file
from orchestrator_vllm.payloads import ReplyProblem, choice_arrays, segments
from orchestrator_vllm.weight_loads import UNAUTHORIZED, api_tokens, authorized, update_weights

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GENERATE_PATH = "/inference/v1/generate"
#: prime-rl's weight update, `{"weight_dir": DIR}` (`weight_loads.py`).
UPDATE_WEIGHTS_PATH = "/update_weights"
#: The environment variables `orchestrator-vllm serve` passes its flags in.
ROOT_ENV = "ORCH_VLLM_PAYLOAD_ROOT"
FSYNC_ENV = "ORCH_VLLM_PAYLOAD_FSYNC"
THREADS_ENV = "ORCH_VLLM_WRITER_THREADS"
#: A generate request's body larger than this is handed to vLLM unread.
MAX_REQUEST_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class WriterSettings:
    """The payload root (None: refuse every `payload_dir`), whether files are fsynced, and
    how many worker threads write."""

    root: str | None = None
    fsync: bool = False
    threads: int = 4

    @classmethod
    def from_environ(cls) -> WriterSettings:
        root = os.environ.get(ROOT_ENV) or None
        return cls(
            root=None if root is None else posixpath.normpath(root),
            fsync=os.environ.get(FSYNC_ENV, "") == "1",
            threads=int(os.environ.get(THREADS_ENV, "4")),
        )


class PayloadWriter:
    """ASGI middleware (module docstring). `settings` defaults to the environment's."""

    def __init__(self, app: ASGIApp, settings: WriterSettings | None = None) -> None:
        self.app = app
        self.settings = WriterSettings.from_environ() if settings is None else settings
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.settings.threads, thread_name_prefix="payload-writer"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"].removeprefix(scope.get("root_path", "")) if "path" in scope else ""
        if scope["type"] != "http" or scope["method"] != "POST" or path not in _OWN_PATHS:
            await self.app(scope, receive, send)
            return
        body, complete = await _read_body(receive)
        replay = _replaying(body, complete, receive)
        if path == UPDATE_WEIGHTS_PATH:
            weight_dir = _weight_dir(body) if complete else None
            if weight_dir is None:
                # Not prime-rl's body: vLLM's own /update_weights answers it.
                await self.app(scope, replay, send)
                return
            app = scope["app"]
            if not authorized(scope.get("headers", ()), api_tokens(app)):
                await _send_json(send, 401, UNAUTHORIZED)
                return
            status, loaded = await update_weights(app.state.engine_client, weight_dir)
            await _send_json(send, status, loaded)
            return
        request = _payload_request(body) if complete else None
        if request is None:
            await self.app(scope, replay, send)
            return
        problem = lexical_problem(request.payload_dir, self.settings.root)
        if problem is None and request.stream:
            problem = "extra_args.payload_dir needs a reply in one piece: stream must be false"
        if problem is not None:
            await _send_json(send, 400, error_body(400, problem))
            return
        answer = _Captured()
        await self.app(scope, replay, answer.send)
        if answer.status != 200 or answer.streamed:
            await answer.forward(send)
            return
        loop = asyncio.get_running_loop()
        status, reply = await loop.run_in_executor(
            self._pool, self._by_handle, bytes(answer.body), request
        )
        await _send_json(send, status, reply, headers=answer.headers)

    def _by_handle(self, body: bytes, request: _Request) -> tuple[int, bytes | dict[str, Any]]:
        """In a worker thread: the reply with its arrays written, or a 400."""
        assert self.settings.root is not None  # lexical_problem refused it otherwise
        try:
            reply = json.loads(body)
            choices = reply["choices"]
        except (ValueError, KeyError, TypeError):
            return 200, body  # not a reply this writer knows: the client will see
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            return 200, body
        try:
            dir_fd, created = open_payload_dir(self.settings.root, request.payload_dir)
        except PayloadDirRefused as exc:
            return 400, error_body(400, str(exc))
        try:
            for choice in choices:
                self._write_choice(choice, dir_fd, request)
            if created and self.settings.fsync:
                os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return 200, json.dumps(reply, separators=(",", ":")).encode()

    def _write_choice(self, choice: dict[str, Any], dir_fd: int, request: _Request) -> None:
        try:
            arrays = choice_arrays(choice, request.prompt_len)
            files = [write_file(dir_fd, arrays, fsync=self.settings.fsync)] if arrays else []
        except (ReplyProblem, OSError) as exc:
            choice["payload"] = None
            choice["payload_error"] = " ".join(f"{type(exc).__name__}: {exc}".split())
        else:
            path = posixpath.join(request.payload_dir, files[0]) if files else ""
            choice["payload"] = segments(path, arrays) if files else []
        choice["routed_experts"] = None
        if "sampling_mask" in choice:
            choice["sampling_mask"] = None


_OWN_PATHS = (GENERATE_PATH, UPDATE_WEIGHTS_PATH)


def _weight_dir(body: bytes) -> Any:
    """The `weight_dir` of prime-rl's `/update_weights` body; None for any other body."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    return request.get("weight_dir") if isinstance(request, dict) else None


@dataclasses.dataclass(frozen=True)
class _Request:
    payload_dir: Any
    prompt_len: int
    stream: bool


def _payload_request(body: bytes) -> _Request | None:
    """What the writer needs of a generate request that asks for payloads by handle;
    None for any other (vLLM answers it, malformed ones included)."""
    try:
        request = json.loads(body)
        extra = request["sampling_params"]["extra_args"]
        payload_dir = extra["payload_dir"]
        tokens = request["token_ids"]
    except (ValueError, KeyError, TypeError):
        return None
    if payload_dir is None or not isinstance(tokens, list):
        return None
    return _Request(payload_dir, len(tokens), bool(request.get("stream")))


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    """The request's body, and whether it is whole (False: the client left, or it is
    longer than `MAX_REQUEST_BYTES`, and the rest is still to be received)."""
    chunks = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return bytes(chunks), False
        chunks += message.get("body", b"")
        if not message.get("more_body", False):
            return bytes(chunks), True
        if len(chunks) > MAX_REQUEST_BYTES:
            return bytes(chunks), False


def _replaying(body: bytes, complete: bool, receive: Receive) -> Receive:
    """A `receive` that hands on `body` first, then what `receive` gives."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": not complete}
        return await receive()

    return replay


class _Captured:
    """vLLM's answer, held back: status, headers, body."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.streamed = False
        self._messages: list[Message] = []

    async def send(self, message: Message) -> None:
        self._messages.append(message)
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")
            if message.get("more_body", False):
                self.streamed = True

    async def forward(self, send: Send) -> None:
        for message in self._messages:
            await send(message)


async def _send_json(
    send: Send,
    status: int,
    body: bytes | dict[str, Any],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    kept = [
        (name, value)
        for name, value in headers or []
        if name.lower() not in (b"content-length", b"content-type")
    ]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                *kept,
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})

"""The verifiers worker: one environment written for verifiers, loaded once, its tasks and
episodes served to the daemon over a Unix socket (the protocol: `protocol.py`).

    python -m orchestrator.tasks.verifiers_env.worker --socket PATH --config JSON

An asyncio program of its own (verifiers is asyncio; the daemon is trio). It listens on
PATH first, then imports verifiers and loads the environment (`--config`: the env's
name, verifiers id, args, max_turns, the tokenizer folder, renderer and chat template
kwargs), so the daemon can connect at once and its `hello` waits for the load; a load
that fails is that `hello`'s error (one line), never a crash. It serves one peer, every
request concurrently, and exits when the peer closes its end or on SIGTERM. Logs go to
stderr, which the daemon relays (warnings and errors; `ORCHESTRATOR_VERIFIERS_LOG_LEVEL=INFO`
in the daemon's environment for more); stdout is stderr too, so nothing the environment
prints can reach anything else.

The environment calls the model through verifiers' training client (`TrainClientConfig`:
it renders prompts with the tokenizer itself and posts token ids to
`/inference/v1/generate`), pointed at a relay of this worker on loopback that forwards
each rollout's requests to that rollout's `model_url`, found by the `X-Session-ID` header
verifiers puts on them (the trace's id, learnt when the trace is minted). verifiers keeps
one HTTP client per distinct endpoint for as long as it serves, each costing about 37 ms
of CPU and 0.75 MB to make: an endpoint per rollout would pay that per rollout, and keep
it. Its `GET /v1/models` (the context length, asked once per endpoint) carries no
session, so it goes to the most recent rollout's `model_url`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any

from orchestrator.tasks.verifiers_env.protocol import INSTALL_LINE, one_line
from orchestrator.tasks.verifiers_env.traces import episode_outcome

log = logging.getLogger("orchestrator.verifiers_worker")

#: The header verifiers' training client puts on every model call of a rollout.
SESSION_HEADER = "X-Session-ID"
#: The API key variable the client is told to read (unset: it sends "EMPTY").
API_KEY_VARIABLE = "ORCHESTRATOR_VERIFIERS_API_KEY"
#: Tasks of an infinite taskset kept for `task` and `run` of recent indices.
CACHED_TASKS = 65536
#: The longest request line read from the daemon.
MAX_LINE_BYTES = 16 << 20
#: The largest request body the relay accepts from the environment (token ids).
MAX_RELAY_BODY = 256 << 20
# The failed calls one rollout reports (an environment retrying a dead endpoint forever
# would otherwise grow its answer without end).
MAX_FAILED_CALLS = 20
#: How long episodes cancelled at exit get to end before the environment stops serving.
STOP_GRACE_S = 5.0


class LoadError(Exception):
    """The environment did not load: the message is the one line `hello` answers."""


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `override` on top, tables merged key by key (a value that is not a
    table replaces)."""
    merged = dict(base)
    for key, value in override.items():
        below = merged.get(key)
        if isinstance(below, Mapping) and isinstance(value, Mapping):
            merged[key] = deep_merge(below, value)
        else:
            merged[key] = value
    return merged


def _first_validation_error(exc: Any, prefix: str) -> str:
    """pydantic's first error as `prefix.loc: message` (and how many more)."""
    errors = exc.errors()
    first = errors[0]
    where = ".".join(str(part) for part in (prefix, *first.get("loc", ())) if part != "")
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid')}{more}"


class Tasks:
    """A taskset's tasks by index: a finite one's are read once (index modulo their
    count); an infinite one's are read on as asked, the most recent kept."""

    def __init__(self, taskset: Any) -> None:
        self._taskset = taskset
        self.count: int | None = None
        self._all: list[Any] = []
        self._recent: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._reader: Any = None
        self._next = 0
        if taskset.bounded:
            self._all = list(taskset)
            self.count = len(self._all)

    def get(self, index: int) -> Any:
        if index < 0:
            raise ValueError(f"task index must not be negative, got {index}")
        if self.count is not None:
            return self._all[index % self.count]
        if index in self._recent:
            self._recent.move_to_end(index)
            return self._recent[index]
        if self._reader is None or index < self._next:
            self._reader = iter(self._taskset.skip(index))
            self._next = index
        while self._next <= index:
            self._recent[self._next] = next(self._reader)
            self._next += 1
            while len(self._recent) > CACHED_TASKS:
                self._recent.popitem(last=False)
        return self._recent[index]


def task_id(task: Any) -> str:
    """A task's id: its data's own id, else its position in the taskset."""
    data = task.data
    return str(data.id) if data.id is not None else f"task-{data.idx}"


class Relay:
    """Loopback HTTP endpoint for the environment's model calls: each goes on to its
    rollout's `model_url` (by the session header), its answer comes back as it is."""

    def __init__(self) -> None:
        self.routes: dict[str, str] = {}
        # Sessions whose rollout the daemon said is over (410, or 404 for a key it
        # closed): their failed calls are expected, not worth a warning each.
        self.over: set[str] = set()
        # By session: the calls that failed on the way (this relay's 502) or were
        # answered 5xx, as [status, message]; the `run` answer hands them to the daemon,
        # which counts them among the run's failures (`model_call`).
        self.failed: dict[str, list[list[Any]]] = {}
        self.url = ""
        self._runner: Any = None
        self._client: Any = None

    async def start(self) -> None:
        import aiohttp
        from aiohttp import web

        app = web.Application(client_max_size=MAX_RELAY_BODY)
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self._client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def route(self, session: str, model_url: str) -> None:
        self.routes[session] = model_url.rstrip("/")

    def forget(self, sessions: list[str]) -> None:
        for session in sessions:
            self.routes.pop(session, None)
            self.over.discard(session)
            self.failed.pop(session, None)

    def failed_calls(self, sessions: list[str]) -> list[list[Any]]:
        """The failed calls of `sessions` (see `failed`), at most `MAX_FAILED_CALLS`."""
        calls = [call for session in sessions for call in self.failed.get(session, ())]
        return calls[:MAX_FAILED_CALLS]

    async def _generate(self, request: Any) -> Any:
        session = request.headers.get(SESSION_HEADER, "")
        base = self.routes.get(session)
        if base is None:
            return _error_response(404, f"no rollout has session {session!r}")
        body = await request.read()
        headers = {SESSION_HEADER: session, "Content-Type": request.content_type}
        answer = await self._forward("POST", f"{base}/inference/v1/generate", body, headers)
        if answer.status in (404, 410):
            self.over.add(session)
        elif answer.status >= 500:
            failed = self.failed.setdefault(session, [])
            if len(failed) < MAX_FAILED_CALLS:
                failed.append([answer.status, _error_message(answer.body)])
        return answer

    async def _models(self, request: Any) -> Any:
        if not self.routes:
            return _error_response(503, "no rollout is running")
        base = next(reversed(self.routes.values()))
        return await self._forward("GET", f"{base}/v1/models", None, {})

    async def _forward(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str]
    ) -> Any:
        import aiohttp
        from aiohttp import web

        try:
            async with self._client.request(method, url, data=body, headers=headers) as answer:
                content = await answer.read()
                return web.Response(
                    status=answer.status,
                    body=content,
                    content_type=answer.content_type,
                )
        except (aiohttp.ClientError, OSError) as exc:
            return _error_response(502, f"the orchestrator's endpoint {url} failed: {exc!r}")


def _error_message(body: Any) -> str:
    """The message of vLLM's (and this relay's) error body, else the body's start."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else str(body)
    try:
        return str(json.loads(text)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return text[:300]


def _error_response(status: int, message: str) -> Any:
    from aiohttp import web

    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class RolloutOverFilter(logging.Filter):
    """Drops verifiers' "model call failed" warning for a session whose rollout the
    daemon ended (a group stopped, the run over): each of its calls then fails, as it
    should, and a line apiece would bury the warnings that matter."""

    def __init__(self, relay: Relay) -> None:
        super().__init__()
        self.relay = relay

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (
            isinstance(record.msg, str)
            and record.msg.startswith("model call failed")
            and isinstance(args, tuple)
            and bool(args)
            and args[0] in self.relay.over
        )


class Worker:
    """The loaded environment and the requests on it."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = config
        self.id = str(config["verifiers"])
        self.load_error: str | None = None
        self.env: Any = None
        self.tasks: Tasks | None = None
        self.version = ""
        self.relay = Relay()
        # On the handlers: verifiers' records reach them by propagation.
        for handler in logging.getLogger().handlers:
            handler.addFilter(RolloutOverFilter(self.relay))
        self.client: Any = None
        self.stop = asyncio.Event()
        self._peer = False
        # The requests being answered, by id.
        self._running: dict[Any, asyncio.Task[None]] = {}

    # -- loading ----------------------------------------------------------------------

    def load(self) -> None:
        """Import verifiers and build the environment and its tasks, or set `load_error`."""
        try:
            self._load()
        except LoadError as exc:
            self.load_error = one_line(str(exc))
        except Exception as exc:
            log.debug("loading failed", exc_info=True)
            self.load_error = one_line(f"{self.id}: loading failed: {type(exc).__name__}: {exc}")

    def _load(self) -> None:
        try:
            import verifiers
            import verifiers.v1 as vf
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] != "verifiers":
                raise
            raise LoadError(f"verifiers is not installed: {INSTALL_LINE}") from None
        self.version = str(verifiers.__version__)
        data = self._env_config_data(vf)
        try:
            env_config = vf.resolve_env_config(data)
            self.env = vf.load_environment(env_config)
        except Exception as exc:
            raise LoadError(self._describe(exc)) from None
        self.tasks = Tasks(self.env.taskset)
        if self.tasks.count == 0:
            raise LoadError(f"{self.id}: its taskset has no tasks")

    def _env_config_data(self, vf: Any) -> dict[str, Any]:
        """What `resolve_env_config` gets: the id as the taskset's (or, for a package that
        exports an environment and no taskset, as the environment's), the user's args on
        top, then for each agent: a local subprocess as its runtime where it would be
        verifiers' default, a remote sandbox, and the user's args name none; the tool-less
        chat loop as its harness where neither the args nor the taskset name one; and at
        most the env's max_turns."""
        args = dict(self.config.get("args") or {})
        max_turns = int(self.config.get("max_turns", 1))
        try:
            vf.taskset_config_type(self.id)
            data = deep_merge({"taskset": {"id": self.id}}, args)
        except (TypeError, AttributeError):  # a package exporting no Taskset: an environment
            data = deep_merge({"id": self.id}, args)
            taskset = data.get("taskset")
            if not (isinstance(taskset, Mapping) and taskset.get("id")):
                raise LoadError(
                    f"{self.id} is a verifiers environment without a taskset of its own: "
                    'name one in args (args = {taskset = {id = "..."}})'
                ) from None
        except Exception as exc:
            raise LoadError(self._describe(exc)) from None
        try:
            resolved = vf.resolve_env_config(data)
            harnesses = resolved.agent_harnesses()
            roles = {name: value for name, value in resolved if isinstance(value, vf.AgentConfig)}
        except Exception as exc:
            raise LoadError(self._describe(exc)) from None
        chosen: dict[str, Any] = {}
        for role, agent in roles.items():
            given = args.get(role)
            given = given if isinstance(given, Mapping) else {}
            ours: dict[str, Any] = {}
            if "runtime" not in given and isinstance(agent.runtime, vf.PrimeConfig):
                ours["runtime"] = {"type": "subprocess"}
            if agent.harness is None and harnesses[role].id == "bash":
                ours["harness"] = {"id": "null"}
            if agent.max_turns is None or agent.max_turns > max_turns:
                ours["max_turns"] = max_turns
            chosen[role] = ours
        return deep_merge(data, chosen)

    def _describe(self, exc: BaseException) -> str:
        """A load failure as one line naming what to fix."""
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            return _first_validation_error(exc, "args")
        text = str(exc)
        missing = re.match(r"(\w+) '([^']*)' not found \(tried to import '([^']*)'\)", text)
        if isinstance(exc, ModuleNotFoundError) and missing:
            kind, ident, module = missing.groups()
            return (
                f"no verifiers {kind} {ident!r} is installed (no module {module!r}): install "
                "its package into this environment, or put its folder on PYTHONPATH"
            )
        if isinstance(exc, ImportError):
            return f"{self.id}: importing it failed: {type(exc).__name__}: {text}"
        return f"{self.id}: {type(exc).__name__}: {text}"

    # -- serving ----------------------------------------------------------------------

    async def serve(self, listener: socket.socket) -> None:
        """Load, then answer the peer until it leaves or SIGTERM."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        loop.add_signal_handler(signal.SIGINT, self.stop.set)
        self.load()
        async with contextlib.AsyncExitStack() as stack:
            if self.load_error is None:
                try:
                    await self._start_serving(stack)
                except LoadError as exc:
                    self.load_error = one_line(str(exc))
                except Exception as exc:
                    log.debug("serving failed", exc_info=True)
                    self.load_error = one_line(
                        f"{self.id}: starting it failed: {type(exc).__name__}: {exc}"
                    )
            server = await asyncio.start_unix_server(
                self._connection, sock=listener, limit=MAX_LINE_BYTES
            )
            async with server:
                await self.stop.wait()
                # The episodes still running end before the environment stops serving.
                for task in self._running.values():
                    task.cancel()
                if self._running:
                    await asyncio.wait(list(self._running.values()), timeout=STOP_GRACE_S)

    async def _start_serving(self, stack: contextlib.AsyncExitStack) -> None:
        import verifiers.v1 as vf

        await self.relay.start()
        stack.push_async_callback(self.relay.close)
        self.client = vf.TrainClientConfig(
            base_url=f"{self.relay.url}/v1",
            api_key_var=API_KEY_VARIABLE,
            renderer_model_name=str(self.config["tokenizer"]),
            renderer=dict(self.config.get("renderer") or {"name": "default"}),
        )
        await asyncio.to_thread(self._check_renderer)
        await stack.enter_async_context(self.env.serving())

    def _check_renderer(self) -> None:
        """Build the renderer once, as verifiers builds it for a turn: one that refuses the
        tokenizer (a model family's renderer on a vocabulary without its special tokens)
        fails the load in one line, not every episode at its first turn."""
        from renderers import create_renderer  # type: ignore[import-untyped]
        from renderers.base import load_tokenizer  # type: ignore[import-untyped]

        renderer = self.client.renderer
        tokenizer = str(self.config["tokenizer"])
        try:
            create_renderer(
                load_tokenizer(tokenizer),
                renderer,
                chat_template_kwargs=dict(self.config.get("chat_template_kwargs") or {}) or None,
            )
        except Exception as exc:
            name = getattr(renderer, "name", "default")
            raise LoadError(
                f"{self.id}: its renderer {name!r} does not load with the tokenizer "
                f"{tokenizer}: {type(exc).__name__}: {exc}"
            ) from None

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._peer:  # one peer: the daemon that started it
            writer.close()
            return
        self._peer = True
        lock = asyncio.Lock()
        try:
            while not self.stop.is_set():
                line = await reader.readline()
                if not line:
                    break
                self._dispatch(line, writer, lock, self._running)
        except (ConnectionError, ValueError) as exc:  # ValueError: a line over the limit
            log.error("the connection failed: %r", exc)
        finally:
            self.stop.set()  # the peer left: exit

    def _dispatch(
        self,
        line: bytes,
        writer: asyncio.StreamWriter,
        lock: asyncio.Lock,
        running: dict[Any, asyncio.Task[None]],
    ) -> None:
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("a request is a JSON object")
        except ValueError as exc:
            asyncio.get_running_loop().create_task(
                _send(writer, lock, {"id": None, "ok": False, "error": one_line(repr(exc))})
            )
            return
        ident = request.get("id")
        if request.get("op") == "cancel":
            target = running.get(request.get("target"))
            if target is not None:
                target.cancel()
            asyncio.get_running_loop().create_task(_send(writer, lock, {"id": ident, "ok": True}))
            return
        task = asyncio.get_running_loop().create_task(self._answer(request, writer, lock))
        running[ident] = task
        task.add_done_callback(lambda _: running.pop(ident, None))

    async def _answer(
        self, request: dict[str, Any], writer: asyncio.StreamWriter, lock: asyncio.Lock
    ) -> None:
        ident = request.get("id")
        try:
            answer = {"id": ident, "ok": True, **await self._op(request)}
        except asyncio.CancelledError:
            raise
        except LoadFailed as exc:
            answer = {"id": ident, "ok": False, "error": str(exc)}
        except Exception as exc:
            log.debug("request %r failed", request.get("op"), exc_info=True)
            answer = {"id": ident, "ok": False, "error": one_line(f"{type(exc).__name__}: {exc}")}
        await _send(writer, lock, answer)

    async def _op(self, request: Mapping[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if self.load_error is not None:
            raise LoadFailed(self.load_error)
        assert self.tasks is not None
        if op == "hello":
            return {
                "tasks": self.tasks.count,
                "env": type(self.env).__name__,
                "taskset": type(self.env.taskset).__name__,
                "verifiers": self.version,
            }
        if op == "task":
            index = int(request["index"])
            return {"task_id": task_id(self.tasks.get(index)), "index": index}
        if op == "run":
            return await self._run(request)
        raise ValueError(f"unknown op {op!r}")

    async def _run(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """One episode of the task at `index` against `model_url`."""
        import verifiers.v1 as vf

        assert self.tasks is not None
        task = self.tasks.get(int(request["index"]))
        model_url = str(request["model_url"])
        sampling = {k: v for k, v in dict(request.get("sampling") or {}).items() if v is not None}
        template_kwargs = self.config.get("chat_template_kwargs")
        if template_kwargs:
            sampling["chat_template_kwargs"] = dict(template_kwargs)
        context = vf.ModelContext(
            model=str(request["model"]),
            client=self.client,
            sampling=vf.SamplingConfig(**sampling),
        )
        sessions: list[str] = []

        def minted(trace: Any) -> None:
            sessions.append(trace.id)
            self.relay.route(trace.id, model_url)

        (slot,) = self.env.slots(task, 1)
        try:
            episode = await self.env.run_slot(slot, context, on_trace=minted)
            failed_calls = self.relay.failed_calls(sessions)
        finally:
            self.relay.forget(sessions)
        return {**episode_outcome(episode), "failed_calls": failed_calls}


class LoadFailed(Exception):
    """A request to a worker whose environment did not load."""


async def _send(writer: asyncio.StreamWriter, lock: asyncio.Lock, answer: dict[str, Any]) -> None:
    data = json.dumps(answer, separators=(",", ":")).encode() + b"\n"
    async with lock:
        try:
            writer.write(data)
            await writer.drain()
        except ConnectionError:
            pass  # the peer left: the reader ends the worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.tasks.verifiers_env.worker")
    parser.add_argument("--socket", required=True, help="the Unix socket to listen on")
    parser.add_argument("--config", required=True, help="the environment, as JSON")
    args = parser.parse_args(argv)
    # Whatever the environment prints goes to stderr (relayed), never to stdout.
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(
        stream=sys.stderr,
        level=os.environ.get("ORCHESTRATOR_VERIFIERS_LOG_LEVEL", "WARNING").upper(),
        format="%(levelname)s %(name)s: %(message)s",
    )
    config = json.loads(args.config)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(args.socket)
    listener.listen(8)
    try:
        asyncio.run(Worker(config).serve(listener))
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(args.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The daemon's side of a verifiers environment: `VerifiersEnvironment`, an `Environment`
whose episodes drive themselves (`DrivenEpisode`), served by a worker process
(`worker.py`) over a Unix socket in a temporary directory of its own.

`open_verifiers_environments` opens them: it starts every worker first, so that they
load side by side (verifiers' import alone takes seconds), then waits for each `hello`
(the environment loaded, its task count) under `start_timeout_s`; anything that goes
wrong is a `UserError`, one line. On exit each worker is stopped: its socket closed and
SIGTERM, then SIGKILL after `stop_grace_s`.

Prompts: a finite taskset's tasks are drawn epoch after epoch, each a shuffle seeded by
the run's seed and the env's name (`DataOrder`, as a dataset's rows), an infinite one's in
its order; the prompt carries no tokens (the environment renders its own). An episode's
`drive` sends `run` and returns the environment's answer as `Driven`: its reward, metrics
and every model call's sampled tokens, or the error (one line) that failed it.

A worker that dies fails the episodes it was running (`Driven.error`) and is started
again by the next request; after `max_restarts` restarts with no answer in between, the
next request raises `UserError` (the run stops, saying why). The worker's stderr is
relayed to the daemon's log, line by line. Nothing here runs on the event loop but the
socket and pipe I/O and the JSON of each answer (a few KB: ids of the sampled tokens).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import structlog
import trio

from orchestrator.core.environments import (
    Driven,
    Prompt,
    PromptSkipped,
    Sampling,
    ScoreFailed,
)
from orchestrator.errors import UserError
from orchestrator.tasks.datasets import DataOrder
from orchestrator.tasks.verifiers_env.protocol import WORKER_MODULE, one_line

log = structlog.get_logger(__name__)

#: How long a worker may take to load its environment and answer `hello`.
START_TIMEOUT_S = 300.0
#: How long a worker gets to exit after SIGTERM before it is killed.
STOP_GRACE_S = 5.0
#: Restarts of a dead worker with no answer in between before the run stops.
MAX_RESTARTS = 3
#: Prompts in a row whose task cannot be read before the run stops.
MAX_SKIPS_IN_A_ROW = 1000
#: The worker's last stderr lines kept to say why it failed.
STDERR_LINES = 20
#: Tasks of a finite taskset above which an epoch's first shuffle runs in a thread.
LARGE_TASKSET = 1 << 16


@contextlib.contextmanager
def _one_error() -> Iterator[None]:
    """A nursery that is an implementation detail: the one exception of its group raised
    as itself (the body's error, a cancellation), not inside a group."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from group.exceptions[0].__cause__
        raise


class WorkerDied(Exception):
    """The worker's connection ended before the request was answered."""


@attrs.frozen
class WorkerSpec:
    """What a worker loads: an `[[env]]` with `verifiers`, and the model's tokenizer."""

    name: str
    verifiers: str
    tokenizer: Path
    args: Mapping[str, Any] = attrs.field(factory=dict)
    max_turns: int = 1
    renderer: Mapping[str, Any] = attrs.field(factory=dict)
    chat_template_kwargs: Mapping[str, Any] = attrs.field(factory=dict)

    def config_json(self) -> str:
        """The worker's `--config`."""
        return json.dumps(
            {
                "name": self.name,
                "verifiers": self.verifiers,
                "tokenizer": str(self.tokenizer),
                "args": dict(self.args),
                "max_turns": self.max_turns,
                "renderer": dict(self.renderer),
                "chat_template_kwargs": dict(self.chat_template_kwargs),
            }
        )


def _python_path() -> str:
    """The worker's PYTHONPATH: this process's own entries (the working directory, its
    PYTHONPATH as it started), not the interpreter's, then its PYTHONPATH as it is now,
    so it imports what the daemon would."""
    prefixes = {os.path.realpath(prefix) for prefix in (sys.prefix, sys.base_prefix)}
    entries: list[str] = []
    inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    for entry in (*sys.path, *inherited):
        if not entry:
            continue
        real = os.path.realpath(entry)
        if any(real == p or real.startswith(p + os.sep) for p in prefixes):
            continue
        if entry not in entries:
            entries.append(entry)
    return os.pathsep.join(entries)


@attrs.define(eq=False)
class _Waiter:
    event: trio.Event = attrs.field(factory=trio.Event)
    answer: dict[str, Any] | None = None


@attrs.define(eq=False)
class _Worker:
    """One started worker process and its connection: requests out, answers matched to
    them by id as they come back."""

    process: trio.Process
    directory: str
    stderr: collections.deque[str]
    stream: trio.SocketStream | None = None
    pending: dict[int, _Waiter] = attrs.field(factory=dict)
    next_id: int = 0
    send_lock: trio.Lock = attrs.field(factory=trio.Lock)
    ended: str | None = None  # why the connection ended

    def why(self) -> str:
        """Why the worker is gone: its exit code (and last stderr line), or signal."""
        code = self.process.returncode
        if code is None:
            return "its connection closed"
        if code < 0:
            return f"it was killed by signal {-code}"
        tail = f" (its last line: {self.stderr[-1]})" if self.stderr and code else ""
        return one_line(f"it exited with code {code}{tail}")

    async def died(self) -> WorkerDied:
        """`WorkerDied` saying why, once the process has exited (or a second passed)."""
        with trio.move_on_after(1):
            await self.process.wait()
        return WorkerDied(self.why())

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send `message` and wait for its answer. Raises `WorkerDied`."""
        if self.stream is None or self.ended is not None:
            raise WorkerDied(self.why())
        ident = self.next_id
        self.next_id += 1
        waiter = _Waiter()
        self.pending[ident] = waiter
        data = json.dumps({"id": ident, **message}, separators=(",", ":")).encode() + b"\n"
        try:
            try:
                async with self.send_lock:
                    await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise await self.died() from None
            await waiter.event.wait()
        except trio.Cancelled:
            if message.get("op") == "run":
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await self._send_quietly({"id": -1, "op": "cancel", "target": ident})
            raise
        finally:
            self.pending.pop(ident, None)
        if waiter.answer is None:
            raise await self.died()
        return waiter.answer

    async def _send_quietly(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode() + b"\n"
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            assert self.stream is not None
            async with self.send_lock:
                await self.stream.send_all(data)

    async def read_answers(self) -> None:
        """Hand each answer line to the request waiting for it, until the connection
        ends; then every request still waiting fails."""
        assert self.stream is not None
        buffer = bytearray()
        scanned = 0
        try:
            while True:
                data = await self.stream.receive_some(1 << 16)
                if not data:
                    break
                buffer += data
                while (end := buffer.find(b"\n", scanned)) >= 0:
                    self._answer(bytes(buffer[:end]))
                    del buffer[: end + 1]
                    scanned = 0
                scanned = len(buffer)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self.ended = "closed"
            for waiter in self.pending.values():
                waiter.event.set()  # no answer: WorkerDied

    def _answer(self, line: bytes) -> None:
        try:
            answer = json.loads(line)
        except ValueError:
            log.warning("verifiers worker sent a line that is not JSON", line=line[:200])
            return
        if not isinstance(answer, dict):
            return
        waiter = self.pending.get(answer.get("id"))  # type: ignore[arg-type]
        if waiter is not None:
            waiter.answer = answer
            waiter.event.set()

    async def relay_stderr(self, env: str | None) -> None:
        """The worker's stderr, line by line, into the daemon's log (under `env`'s name;
        None: the last lines only kept)."""
        assert self.process.stderr is not None
        buffer = b""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while chunk := await self.process.stderr.receive_some(1 << 16):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for raw in lines:
                    self._log_line(env, raw)
        if buffer:
            self._log_line(env, buffer)

    def _log_line(self, env: str | None, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip()
        if not line:
            return
        self.stderr.append(line)
        if env is None:
            return
        level = line.split(" ", 1)[0]
        if level in ("ERROR", "CRITICAL"):
            log.error("verifiers worker", env=env, line=line)
        elif level == "WARNING":
            log.warning("verifiers worker", env=env, line=line)
        else:
            log.info("verifiers worker", env=env, line=line)


@attrs.define(eq=False)
class VerifiersEnvironment:
    """One `[[env]]` (or `[[eval.env]]`) with `verifiers`; see the module docstring."""

    spec: WorkerSpec
    sampling: Sampling
    #: The model's name in its calls (`[inference] model`; "" for none).
    model: str = ""
    seed: int = 0
    start_timeout_s: float = START_TIMEOUT_S
    stop_grace_s: float = STOP_GRACE_S
    max_restarts: int = MAX_RESTARTS
    #: What its errors start with: the config key (`env[0].verifiers`), or `env NAME`.
    key: str = ""
    #: Relay the worker's stderr to the log (else only kept, to say why it failed).
    relay_log: bool = True
    #: What the worker's `hello` said (the task count, the environment's class...).
    hello: dict[str, Any] = attrs.field(factory=dict, init=False)
    _worker: _Worker | None = attrs.field(default=None, init=False)
    _nursery: trio.Nursery | None = attrs.field(default=None, init=False)
    _start_lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)
    _order_lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)
    _order: DataOrder | None = attrs.field(default=None, init=False)
    _restarts_in_a_row: int = attrs.field(default=0, init=False)
    _skips_in_a_row: int = attrs.field(default=0, init=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def label(self) -> str:
        return self.key or f"env {self.name}"

    @property
    def tasks(self) -> int | None:
        """The taskset's tasks (None: infinite), known once started."""
        count = self.hello.get("tasks")
        return None if count is None else int(count)

    # -- opening and closing --------------------------------------------------------

    @contextlib.asynccontextmanager
    async def spawned(self) -> AsyncIterator[None]:
        """The worker started (not yet loaded: `wait_started`), stopped on exit."""
        with _one_error():
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    self._worker = await self._spawn()
                    yield
                finally:
                    with trio.CancelScope(shield=True):
                        if self._worker is not None:
                            await self._stop(self._worker)
                    nursery.cancel_scope.cancel()
                    self._nursery = None

    async def wait_started(self) -> None:
        """Wait for the spawned worker's `hello`. Raises `UserError`, one line."""
        assert self._worker is not None
        self.hello = await self._hello(self._worker)
        count = self.tasks
        if count is not None:
            self._order = DataOrder(count, self.seed, self.name)

    async def _spawn(self) -> _Worker:
        directory = await trio.to_thread.run_sync(
            lambda: tempfile.mkdtemp(prefix="orchestrator-verifiers-")
        )
        environ = dict(os.environ)
        environ["PYTHONPATH"] = _python_path()
        command = [
            sys.executable,
            "-m",
            WORKER_MODULE,
            "--socket",
            os.path.join(directory, "worker.sock"),
            "--config",
            self.spec.config_json(),
        ]
        try:
            process = await trio.lowlevel.open_process(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=environ,
                # Its own session: Ctrl-C reaches the daemon, which stops it in order.
                start_new_session=True,
            )
        except OSError as exc:
            await trio.to_thread.run_sync(shutil.rmtree, directory, True)
            raise UserError(f"{self.label}: the verifiers worker did not start: {exc}") from None
        worker = _Worker(process, directory, collections.deque(maxlen=STDERR_LINES))
        assert self._nursery is not None
        self._nursery.start_soon(worker.relay_stderr, self.name if self.relay_log else None)
        return worker

    async def _hello(self, worker: _Worker) -> dict[str, Any]:
        """Connect to `worker` and ask `hello` under the start deadline."""
        path = os.path.join(worker.directory, "worker.sock")
        with trio.move_on_after(self.start_timeout_s) as deadline:
            while worker.stream is None:
                if worker.process.returncode is not None:
                    break
                try:
                    worker.stream = await trio.open_unix_socket(path)
                except OSError:
                    await trio.sleep(0.05)
            if worker.stream is not None:
                assert self._nursery is not None
                self._nursery.start_soon(worker.read_answers)
                with contextlib.suppress(WorkerDied):
                    answer = await worker.request({"op": "hello"})
                    if not answer.get("ok"):
                        error = one_line(str(answer.get("error")))
                        raise UserError(f"{self.label}: {error}")
                    return answer
            with trio.move_on_after(1):
                await worker.process.wait()  # an exit code for `why`
        if deadline.cancelled_caught:
            raise UserError(
                f"{self.label}: the verifiers worker did not load "
                f"{self.spec.verifiers!r} within {self.start_timeout_s:g} s"
            )
        raise UserError(
            f"{self.label}: the verifiers worker stopped before it loaded "
            f"{self.spec.verifiers!r}: {worker.why()}"
        )

    async def _stop(self, worker: _Worker) -> None:
        """Close the connection, SIGTERM, SIGKILL after the grace; remove its directory."""
        if worker.stream is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await worker.stream.aclose()
        if worker.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)
            with trio.move_on_after(self.stop_grace_s):
                await worker.process.wait()
            if worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
                await worker.process.wait()
        await trio.to_thread.run_sync(shutil.rmtree, worker.directory, True)

    async def _live_worker(self) -> _Worker:
        """The worker, started again when it died. Raises `UserError` once it died
        `max_restarts` times in a row, or does not start."""
        async with self._start_lock:
            worker = self._worker
            if worker is not None and worker.ended is None:
                return worker
            if self._nursery is None:
                raise UserError(f"{self.label}: the verifiers environment is not open")
            why = (await worker.died()).args[0] if worker is not None else "it was not started"
            if self._restarts_in_a_row >= self.max_restarts:
                raise UserError(
                    f"{self.label}: the verifiers worker keeps dying ({self._restarts_in_a_row} "
                    f"restarts in a row, no answer in between; last: {why})"
                )
            self._restarts_in_a_row += 1
            log.warning(
                "verifiers worker died: starting it again",
                env=self.name,
                why=why,
                restart=self._restarts_in_a_row,
            )
            if worker is not None:
                with trio.CancelScope(shield=True):
                    await self._stop(worker)
            self._worker = None
            self._worker = worker = await self._spawn()
            await self._hello(worker)
            return worker

    async def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        """`message` answered by a live worker (started again if it died). Raises
        `WorkerDied` when it dies before answering, `UserError` as `_live_worker`."""
        worker = await self._live_worker()
        answer = await worker.request(message)
        self._restarts_in_a_row = 0
        return answer

    # -- the Environment ---------------------------------------------------------------

    async def prompt(self, index: int) -> Prompt:
        if index < 0:
            raise ValueError(f"prompt index must not be negative, got {index}")
        epoch, position = 0, index
        if self._order is not None:
            epoch, position = await self._draw(self._order, index)
        while True:  # `task` is idempotent: asked again of a restarted worker
            try:
                answer = await self._request({"op": "task", "index": position})
                break
            except WorkerDied:
                continue
        if not answer.get("ok"):
            self._skips_in_a_row += 1
            reason = f"task {position}: {one_line(str(answer.get('error')))}"
            if self._skips_in_a_row > MAX_SKIPS_IN_A_ROW:
                raise UserError(f"{self.label}: {MAX_SKIPS_IN_A_ROW} tasks in a row ({reason})")
            raise PromptSkipped(self.name, reason)
        self._skips_in_a_row = 0
        task_id = str(answer.get("task_id"))
        info = {"index": position, "epoch": epoch, "task_id": task_id}
        return Prompt(task_id, np.zeros(0, dtype=np.int32), self.name, info, self.sampling)

    async def _draw(self, order: DataOrder, index: int) -> tuple[int, int]:
        if order.length < LARGE_TASKSET:
            return order.row_at(index)
        async with self._order_lock:  # an epoch's first draw shuffles every task index
            return await trio.to_thread.run_sync(order.row_at, index)

    def episode(self, prompt: Prompt) -> VerifiersEpisode:
        return VerifiersEpisode(self, prompt)

    async def run(self, prompt: Prompt, model_url: str) -> Driven:
        """One episode of `prompt`'s task, the model at `model_url`."""
        sampling = prompt.sampling
        request = {
            "op": "run",
            "index": int(prompt.info["index"]),
            "model_url": model_url,
            "model": self.model,
            "sampling": {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "max_tokens": sampling.max_tokens,
            },
        }
        try:
            answer = await self._request(request)
        except WorkerDied as exc:
            return Driven(None, error=f"the verifiers worker died: {exc}")
        if not answer.get("ok"):
            return Driven(None, error=one_line(str(answer.get("error"))))
        return _driven(answer)


def _driven(answer: Mapping[str, Any]) -> Driven:
    """A `run` answer as `Driven`, its types checked."""
    try:
        reward = answer.get("reward")
        if reward is not None:
            reward = float(reward)
        completions = tuple(tuple(int(token) for token in call) for call in answer["completions"])
        metrics = {str(name): float(value) for name, value in dict(answer["metrics"]).items()}
        failed_calls = tuple(
            (int(status), one_line(str(message)))
            for status, message in answer.get("failed_calls") or ()
        )
    except (KeyError, TypeError, ValueError) as exc:
        return Driven(None, error=one_line(f"the worker's answer does not read: {exc!r}"))
    error = answer.get("error")
    return Driven(
        reward,
        completions=completions,
        metrics=metrics,
        error=None if error is None else one_line(str(error)),
        failed_calls=failed_calls,
    )


@attrs.define(eq=False)
class VerifiersEpisode:
    """One rollout of a verifiers environment: it drives itself (`DrivenEpisode`)."""

    env: VerifiersEnvironment
    prompt: Prompt
    driven: Driven | None = None

    async def drive(self, model_url: str) -> Driven:
        self.driven = await self.env.run(self.prompt, model_url)
        return self.driven

    async def score(self, completions: Sequence[np.ndarray]) -> float:
        driven = self.driven
        if driven is None:
            raise ScoreFailed("raised", "the episode was scored before it was driven")
        if driven.reward is None:
            error = driven.error or "the environment gave no reward"
            kind = "worker_died" if error.startswith("the verifiers worker died") else "raised"
            raise ScoreFailed(kind, error)
        return driven.reward


@contextlib.asynccontextmanager
async def open_verifiers_environments(
    environments: Sequence[VerifiersEnvironment],
) -> AsyncIterator[None]:
    """Open `environments` together: every worker spawned first, so they load side by
    side, then each `hello` awaited. Raises the first environment's `UserError` (in
    their order) when any does not start; all are stopped then."""
    async with contextlib.AsyncExitStack() as stack:
        for environment in environments:
            await stack.enter_async_context(environment.spawned())
        errors: list[UserError | None] = [None] * len(environments)

        async def wait(index: int) -> None:
            try:
                await environments[index].wait_started()
            except UserError as exc:
                errors[index] = exc

        with _one_error():
            async with trio.open_nursery() as nursery:
                for index in range(len(environments)):
                    nursery.start_soon(wait, index)
        for error in errors:
            if error is not None:
                raise error
        yield

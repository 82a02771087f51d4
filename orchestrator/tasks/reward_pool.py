"""Scoring rollouts in worker processes, so a reward function that hangs, crashes or
returns nonsense costs one rollout's score, never the daemon.

Calls made together go to the workers together: the calls that arrive in one round of
trio's scheduler (a group's members, scored as the group finishes) are split into as
many batches as there are free workers, at least one, and each batch is one job for one
worker. A round trip to a worker costs the event loop some 160 µs a call one by one
against about 30 µs a call in a batch of four (docs/design.md §12). A batch that times out
or kills its worker is scored again one call per job, so that only the call at fault
fails, and that environment's calls go one by one from then on.

The workers are trio-parallel's spawned processes. They import
`orchestrator.tasks.reward_functions`, `orchestrator.rewards` and the user's reward
modules, found on the `sys.path` they inherit: a spawned worker starts with the parent's
`sys.path` (and working directory) as they are when it starts, so a folder added to
`sys.path` or `PYTHONPATH` before the pool opens reaches every worker.
"""

from __future__ import annotations

import collections
import functools
import math
import re
import signal
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, Protocol, TypeVar

import attrs
import structlog
import trio
import trio_parallel

from orchestrator.core.environments import ScoreFailed
from orchestrator.tasks.reward_functions import (
    RewardSpec,
    ScoreOutcome,
    score_rollouts_captured,
    start_reward_worker,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")

FailureKind = Literal["raised", "timeout", "worker_died", "bad_value"]

# A fresh worker spawns a Python, imports the reward modules (math-verify brings sympy)
# and only then takes a job: seconds, and more on a loaded machine. That start-up is kept
# out of the per-call deadline, under this one of its own.
_WORKER_START_DEADLINE_S = 120.0
# How long closing the pool waits for idle workers to exit before killing them. A worker
# holds nothing worth saving, and an idle one exits in milliseconds once told to; one that
# does not is kept alive by its reward module (a thread or a child process it started,
# which Python waits for at exit), and would never exit: waiting longer only delays the
# end of the run (it once added 10 s to every Ctrl-C, ending in a warning).
_WORKER_GRACE_PERIOD_S = 1.0
# trio-parallel's message when workers did not end cleanly (trio_parallel/_proc.py).
_SHUTDOWN_COUNTS = re.compile(r"(\d+) nonzero exit codes and (\d+) forceful terminations")


class RewardFailed(Exception):
    """Scoring one rollout failed; the pool is still usable.

    `kind` is "raised" (a reward function raised; `detail` is the exception's type and
    message), "timeout" (no score within the pool's deadline; the worker was killed),
    "worker_died" (the worker process died, e.g. `os._exit` or a segfault) or "bad_value"
    (a reward function returned something that is not a finite number).
    """

    def __init__(self, kind: FailureKind, detail: str) -> None:
        super().__init__(f"reward {kind}: {detail}")
        self.kind: FailureKind = kind
        self.detail = detail


def _death_detail(exc: BaseException) -> str:
    # trio-parallel passes the dead worker's multiprocessing.Process as the last argument.
    process = exc.args[-1] if exc.args else None
    code = getattr(process, "exitcode", None)
    if isinstance(code, int):
        return f"the worker process {_exit_detail(code)}"
    return f"the worker process died: {exc}"


def _exit_detail(code: int | None) -> str:
    """How a worker process ended, from its exit code."""
    if isinstance(code, int) and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class RewardExecutor(Protocol):
    """Where rewards run: this machine's worker processes (`RewardPool`) or a Ray cluster
    (`orchestrator.tasks.ray_rewards.RayRewardPool`), chosen by `[rewards] executor`."""

    @property
    def failures(self) -> Mapping[tuple[str, FailureKind], int]: ...

    async def score(
        self, env: str, specs: Sequence[RewardSpec], arguments: Mapping[str, Any]
    ) -> float: ...


@attrs.define(eq=False)
class RewardFailures:
    """Failed calls counted by (environment, kind). The first failure of each is logged at
    warning level with its traceback ("reward failed"); later ones are only counted."""

    counts: collections.Counter[tuple[str, FailureKind]] = attrs.field(factory=collections.Counter)
    _logged: set[tuple[str, FailureKind]] = attrs.field(factory=set)
    #: False: nothing is logged (check-config's trial says the failure in its one line).
    log_failures: bool = True

    def failed(self, env: str, kind: FailureKind, detail: str, traceback: str = "") -> RewardFailed:
        """Count one failure and return the exception that reports it."""
        self.counts[env, kind] += 1
        fields: dict[str, str] = {"traceback": traceback} if traceback else {}
        self._log_first(env, kind, detail, **fields)
        return RewardFailed(kind, detail)

    def batch_failed(self, env: str, kind: FailureKind, detail: str, calls: int) -> None:
        """A job of `calls` calls failed as a whole: reported like a call's failure, but
        not counted, since each of its calls is scored again alone."""
        self._log_first(
            env,
            kind,
            detail,
            batch=str(calls),
            retry="each call of the job is scored again alone, and this environment's "
            "calls go one by one from now on",
        )

    def _log_first(self, env: str, kind: FailureKind, detail: str, **fields: str) -> None:
        if not self.log_failures or (env, kind) in self._logged:
            return
        self._logged.add((env, kind))
        log.warning(
            "reward failed",
            env=env,
            kind=kind,
            detail=detail,
            note="logged once per environment and kind; later ones are only counted",
            **fields,
        )

    def of_outcome(self, env: str, outcome: ScoreOutcome) -> float:
        """The score of a call's outcome; raises `RewardFailed` when it holds a failure."""
        if outcome.score is None:
            kind = outcome.failure or "raised"
            raise self.failed(env, kind, outcome.detail, outcome.traceback)
        return outcome.score


#: Why a call got no outcome from its worker: the failure's kind and detail.
CallFailure = tuple[FailureKind, str]


@attrs.define(eq=False)
class _Call:
    """One rollout's reward call, waiting for the batch it went out in."""

    env: str
    specs: tuple[RewardSpec, ...]
    arguments: dict[str, Any]
    done: trio.Event = attrs.field(factory=trio.Event)
    outcome: ScoreOutcome | CallFailure | None = None
    #: Its caller stopped waiting (cancelled): nobody needs its outcome.
    abandoned: bool = False
    #: The batch it went out in, once it has.
    batch: _Batch | None = None

    def settle(self, outcome: ScoreOutcome | CallFailure) -> None:
        self.outcome = outcome
        self.done.set()


@attrs.define(eq=False)
class _Batch:
    """Calls scored by one job of one worker, cancelled when all their callers are gone."""

    calls: list[_Call]
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)

    def abandon(self) -> None:
        if all(call.abandoned for call in self.calls):
            self.scope.cancel()


def split(calls: Sequence[_Call], parts: int) -> list[list[_Call]]:
    """`calls` in `parts` (at least one, at most one per call) runs of nearly equal size,
    in order."""
    parts = max(1, min(parts, len(calls)))
    size, extra = divmod(len(calls), parts)
    runs, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        runs.append(list(calls[start:end]))
        start = end
    return runs


@attrs.define(eq=False)
class RewardPool:
    """Worker processes that score rollouts; open it with `open_reward_pool`.

    `failures` counts the failed calls by (environment, kind) (`RewardFailures`).
    """

    timeout_s: float
    _context: Any  # trio_parallel.WorkerContext (untyped)
    # Where the batches run: the pool's own, so that a batch outlives the caller that
    # happened to send it (the others of the batch still wait for it).
    _nursery: trio.Nursery
    _limiter: trio.CapacityLimiter
    # Handed to trio-parallel, which wants a limiter of its own: a batch already holds a
    # token of `_limiter` when it calls in, and a task cannot take a token twice.
    _worker_limiter: trio.CapacityLimiter
    _failures: RewardFailures = attrs.field(factory=RewardFailures)
    # Set once the first workers have started (or failed to); None until they begin.
    _started: trio.Event | None = None
    # The calls of this scheduler round, gathered for the batches that send them.
    _gathering: list[_Call] | None = None
    # Environments whose batch timed out or killed its worker: scored one call per job.
    _one_by_one: set[str] = attrs.field(factory=set)

    @property
    def failures(self) -> Mapping[tuple[str, FailureKind], int]:
        """The number of failed calls so far, by (environment, kind)."""
        return dict(self._failures.counts)

    async def start_workers(self) -> None:
        """Start the pool's `workers` processes, all at once, unless that has begun
        already; return once they have started (a worker that did not start is logged,
        and the next call starts another). The daemon runs it beside its own start; the
        first call runs it otherwise, before its deadline starts."""
        if self._started is not None:
            await self._started.wait()
            return
        self._started = trio.Event()
        try:
            # All at once, so that each of these calls starts a worker of its own.
            async with trio.open_nursery() as nursery:
                for _ in range(int(self._limiter.total_tokens)):
                    nursery.start_soon(self._start_first_worker)
        finally:
            self._started.set()

    async def run_in_worker(self, function: Callable[..., T], *args: Any, deadline_s: float) -> T:
        """`function(*args)` as one job of one of the pool's workers, under `deadline_s`
        (the worker killed past it: `trio.TooSlowError`): check-config's trial runs the
        rewards' `prepare` so, in the worker that scores its rows next. Raises
        `trio_parallel.BrokenWorkerError` when the worker dies."""
        async with self._limiter:
            await self._ensure_idle_worker()
            with trio.fail_after(deadline_s):
                result: T = await self._context.run_sync(
                    function, *args, kill_on_cancel=True, limiter=self._worker_limiter
                )
        return result

    async def score(
        self, env: str, specs: Sequence[RewardSpec], arguments: Mapping[str, Any]
    ) -> float:
        """The weighted sum of `specs` for one rollout of `env`, computed in a worker.

        `arguments` holds the reward arguments by name (`REWARD_ARGUMENTS`). The calls made
        in the same round of the scheduler go out together (the module's docstring); at
        most `workers` jobs run at once, the others wait for a free worker, and each job
        runs under the pool's deadline. Raises `RewardFailed` for every failure of the
        reward functions or their worker.
        """
        call = _Call(env, tuple(specs), dict(arguments))
        if self._gathering is None:
            self._gathering = []
            self._nursery.start_soon(self._send_gathered)
        self._gathering.append(call)
        try:
            await call.done.wait()
        except BaseException:
            call.abandoned = True
            if call.batch is not None:
                call.batch.abandon()
            raise
        outcome = call.outcome
        if isinstance(outcome, ScoreOutcome):
            return self._failures.of_outcome(env, outcome)
        assert outcome is not None  # settled before done is set
        raise self._failures.failed(env, *outcome)

    async def _send_gathered(self) -> None:
        # Started by the round's first call, so it runs once that round is over.
        gathered = self._gathering or []
        try:
            await self.start_workers()
            self._gathering = None
            calls = [call for call in gathered if not call.abandoned]
            alone = [call for call in calls if call.env in self._one_by_one]
            together = [call for call in calls if call.env not in self._one_by_one]
            batches = split(together, int(self._limiter.available_tokens)) if together else []
            async with trio.open_nursery() as nursery:
                for batch in [*batches, *([call] for call in alone)]:
                    nursery.start_soon(self._send, batch)
        finally:
            _release(gathered)

    async def _send(self, calls: list[_Call]) -> None:
        """Score `calls` in one job; if it times out or its worker dies, score each alone."""
        batch = _Batch(calls)
        for call in calls:
            call.batch = batch
        batch.abandon()
        failure: CallFailure | None = None
        try:
            with batch.scope:
                try:
                    outcomes = await self._run_job(calls)
                except _JobFailed as exc:
                    failure = exc.failure
            if batch.scope.cancelled_caught:
                return  # every caller has gone
            if failure is None:
                for call, outcome in zip(calls, outcomes, strict=True):
                    call.settle(outcome)
            elif len(calls) == 1:
                calls[0].settle(failure)
            else:
                self._score_alone_from_now_on(calls, failure)
                async with trio.open_nursery() as nursery:
                    for call in calls:
                        if not call.abandoned:
                            nursery.start_soon(self._send, [call])
        finally:
            _release(calls)

    async def _run_job(self, calls: Sequence[_Call]) -> list[ScoreOutcome]:
        """The outcomes of `calls` from one worker, within the pool's deadline. Raises
        `_JobFailed` when the job timed out (its worker killed) or its worker died."""
        async with self._limiter:
            try:
                await self._ensure_idle_worker()
                with trio.fail_after(self.timeout_s):
                    outcomes: list[ScoreOutcome] = await self._context.run_sync(
                        score_rollouts_captured,
                        [(call.specs, call.arguments) for call in calls],
                        kill_on_cancel=True,
                        limiter=self._worker_limiter,
                    )
            except trio.TooSlowError:
                detail = f"no score within {self.timeout_s:g} s; worker killed"
                raise _JobFailed(("timeout", detail)) from None
            except trio_parallel.BrokenWorkerError as exc:
                raise _JobFailed(("worker_died", _death_detail(exc))) from None
            except Exception as exc:  # arguments that do not pickle: never the daemon's end
                detail = f"the job did not reach its worker: {exc!r:.200}"
                raise _JobFailed(("raised", detail)) from None
        return outcomes

    def _score_alone_from_now_on(self, calls: Sequence[_Call], failure: CallFailure) -> None:
        # Reported even for an environment already one by one (a batch formed before its
        # first failure): a worker that died there is that environment's first death.
        for env in sorted({call.env for call in calls}):
            self._one_by_one.add(env)
            self._failures.batch_failed(env, *failure, calls=len(calls))

    async def _ensure_idle_worker(self) -> None:
        # trio-parallel replaces a killed or dead worker lazily, inside the next call. Start
        # the replacement here, before the call's deadline starts, so a spawn and its
        # imports are not mistaken for a slow reward. (Calls that start at the same moment
        # can still share one idle worker; the others then start theirs in their call.)
        if self._context.statistics().idle_workers == 0:
            await self._start_worker()

    async def _start_worker(self) -> None:
        # A no-op job: with no idle worker to take it, trio-parallel starts one (which
        # imports the preloaded reward functions), then keeps it idle for the next call.
        try:
            with trio.fail_after(_WORKER_START_DEADLINE_S):
                await self._context.run_sync(
                    bool, kill_on_cancel=True, limiter=self._worker_limiter
                )
        except trio.TooSlowError:
            raise trio_parallel.BrokenWorkerError(
                f"a new worker did not start within {_WORKER_START_DEADLINE_S:g} s"
            ) from None

    async def _start_first_worker(self) -> None:
        try:
            await self._start_worker()
        except trio_parallel.BrokenWorkerError as exc:
            # Not fatal: the next call starts another, and reports it if that dies too.
            log.warning("reward worker did not start", detail=_death_detail(exc))


def _release(calls: Iterable[_Call]) -> None:
    """Settle what is still unsettled of `calls`: the pool closed under them."""
    for call in calls:
        if not call.done.is_set():
            call.settle(("worker_died", "the reward pool closed before the call was scored"))


class _JobFailed(Exception):
    """A worker's job gave no outcomes: `failure` says why."""

    def __init__(self, failure: CallFailure) -> None:
        super().__init__(*failure)
        self.failure = failure


@asynccontextmanager
async def open_reward_pool(
    workers: int,
    timeout_s: float,
    *,
    preload: Iterable[RewardSpec] = (),
    start: bool = False,
    log_failures: bool = True,
) -> AsyncIterator[RewardPool]:
    """A pool of `workers` processes that score rollouts, each call under `timeout_s`.

    The workers start as the pool opens with `start`, else with `RewardPool.start_workers`
    (or the first call), side by side with what the caller does meanwhile: a spawn and its
    imports take seconds. Each worker (and each replacement of a killed one) imports the
    reward functions of `preload` when it starts, so that neither counts against a call's
    deadline. On exit, the jobs still running are killed (cancel their calls first: a
    call cancelled kills its job's worker once no call of the job waits for it). Raises
    ValueError for fewer than one worker or a deadline that is not positive. With
    `log_failures` false, failed calls are counted and raised but not logged.
    """
    if workers < 1:
        raise ValueError(f"a reward pool needs at least one worker, not {workers}")
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"a reward pool's timeout must be positive and finite, not {timeout_s}")
    paths = tuple(dict.fromkeys(spec.path for spec in preload))
    async with _worker_context(paths) as context:
        try:
            async with trio.open_nursery() as nursery:
                pool = RewardPool(
                    timeout_s,
                    context,
                    nursery,
                    trio.CapacityLimiter(workers),
                    trio.CapacityLimiter(workers),
                    RewardFailures(log_failures=log_failures),
                )
                if start:
                    nursery.start_soon(pool.start_workers)
                yield pool
                # What still runs has no caller left (they were cancelled first): it goes.
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The caller's own error, raised as it raised it: the pool's nursery is its
            # business, not a layer of exception group around the caller's code.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise


@asynccontextmanager
async def _worker_context(paths: Sequence[str]) -> AsyncIterator[trio_parallel.WorkerContext]:
    """trio-parallel's worker context, whose end never raises for the workers' exits.

    Its graceful shutdown raises `BrokenWorkerError` when a worker did not exit cleanly:
    one that died before (killed from outside: the OOM killer, an operator), or one still
    running `_WORKER_GRACE_PERIOD_S` after it was told to exit, which it then kills. The
    pool is over either way, and its calls were settled: a line that says which, in the
    user's terms (`_log_unclean_end`), not a traceback at the end of the daemon's stop.
    """
    manager = trio_parallel.open_worker_context(
        # Idle workers are kept: starting one costs seconds.
        idle_timeout=math.inf,
        init=functools.partial(start_reward_worker, paths),
        grace_period=_WORKER_GRACE_PERIOD_S,
    )
    context = await manager.__aenter__()
    try:
        yield context
    except BaseException as exc:
        if not await manager.__aexit__(type(exc), exc, exc.__traceback__):
            raise
        return
    try:
        await manager.__aexit__(None, None, None)
    except trio_parallel.BrokenWorkerError as exc:
        _log_unclean_end(exc)


def _log_unclean_end(exc: trio_parallel.BrokenWorkerError) -> None:
    """Say what trio-parallel's shutdown error means: workers killed because they did not
    exit in time (their reward module keeps them alive: nothing is lost, an info line), or
    workers that had died before the end (a warning, with how they ended)."""
    message = str(exc.args[0]) if exc.args else str(exc)
    counts = _SHUTDOWN_COUNTS.search(message)
    if counts is None:
        log.warning("reward workers did not stop cleanly", error=message)
        return
    died, killed = int(counts[1]), int(counts[2])
    if killed:
        log.info(
            "reward workers killed at the end",
            workers=killed,
            detail=f"still running {_WORKER_GRACE_PERIOD_S:g} s after the run told them to "
            "exit: a reward module left a thread or a child process running in them, or the "
            "machine was too busy for them to exit sooner; nothing was lost",
        )
    if died:
        # The processes after the message: the ones that died first, then the killed.
        ended = [getattr(process, "exitcode", None) for process in exc.args[1 : 1 + died]]
        log.warning(
            "reward workers had died before the end of the run",
            workers=died,
            detail="; ".join(f"one {_exit_detail(code)}" for code in ended),
            note="killed from outside the daemon (the OOM killer, an operator) or crashed; "
            "a rollout one was scoring then counted as reward_failed",
        )


async def score_episode(
    pool: RewardExecutor,
    env: str,
    specs: Sequence[RewardSpec],
    *,
    prompt: Sequence[Mapping[str, Any]],
    messages: Sequence[Mapping[str, Any]],
    completion: str,
    answer: object,
    info: Mapping[str, Any],
) -> float:
    """An episode of `env` scored by its reward functions in `pool`, with the contract's
    arguments (`REWARD_ARGUMENTS`). Raises `ScoreFailed` (the environment seam's) for any
    `RewardFailed`."""
    arguments = {
        "prompt": list(prompt),
        "completion": completion,
        "messages": list(messages),
        "answer": answer,
        "info": dict(info),
        "env": env,
    }
    try:
        return await pool.score(env, specs, arguments)
    except RewardFailed as exc:
        raise ScoreFailed(exc.kind, exc.detail) from None

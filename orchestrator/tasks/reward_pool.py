"""Scoring rollouts in worker processes, so a reward function that hangs, crashes or
returns nonsense costs one rollout's score, never the daemon.

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
import os
import signal
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, Protocol

import attrs
import structlog
import trio
import trio_parallel

from orchestrator.core.environments import ScoreFailed
from orchestrator.tasks.reward_functions import (
    RewardSpec,
    ScoreOutcome,
    import_reward_functions,
    score_rollout_captured,
)

log = structlog.get_logger(__name__)

FailureKind = Literal["raised", "timeout", "worker_died", "bad_value"]

# A fresh worker spawns a Python, imports the reward modules (math-verify brings sympy)
# and only then takes a job: seconds, and more on a loaded machine. That start-up is kept
# out of the per-call deadline, under this one of its own.
_WORKER_START_DEADLINE_S = 120.0
# How long closing the pool waits for idle workers to exit before killing them.
_WORKER_GRACE_PERIOD_S = 10.0
#: How much nicer than the daemon its reward workers run (see `_start_worker`).
REWARD_WORKER_NICENESS = 5


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
    if isinstance(code, int) and code < 0:
        try:
            return f"the worker process was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"the worker process was killed by signal {-code}"
    if isinstance(code, int):
        return f"the worker process exited with code {code}"
    return f"the worker process died: {exc}"


class RewardExecutor(Protocol):
    """Where rewards run: this machine's worker processes (`RewardPool`) or a Ray cluster
    (`orchestrator.tasks.ray_rewards.RayRewardPool`), chosen by `[rewards] executor`."""

    @property
    def failures(self) -> Mapping[tuple[str, FailureKind], int]: ...

    async def start_workers(self) -> None:
        """Start what the first calls would otherwise wait for; returns once started."""

    async def score(
        self, env: str, specs: Sequence[RewardSpec], arguments: Mapping[str, Any]
    ) -> float: ...


@attrs.define(eq=False)
class RewardFailures:
    """Failed calls counted by (environment, kind). The first failure of each is logged at
    warning level with its traceback ("reward failed"); later ones are only counted."""

    counts: collections.Counter[tuple[str, FailureKind]] = attrs.field(factory=collections.Counter)

    def failed(self, env: str, kind: FailureKind, detail: str, traceback: str = "") -> RewardFailed:
        """Count one failure and return the exception that reports it."""
        key = (env, kind)
        self.counts[key] += 1
        if self.counts[key] == 1:
            fields: dict[str, str] = {"traceback": traceback} if traceback else {}
            log.warning(
                "reward failed",
                env=env,
                kind=kind,
                detail=detail,
                note="logged once per environment and kind; later ones are only counted",
                **fields,
            )
        return RewardFailed(kind, detail)

    def of_outcome(self, env: str, outcome: ScoreOutcome) -> float:
        """The score of a call's outcome; raises `RewardFailed` when it holds a failure."""
        if outcome.score is None:
            kind = outcome.failure or "raised"
            raise self.failed(env, kind, outcome.detail, outcome.traceback)
        return outcome.score


@attrs.define(eq=False)
class RewardPool:
    """Worker processes that score rollouts; open it with `open_reward_pool`.

    `failures` counts the failed calls by (environment, kind) (`RewardFailures`).
    """

    timeout_s: float
    _context: Any  # trio_parallel.WorkerContext (untyped)
    _limiter: trio.CapacityLimiter
    # Handed to trio-parallel, which wants a limiter of its own: `score` already holds a
    # token of `_limiter` when it calls in, and a task cannot take a token twice.
    _worker_limiter: trio.CapacityLimiter
    _failures: RewardFailures = attrs.field(factory=RewardFailures)
    # Set once the first workers have started (or failed to); None until they begin.
    _started: trio.Event | None = None

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

    async def score(
        self, env: str, specs: Sequence[RewardSpec], arguments: Mapping[str, Any]
    ) -> float:
        """The weighted sum of `specs` for one rollout of `env`, computed in a worker.

        `arguments` holds the reward arguments by name (`REWARD_ARGUMENTS`). At most
        `workers` calls run at once; the others wait for a free worker. Raises
        `RewardFailed` for every failure of the reward functions or their worker.
        """
        await self.start_workers()
        async with self._limiter:
            try:
                await self._ensure_idle_worker()
                with trio.fail_after(self.timeout_s):
                    outcome: ScoreOutcome = await self._context.run_sync(
                        score_rollout_captured,
                        tuple(specs),
                        dict(arguments),
                        kill_on_cancel=True,
                        limiter=self._worker_limiter,
                    )
            except trio.TooSlowError:
                raise self._failures.failed(
                    env, "timeout", f"no score within {self.timeout_s:g} s; worker killed"
                ) from None
            except trio_parallel.BrokenWorkerError as exc:
                raise self._failures.failed(env, "worker_died", _death_detail(exc)) from None
        return self._failures.of_outcome(env, outcome)

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


@asynccontextmanager
async def open_reward_pool(
    workers: int, timeout_s: float, *, preload: Iterable[RewardSpec] = ()
) -> AsyncIterator[RewardPool]:
    """A pool of `workers` processes that score rollouts, each call under `timeout_s`.

    The workers start with `RewardPool.start_workers` (or the first call), side by side
    with what the caller starts meanwhile: a spawn and its imports take seconds. Each
    worker (and each replacement of a killed one) imports the reward functions of
    `preload` when it starts, so that neither counts against a call's deadline. On exit,
    calls still running are waited for (cancel them first: a cancelled call kills its
    worker). Raises ValueError for fewer than one worker or a deadline that is not
    positive.
    """
    if workers < 1:
        raise ValueError(f"a reward pool needs at least one worker, not {workers}")
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"a reward pool's timeout must be positive and finite, not {timeout_s}")
    paths = tuple(dict.fromkeys(spec.path for spec in preload))
    async with trio_parallel.open_worker_context(
        # Idle workers are kept: starting one costs seconds.
        idle_timeout=math.inf,
        init=functools.partial(_start_worker, paths),
        grace_period=_WORKER_GRACE_PERIOD_S,
    ) as context:
        yield RewardPool(
            timeout_s,
            context,
            trio.CapacityLimiter(workers),
            trio.CapacityLimiter(workers),
        )


def _start_worker(paths: Sequence[str]) -> None:
    """A worker's start-up: below the daemon in the scheduler's eyes, then the imports.

    Rewards are throughput work and the event loop is the latency that keeps the servers
    fed: where both want the same cores, the loop goes first. (Without contention a
    niceness changes nothing.)"""
    os.nice(REWARD_WORKER_NICENESS)
    import_reward_functions(paths)


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

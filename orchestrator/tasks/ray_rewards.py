"""Reward functions as tasks on a Ray cluster (`[rewards] executor = "ray"`), for rewards
that need more cores than the head node has: code execution, judges, tools.

The same reward functions as the local worker processes, with the same contract: one call
per rollout runs `score_rollout_captured` as a Ray task (no retries: a reward that killed
its worker is `worker_died`, never run twice), under `[rewards] timeout_s` (past it the
task is cancelled, its worker killed: `timeout`), a failure of any kind one
`reward_failed` discard. As with the local workers, the deadline is the reward's own: it
starts when the task runs on a worker with the reward modules imported, so the cluster's
scheduling and the start of a fresh worker (after one was killed) are not mistaken for a
slow reward. The task tells the daemon it started by yielding a first item (a streaming
generator task); a task that does not start within `START_DEADLINE_S` is cancelled.
Back-pressure: at most `workers` calls are on the cluster at once (0: the cluster's CPUs),
so the daemon never queues more reward work than it can take; the others wait here, in
the rollouts' own tasks. Waiting for a task's result happens in a worker thread, never on
the event loop.

Ray is an optional extra (`pip install 'rollout-orchestrator[ray]'`); it is imported only
when the executor is asked for. The reward modules (and this package, which the tasks
import) must be importable on the cluster's nodes: installed there, or shipped with
`[rewards] ray_runtime_env` (Ray's runtime environments, e.g. `{working_dir = "."}`). A
local instance (`address = ""`) starts on this machine and gets the daemon's `sys.path`.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import structlog
import trio

from orchestrator.errors import UserError
from orchestrator.tasks.reward_functions import (
    RewardSpec,
    ScoreOutcome,
    import_reward_functions,
    score_rollout_captured,
)
from orchestrator.tasks.reward_pool import FailureKind, RewardFailures

log = structlog.get_logger(__name__)

#: How long connecting to the cluster (or starting a local instance) may take.
CONNECT_DEADLINE_S = 120.0
#: How long the first tasks, which import the reward modules on the cluster, may take.
WARM_UP_DEADLINE_S = 120.0
#: How long a call's task may take to start on a worker (scheduling, a fresh worker's
#: start and its imports of the reward modules), before its reward's deadline starts.
START_DEADLINE_S = 120.0


@attrs.define(eq=False)
class RayRewardPool:
    """Scores rollouts as Ray tasks; open it with `open_ray_reward_pool`."""

    timeout_s: float
    _ray: Any  # the ray module
    _task: Any  # score_on_worker as a remote (streaming generator) function
    _limiter: trio.CapacityLimiter  # calls on the cluster at once
    # The waiting threads' own limiter: a task holding a token of `_limiter` cannot take
    # another of it for its thread.
    _thread_limiter: trio.CapacityLimiter
    _failures: RewardFailures = attrs.field(factory=RewardFailures)

    @property
    def failures(self) -> Mapping[tuple[str, FailureKind], int]:
        return dict(self._failures.counts)

    @property
    def capacity(self) -> int:
        """The most calls on the cluster at once."""
        return int(self._limiter.total_tokens)

    async def score(
        self, env: str, specs: Sequence[RewardSpec], arguments: Mapping[str, Any]
    ) -> float:
        """The weighted sum of `specs` for one rollout of `env`, computed on the cluster.
        Raises `RewardFailed` for every failure of the functions, their task or worker."""
        async with self._limiter:
            items = self._task.remote(tuple(specs), dict(arguments))
            try:
                result = await trio.to_thread.run_sync(
                    self._wait, items, abandon_on_cancel=True, limiter=self._thread_limiter
                )
            except trio.Cancelled:
                # The rollout was cancelled: its task goes too (the thread ends with it).
                self._ray.cancel(items, force=True)
                raise
        if isinstance(result, ScoreOutcome):
            return self._failures.of_outcome(env, result)
        kind, detail = result
        raise self._failures.failed(env, kind, detail)

    def _wait(self, items: Any) -> ScoreOutcome | tuple[FailureKind, str]:
        """The outcome of the task yielding `items`, or the kind and detail of why there is
        none. Blocking."""
        ray, exceptions = self._ray, self._ray.exceptions
        try:
            if not self._next_ready(items, START_DEADLINE_S):
                return "timeout", (
                    f"its Ray task did not start on a worker within {START_DEADLINE_S:g} s "
                    "and was cancelled"
                )
            ray.get(next(items))  # the task started (or raises why it could not)
            if not self._next_ready(items, self.timeout_s):
                return "timeout", (
                    f"no score within {self.timeout_s:g} s; its Ray task was cancelled"
                )
            outcome = ray.get(next(items))
        except StopIteration:
            return "bad_value", "the Ray task ended without a score"
        except exceptions.TaskCancelledError:
            return "timeout", "its Ray task was cancelled"
        except exceptions.RayTaskError as exc:
            # The task itself failed outside the captured call (its arguments or result
            # did not (un)pickle on the node, an import of this package failed there).
            return "raised", _one_line(exc.cause if exc.cause is not None else exc)
        except exceptions.RayError as exc:
            # A worker or node that died, an object lost with it.
            return "worker_died", f"on the Ray cluster: {_one_line(exc)}"
        if not isinstance(outcome, ScoreOutcome):
            return "bad_value", f"the Ray task returned {type(outcome).__name__}"
        return outcome

    def _next_ready(self, items: Any, timeout_s: float) -> bool:
        """Whether the task yields its next item within `timeout_s`; if not, it is
        cancelled (its worker killed). Blocking."""
        ready, _ = self._ray.wait([items], timeout=timeout_s)
        if not ready:
            self._ray.cancel(items, force=True)
        return bool(ready)


def score_on_worker(
    specs: Sequence[RewardSpec], arguments: Mapping[str, Any]
) -> Iterator[str | ScoreOutcome]:
    """What a call's Ray task runs: import the reward modules (a fresh worker has none),
    yield that the reward starts, then yield its `score_rollout_captured` outcome."""
    import_reward_functions(spec.path for spec in specs)
    yield "started"
    yield score_rollout_captured(specs, arguments)


def _one_line(exc: BaseException) -> str:
    message = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def import_ray() -> Any:
    """The `ray` module; raises `UserError` saying how to install it when it is missing."""
    try:
        import ray
    except ImportError:
        raise UserError(
            'rewards.executor = "ray" needs Ray, which is not installed: '
            "pip install 'rollout-orchestrator[ray]' (or uv sync --extra ray)"
        ) from None
    return ray


def _connect(ray: Any, address: str, runtime_env: Mapping[str, Any]) -> int:
    """Connect to the cluster at `address` ("" starts a local instance) and return its
    CPUs. Blocking."""
    env = dict(runtime_env)
    if not address:
        # A local instance runs this machine's Python: the daemon's import path reaches
        # its workers, so that "module:function" paths in the current directory resolve.
        variables = dict(env.get("env_vars", {}))
        variables.setdefault("PYTHONPATH", os.pathsep.join(p for p in sys.path if p))
        env["env_vars"] = variables
    try:
        ray.init(
            address=address or None,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
            runtime_env=env or None,
            ignore_reinit_error=True,
        )
    except Exception as exc:
        where = f"the Ray cluster at {address!r}" if address else "a local Ray instance"
        raise UserError(f"rewards.address: cannot connect to {where}: {_one_line(exc)}") from None
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def _warm_up(ray: Any, paths: Sequence[str], count: int) -> None:
    """Start up to `count` of the cluster's workers and import the reward modules in them,
    so the first calls need not wait for it. Blocking; a failure is for the calls to
    report."""
    warm = ray.remote(max_retries=0, num_cpus=1)(import_reward_functions)
    refs = [warm.remote(tuple(paths)) for _ in range(count)]
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=WARM_UP_DEADLINE_S)
    for ref in pending:
        ray.cancel(ref, force=True)
    if pending:
        log.warning(
            "Ray reward workers slow to start",
            ready=len(ready),
            pending=len(pending),
            deadline_s=WARM_UP_DEADLINE_S,
        )


@asynccontextmanager
async def open_ray_reward_pool(
    address: str,
    workers: int,
    timeout_s: float,
    *,
    runtime_env: Mapping[str, Any] | None = None,
    preload: Iterable[RewardSpec] = (),
) -> AsyncIterator[RayRewardPool]:
    """A pool that scores rollouts on the Ray cluster at `address` ("" starts a local
    instance), at most `workers` calls at once (0: the cluster's CPUs). Raises `UserError`
    when Ray is not installed or the cluster cannot be reached."""
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"a reward pool's timeout must be positive and finite, not {timeout_s}")
    ray = import_ray()
    with trio.fail_after(CONNECT_DEADLINE_S):
        cpus = await trio.to_thread.run_sync(_connect, ray, address, dict(runtime_env or {}))
    try:
        capacity = workers or cpus
        task = ray.remote(max_retries=0, num_cpus=1)(score_on_worker)
        paths = tuple(dict.fromkeys(spec.path for spec in preload))
        await trio.to_thread.run_sync(_warm_up, ray, paths, min(capacity, cpus))
        log.info("rewards on Ray", address=address or "local", cpus=cpus, capacity=capacity)
        yield RayRewardPool(
            timeout_s, ray, task, trio.CapacityLimiter(capacity), trio.CapacityLimiter(capacity)
        )
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(ray.shutdown)

"""Reward functions as tasks on a Ray cluster (`[rewards] executor = "ray"`), for rewards
that need more cores than the head node has: code execution, judges, tools.

The same reward functions as the local worker processes, with the same contract: one call
per rollout runs `score_rollout_captured` as a Ray task (no retries: a reward that killed
its worker is `worker_died`, never run twice), under `[rewards] timeout_s` (past it the
task is cancelled, its worker killed: `timeout`), a failure of any kind one
`reward_failed` discard. Back-pressure: at most `workers` calls are on the cluster at once
(0: the cluster's CPUs), so the daemon never queues more reward work than it can take;
the others wait here, in the rollouts' own tasks. Waiting for a task's result happens in
a worker thread, never on the event loop.

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
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
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


@attrs.define(eq=False)
class RayRewardPool:
    """Scores rollouts as Ray tasks; open it with `open_ray_reward_pool`."""

    timeout_s: float
    _ray: Any  # the ray module
    _task: Any  # score_rollout_captured as a remote function
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
            ref = self._task.remote(tuple(specs), dict(arguments))
            try:
                result = await trio.to_thread.run_sync(
                    self._wait, ref, abandon_on_cancel=True, limiter=self._thread_limiter
                )
            except trio.Cancelled:
                # The rollout was cancelled: its task goes too (the thread ends with it).
                self._ray.cancel(ref, force=True)
                raise
        if isinstance(result, ScoreOutcome):
            return self._failures.of_outcome(env, result)
        kind, detail = result
        raise self._failures.failed(env, kind, detail)

    def _wait(self, ref: Any) -> ScoreOutcome | tuple[FailureKind, str]:
        """The task's outcome, or the kind and detail of why there is none. Blocking."""
        exceptions = self._ray.exceptions
        try:
            outcome = self._ray.get(ref, timeout=self.timeout_s)
        except exceptions.GetTimeoutError:
            self._ray.cancel(ref, force=True)
            return "timeout", f"no score within {self.timeout_s:g} s; its Ray task was cancelled"
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


def _warm_up(ray: Any, task: Any, paths: Sequence[str], count: int) -> None:
    """Import the reward modules in up to `count` of the cluster's workers, so the first
    calls' deadlines do not pay for it. Blocking; a failure is for the calls to report."""
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
        task = ray.remote(max_retries=0, num_cpus=1)(score_rollout_captured)
        paths = tuple(dict.fromkeys(spec.path for spec in preload))
        await trio.to_thread.run_sync(_warm_up, ray, task, paths, min(capacity, cpus))
        log.info("rewards on Ray", address=address or "local", cpus=cpus, capacity=capacity)
        yield RayRewardPool(
            timeout_s, ray, task, trio.CapacityLimiter(capacity), trio.CapacityLimiter(capacity)
        )
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(ray.shutdown)

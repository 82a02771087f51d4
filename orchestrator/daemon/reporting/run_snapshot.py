"""What the stall watch and the progress line read of a run at one moment.

Both read the same `RunSnapshot`, so they name the same step, samples, discard reasons
(the sink's) and failure kinds (`Dispatch.failures`) under the same keys.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import attrs

from orchestrator.core.sink import TrainSink
from orchestrator.daemon.run_state import RunState
from orchestrator.daemon.run_totals import run_totals


@attrs.frozen
class RunSnapshot:
    """The run's figures at one moment (counts are totals of this run)."""

    step: int  # the batch being filled
    queued: int  # samples in the sink's queue
    needed: int  # samples a batch needs
    gate_open: bool  # whether batch `step` may ship as far as the trainer is concerned
    applied_version: int
    idle: bool  # nothing left to ship (max_steps reached, or stopping): never a stall
    discards: Mapping[str, int] = attrs.field(factory=dict)
    failures: Mapping[str, int] = attrs.field(factory=dict)
    texts: Mapping[tuple[str, str], int] = attrs.field(factory=dict)
    inflight: int = 0  # rollouts in flight
    completed: int = 0  # rollouts completed
    inflight_limit: int = 0  # the limit the dispatcher obeys (0: not known)
    # By environment: rollouts scored and the sum of their rewards.
    scored: Mapping[str, int] = attrs.field(factory=dict)
    reward_sums: Mapping[str, float] = attrs.field(factory=dict)
    # The applied version's update has not finished (its collection and sweep): the
    # policy watcher looks for no newer version meanwhile.
    settling: bool = False
    # Samples ever queued (trainable); no_signal units whose group's rewards all lay at
    # the "top" or "bottom" of the curriculum's range; the reward failures' most common
    # texts by (kind, text); payload bytes deleted with discards.
    trainable: int = 0
    no_signal_at: Mapping[str, int] = attrs.field(factory=dict)
    reward_texts: Mapping[tuple[str, str], int] = attrs.field(factory=dict)
    discarded_bytes: int = 0
    # The daemon process's CPU seconds so far (`time.process_time`: all its threads).
    cpu_s: float = 0.0


def snapshot(state: RunState, sink: TrainSink, *, needed: int, inflight_limit: int) -> RunSnapshot:
    """`state` and `sink` now; `needed` is the batch size."""
    step = state.shipping.next_step
    totals = run_totals(state, sink)
    return RunSnapshot(
        step=step,
        queued=totals.queued_samples,
        needed=needed,
        gate_open=state.may_ship(step),
        applied_version=totals.applied_version,
        idle=state.training_over,
        discards=totals.discards,
        failures=totals.failures,
        texts=state.dispatch.rejections.texts(),
        inflight=totals.inflight_rollouts,
        completed=totals.rollouts.get("completed", 0),
        inflight_limit=inflight_limit,
        scored={env: env_totals.scored for env, env_totals in totals.envs.items()},
        reward_sums={env: env_totals.reward_sum for env, env_totals in totals.envs.items()},
        settling=state.versions.settled < state.versions.applied,
        trainable=totals.samples_trainable,
        no_signal_at=totals.no_signal_at,
        reward_texts=state.dispatch.reward_errors.texts(),
        discarded_bytes=totals.bytes_deleted.get("discard", 0),
        cpu_s=time.process_time(),
    )


def grown(now: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """Each key's growth from `before` to `now`, keys that grew only."""
    return {key: n - before.get(key, 0) for key, n in now.items() if n > before.get(key, 0)}

"""The run's running totals, read off its state and its sink in one place.

Four views show them, each under its own names: a `steps.jsonl` line (`shipper.py`), the
progress line and the stall warning (`reporting/run_snapshot.py`), the end-of-run summary
(`commands/summary.py`) and the Prometheus families (`metrics/collector.py`). Each view
reads a `RunTotals` and renames; none reaches into the state's counters itself, so a new
figure, or a fix to how one is counted, is made here once.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from orchestrator.core.sink import EnvTally, TrainSink
from orchestrator.daemon.run_state import RunState


@attrs.frozen
class EnvTotals:
    """One environment's totals: rollouts scored and their rewards, samples shipped,
    discards by reason, prompts it skipped."""

    scored: int
    reward_sum: float
    shipped: int
    discards: Mapping[str, int]
    prompts_skipped: int
    # The environment's own metrics (a verifiers rubric's), mean by name.
    metrics: Mapping[str, float] = attrs.field(factory=dict)

    @property
    def mean_reward(self) -> float | None:
        """The mean reward of the scored rollouts (None before the first)."""
        return self.reward_sum / self.scored if self.scored else None


@attrs.frozen
class RunTotals:
    """The run's totals at one moment (copies: later counting does not change them)."""

    last_shipped: int  # the last batch shipped (0 before the first)
    applied_version: int
    collected_below: int | None  # the last collection's bound (None before the first)
    rollouts: Mapping[str, int]  # by outcome
    failures: Mapping[str, int]  # by kind (docs/operations.md § Faults)
    discards: Mapping[str, int]  # the sink's, by reason
    inflight_rollouts: int
    queued_samples: int
    samples_shipped: int
    payload_files: int  # payload files on disk, by the daemon's account
    payload_bytes: int  # bytes under the payload root at the last measurement
    peak_payload_bytes: int
    files_written: int
    bytes_written: int
    files_deleted: Mapping[str, int]  # by path: discard, sweep, collection, wipe
    bytes_deleted: Mapping[str, int]
    envs: Mapping[str, EnvTotals]  # by `[[env]]` name, sorted
    # Samples the sink ever queued (trainable), and the no_signal units of groups whose
    # equal rewards lay at the "top" or "bottom" of the curriculum's range.
    samples_trainable: int = 0
    no_signal_at: Mapping[str, int] = attrs.field(factory=dict)


def run_totals(state: RunState, sink: TrainSink) -> RunTotals:
    """The totals of `state` and `sink` now."""
    dispatch, payload = state.dispatch, state.payload
    return RunTotals(
        last_shipped=state.shipping.last_shipped,
        applied_version=state.versions.applied,
        collected_below=state.versions.collected_below,
        rollouts=dict(dispatch.rollouts),
        failures=dict(dispatch.failures),
        discards=dict(sink.counters),
        inflight_rollouts=dispatch.inflight_rollouts,
        queued_samples=sink.queued_samples,
        samples_shipped=sink.shipped,
        payload_files=payload.account.files,
        payload_bytes=payload.bytes,
        peak_payload_bytes=payload.peak_bytes,
        files_written=payload.files_written,
        bytes_written=payload.bytes_written,
        files_deleted=dict(payload.files_deleted),
        bytes_deleted=dict(payload.bytes_deleted),
        envs={
            name: _env_totals(sink.by_env.get(name), dispatch.prompts_skipped[name])
            # An environment that skipped every prompt it was asked for has no tally.
            for name in sorted({*sink.by_env, *dispatch.prompts_skipped})
        },
        samples_trainable=sink.trainable,
        no_signal_at=sink.no_signal_at,
    )


def _env_totals(tally: EnvTally | None, prompts_skipped: int) -> EnvTotals:
    if tally is None:
        return EnvTotals(0, 0.0, 0, {}, prompts_skipped)
    return EnvTotals(
        tally.scored,
        tally.reward_sum,
        tally.shipped,
        dict(tally.discards),
        prompts_skipped,
        tally.metrics.means(),
    )

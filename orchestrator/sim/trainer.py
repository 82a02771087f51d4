"""The local trainer (docs/design.md §3, §11): reads each batch's payload bytes, then publishes.

It stands in for a real trainer on one machine. For each step `s`, starting after the
latest published version (so a killed trainer resumes where it stopped), it waits for
batch `s`, reads it with `read_batch(verify=True, on_corrupt="drop")` (every payload
byte, digests checked), "trains" for `train_time_s` on the samples it could read, and
publishes `v{s}`.

A sample whose payload files are broken is **dropped**: left out of the step, counted and
logged with its rollout and server. A digest mismatch (or a payload file replaced by a
link or a non-regular file) is the inference server's fault, which the orchestrator
cannot see because it never reads payload bytes: a drop, not a violation. A missing or
short payload file breaks the hand-off the orchestrator guarantees (it checked each file
when the group finished and keeps it until `v{s}` is published), so it is dropped *and*
counted as a **violation**, as is a batch that cannot be read at all (a malformed
`batch.bin`, or a batch of the old JSON format 1). Violations are counted and logged,
never a crash, and training goes on. Its `TrainerStats` are written as JSON to
`report_path` after every step, so a test or the demo can check them from another
process.

With `format = "prime-rl"` it stands in for prime-rl's trainer instead: it waits for
every `<batches_dir>/step_N/rank_R.bin` (R < `data_world_size`), decodes each as prime-rl
does and checks every micro batch, and the routing rows against the payload files the
step's manifest names (`orchestrator.handoff.primerl.read_primerl_step`); each problem
is a violation. The samples the daemon dropped before shipping (an unreadable payload,
listed in the manifest) are counted as dropped, a missing payload file among them as a
violation too, as above. Then it publishes `<weights_dir>/step_N/STABLE`.

Which step to wait for, when it is there and how to read it is the format's
(`HandoffFormat.step_dir`, `is_step_shipped`, `read_step`, from the registry): this
module compares no format names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import structlog
import trio

from orchestrator.handoff import (
    HandoffFormat,
    HandoffSettings,
    StepLayout,
    handoff_format,
    latest_published_version,
    publish_weights,
    wait_for_step_dir,
    weights_step_dir,
)
from orchestrator.handoff.trainer_report import REPORT_FORMAT as REPORT_FORMAT
from orchestrator.handoff.trainer_report import Dropped as Dropped
from orchestrator.handoff.trainer_report import TrainerStats as TrainerStats
from orchestrator.handoff.trainer_report import Violation as Violation
from orchestrator.handoff.trainer_report import (
    dropped_entries,
    initial_stats,
    write_report,
)
from orchestrator.sim.checkpoints import write_checkpoint

log = structlog.get_logger(__name__)

_T = TypeVar("_T")


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


@attrs.frozen
class SimTrainerConfig:
    """What the local trainer needs. `max_steps = 0` trains until cancelled.

    `poll_interval_s` bounds how long a missed filesystem event can delay the trainer,
    and is the polling period with `force_polling` (NFS). `weights_layout` names the
    versions it publishes (and resumes after): "native" `step_000007`, or "prime-rl"
    `step_7`, to stand in for prime-rl's trainer. `format` is what it reads: "native"
    batches, or prime-rl's `step_N/rank_R.bin` for `data_world_size` ranks (which needs
    the "prime-rl" weights layout, as prime-rl's trainer publishes). Raises ValueError
    for negative times or steps, a poll interval or data world size that is not
    positive, an unknown format, or a format its settings do not suit (its `check`: the
    "prime-rl" format with another weights layout).
    """

    batches_dir: Path
    weights_dir: Path
    train_time_s: float = attrs.field(validator=_non_negative)
    max_steps: int = attrs.field(validator=_non_negative)
    force_polling: bool = False
    poll_interval_s: float = attrs.field(default=1.0, validator=_positive)
    verify: bool = True
    report_path: Path | None = None
    weights_layout: StepLayout = "native"
    format: str = "native"
    data_world_size: int = attrs.field(default=1, validator=_positive)
    # A model folder: each version's directory then holds a full checkpoint of it,
    # perturbed by the version (orchestrator/sim/checkpoints.py), for servers that load
    # weights from disk.
    checkpoint_base: Path | None = None

    def __attrs_post_init__(self) -> None:
        problem = self.handoff.check(self.handoff_settings)
        if problem is not None:
            raise ValueError(f'format "{self.format}" {problem}')

    @property
    def handoff(self) -> HandoffFormat:
        """The format `format` names: the one lookup of the name."""
        return handoff_format(self.format)

    @property
    def handoff_settings(self) -> HandoffSettings:
        """What the format is told: where steps are shipped, the weights layout, the ranks."""
        return HandoffSettings(
            self.batches_dir,
            weights_layout=self.weights_layout,
            data_world_size=self.data_world_size,
        )


@attrs.frozen
class _StepRead:
    samples: int
    payload_bytes: int
    violations: tuple[Violation, ...] = ()
    dropped: tuple[Dropped, ...] = ()


async def serve_trainer(
    config: SimTrainerConfig,
    *,
    task_status: trio.TaskStatus[TrainerStats] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Train on batches as they are shipped, publishing a version after each.

    Starts at `latest_published_version + 1` and returns once `v{max_steps}` is published
    (never when `max_steps == 0`). Reports readiness with the live `TrainerStats`, which
    the caller may read at any time (also after cancelling the trainer). When
    `report_path` is set and the trainer resumes, the counts of the previous report are
    carried on. Dropped samples and violations are counted, never raised.

    Raises OSError when the batches or weights directory cannot be created, listed or
    written to.
    """
    # One thread at a time: the trainer does one thing at a time anyway.
    limiter = trio.CapacityLimiter(1)
    latest = await _in_thread(functools.partial(_prepare_dirs, config), limiter)
    stats = await _in_thread(functools.partial(initial_stats, config.report_path, latest), limiter)
    await _write_report(config, stats, limiter)
    task_status.started(stats)
    step = latest + 1
    log.info("trainer started", first_step=step, max_steps=config.max_steps)
    while config.max_steps == 0 or step <= config.max_steps:
        read = await _wait_and_read(config, step, limiter)
        await trio.sleep(config.train_time_s)
        await _in_thread(functools.partial(_publish, config, step), limiter)
        stats.add_step(
            step,
            samples=read.samples,
            payload_bytes=read.payload_bytes,
            violations=read.violations,
            dropped=read.dropped,
        )
        await _write_report(config, stats, limiter)
        log.info(
            "trained",
            step=step,
            samples=read.samples,
            dropped=len(read.dropped),
            payload_bytes=read.payload_bytes,
            violations=len(stats.violations),
        )
        step += 1


async def _wait_and_read(
    config: SimTrainerConfig, step: int, limiter: trio.CapacityLimiter
) -> _StepRead:
    """Wait for step `step` in the configured format (what its trainer waits for), then
    read it."""
    handoff = config.handoff
    settings = config.handoff_settings
    step_dir = await wait_for_step_dir(
        config.batches_dir,
        handoff.step_dir(settings, step),
        functools.partial(handoff.is_step_shipped, settings),
        force_polling=config.force_polling,
        poll_interval_s=config.poll_interval_s,
        limiter=limiter,
    )
    read = functools.partial(_read_step, handoff, settings, step_dir, step, config.verify)
    return await _in_thread(read, limiter)


async def _in_thread(fn: Callable[[], _T], limiter: trio.CapacityLimiter) -> _T:
    return await trio.to_thread.run_sync(fn, limiter=limiter)


def _publish(config: SimTrainerConfig, step: int) -> None:
    """Publish `v{step}`: its checkpoint first (if any), the `STABLE` marker last."""
    if config.checkpoint_base is not None:
        out = weights_step_dir(config.weights_dir, step, layout=config.weights_layout)
        write_checkpoint(config.checkpoint_base, step, out)
    publish_weights(config.weights_dir, step, layout=config.weights_layout)


def _prepare_dirs(config: SimTrainerConfig) -> int:
    """Create the hand-off directories; return the latest published version."""
    config.batches_dir.mkdir(parents=True, exist_ok=True)
    config.weights_dir.mkdir(parents=True, exist_ok=True)
    if config.report_path is not None:
        config.report_path.parent.mkdir(parents=True, exist_ok=True)
    return latest_published_version(config.weights_dir, layout=config.weights_layout)


def _read_step(
    handoff: HandoffFormat, settings: HandoffSettings, step_dir: Path, step: int, verify: bool
) -> _StepRead:
    """Read a step as the format's trainer does; its problems, and the samples dropped for
    a missing payload file, become violations. Blocking."""
    read = handoff.read_step(settings, step_dir, step, verify=verify)
    violations = []
    for problem in read.problems:
        log.error(
            "step violates the hand-off",
            step=step,
            kind=problem.kind,
            file=problem.file,
            error=problem.message,
        )
        violations.append(Violation(step, problem.kind, problem.file, problem.message))
    dropped, missing = dropped_entries(step, read.dropped)
    return _StepRead(read.samples, read.payload_bytes, (*violations, *missing), dropped)


async def _write_report(
    config: SimTrainerConfig, stats: TrainerStats, limiter: trio.CapacityLimiter
) -> None:
    if config.report_path is not None:
        await _in_thread(functools.partial(write_report, config.report_path, stats), limiter)

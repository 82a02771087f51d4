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
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import structlog
import trio

from orchestrator.handoff import (
    DroppedSample,
    HandoffFormat,
    HandoffSettings,
    StepLayout,
    handoff_format,
    latest_published_version,
    publish_weights,
    replace_file_atomically,
    wait_for_step_dir,
    weights_step_dir,
)
from orchestrator.sim.checkpoints import write_checkpoint

log = structlog.get_logger(__name__)

_T = TypeVar("_T")

REPORT_FORMAT = "rollout-orchestrator.trainer-report/1"


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
class Violation:
    """A batch the trainer could not read: which step, what kind, which file, why.

    `kind` is one of `payload_missing`, `payload_corrupt`, `bad_payload`, `bad_batch`,
    `io_error`; with the "prime-rl" format also `bad_micro_batch` (a micro batch breaks
    prime-rl's rules, or disagrees with the step's manifest) and `routing_mismatch`
    (routing rows differ from the payload files).
    """

    step: int
    kind: str
    file: str
    message: str


@attrs.frozen
class Dropped:
    """A sample the trainer left out of step `step` because its payload files are broken.

    `reason` is `payload_corrupt`, `payload_missing` or `bad_payload_file` (see
    `orchestrator.handoff.DroppedSample`); `server` the inference server that generated
    it (None when the batch does not say); `file` the payload file concerned.
    """

    step: int
    group_id: str
    rollout_id: str
    server: str | None
    reason: str
    file: str
    message: str


@attrs.define
class TrainerStats:
    """What the trainer did: steps trained, samples and payload bytes read, samples
    dropped, violations.

    `samples` counts the samples trained on; `dropped` lists those left out for broken
    payload files (a `payload_missing` one is also a violation, the others are not).
    `payload_bytes` counts the payload arrays the trainer got, read from files (by
    handle) or decoded (inline). The counts cover steps `first_step .. last_step`:
    `last_step` is the last version published (`first_step - 1` before the first). A
    restarted trainer carries on the previous report's counts when it can read them,
    else it counts from where it resumed.
    """

    first_step: int
    last_step: int = 0
    steps: int = 0
    samples: int = 0
    payload_bytes: int = 0
    violations: list[Violation] = attrs.Factory(list)
    dropped: list[Dropped] = attrs.Factory(list)

    def to_json(self) -> dict[str, Any]:
        """The report's JSON object."""
        return {"format": REPORT_FORMAT, **attrs.asdict(self)}

    @classmethod
    def from_json(cls, obj: object) -> TrainerStats:
        """Parse a report written by `to_json`. Raises ValueError when it is not one."""
        if not isinstance(obj, dict) or obj.get("format") != REPORT_FORMAT:
            raise ValueError("not a trainer report")
        try:
            violations = [Violation(**v) for v in obj["violations"]]
            # A report written before samples were dropped has no `dropped`.
            dropped = [Dropped(**d) for d in obj.get("dropped", [])]
            fields = {k: obj[k] for k in ("first_step", "last_step", "steps", "samples")}
            stats = cls(
                **fields,
                payload_bytes=obj["payload_bytes"],
                violations=violations,
                dropped=dropped,
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed trainer report: {exc}") from None
        counts = (stats.first_step, stats.last_step, stats.steps, stats.samples)
        if not all(type(value) is int for value in (*counts, stats.payload_bytes)):
            raise ValueError("malformed trainer report: counts must be integers")
        return stats


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
    stats = await _in_thread(functools.partial(_initial_stats, config, latest), limiter)
    await _write_report(config, stats, limiter)
    task_status.started(stats)
    step = latest + 1
    log.info("trainer started", first_step=step, max_steps=config.max_steps)
    while config.max_steps == 0 or step <= config.max_steps:
        read = await _wait_and_read(config, step, limiter)
        await trio.sleep(config.train_time_s)
        await _in_thread(functools.partial(_publish, config, step), limiter)
        stats.last_step = step
        stats.steps += 1
        stats.samples += read.samples
        stats.payload_bytes += read.payload_bytes
        stats.violations.extend(read.violations)
        stats.dropped.extend(read.dropped)
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


def _initial_stats(config: SimTrainerConfig, latest: int) -> TrainerStats:
    """Fresh stats, or the previous report's when resuming (latest > 0)."""
    fresh = TrainerStats(first_step=latest + 1, last_step=latest)
    if latest == 0 or config.report_path is None:
        return fresh
    try:
        previous = TrainerStats.from_json(json.loads(config.report_path.read_bytes()))
    except FileNotFoundError:
        return fresh
    except (OSError, ValueError) as exc:
        log.warning("previous trainer report unusable; counting afresh", error=str(exc))
        return fresh
    previous.last_step = latest
    return previous


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
    dropped = tuple(_drop(step, sample) for sample in read.dropped)
    violations += [
        Violation(step=step, kind=d.reason, file=d.file, message=d.message)
        for d in dropped
        if d.reason == "payload_missing"
    ]
    return _StepRead(read.samples, read.payload_bytes, tuple(violations), dropped)


def _drop(step: int, sample: DroppedSample) -> Dropped:
    fields = {
        "step": step,
        "rollout": sample.rollout_id,
        "group": sample.group_id,
        "server": sample.server,
        "reason": sample.reason,
        "file": sample.file,
    }
    if sample.reason == "payload_missing":
        # Not the server's doing, as far as anyone can tell: the orchestrator checked the
        # file when the group finished and must keep it until this step is published.
        log.error("sample violates the hand-off; dropped", **fields, error=sample.error)
    else:
        log.warning("sample dropped: broken payload", **fields, error=sample.error)
    return Dropped(
        step=step,
        group_id=sample.group_id,
        rollout_id=sample.rollout_id,
        server=sample.server,
        reason=sample.reason,
        file=sample.file,
        message=str(sample),
    )


async def _write_report(
    config: SimTrainerConfig, stats: TrainerStats, limiter: trio.CapacityLimiter
) -> None:
    if config.report_path is None:
        return
    data = (json.dumps(stats.to_json(), indent=2) + "\n").encode()
    # A report is diagnostics, not state: atomic for readers, but no fsync needed.
    write = functools.partial(replace_file_atomically, config.report_path, data, fsync=False)
    await _in_thread(write, limiter)

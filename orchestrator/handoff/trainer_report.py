"""The trainer's report, `<run_dir>/trainer/report.json`: what a trainer read of the
hand-off (steps, samples, payload bytes), the samples it dropped for broken payload files,
and the violations of the hand-off, rewritten after every step so a test, the demo's
summary (`orchestrator.commands.summary`) or `make demo-learn` can check them from another
process. One home for the format: the simulated trainer (`orchestrator.sim.trainer`) and
the reference trainer (`orchestrator_trainer.loop`) both count with `TrainerStats`, turn
dropped samples into `Dropped` (and violations) with `dropped_entries`, and write with
`write_report`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import structlog

from orchestrator.handoff.dropped import DroppedSample
from orchestrator.handoff.durable import replace_file_atomically

log = structlog.get_logger(__name__)

#: Where a run's trainer writes its report, under the run directory.
REPORT_PATH = Path("trainer") / "report.json"

REPORT_FORMAT = "rollout-orchestrator.trainer-report/1"


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

    def add_step(
        self,
        step: int,
        *,
        samples: int,
        payload_bytes: int,
        violations: Iterable[Violation] = (),
        dropped: Iterable[Dropped] = (),
    ) -> None:
        """Count step `step` as trained on: its samples and payload bytes read, its
        violations and dropped samples."""
        self.last_step = step
        self.steps += 1
        self.samples += samples
        self.payload_bytes += payload_bytes
        self.violations.extend(violations)
        self.dropped.extend(dropped)

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


def dropped_entry(step: int, sample: DroppedSample) -> Dropped:
    """A sample left out of step `step`, logged (an error when it breaks the hand-off)."""
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


def dropped_entries(
    step: int, samples: Iterable[DroppedSample]
) -> tuple[tuple[Dropped, ...], tuple[Violation, ...]]:
    """The samples left out of step `step` (`dropped_entry`, each logged), and the
    violations among them: a missing payload file breaks the hand-off the orchestrator
    guarantees, the other reasons are the inference server's doing."""
    dropped = tuple(dropped_entry(step, sample) for sample in samples)
    violations = tuple(
        Violation(step=step, kind=d.reason, file=d.file, message=d.message)
        for d in dropped
        if d.reason == "payload_missing"
    )
    return dropped, violations


def initial_stats(path: Path | None, latest: int) -> TrainerStats:
    """Fresh stats for a trainer that starts after version `latest`, or the previous
    report's at `path` when it resumes (latest > 0) and that report can be read (one
    that cannot is logged, and counting starts afresh). Blocking."""
    fresh = TrainerStats(first_step=latest + 1, last_step=latest)
    if latest == 0 or path is None:
        return fresh
    try:
        previous = TrainerStats.from_json(json.loads(path.read_bytes()))
    except FileNotFoundError:
        return fresh
    except (OSError, ValueError) as exc:
        log.warning("previous trainer report unusable; counting afresh", error=str(exc))
        return fresh
    previous.last_step = latest
    return previous


def write_report(path: Path, stats: TrainerStats) -> None:
    """Replace the report at `path` with `stats` (its directory created). Blocking;
    raises OSError."""
    data = (json.dumps(stats.to_json(), indent=2) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    # A report is diagnostics, not state: atomic for readers, but no fsync needed.
    replace_file_atomically(path, data, fsync=False)

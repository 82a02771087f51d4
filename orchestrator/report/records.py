"""What a run wrote, read back for the report: `steps.jsonl`, `evals.jsonl`,
`progress.json` and, when a trainer appends one, `trainer.jsonl`. A line that is not a
JSON object of the expected kind (the torn last line of a crash, a hand edit, another
format) is counted and passed over, never the end of the report."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from orchestrator.errors import UserError

Record = Mapping[str, Any]

TRAINER_FORMAT = "rollout-orchestrator.trainer-step/1"
"""The `format` of a `trainer.jsonl` line the report draws (the reference trainer's
`orchestrator_trainer.step_log.FORMAT`, which it writes); a line of another is skipped."""


@attrs.frozen
class RunRecords:
    """The run's records, in file order: a step line per shipped batch (a resumed run
    appends to the same file, so a step may appear again: the last one counts), an eval
    line per eval, the last saved progress (None when there is none), and the trainer's
    line per trained step (none when it writes no `trainer.jsonl`; repeats as for steps)."""

    run_dir: Path
    steps: tuple[Record, ...] = ()
    evals: tuple[Record, ...] = ()
    progress: Record | None = None
    skipped_lines: int = 0
    trainer: tuple[Record, ...] = ()

    @property
    def step_rows(self) -> list[Record]:
        """One line per step, the last written for it, in step order."""
        return _last_per_step(self.steps)

    @property
    def trainer_rows(self) -> list[Record]:
        """One trainer line per trained step, the last written for it, in step order."""
        return _last_per_step(self.trainer)

    @property
    def eval_envs(self) -> list[str]:
        return sorted({env for line in self.evals for env in line["envs"]})

    @property
    def train_envs(self) -> list[str]:
        return sorted({env for line in self.steps for env in line.get("reward_by_env", {})})


def _last_per_step(lines: tuple[Record, ...]) -> list[Record]:
    last: dict[int, Record] = {}
    for line in lines:
        last[int(line["step"])] = line
    return [last[step] for step in sorted(last)]


def read_records(
    run_dir: Path,
    *,
    steps_file: Path,
    evals_file: Path,
    state_dir: Path,
    trainer_file: Path | None = None,
) -> RunRecords:
    """Read a run's records (`trainer_file` defaults to `<run_dir>/trainer.jsonl`).
    Blocking. Raises `UserError` when `run_dir` is no directory; files not written yet
    are empty records."""
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist: nothing to report")
    steps, skipped_steps = _lines(steps_file, _is_step)
    evals, skipped_evals = _lines(evals_file, _is_eval)
    trainer, skipped_trainer = _lines(trainer_file or run_dir / "trainer.jsonl", _is_trainer)
    return RunRecords(
        run_dir,
        steps=tuple(steps),
        evals=tuple(evals),
        progress=_progress(state_dir / "progress.json"),
        skipped_lines=skipped_steps + skipped_evals + skipped_trainer,
        trainer=tuple(trainer),
    )


def _lines(path: Path, valid: Any) -> tuple[list[Record], int]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return [], 0
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    records, skipped = [], 0
    for record in _parsed(text):
        if record is not None and valid(record):
            records.append(record)
        else:
            skipped += 1
    return records, skipped


def _parsed(text: str) -> Iterator[Record | None]:
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            yield None
            continue
        yield value if isinstance(value, dict) else None


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_step(record: Record) -> bool:
    return (
        isinstance(record.get("step"), int)
        and _number(record.get("time"))
        and isinstance(record.get("reward_by_env", {}), dict)
    )


def _is_eval(record: Record) -> bool:
    envs = record.get("envs")
    return (
        isinstance(record.get("version"), int)
        and isinstance(envs, dict)
        and all(isinstance(result, dict) for result in envs.values())
    )


def _is_trainer(record: Record) -> bool:
    """A trainer step line of the known format with what the figures draw: the loss,
    grad norm and clipped share always, the mismatch KLs a number or null."""
    step = record.get("step")
    return (
        record.get("format") == TRAINER_FORMAT
        and isinstance(step, int)
        and not isinstance(step, bool)
        and step >= 1
        and all(_number(record.get(key)) for key in ("loss", "grad_norm", "clipped_share"))
        and all(
            record.get(key) is None or _number(record.get(key))
            for key in ("mismatch_kl", "mismatch_kl_no_replay")
        )
    )


def _progress(path: Path) -> Record | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None

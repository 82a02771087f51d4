"""What a run wrote, read back for the report: `steps.jsonl`, `evals.jsonl` and
`progress.json`. A line that is not a JSON object of the expected kind (the torn last
line of a crash, a hand edit) is counted and passed over, never the end of the report."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from orchestrator.errors import UserError

Record = Mapping[str, Any]


@attrs.frozen
class RunRecords:
    """The run's records, in file order: a step line per shipped batch (a resumed run
    appends to the same file, so a step may appear again: the last one counts), an eval
    line per eval, and the last saved progress (None when there is none)."""

    run_dir: Path
    steps: tuple[Record, ...] = ()
    evals: tuple[Record, ...] = ()
    progress: Record | None = None
    skipped_lines: int = 0

    @property
    def step_rows(self) -> list[Record]:
        """One line per step, the last written for it, in step order."""
        last: dict[int, Record] = {}
        for line in self.steps:
            last[int(line["step"])] = line
        return [last[step] for step in sorted(last)]

    @property
    def eval_envs(self) -> list[str]:
        return sorted({env for line in self.evals for env in line["envs"]})

    @property
    def train_envs(self) -> list[str]:
        return sorted({env for line in self.steps for env in line.get("reward_by_env", {})})


def read_records(
    run_dir: Path, *, steps_file: Path, evals_file: Path, state_dir: Path
) -> RunRecords:
    """Read a run's records. Blocking. Raises `UserError` when `run_dir` is no directory;
    files not written yet are empty records."""
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist: nothing to report")
    steps, skipped_steps = _lines(steps_file, _is_step)
    evals, skipped_evals = _lines(evals_file, _is_eval)
    return RunRecords(
        run_dir,
        steps=tuple(steps),
        evals=tuple(evals),
        progress=_progress(state_dir / "progress.json"),
        skipped_lines=skipped_steps + skipped_evals,
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


def _progress(path: Path) -> Record | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None

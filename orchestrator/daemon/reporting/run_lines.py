"""The run's records, `<run_dir>/steps.jsonl` and `<run_dir>/evals.jsonl` (`RunLines`):
one line per shipped batch or eval, appended with one `write` of the whole line
(O_APPEND), so a reader never sees half a line but for the last one after a crash, which
`orchestrator report` passes over; mirrored to Weights & Biases when `[wandb]` is on.
Written in a worker thread; a line that cannot be written is logged, never the end of
the run."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import structlog
import trio

from orchestrator.daemon.reporting.wandb_log import WandbLog, eval_metrics, step_metrics

log = structlog.get_logger(__name__)


def append_line(path: Path, record: Mapping[str, Any]) -> None:
    """Append `record` as one JSON line to `path` (created if missing; not through a
    link). Blocking. Raises OSError."""
    data = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(path, flags, 0o644)
    try:
        view = memoryview(data)
        while view:  # a regular file takes it whole; a short write goes on where it ended
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


async def append_run_line(
    path: Path, record: Mapping[str, Any], *, limiter: trio.CapacityLimiter
) -> None:
    """`append_line` in a worker thread; a failure is logged once per call."""
    try:
        await trio.to_thread.run_sync(append_line, path, record, limiter=limiter)
    except (OSError, ValueError) as exc:
        log.error("cannot append to the run's record", path=str(path), error=str(exc))


@attrs.define(eq=False)
class RunLines:
    """Where the shipper's and the evaluator's lines go."""

    steps_file: Path
    evals_file: Path
    limiter: trio.CapacityLimiter
    wandb: WandbLog | None = None

    def mirror_to(self, wandb: WandbLog | None) -> None:
        """Send the lines to this W&B run from now on too (None: to none)."""
        self.wandb = wandb

    async def step(self, line: Mapping[str, Any]) -> None:
        """A shipped batch's line (`Shipper.step_line`)."""
        await append_run_line(self.steps_file, line, limiter=self.limiter)
        if self.wandb is not None:
            await self.wandb.log(step_metrics(line))

    async def eval(self, line: Mapping[str, Any]) -> None:
        """An eval's line (`EvalReport.to_json`)."""
        await append_run_line(self.evals_file, line, limiter=self.limiter)
        if self.wandb is not None:
            await self.wandb.log(eval_metrics(line))

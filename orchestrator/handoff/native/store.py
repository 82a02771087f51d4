"""Publishing batches into `batches_dir` and listing the shipped ones (docs/design.md §5).

A batch is published atomically: its directory is built under a hidden temp name,
fsynced, and renamed into place, so a trainer (on this host or another) sees either no
`step_000007` or a complete one. The set of complete batch directories is the source of
truth for "shipped": a crash between shipping and saving progress neither re-ships nor
loses a batch. A shipped batch is never rewritten.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Sequence
from pathlib import Path

from orchestrator.core.rollouts import TrainSample
from orchestrator.handoff.durable import BatchExists, publish_step_dir
from orchestrator.handoff.native.batch_file import write_layout
from orchestrator.handoff.native.format import BATCH_FILE, encode_batch
from orchestrator.handoff.step_dirs import complete_steps, is_complete_step_dir, step_dir


def batch_step_dir(batches_dir: Path, step: int) -> Path:
    """The directory of batch `step`: `<batches_dir>/step_000007`.

    Raises ValueError for a negative step.
    """
    return step_dir(batches_dir, step)


def publish_batch(
    batches_dir: Path, step: int, samples: Sequence[TrainSample], *, fsync: bool = True
) -> Path:
    """Ship batch `step`: write `step_NNNNNN/batch.bin` atomically and return its directory.

    Writes `.tmp-step_NNNNNN-<hex>/batch.bin` (`write_layout`: the arrays go straight from
    the samples' buffers to the file, the interpreter lock released while they are
    written), fsyncs the file and the temp directory, renames the temp directory to
    `step_NNNNNN` and fsyncs `batches_dir` (with `fsync=False` it skips the fsyncs, for
    tests and benchmarks). Creates `batches_dir` when missing. Blocking; a worker thread
    running it stalls an event loop for milliseconds at most (the daemon ships from one).

    An empty directory at the final name (not a shipped batch) is replaced.

    Raises `BatchExists` when the step was shipped already, or something else occupies
    its name (nothing is changed then),
    ValueError for a step < 1, a non-finite number in a sample or an inline array the
    format does not allow, OSError when writing fails (the temp directory is removed).
    """
    # Planned before touching the disk: a batch that cannot be encoded leaves nothing.
    layout = encode_batch(step, samples, created_at=time.time())
    final_dir = batch_step_dir(batches_dir, step)
    batches_dir.mkdir(parents=True, exist_ok=True)
    if is_complete_batch(final_dir):
        raise BatchExists(errno.EEXIST, "batch already shipped", str(final_dir))
    publish_step_dir(
        final_dir,
        lambda temp_dir: write_layout(temp_dir / BATCH_FILE, layout, fsync=fsync),
        fsync=fsync,
    )
    return final_dir


def is_complete_batch(batch_dir: Path) -> bool:
    """Whether `batch_dir` is a shipped batch: a real directory holding `batch.bin`."""
    return is_complete_step_dir(batch_dir, BATCH_FILE)


def shipped_steps(batches_dir: Path) -> list[int]:
    """The steps of the complete batch directories in `batches_dir`, sorted.

    Only canonical `step_NNNNNN` directories holding `batch.bin` count: temp directories
    of a publish in progress (or cut short), symlinks and other names are ignored. A
    missing `batches_dir` means none. Raises OSError when it cannot be listed.
    """
    return complete_steps(batches_dir, BATCH_FILE)

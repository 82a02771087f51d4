"""The trainer's side of the hand-off: `read_batch` turns a shipped batch into arrays.

The batch file is mapped and validated whole (`read_batch_file`); the per-position arrays
and inline payloads handed out are views of that copy-on-write mapping, writable, copied
by nothing. By-handle payloads are read through the payload reader
(`read_sample_payload`: segments validated before any byte is read, digests verified on
request). Both payload forms give the same arrays for the same sample, bitwise.
Blocking: an async trainer calls it in a worker thread.

A sample whose payload files are broken (a digest mismatch, a file missing, short, or not
a regular file) is that sample's fault (mostly its inference server's), not the batch's:
with ``on_corrupt="drop"`` it is left out and named in `Batch.dropped`, and the rest of
the batch is read. A malformed `batch.bin` is always a `BatchError`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, get_args

import attrs
import numpy as np

from orchestrator.handoff.dropped import DroppedSample
from orchestrator.handoff.native.batch_file import read_batch_file
from orchestrator.handoff.native.format import (
    BATCH_FILE,
    FORMAT_VERSION,
    LEGACY_BATCH_FILE,
    BatchError,
    BatchSample,
)
from orchestrator.handoff.step_dirs import parse_step_dir
from orchestrator.payload import (
    BadSegment,
    PayloadCorrupt,
    PayloadError,
    PayloadMissing,
    read_sample_payload,
)

OnCorrupt = Literal["raise", "drop"]
"""What `read_batch` does with a sample whose payload files are broken."""

# The `BadSegment` reasons that describe a payload file on disk rather than the batch
# document: the daemon checked the file at admission, so it changed after.
_FILE_REASONS = frozenset({"symlink", "mount_point", "not_regular_file"})


@attrs.frozen(eq=False)
class SampleArrays:
    """One sample of a batch as arrays, over the positions in `rows`.

    Per position (all of length `len(rows)`): `token_ids` int32, `loss_mask` bool,
    `advantages` float32 (the sample's advantage on loss positions, 0 elsewhere),
    `logprobs` float32 (inference logprobs, 0 on prompt positions), `routed_experts`
    `[n, layers, top_k]` (uint8/uint16; int16/int32 when the final token carries the -1
    sentinel) and `sampling_mask` int32 `[n, W]` padded with -1, each None when the
    sample has no such payload. All are writable numpy arrays (`torch.from_numpy` takes
    them as they are); the per-position ones and inline payloads are views of the mapped
    batch file (copy-on-write: writing to one never changes the file), by-handle payloads
    are read into fresh arrays. `rows` is the window of positions read: the whole sample
    (`range(length)`) unless `read_batch` was given one. `server` is the inference server
    that generated the sample, when the batch says.
    """

    group_id: str
    rollout_id: str
    start_version: int
    dispatch_version: int
    reward: float
    advantage: float
    length: int
    rows: range
    token_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    logprobs: np.ndarray
    routed_experts: np.ndarray | None
    sampling_mask: np.ndarray | None
    server: str | None = None

    @property
    def payload_nbytes(self) -> int:
        """The bytes of payload arrays this sample holds (routing and masks)."""
        return sum(
            array.nbytes for array in (self.routed_experts, self.sampling_mask) if array is not None
        )


def _dropped_tuple(value: Iterable[DroppedSample]) -> tuple[DroppedSample, ...]:
    return tuple(value)


@attrs.frozen(eq=False)
class Batch:
    """A batch read by `read_batch`: its step, when it was shipped, and its samples.

    `dropped` names the samples left out for broken payload files (only with
    ``on_corrupt="drop"``), in batch order; `samples` holds the others, in batch order.
    """

    step: int
    created_at: float
    samples: list[SampleArrays]
    dropped: tuple[DroppedSample, ...] = attrs.field(default=(), converter=_dropped_tuple)

    @property
    def payload_nbytes(self) -> int:
        """The bytes of payload arrays over all samples."""
        return sum(sample.payload_nbytes for sample in self.samples)


def read_batch(
    batch_dir: str | os.PathLike[str],
    *,
    verify: bool = True,
    rows: range | None = None,
    on_corrupt: OnCorrupt = "raise",
) -> Batch:
    """Read the shipped batch in `batch_dir` (a `step_NNNNNN` directory, a path or a `str`)
    with its payloads.

    `verify` checks every by-handle payload byte against its segment's digest. `rows`
    (a range with step 1) reads only that window of positions of each sample, clipped to
    the sample's length, as a context-parallel rank does; per-position arrays then cover
    only the window. Blocking.

    `on_corrupt` says what a sample with broken payload files does to the batch: with
    ``"raise"`` (the default: nothing is ever left out silently) the error below is
    raised; with ``"drop"`` the sample is left out and described in `Batch.dropped`, and
    the rest is read. Whether a sample is dropped never depends on `rows`: every segment's
    file is opened and size-checked, and with `verify` every segment's digest is checked,
    also outside the window, so all ranks of a context-parallel group drop the same
    samples.

    Raises `BatchError` (one line naming the file) when `batch.bin` is missing,
    unreadable or malformed (`read_batch_file`; a directory holding only the `batch.json`
    of format 1 is named as such), its step differs from the directory's, or a sample's
    payload is malformed (a bad segment or inline array, a `payload_dir` that is not
    `v<k>` for the sample's dispatch version); with ``on_corrupt="raise"``,
    `PayloadMissing` naming the payload file when it is missing or short, `PayloadCorrupt`
    naming it when `verify` finds a digest mismatch, and `BatchError` for a payload file
    that is a symbolic link or not a regular file; ValueError for a `rows` range whose step is not
    1 or whose start is negative, or an unknown `on_corrupt`.
    """
    if rows is not None and (rows.step != 1 or rows.start < 0):
        raise ValueError(f"rows must be a range with step 1 and start >= 0, got {rows}")
    if on_corrupt not in get_args(OnCorrupt):
        raise ValueError(f"on_corrupt must be 'raise' or 'drop', got {on_corrupt!r}")
    batch_dir = Path(batch_dir)
    batch_file = batch_dir / BATCH_FILE
    legacy_file = batch_dir / LEGACY_BATCH_FILE
    if not batch_file.exists() and legacy_file.is_file():
        raise BatchError(
            f"{legacy_file}: batch format 1 (JSON), written by an earlier version; this "
            f"version reads format {FORMAT_VERSION} ({BATCH_FILE}) only"
        )
    contents = read_batch_file(batch_file)
    dir_step = parse_step_dir(batch_dir.name)
    if dir_step is not None and dir_step != contents.step:
        raise BatchError(f"{batch_file}: step {contents.step} in the directory of step {dir_step}")
    samples = []
    dropped = []
    for sample in contents.samples:
        try:
            samples.append(_sample_arrays(sample, rows=rows, verify=verify))
        except BadSegment as exc:
            if on_corrupt == "raise" or exc.reason not in _FILE_REASONS:
                raise BatchError(f"{batch_file}: samples[{sample.index}]: {exc}") from None
            dropped.append(_dropped(sample, exc))
        except (PayloadMissing, PayloadCorrupt) as exc:
            if on_corrupt == "raise":
                raise
            dropped.append(_dropped(sample, exc))
    return Batch(
        step=contents.step, created_at=contents.created_at, samples=samples, dropped=dropped
    )


def _dropped(sample: BatchSample, exc: PayloadError) -> DroppedSample:
    if isinstance(exc, PayloadCorrupt):
        reason, file = "payload_corrupt", str(exc.path)
    elif isinstance(exc, PayloadMissing):
        reason, file = "payload_missing", str(exc.path)
    else:
        assert isinstance(exc, BadSegment) and sample.payload_dir is not None
        reason, file = "bad_payload_file", str(Path(sample.payload_dir) / exc.file)
    return DroppedSample(
        index=sample.index,
        group_id=sample.group_id,
        rollout_id=sample.rollout_id,
        server=sample.server,
        reason=reason,
        file=file,
        error=str(exc),
    )


def _sample_arrays(sample: BatchSample, *, rows: range | None, verify: bool) -> SampleArrays:
    length = sample.length
    window = (
        range(length) if rows is None else range(min(rows.start, length), min(rows.stop, length))
    )
    rows_slice = slice(window.start, window.stop)
    payload = _read_payload(sample, window, verify=verify)
    return SampleArrays(
        group_id=sample.group_id,
        rollout_id=sample.rollout_id,
        start_version=sample.start_version,
        dispatch_version=sample.dispatch_version,
        reward=sample.reward,
        advantage=sample.advantage,
        length=length,
        rows=window,
        token_ids=sample.token_ids[rows_slice],
        loss_mask=sample.loss_mask[rows_slice],
        advantages=sample.advantages[rows_slice],
        logprobs=sample.logprobs[rows_slice],
        routed_experts=payload.get("routed_experts"),
        sampling_mask=payload.get("sampling_mask"),
        server=sample.server,
    )


def _read_payload(sample: BatchSample, window: range, *, verify: bool) -> dict[str, np.ndarray]:
    """The sample's payload arrays over `window`. Raises BadSegment and the payload errors."""
    if sample.payload_dir is not None:
        # The batch file was checked: payload_dir is <root>/v<dispatch_version>.
        return read_sample_payload(
            Path(sample.payload_dir), sample.payload, sample.length, rows=window, verify=verify
        )
    # Inline arrays are the stitched whole, one row per position: views of the batch file.
    return {
        field: array[window.start : window.stop] for field, array in (sample.inline or {}).items()
    }

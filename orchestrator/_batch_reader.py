"""The trainer's side of the hand-off: `read_batch` turns a shipped batch into arrays.

By-handle payloads are read through the payload reader (`read_sample_payload`: segments
validated before any byte is read, digests verified on request); inline ones are decoded
with `decode_inline`. Both give the same arrays for the same sample, bitwise. Blocking:
an async trainer calls it in a worker thread.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np

from orchestrator._batch_format import BATCH_FILE, BatchError, TrainSample, decode_batch
from orchestrator._step_dirs import parse_step_dir
from orchestrator.payload import BadSegment, decode_inline, read_sample_payload


@attrs.frozen(eq=False)
class SampleArrays:
    """One sample of a batch as arrays, over the positions in `rows`.

    Per position (all of length `len(rows)`): `token_ids` int64, `loss_mask` bool,
    `advantages` float32 (the sample's advantage on loss positions, 0 elsewhere),
    `logprobs` float32 (inference logprobs, 0 on prompt positions), `routed_experts`
    `[n, layers, top_k]` (uint8/uint16; int16/int32 when the final token carries the -1
    sentinel) and `sampling_mask` int32 `[n, W]` padded with -1, each None when the
    sample has no such payload. `rows` is the window of positions read: the whole sample
    (`range(length)`) unless `read_batch` was given one.
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

    @property
    def payload_nbytes(self) -> int:
        """The bytes of payload arrays this sample holds (routing and masks)."""
        return sum(
            array.nbytes for array in (self.routed_experts, self.sampling_mask) if array is not None
        )


@attrs.frozen(eq=False)
class Batch:
    """A batch read by `read_batch`: its step, when it was shipped, and its samples."""

    step: int
    created_at: float
    samples: list[SampleArrays]

    @property
    def payload_nbytes(self) -> int:
        """The bytes of payload arrays over all samples."""
        return sum(sample.payload_nbytes for sample in self.samples)


def read_batch(batch_dir: Path, *, verify: bool = True, rows: range | None = None) -> Batch:
    """Read the shipped batch in `batch_dir` (a `step_NNNNNN` directory) with its payloads.

    `verify` checks every by-handle payload byte against its segment's digest. `rows`
    (a range with step 1) reads only that window of positions of each sample, clipped to
    the sample's length, as a context-parallel rank does; per-position arrays then cover
    only the window. Blocking.

    Raises `BatchError` (one line naming the file) when `batch.json` is missing,
    unreadable or malformed, its step differs from the directory's, or a sample's payload
    is malformed (a bad segment or inline array, a `payload_dir` that is not `v<k>` for
    the sample's dispatch version); `PayloadMissing` naming the payload file when it is
    missing or short; `PayloadCorrupt` naming it when `verify` finds a digest mismatch;
    ValueError for a `rows` range whose step is not 1 or whose start is negative.
    """
    if rows is not None and (rows.step != 1 or rows.start < 0):
        raise ValueError(f"rows must be a range with step 1 and start >= 0, got {rows}")
    batch_file = batch_dir / BATCH_FILE
    try:
        data = batch_file.read_bytes()
    except OSError as exc:
        raise BatchError(f"{batch_file}: cannot read: {exc.strerror or exc}") from None
    document = decode_batch(data, source=str(batch_file))
    dir_step = parse_step_dir(batch_dir.name)
    if dir_step is not None and dir_step != document.step:
        raise BatchError(f"{batch_file}: step {document.step} in the directory of step {dir_step}")
    samples = []
    for index, sample in enumerate(document.samples):
        try:
            samples.append(_sample_arrays(sample, rows=rows, verify=verify))
        except BadSegment as exc:
            raise BatchError(f"{batch_file}: samples[{index}]: {exc}") from None
    return Batch(step=document.step, created_at=document.created_at, samples=samples)


def _sample_arrays(sample: TrainSample, *, rows: range | None, verify: bool) -> SampleArrays:
    length = len(sample.token_ids)
    window = (
        range(length) if rows is None else range(min(rows.start, length), min(rows.stop, length))
    )
    payload = _read_payload(sample, window, verify=verify)
    token_ids = np.asarray(sample.token_ids, dtype=np.int64)[window.start : window.stop]
    loss_mask = np.asarray(sample.loss_mask, dtype=np.bool_)[window.start : window.stop]
    logprobs = np.asarray(sample.logprobs, dtype=np.float32)[window.start : window.stop]
    advantages = np.where(loss_mask, np.float32(sample.advantage), np.float32(0.0))
    return SampleArrays(
        group_id=sample.group_id,
        rollout_id=sample.rollout_id,
        start_version=sample.start_version,
        dispatch_version=sample.dispatch_version,
        reward=sample.reward,
        advantage=sample.advantage,
        length=length,
        rows=window,
        token_ids=token_ids,
        loss_mask=loss_mask,
        advantages=advantages.astype(np.float32, copy=False),
        logprobs=logprobs,
        routed_experts=payload.get("routed_experts"),
        sampling_mask=payload.get("sampling_mask"),
    )


def _read_payload(sample: TrainSample, window: range, *, verify: bool) -> dict[str, np.ndarray]:
    """The sample's payload arrays over `window`. Raises BadSegment and the payload errors."""
    length = len(sample.token_ids)
    if sample.payload_dir is not None:
        payload_dir = Path(sample.payload_dir)
        # Every turn of a rollout writes into <root>/v<k>, k its dispatch version (DESIGN
        # §3): a sample pointing elsewhere would escape the collector's bound.
        if payload_dir.name != f"v{sample.dispatch_version}":
            raise BadSegment(
                "wrong_version_dir",
                "",
                f"payload_dir {sample.payload_dir!r} is not v{sample.dispatch_version}, "
                "the sample's dispatch version",
            )
        return read_sample_payload(payload_dir, sample.payload, length, rows=window, verify=verify)
    arrays: dict[str, np.ndarray] = {}
    for field, obj in (sample.inline or {}).items():
        array, pos = decode_inline(dict(obj), field=field, allow_sentinel=True)
        # A sample's inline arrays are the stitched whole: one row per position.
        if pos != 0 or array.shape[0] != length:
            raise BadSegment(
                "coverage",
                "",
                f"inline {field} has rows {pos}..{pos + array.shape[0]}, "
                f"the sample needs 0..{length}",
            )
        arrays[field] = array[window.start : window.stop]
    return arrays

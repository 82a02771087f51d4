"""Shipping a step to prime-rl's trainer: `<rollouts_dir>/step_N/rank_R.bin`, all at once.

prime-rl's trainer reads, for step N (from 1), `rollouts/step_N/rank_R.bin` on data rank R
as soon as that file exists (`FileSystemMicroBatchReceiver`), and publishes
`broadcasts/step_N/STABLE` after it has read the step. This module writes that layout:

    <rollouts_dir>/step_7/rank_0.bin          prime-rl's msgpack `list[MicroBatch]`
    <rollouts_dir>/step_7/rank_1.bin          ... one per data rank
    <rollouts_dir>/step_7/orchestrator.json   this project's manifest (prime-rl ignores it)

A step is built under a hidden temp name (`.tmp-step_7-<hex>`), every file fsynced, the
temp directory fsynced, renamed to `step_7` and `rollouts_dir` fsynced: every rank file
appears at the same moment, none is ever seen half-written, and a crash leaves at most a
`.tmp-*` directory that start-up removes. A shipped step is never rewritten. The set of
complete step directories (`shipped_primerl_steps`: the canonical `step_N` holding every
rank file and the manifest) is what "shipped" means, as `batch.bin` is for native batches.

The samples' routed experts are read here, in the worker thread that writes the step: by
handle from the payload files (digests verified), inline from the sample; by handle they
are in memory only while their step is written, never in the daemon's queue. A sample
whose payload cannot be read is left out of the step (logged with its rollout and server,
listed in the manifest's `dropped`); when no sample is left, nothing is written and
`NothingToShip` says so.

The manifest, `orchestrator.json` (one line of JSON):

    {"format": "rollout-orchestrator.prime-rl-step/1", "step": 7, "created_at": <unix s>,
     "data_world_size": 2, "seq_len": 8192, "env_name": "mixed", "samples": 63,
     "micro_batches_per_rank": 4,
     "ranks": [{"file": "rank_0.bin", "bytes": <size>, "micro_batches": [
         {"tokens": 8012, "padding": false, "routed": true, "sequences": [
             {"rollout_id": "...", "group_id": "...", "server": "http://...",
              "length": 812, "routing": "by_handle",
              "payload_dir": "/.../v6", "routed_experts": [<segment>, ...]},
             ...]},
         ...]},
       ...],
     "dropped": [{"index": 5, "group_id": "...", "rollout_id": "...", "server": "...",
                  "reason": "payload_corrupt", "file": "/.../v6/....bin", "error": "..."}]}

`ranks[R].micro_batches[i].sequences[j]` is the j-th packed sequence of the i-th micro
batch of `rank_R.bin`, in order; `routing` is "by_handle" (then `payload_dir` and the
`routed_experts` segments in batch form, `PayloadSegment.to_json`, say where its rows
are), "inline" or "none"; `padding` marks a zero-loss copy that pads a rank's count.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import structlog

from orchestrator.core.rollouts import TrainSample
from orchestrator.handoff.dropped import DroppedSample, NothingToShip
from orchestrator.handoff.durable import (
    BatchExists,
    publish_step_dir,
    write_file_synced,
    write_new_file,
)
from orchestrator.handoff.primerl.micro_batches import MicroBatchArrays, PackedSample, pack_step
from orchestrator.handoff.primerl.rank_file import encode_rank_file
from orchestrator.handoff.step_dirs import (
    complete_steps,
    is_complete_step_dir,
    parse_step_dir,
    step_dir,
)
from orchestrator.payload import (
    BadSegment,
    PayloadCorrupt,
    PayloadError,
    PayloadMissing,
    read_sample_payload,
)

__all__ = [
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "NothingToShip",
    "PrimeRLStep",
    "is_complete_primerl_step",
    "primerl_step_dir",
    "publish_primerl_step",
    "rank_file_name",
    "shipped_primerl_steps",
    "unfinished_primerl_steps",
]

log = structlog.get_logger(__name__)

MANIFEST_FILE = "orchestrator.json"
MANIFEST_FORMAT = "rollout-orchestrator.prime-rl-step/1"

# The `BadSegment` reasons that describe a payload file on disk (as the native reader
# classifies them), not the segment record.
_FILE_REASONS = frozenset({"symlink", "mount_point", "not_regular_file"})


@attrs.frozen
class PrimeRLStep:
    """What `publish_primerl_step` shipped: the step directory, the samples in it, the
    micro batches each rank got, the tokens of all ranks (padding copies included), and
    the samples left out for an unreadable payload."""

    path: Path
    samples: int
    micro_batches: int
    tokens: int
    dropped: tuple[DroppedSample, ...] = ()


def rank_file_name(rank: int) -> str:
    """`rank_R.bin`, the file data rank `rank` reads (no padding, as prime-rl names it)."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    return f"rank_{rank}.bin"


def primerl_step_dir(rollouts_dir: Path, step: int) -> Path:
    """`<rollouts_dir>/step_N`, prime-rl's spelling. Raises ValueError for a negative step."""
    return step_dir(rollouts_dir, step, "prime-rl")


def is_complete_primerl_step(path: Path, data_world_size: int) -> bool:
    """Whether `path` is a shipped step: a real directory holding the manifest and
    `rank_R.bin` for every R < `data_world_size`. Blocking."""
    return is_complete_step_dir(path, MANIFEST_FILE) and all(
        (path / rank_file_name(rank)).is_file() for rank in range(data_world_size)
    )


def shipped_primerl_steps(rollouts_dir: Path, data_world_size: int) -> list[int]:
    """The shipped steps in `rollouts_dir`, sorted: canonical `step_N` directories (not
    links) holding the manifest and every `rank_R.bin`, R < `data_world_size`.

    Temp directories, other spellings (`step_07`, `step_000007`) and directories missing
    a file are ignored. A missing `rollouts_dir` means none. Raises OSError when it
    cannot be listed.
    """
    return [
        step
        for step in complete_steps(rollouts_dir, MANIFEST_FILE, layout="prime-rl")
        if is_complete_primerl_step(primerl_step_dir(rollouts_dir, step), data_world_size)
    ]


def unfinished_primerl_steps(rollouts_dir: Path, data_world_size: int) -> list[int]:
    """Canonical step directories that hold a rank file or a manifest but are not
    complete for `data_world_size`: written by another writer (prime-rl's own
    orchestrator), or shipped with fewer data ranks. This module never leaves one (it
    renames whole directories), so start-up refuses to run over them. Blocking; a
    missing `rollouts_dir` holds none."""
    try:
        entries = list(os.scandir(rollouts_dir))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        step = parse_step_dir(entry.name, "prime-rl")
        if step is None or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        if is_complete_primerl_step(path, data_world_size):
            continue
        names = os.listdir(path)
        if MANIFEST_FILE in names or any(n.startswith("rank_") for n in names):
            found.append(step)
    return sorted(found)


def publish_primerl_step(
    rollouts_dir: Path,
    step: int,
    samples: Sequence[TrainSample],
    *,
    data_world_size: int,
    seq_len: int,
    env_name: str,
    fsync: bool = True,
) -> PrimeRLStep:
    """Ship step `step` to prime-rl's trainer: `<rollouts_dir>/step_N/rank_R.bin` for
    every data rank and the manifest, all appearing at once (module docstring). Blocking.

    Each sample becomes a `PackedSample`: per position its token, loss bit, the sample's
    advantage on loss positions (0 elsewhere), its logprob and the temperature it was
    sampled at; its environment's name (`env_name` for a sample that names none); its
    routed experts, read from the payload files by handle (digests
    verified) or taken from the inline arrays, else None. A sample whose payload cannot
    be read is dropped (warning naming rollout and server). `pack_step` packs them into
    `seq_len` token micro batches for `data_world_size` ranks. With `fsync=False` the
    fsyncs are skipped (tests, benchmarks). Creates `rollouts_dir` when missing.

    Raises `BatchExists` when the step is shipped already or something else occupies its
    name (nothing changed), `NothingToShip` when every sample was dropped (nothing
    written), ValueError for a step < 1, no samples, or a sample longer than `seq_len`,
    OSError when writing fails (the temp directory is removed).
    """
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    if not samples:
        raise ValueError("a step needs at least one sample")
    final_dir = primerl_step_dir(rollouts_dir, step)
    rollouts_dir.mkdir(parents=True, exist_ok=True)
    if is_complete_primerl_step(final_dir, data_world_size):
        raise BatchExists(errno.EEXIST, "step already shipped", str(final_dir))
    kept, packed, dropped = _packed_samples(step, samples, env_name)
    if not kept:
        raise NothingToShip(step, dropped)
    ranks = pack_step(packed, seq_len=seq_len, data_world_size=data_world_size)
    # From here on the micro batches hold the only copy of the routing rows: each rank's
    # are let go once its file is written, so a step's rows are in memory about once.
    del packed
    rank_entries = [[_micro_batch_entry(batch, kept) for batch in rank] for rank in ranks]
    micro_batches = len(ranks[0])
    tokens = sum(batch.tokens for rank in ranks for batch in rank)

    def fill(temp_dir: Path) -> None:
        sizes = []
        for rank in range(len(ranks)):
            path = temp_dir / rank_file_name(rank)
            sizes.append(_write_rank_file(path, ranks[rank], fsync=fsync))
            ranks[rank] = []
        manifest = _manifest(
            step, rank_entries, sizes, kept, dropped, seq_len=seq_len, env_name=env_name
        )
        write_file_synced(temp_dir / MANIFEST_FILE, manifest, fsync=fsync)

    publish_step_dir(final_dir, fill, fsync=fsync)
    return PrimeRLStep(
        path=final_dir,
        samples=len(kept),
        micro_batches=micro_batches,
        tokens=tokens,
        dropped=tuple(dropped),
    )


def _packed_samples(
    step: int, samples: Sequence[TrainSample], env_name: str
) -> tuple[list[TrainSample], list[PackedSample], list[DroppedSample]]:
    """The samples whose payload could be read, as `PackedSample`s, and those dropped."""
    kept: list[TrainSample] = []
    packed: list[PackedSample] = []
    dropped: list[DroppedSample] = []
    for index, sample in enumerate(samples):
        try:
            routed = _routed_experts(sample)
        except (PayloadError, OSError, ValueError) as exc:
            drop = _dropped(index, sample, exc)
            log.warning(
                "sample dropped: payload unreadable",
                step=step,
                rollout=drop.rollout_id,
                group=drop.group_id,
                server=drop.server,
                reason=drop.reason,
                file=drop.file,
                error=drop.error,
            )
            dropped.append(drop)
            continue
        length = len(sample.token_ids)
        kept.append(sample)
        packed.append(
            PackedSample(
                token_ids=sample.token_ids,
                loss_mask=sample.loss_mask,
                advantages=np.where(sample.loss_mask, sample.advantage, 0.0).astype(np.float32),
                logprobs=sample.logprobs,
                temperatures=np.full(length, sample.temperature, dtype=np.float32),
                env_name=sample.env or env_name,
                routed_experts=routed,
            )
        )
    return kept, packed, dropped


def _routed_experts(sample: TrainSample) -> np.ndarray | None:
    """The sample's routed experts `[length, layers, top_k]`, or None when it has none.

    By handle only the routing segments are read (prime-rl's micro batch has no sampling
    mask): every segment's file size-checked and digest verified. Raises the payload
    errors, OSError, ValueError.
    """
    if sample.payload_dir is not None and "routed_experts" in sample.payload:
        segments = {"routed_experts": sample.payload["routed_experts"]}
        arrays = read_sample_payload(
            Path(sample.payload_dir), segments, len(sample.token_ids), verify=True
        )
        return arrays["routed_experts"]
    if sample.inline is not None and "routed_experts" in sample.inline:
        return sample.inline["routed_experts"]
    return None


def _dropped(index: int, sample: TrainSample, exc: Exception) -> DroppedSample:
    payload_dir = Path(sample.payload_dir or "")
    if isinstance(exc, PayloadCorrupt):
        reason, file = "payload_corrupt", str(exc.path)
    elif isinstance(exc, PayloadMissing):
        reason, file = "payload_missing", str(exc.path)
    elif isinstance(exc, BadSegment):
        reason = "bad_payload_file" if exc.reason in _FILE_REASONS else "bad_payload"
        file = str(payload_dir / exc.file)
    elif isinstance(exc, OSError):
        reason, file = "io_error", str(exc.filename or payload_dir)
    else:
        reason, file = "bad_payload", str(payload_dir)
    return DroppedSample(
        index=index,
        group_id=sample.group_id,
        rollout_id=sample.rollout_id,
        server=sample.server,
        reason=reason,
        file=file,
        error=str(exc),
    )


def _write_rank_file(path: Path, micro_batches: Sequence[MicroBatchArrays], *, fsync: bool) -> int:
    """Create `path` with the rank's `list[MicroBatch]`; return its size. Blocking."""
    buffers = [
        np.frombuffer(part, dtype=np.uint8)
        if isinstance(part, bytes)
        else part.reshape(-1).view(np.uint8)
        for part in encode_rank_file(micro_batches)
    ]
    return write_new_file(path, buffers, fsync=fsync)


def _manifest(
    step: int,
    ranks: Sequence[Sequence[dict[str, Any]]],
    sizes: Sequence[int],
    kept: Sequence[TrainSample],
    dropped: Sequence[DroppedSample],
    *,
    seq_len: int,
    env_name: str,
) -> bytes:
    document = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "created_at": time.time(),
        "data_world_size": len(ranks),
        "seq_len": seq_len,
        "env_name": env_name,
        "samples": len(kept),
        "micro_batches_per_rank": len(ranks[0]),
        "ranks": [
            {
                "file": rank_file_name(rank),
                "bytes": size,
                "micro_batches": list(entries),
            }
            for rank, (entries, size) in enumerate(zip(ranks, sizes, strict=True))
        ],
        "dropped": [attrs.asdict(drop) for drop in dropped],
    }
    return (json.dumps(document, allow_nan=False, separators=(",", ":")) + "\n").encode()


def _micro_batch_entry(batch: MicroBatchArrays, kept: Sequence[TrainSample]) -> dict[str, Any]:
    return {
        "tokens": batch.tokens,
        "padding": batch.padding,
        "routed": batch.routed_experts is not None,
        "sequences": [_sequence_entry(kept[index]) for index in batch.sample_indices],
    }


def _sequence_entry(sample: TrainSample) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "rollout_id": sample.rollout_id,
        "group_id": sample.group_id,
        "server": sample.server,
        "length": len(sample.token_ids),
    }
    if sample.payload_dir is not None and "routed_experts" in sample.payload:
        entry["routing"] = "by_handle"
        entry["payload_dir"] = sample.payload_dir
        entry["routed_experts"] = [s.to_json() for s in sample.payload["routed_experts"]]
    elif sample.inline is not None and "routed_experts" in sample.inline:
        entry["routing"] = "inline"
    else:
        entry["routing"] = "none"
    return entry

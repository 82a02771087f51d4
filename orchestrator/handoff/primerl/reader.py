"""The local trainer's side of prime-rl's hand-off: read a step as prime-rl's trainer does,
and check it (`read_primerl_step`).

prime-rl's data rank R waits for `rollouts/step_N/rank_R.bin` and decodes it as
`list[MicroBatch]`. The local trainer does the same for every rank (`decode_rank_file`),
then checks what prime-rl's trainer takes for granted:

- each micro batch: every per-token list has `len(input_ids)` entries;
  `sum(sequence_lengths) == sum(seq_lens) == len(input_ids)`; `position_ids` count from 0
  in every sequence; `routed_experts` (when present) has `shape[0] == len(input_ids)` and
  exactly `prod(shape)` items of its dtype;
- the ranks: the same number of micro batches each;
- against the manifest (`orchestrator.json`): the sequences' lengths, whether a micro
  batch carries routing, and, sequence by sequence, that its routing rows are the bytes
  of the payload files the manifest names (`read_sample_payload`, digests verified).

Every failure is a `StepProblem`, never an exception: the trainer counts it as a violation
and goes on. Blocking: the trainer calls it in a worker thread.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs
import msgspec
import numpy as np

from orchestrator.handoff.contract import StepProblem
from orchestrator.handoff.primerl.rank_file import MicroBatch, decode_rank_file
from orchestrator.handoff.primerl.store import MANIFEST_FILE, MANIFEST_FORMAT, rank_file_name
from orchestrator.payload import (
    BadSegment,
    PayloadCorrupt,
    PayloadError,
    PayloadMissing,
    PayloadSegment,
    read_sample_payload,
)

__all__ = ["PrimeRLStepRead", "ranks_ready", "read_primerl_step"]

_PER_TOKEN = (
    "loss_mask",
    "advantages",
    "inference_logprobs",
    "position_ids",
    "temperatures",
    "env_names",
)


@attrs.frozen
class PrimeRLStepRead:
    """What reading a step found: the samples (sequences of micro batches that are not
    padding), the routing bytes of those micro batches, the problems, and the samples
    the daemon dropped before shipping (the manifest's `dropped`)."""

    samples: int
    payload_bytes: int
    problems: tuple[StepProblem, ...] = ()
    dropped: tuple[dict[str, Any], ...] = ()


def ranks_ready(data_world_size: int, step_dir: Path) -> bool:
    """Whether every `rank_R.bin`, R < `data_world_size`, exists in `step_dir`: what
    prime-rl's ranks wait for. Blocking."""
    return all((step_dir / rank_file_name(rank)).is_file() for rank in range(data_world_size))


def read_primerl_step(
    step_dir: Path, step: int, data_world_size: int, *, verify: bool = True
) -> PrimeRLStepRead:
    """Read and check the step in `step_dir` (see the module docstring). Blocking."""
    reader = _StepReader(step_dir, step, verify)
    ranks = [reader.decode_rank(rank) for rank in range(data_world_size)]
    manifest = reader.manifest(data_world_size)
    decoded = [micro_batches for micro_batches in ranks if micro_batches is not None]
    counts = {len(micro_batches) for micro_batches in decoded}
    if len(counts) > 1:
        reader.problem(
            "bad_micro_batch",
            step_dir,
            f"ranks hold different numbers of micro batches: {[len(m) for m in decoded]}",
        )
    samples = payload_bytes = 0
    for rank, micro_batches in enumerate(ranks):
        if micro_batches is None:
            continue
        entries = _rank_entries(manifest, rank, len(micro_batches), reader)
        for index, batch in enumerate(micro_batches):
            entry = entries[index] if entries is not None else None
            where = f"rank {rank} micro batch {index}"
            reader.check_micro_batch(batch, entry, rank, where)
            if entry is not None and entry.get("padding"):
                continue
            samples += len(batch.sequence_lengths)
            if batch.routed_experts is not None:
                payload_bytes += len(batch.routed_experts.data)
    dropped = tuple(manifest.get("dropped", [])) if manifest is not None else ()
    return PrimeRLStepRead(samples, payload_bytes, tuple(reader.problems), dropped)


def _rank_entries(
    manifest: dict[str, Any] | None, rank: int, count: int, reader: _StepReader
) -> list[dict[str, Any]] | None:
    if manifest is None:
        return None
    entries = manifest["ranks"][rank].get("micro_batches")
    if (
        not isinstance(entries, list)
        or len(entries) != count
        or not all(isinstance(entry, dict) for entry in entries)
    ):
        reader.problem(
            "bad_micro_batch",
            reader.step_dir / rank_file_name(rank),
            f"the manifest lists {len(entries) if isinstance(entries, list) else '?'} "
            f"micro batches for rank {rank}, the file holds {count}",
        )
        return None
    return entries


@attrs.define
class _StepReader:
    step_dir: Path
    step: int
    verify: bool
    problems: list[StepProblem] = attrs.Factory(list)
    # Routing rows read from payload files, by (payload_dir, rollout_id): a padding copy
    # repeats sequences already read.
    _rows: dict[tuple[str, str], np.ndarray] = attrs.Factory(dict)

    def problem(self, kind: str, file: Path | str, message: str) -> None:
        self.problems.append(StepProblem(kind, str(file), f"step {self.step}: {message}"))

    def decode_rank(self, rank: int) -> list[MicroBatch] | None:
        path = self.step_dir / rank_file_name(rank)
        try:
            return decode_rank_file(path.read_bytes())
        except OSError as exc:
            self.problem("bad_batch", path, f"cannot read: {exc.strerror or exc}")
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.problem("bad_batch", path, f"not prime-rl's list[MicroBatch]: {exc}")
        return None

    def manifest(self, data_world_size: int) -> dict[str, Any] | None:
        path = self.step_dir / MANIFEST_FILE
        try:
            document = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            self.problem("bad_batch", path, f"cannot read the manifest: {exc}")
            return None
        if not isinstance(document, dict) or document.get("format") != MANIFEST_FORMAT:
            self.problem("bad_batch", path, f"not a manifest of {MANIFEST_FORMAT}")
            return None
        ranks = document.get("ranks")
        if document.get("step") != self.step or not isinstance(ranks, list):
            self.problem("bad_batch", path, f"not the manifest of step {self.step}")
            return None
        if len(ranks) != data_world_size or not all(isinstance(r, dict) for r in ranks):
            self.problem(
                "bad_batch", path, f"lists {len(ranks)} ranks, the trainer has {data_world_size}"
            )
            return None
        return document

    def check_micro_batch(
        self, batch: MicroBatch, entry: dict[str, Any] | None, rank: int, where: str
    ) -> None:
        file = self.step_dir / rank_file_name(rank)
        tokens = len(batch.input_ids)
        for name in _PER_TOKEN:
            if len(getattr(batch, name)) != tokens:
                self.problem(
                    "bad_micro_batch",
                    file,
                    f"{where}: {name} has {len(getattr(batch, name))} entries, input_ids {tokens}",
                )
        lengths = list(batch.sequence_lengths)
        if sum(lengths) != tokens or sum(batch.seq_lens) != tokens:
            self.problem(
                "bad_micro_batch",
                file,
                f"{where}: sequence_lengths sum to {sum(lengths)}, seq_lens to "
                f"{sum(batch.seq_lens)}, input_ids has {tokens}",
            )
            return
        expected = np.concatenate([np.arange(n) for n in lengths]) if lengths else np.zeros(0)
        if not np.array_equal(np.asarray(batch.position_ids), expected):
            self.problem(
                "bad_micro_batch", file, f"{where}: position_ids do not restart at 0 per sequence"
            )
        routing = self._routing(batch, file, where)
        if entry is not None:
            self._check_against_manifest(batch, routing, entry, file, where)

    def _routing(self, batch: MicroBatch, file: Path, where: str) -> np.ndarray | None:
        routed = batch.routed_experts
        if routed is None:
            return None
        try:
            dtype = np.dtype(routed.dtype).newbyteorder("<")
            shape = tuple(int(n) for n in routed.shape)
        except (TypeError, ValueError) as exc:
            self.problem("bad_micro_batch", file, f"{where}: routed_experts: {exc}")
            return None
        if len(shape) != 3 or shape[0] != len(batch.input_ids):
            self.problem(
                "bad_micro_batch",
                file,
                f"{where}: routed_experts has shape {list(shape)}, "
                f"input_ids {len(batch.input_ids)} tokens",
            )
            return None
        if len(routed.data) != math.prod(shape) * dtype.itemsize:
            self.problem(
                "bad_micro_batch",
                file,
                f"{where}: routed_experts holds {len(routed.data)} bytes, "
                f"shape {list(shape)} of {routed.dtype} needs {math.prod(shape) * dtype.itemsize}",
            )
            return None
        return np.frombuffer(routed.data, dtype=dtype).reshape(shape)

    def _check_against_manifest(
        self,
        batch: MicroBatch,
        routing: np.ndarray | None,
        entry: dict[str, Any],
        file: Path,
        where: str,
    ) -> None:
        sequences = entry.get("sequences")
        if not isinstance(sequences, list) or [
            s.get("length") for s in sequences if isinstance(s, dict)
        ] != list(batch.sequence_lengths):
            self.problem(
                "bad_micro_batch",
                file,
                f"{where}: the sequences differ from the manifest's",
            )
            return
        if entry.get("routed") != (batch.routed_experts is not None):
            self.problem(
                "bad_micro_batch",
                file,
                f"{where}: routed_experts {'missing' if entry.get('routed') else 'unexpected'}",
            )
            return
        if routing is None:
            return
        start = 0
        for sequence in sequences:
            length = int(sequence["length"])
            rows = routing[start : start + length]
            start += length
            if sequence.get("routing") != "by_handle":
                continue
            expected = self._payload_rows(sequence)
            if expected is None:
                continue
            if expected.shape != rows.shape or (
                expected.astype(rows.dtype).tobytes() != rows.tobytes()
            ):
                self.problem(
                    "routing_mismatch",
                    file,
                    f"{where}: routing rows of rollout {sequence.get('rollout_id')} differ "
                    f"from its payload files in {sequence.get('payload_dir')}",
                )

    def _payload_rows(self, sequence: dict[str, Any]) -> np.ndarray | None:
        payload_dir = str(sequence.get("payload_dir"))
        key = (payload_dir, str(sequence.get("rollout_id")))
        if key in self._rows:
            return self._rows[key]
        try:
            segments = [PayloadSegment.from_json(s) for s in sequence["routed_experts"]]
            rows = read_sample_payload(
                Path(payload_dir),
                {"routed_experts": segments},
                int(sequence["length"]),
                verify=self.verify,
            )["routed_experts"]
        except PayloadMissing as exc:
            self.problem("payload_missing", exc.path, str(exc))
            return None
        except PayloadCorrupt as exc:
            self.problem("payload_corrupt", exc.path, str(exc))
            return None
        except (BadSegment, PayloadError, KeyError, TypeError, ValueError) as exc:
            self.problem("bad_payload", payload_dir, f"rollout {key[1]}: {exc}")
            return None
        except OSError as exc:
            self.problem("io_error", exc.filename or payload_dir, str(exc))
            return None
        self._rows[key] = rows
        return rows

"""The native hand-off as a `HandoffFormat`: `<batches_dir>/step_000007/batch.bin`.

Ships with `publish_batch` (the samples' payloads travel by handle or inline; the
trainer reads them itself, so nothing is dropped when shipping), lists with
`shipped_steps`, and reads a step as this project's trainer does (`read_batch` with
`on_corrupt="drop"`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import orchestrator.handoff.native.store as store
from orchestrator.core.rollouts import TrainSample
from orchestrator.errors import UserError
from orchestrator.handoff.contract import HandoffSettings, Shipment, StepProblem, StepRead
from orchestrator.handoff.native.format import BATCH_FILE, LEGACY_BATCH_FILE, BatchError
from orchestrator.handoff.native.reader import read_batch
from orchestrator.handoff.step_dirs import StepLayout, complete_steps
from orchestrator.payload import BadSegment, PayloadCorrupt, PayloadError, PayloadMissing

__all__ = ["NATIVE_FORMAT", "NativeFormat"]


class NativeFormat:
    """Batch format 2, one `batch.bin` per step (docs/protocol.md#batches)."""

    name = "native"
    # Its trainer may publish versions in either layout.
    weights_layout: StepLayout | None = None

    def describe(self, settings: HandoffSettings) -> str:
        return "native batches (step_000007/batch.bin)"

    def check(self, settings: HandoffSettings) -> str | None:
        return None

    def ship(
        self, settings: HandoffSettings, step: int, samples: Sequence[TrainSample]
    ) -> Shipment:
        # Looked up when called: a benchmark times the daemon by wrapping `store.publish_batch`.
        path = store.publish_batch(settings.batches_dir, step, samples, fsync=settings.fsync)
        return Shipment(path, len(samples))

    def shipped_steps(self, settings: HandoffSettings) -> list[int]:
        return store.shipped_steps(settings.batches_dir)

    def refuse_resume(self, settings: HandoffSettings) -> None:
        """Refuse batches of the old JSON format 1, which this version neither writes nor
        reads."""
        legacy = complete_steps(settings.batches_dir, LEGACY_BATCH_FILE)
        if legacy:
            raise UserError(
                f"{settings.batches_dir} holds batches of the old JSON format 1 (step "
                f"{legacy[-1]}: {LEGACY_BATCH_FILE}); this version ships format 2 "
                "(batch.bin) and cannot resume that run: start a new run directory"
            )

    def step_dir(self, settings: HandoffSettings, step: int) -> Path:
        return store.batch_step_dir(settings.batches_dir, step)

    def is_step_shipped(self, settings: HandoffSettings, step_dir: Path) -> bool:
        return store.is_complete_batch(step_dir)

    def read_step(
        self, settings: HandoffSettings, step_dir: Path, step: int, *, verify: bool
    ) -> StepRead:
        """Read the batch in full, dropping samples with broken payload files; a batch
        that cannot be read, or a payload error the reader does not drop for, is the one
        problem of the step."""
        batch_file = step_dir / BATCH_FILE
        try:
            batch = read_batch(step_dir, verify=verify, on_corrupt="drop")
        except BatchError as exc:
            return _unreadable("bad_batch", batch_file, exc)
        except PayloadMissing as exc:
            return _unreadable("payload_missing", exc.path, exc)
        except PayloadCorrupt as exc:
            return _unreadable("payload_corrupt", exc.path, exc)
        except (BadSegment, PayloadError) as exc:
            return _unreadable("bad_payload", batch_file, exc)
        except OSError as exc:
            return _unreadable("io_error", Path(exc.filename or step_dir), exc)
        return StepRead(len(batch.samples), batch.payload_nbytes, dropped=batch.dropped)


def _unreadable(kind: str, file: Path, exc: Exception) -> StepRead:
    return StepRead(0, 0, (StepProblem(kind, str(file), str(exc)),))


NATIVE_FORMAT = NativeFormat()

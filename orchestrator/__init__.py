"""rollout-orchestrator: the asynchronous RL rollout daemon.

The trainer-side API lives here so a trainer can read batches without knowing the
package's layout: `read_batch(batch_dir)` returns the samples with their arrays, read
through the payload reader (docs/design.md §5); `read_batch(batch_dir, on_corrupt="drop")` leaves
out samples with broken payload files and names them in `Batch.dropped`.

The names are imported when first used (PEP 562), so that importing a module of the
package (a reward worker importing `orchestrator.rewards`, the command line) does not pay
for the hand-off's imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.lazy_names import lazy_names

if TYPE_CHECKING:
    from orchestrator.handoff import Batch as Batch
    from orchestrator.handoff import BatchError as BatchError
    from orchestrator.handoff import DroppedSample as DroppedSample
    from orchestrator.handoff import SampleArrays as SampleArrays
    from orchestrator.handoff import TrainSample as TrainSample
    from orchestrator.handoff import read_batch as read_batch
    from orchestrator.payload import PayloadCorrupt as PayloadCorrupt
    from orchestrator.payload import PayloadMissing as PayloadMissing

_HOMES = {
    "Batch": "orchestrator.handoff",
    "BatchError": "orchestrator.handoff",
    "DroppedSample": "orchestrator.handoff",
    "SampleArrays": "orchestrator.handoff",
    "TrainSample": "orchestrator.handoff",
    "read_batch": "orchestrator.handoff",
    "PayloadCorrupt": "orchestrator.payload",
    "PayloadMissing": "orchestrator.payload",
}

__all__ = sorted(_HOMES)


__getattr__ = lazy_names(__name__, _HOMES)

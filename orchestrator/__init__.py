"""rollout-orchestrator: the asynchronous RL rollout daemon.

The trainer-side API lives here so a trainer can read batches without knowing the
package's layout: `read_batch(batch_dir)` returns the samples with their arrays, read
through the payload reader (docs/design.md §5); `read_batch(batch_dir, on_corrupt="drop")` leaves
out samples with broken payload files and names them in `Batch.dropped`.
"""

from orchestrator.handoff import Batch as Batch
from orchestrator.handoff import BatchError as BatchError
from orchestrator.handoff import DroppedSample as DroppedSample
from orchestrator.handoff import SampleArrays as SampleArrays
from orchestrator.handoff import TrainSample as TrainSample
from orchestrator.handoff import read_batch as read_batch
from orchestrator.payload import PayloadCorrupt as PayloadCorrupt
from orchestrator.payload import PayloadMissing as PayloadMissing

__all__ = [
    "Batch",
    "BatchError",
    "DroppedSample",
    "PayloadCorrupt",
    "PayloadMissing",
    "SampleArrays",
    "TrainSample",
    "read_batch",
]

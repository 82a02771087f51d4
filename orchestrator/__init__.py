"""rollout-orchestrator: the asynchronous RL rollout daemon.

The trainer-side API lives here so a trainer can read batches without knowing the
package's layout: `read_batch(batch_dir)` returns the samples with their arrays, read
through the payload reader (DESIGN §5); `read_batch(batch_dir, on_corrupt="drop")` leaves
out samples with broken payload files and names them in `Batch.dropped`.
"""

from orchestrator.batches import Batch as Batch
from orchestrator.batches import BatchError as BatchError
from orchestrator.batches import DroppedSample as DroppedSample
from orchestrator.batches import SampleArrays as SampleArrays
from orchestrator.batches import TrainSample as TrainSample
from orchestrator.batches import read_batch as read_batch
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

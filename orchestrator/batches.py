"""The trainer hand-off: batches shipped as files, and the trainer's `read_batch`.

DESIGN §5. The orchestrator ships batch `s` as `<batches_dir>/step_NNNNNN/batch.json`,
published atomically and never rewritten; the trainer reads it (payload bytes included)
and then publishes `v{s}` (`orchestrator.weights`). docs/protocol.md § Batches describes
the format for trainers in other codebases.
"""

from orchestrator._batch_format import BATCH_FILE as BATCH_FILE
from orchestrator._batch_format import BATCH_FORMAT as BATCH_FORMAT
from orchestrator._batch_format import BatchDocument as BatchDocument
from orchestrator._batch_format import BatchError as BatchError
from orchestrator._batch_format import TrainSample as TrainSample
from orchestrator._batch_format import decode_batch as decode_batch
from orchestrator._batch_format import encode_batch as encode_batch
from orchestrator._batch_reader import Batch as Batch
from orchestrator._batch_reader import DroppedSample as DroppedSample
from orchestrator._batch_reader import SampleArrays as SampleArrays
from orchestrator._batch_reader import read_batch as read_batch
from orchestrator._batch_store import PARTIAL_BATCH_PREFIX as PARTIAL_BATCH_PREFIX
from orchestrator._batch_store import BatchExists as BatchExists
from orchestrator._batch_store import batch_step_dir as batch_step_dir
from orchestrator._batch_store import is_complete_batch as is_complete_batch
from orchestrator._batch_store import publish_batch as publish_batch
from orchestrator._batch_store import publish_batch_async as publish_batch_async
from orchestrator._batch_store import remove_partial_batches as remove_partial_batches
from orchestrator._batch_store import shipped_steps as shipped_steps
from orchestrator._batch_wait import wait_for_batch as wait_for_batch

__all__ = [
    "BATCH_FILE",
    "BATCH_FORMAT",
    "PARTIAL_BATCH_PREFIX",
    "Batch",
    "BatchDocument",
    "BatchError",
    "BatchExists",
    "DroppedSample",
    "SampleArrays",
    "TrainSample",
    "batch_step_dir",
    "decode_batch",
    "encode_batch",
    "is_complete_batch",
    "publish_batch",
    "publish_batch_async",
    "read_batch",
    "remove_partial_batches",
    "shipped_steps",
    "wait_for_batch",
]

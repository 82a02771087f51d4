"""The native hand-off: batch format 2, one `<batches_dir>/step_000007/batch.bin` per step
(docs/protocol.md#batches).

`format` is the file's layout (encoded from and decoded to values), `batch_file` writes
and maps one file, `store` publishes a step directory atomically and lists the shipped
ones, `reader` is the trainer's side (`read_batch`), and `handoff_format` is all of it as
the registry's "native" (`NATIVE_FORMAT`).
"""

from orchestrator.handoff.native.batch_file import read_batch_file as read_batch_file
from orchestrator.handoff.native.batch_file import write_batch_file as write_batch_file
from orchestrator.handoff.native.format import BATCH_FILE as BATCH_FILE
from orchestrator.handoff.native.format import BATCH_FORMAT as BATCH_FORMAT
from orchestrator.handoff.native.format import FORMAT_VERSION as FORMAT_VERSION
from orchestrator.handoff.native.format import LEGACY_BATCH_FILE as LEGACY_BATCH_FILE
from orchestrator.handoff.native.format import BatchError as BatchError
from orchestrator.handoff.native.format import BatchFile as BatchFile
from orchestrator.handoff.native.format import BatchLayout as BatchLayout
from orchestrator.handoff.native.format import BatchSample as BatchSample
from orchestrator.handoff.native.format import decode_batch as decode_batch
from orchestrator.handoff.native.format import encode_batch as encode_batch
from orchestrator.handoff.native.handoff_format import NATIVE_FORMAT as NATIVE_FORMAT
from orchestrator.handoff.native.handoff_format import NativeFormat as NativeFormat
from orchestrator.handoff.native.reader import Batch as Batch
from orchestrator.handoff.native.reader import SampleArrays as SampleArrays
from orchestrator.handoff.native.reader import read_batch as read_batch
from orchestrator.handoff.native.store import batch_step_dir as batch_step_dir
from orchestrator.handoff.native.store import is_complete_batch as is_complete_batch
from orchestrator.handoff.native.store import publish_batch as publish_batch
from orchestrator.handoff.native.store import shipped_steps as shipped_steps

__all__ = [
    "BATCH_FILE",
    "BATCH_FORMAT",
    "FORMAT_VERSION",
    "LEGACY_BATCH_FILE",
    "NATIVE_FORMAT",
    "Batch",
    "BatchError",
    "BatchFile",
    "BatchLayout",
    "BatchSample",
    "NativeFormat",
    "SampleArrays",
    "batch_step_dir",
    "decode_batch",
    "encode_batch",
    "is_complete_batch",
    "publish_batch",
    "read_batch",
    "read_batch_file",
    "shipped_steps",
    "write_batch_file",
]

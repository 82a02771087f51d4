"""The trainer hand-off: batches shipped as files, published weights, the daemon's progress.

docs/design.md §5. The orchestrator ships batch `s` as `<batches_dir>/step_NNNNNN/batch.bin`,
published atomically and never rewritten (`store`, in the binary format 2 of `format`,
written and mapped by `batch_file`); the
trainer reads it (payload bytes included: `reader`'s `read_batch`, also exported as
`orchestrator.read_batch`) and then publishes `v{s}` as `<weights_dir>/step_NNNNNN/STABLE`
(`weights`), or as `<weights_dir>/step_N/STABLE` in prime-rl's layout (`StepLayout`,
`step_dirs`). With `[trainer] format = "prime-rl"` the daemon ships prime-rl's trainer's
own input instead, `<rollouts_dir>/step_N/rank_R.bin` per data rank (`primerl`; which
format is shipped and what "shipped" means: `formats`). The daemon keeps its own state
next to them (`progress`: `progress.json` and the run lock). docs/protocol.md#batches
describes the hand-off and the file byte for byte for trainers in other codebases.
"""

from orchestrator.core.rollouts import TrainSample as TrainSample
from orchestrator.handoff.batch_file import read_batch_file as read_batch_file
from orchestrator.handoff.batch_file import write_batch_file as write_batch_file
from orchestrator.handoff.format import BATCH_FILE as BATCH_FILE
from orchestrator.handoff.format import BATCH_FORMAT as BATCH_FORMAT
from orchestrator.handoff.format import FORMAT_VERSION as FORMAT_VERSION
from orchestrator.handoff.format import LEGACY_BATCH_FILE as LEGACY_BATCH_FILE
from orchestrator.handoff.format import BatchError as BatchError
from orchestrator.handoff.format import BatchFile as BatchFile
from orchestrator.handoff.format import BatchLayout as BatchLayout
from orchestrator.handoff.format import BatchSample as BatchSample
from orchestrator.handoff.format import decode_batch as decode_batch
from orchestrator.handoff.format import encode_batch as encode_batch
from orchestrator.handoff.progress import LOCK_FILE as LOCK_FILE
from orchestrator.handoff.progress import PROGRESS_FILE as PROGRESS_FILE
from orchestrator.handoff.progress import Progress as Progress
from orchestrator.handoff.progress import RunLocked as RunLocked
from orchestrator.handoff.progress import hold_run_lock as hold_run_lock
from orchestrator.handoff.progress import load_progress as load_progress
from orchestrator.handoff.progress import save_progress as save_progress
from orchestrator.handoff.reader import Batch as Batch
from orchestrator.handoff.reader import DroppedSample as DroppedSample
from orchestrator.handoff.reader import SampleArrays as SampleArrays
from orchestrator.handoff.reader import read_batch as read_batch
from orchestrator.handoff.step_dirs import STEP_LAYOUTS as STEP_LAYOUTS
from orchestrator.handoff.step_dirs import StepLayout as StepLayout
from orchestrator.handoff.step_dirs import parse_step_dir as parse_step_dir
from orchestrator.handoff.step_dirs import step_dir_name as step_dir_name
from orchestrator.handoff.store import PARTIAL_BATCH_PREFIX as PARTIAL_BATCH_PREFIX
from orchestrator.handoff.store import BatchExists as BatchExists
from orchestrator.handoff.store import batch_step_dir as batch_step_dir
from orchestrator.handoff.store import is_complete_batch as is_complete_batch
from orchestrator.handoff.store import publish_batch as publish_batch
from orchestrator.handoff.store import publish_batch_async as publish_batch_async
from orchestrator.handoff.store import remove_partial_batches as remove_partial_batches
from orchestrator.handoff.store import shipped_steps as shipped_steps
from orchestrator.handoff.wait import wait_for_batch as wait_for_batch
from orchestrator.handoff.weights import MODEL_FILE as MODEL_FILE
from orchestrator.handoff.weights import STABLE_MARKER as STABLE_MARKER
from orchestrator.handoff.weights import WEIGHTS_FORMAT as WEIGHTS_FORMAT
from orchestrator.handoff.weights import latest_published_version as latest_published_version
from orchestrator.handoff.weights import publish_weights as publish_weights
from orchestrator.handoff.weights import published_versions as published_versions
from orchestrator.handoff.weights import weights_step_dir as weights_step_dir

__all__ = [
    "BATCH_FILE",
    "BATCH_FORMAT",
    "FORMAT_VERSION",
    "LEGACY_BATCH_FILE",
    "LOCK_FILE",
    "MODEL_FILE",
    "PARTIAL_BATCH_PREFIX",
    "PROGRESS_FILE",
    "STABLE_MARKER",
    "STEP_LAYOUTS",
    "WEIGHTS_FORMAT",
    "Batch",
    "BatchError",
    "BatchExists",
    "BatchFile",
    "BatchLayout",
    "BatchSample",
    "DroppedSample",
    "Progress",
    "RunLocked",
    "SampleArrays",
    "StepLayout",
    "TrainSample",
    "batch_step_dir",
    "decode_batch",
    "encode_batch",
    "hold_run_lock",
    "is_complete_batch",
    "latest_published_version",
    "load_progress",
    "parse_step_dir",
    "publish_batch",
    "publish_batch_async",
    "publish_weights",
    "published_versions",
    "read_batch",
    "read_batch_file",
    "remove_partial_batches",
    "save_progress",
    "shipped_steps",
    "step_dir_name",
    "wait_for_batch",
    "weights_step_dir",
    "write_batch_file",
]

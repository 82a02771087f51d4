"""The trainer hand-off: steps shipped as files, published weights, the daemon's progress.

docs/design.md §5. What a step is on disk depends on the format (`[trainer] format`), each
in its own folder behind one protocol (`formats.HandoffFormat`), chosen by name from
`registry`: `native/`, ours, ships batch `s` as `<batches_dir>/step_NNNNNN/batch.bin`
(binary format 2), which the trainer reads with `read_batch` (payload bytes included;
also exported as `orchestrator.read_batch`); `primerl/` ships prime-rl's trainer's own
input, `<rollouts_dir>/step_N/rank_R.bin` per data rank. Either way the complete step
directories are the truth about what shipped. Shared by both: crash-safe writes and the
atomic step directory (`durable`), step directory names and their layouts
(`step_dirs`), waiting for a step (`wait`), the samples dropped for an unreadable
payload (`dropped`), published weights, `<weights_dir>/step_NNNNNN/STABLE` or
`step_N/STABLE` in prime-rl's layout (`weights`), and the daemon's own state
(`progress`: `progress.json` and the run lock), and the trainer's report of what it read
(`trainer_report`: `<run_dir>/trainer/report.json`, either trainer's).
docs/protocol.md#batches describes the hand-off and the file byte for byte for trainers
in other codebases.
"""

from orchestrator.core.rollouts import TrainSample as TrainSample
from orchestrator.handoff.contract import HandoffFormat as HandoffFormat
from orchestrator.handoff.contract import HandoffSettings as HandoffSettings
from orchestrator.handoff.contract import Shipment as Shipment
from orchestrator.handoff.contract import StepProblem as StepProblem
from orchestrator.handoff.contract import StepRead as StepRead
from orchestrator.handoff.dropped import DroppedSample as DroppedSample
from orchestrator.handoff.dropped import NothingToShip as NothingToShip
from orchestrator.handoff.durable import PARTIAL_BATCH_PREFIX as PARTIAL_BATCH_PREFIX
from orchestrator.handoff.durable import BatchExists as BatchExists
from orchestrator.handoff.durable import remove_partial_batches as remove_partial_batches
from orchestrator.handoff.durable import replace_file_atomically as replace_file_atomically
from orchestrator.handoff.native import BATCH_FILE as BATCH_FILE
from orchestrator.handoff.native import BATCH_FORMAT as BATCH_FORMAT
from orchestrator.handoff.native import FORMAT_VERSION as FORMAT_VERSION
from orchestrator.handoff.native import LEGACY_BATCH_FILE as LEGACY_BATCH_FILE
from orchestrator.handoff.native import NATIVE_FORMAT as NATIVE_FORMAT
from orchestrator.handoff.native import Batch as Batch
from orchestrator.handoff.native import BatchError as BatchError
from orchestrator.handoff.native import BatchFile as BatchFile
from orchestrator.handoff.native import BatchLayout as BatchLayout
from orchestrator.handoff.native import BatchSample as BatchSample
from orchestrator.handoff.native import NativeFormat as NativeFormat
from orchestrator.handoff.native import SampleArrays as SampleArrays
from orchestrator.handoff.native import batch_step_dir as batch_step_dir
from orchestrator.handoff.native import decode_batch as decode_batch
from orchestrator.handoff.native import encode_batch as encode_batch
from orchestrator.handoff.native import is_complete_batch as is_complete_batch
from orchestrator.handoff.native import publish_batch as publish_batch
from orchestrator.handoff.native import read_batch as read_batch
from orchestrator.handoff.native import read_batch_file as read_batch_file
from orchestrator.handoff.native import shipped_steps as shipped_steps
from orchestrator.handoff.native import write_batch_file as write_batch_file
from orchestrator.handoff.primerl import PRIME_RL_FORMAT as PRIME_RL_FORMAT
from orchestrator.handoff.progress import LOCK_FILE as LOCK_FILE
from orchestrator.handoff.progress import PROGRESS_FILE as PROGRESS_FILE
from orchestrator.handoff.progress import Progress as Progress
from orchestrator.handoff.progress import ProgressLine as ProgressLine
from orchestrator.handoff.progress import RunLocked as RunLocked
from orchestrator.handoff.progress import TopError as TopError
from orchestrator.handoff.progress import hold_run_lock as hold_run_lock
from orchestrator.handoff.progress import load_progress as load_progress
from orchestrator.handoff.progress import save_progress as save_progress
from orchestrator.handoff.registry import HANDOFF_FORMATS as HANDOFF_FORMATS
from orchestrator.handoff.registry import UnknownFormat as UnknownFormat
from orchestrator.handoff.registry import format_names as format_names
from orchestrator.handoff.registry import handoff_format as handoff_format
from orchestrator.handoff.step_dirs import STEP_LAYOUTS as STEP_LAYOUTS
from orchestrator.handoff.step_dirs import StepLayout as StepLayout
from orchestrator.handoff.step_dirs import complete_steps as complete_steps
from orchestrator.handoff.step_dirs import newest_complete_step as newest_complete_step
from orchestrator.handoff.step_dirs import parse_step_dir as parse_step_dir
from orchestrator.handoff.step_dirs import step_dir_name as step_dir_name
from orchestrator.handoff.wait import wait_for_batch as wait_for_batch
from orchestrator.handoff.wait import wait_for_step_dir as wait_for_step_dir
from orchestrator.handoff.weights import MODEL_FILE as MODEL_FILE
from orchestrator.handoff.weights import STABLE_MARKER as STABLE_MARKER
from orchestrator.handoff.weights import WEIGHTS_FORMAT as WEIGHTS_FORMAT
from orchestrator.handoff.weights import latest_published_version as latest_published_version
from orchestrator.handoff.weights import newest_published_version as newest_published_version
from orchestrator.handoff.weights import publish_weights as publish_weights
from orchestrator.handoff.weights import published_versions as published_versions
from orchestrator.handoff.weights import weights_step_dir as weights_step_dir

__all__ = [
    "BATCH_FILE",
    "BATCH_FORMAT",
    "FORMAT_VERSION",
    "HANDOFF_FORMATS",
    "LEGACY_BATCH_FILE",
    "LOCK_FILE",
    "MODEL_FILE",
    "NATIVE_FORMAT",
    "PARTIAL_BATCH_PREFIX",
    "PRIME_RL_FORMAT",
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
    "HandoffFormat",
    "HandoffSettings",
    "NativeFormat",
    "NothingToShip",
    "Progress",
    "ProgressLine",
    "RunLocked",
    "SampleArrays",
    "Shipment",
    "StepLayout",
    "StepProblem",
    "StepRead",
    "TopError",
    "TrainSample",
    "UnknownFormat",
    "batch_step_dir",
    "complete_steps",
    "decode_batch",
    "encode_batch",
    "format_names",
    "handoff_format",
    "hold_run_lock",
    "is_complete_batch",
    "latest_published_version",
    "load_progress",
    "newest_complete_step",
    "newest_published_version",
    "parse_step_dir",
    "publish_batch",
    "publish_weights",
    "published_versions",
    "read_batch",
    "read_batch_file",
    "remove_partial_batches",
    "replace_file_atomically",
    "save_progress",
    "shipped_steps",
    "step_dir_name",
    "wait_for_batch",
    "wait_for_step_dir",
    "weights_step_dir",
    "write_batch_file",
]

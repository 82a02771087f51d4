"""The hand-off to prime-rl's trainer: each step packed into micro batches per data rank
and written as `rollouts/step_N/rank_R.bin` (docs/protocol.md § The prime-rl hand-off).

`micro_batches` packs, `rank_file` encodes prime-rl's `list[MicroBatch]`, `store` ships a
step and lists the shipped ones, `reader` reads and checks a step as prime-rl's trainer
does (the local trainer's side), and `handoff_format` is all of it as the registry's
"prime-rl" (`PRIME_RL_FORMAT`).
"""

from orchestrator.handoff.dropped import NothingToShip as NothingToShip
from orchestrator.handoff.primerl.handoff_format import PRIME_RL_FORMAT as PRIME_RL_FORMAT
from orchestrator.handoff.primerl.handoff_format import PrimeRLFormat as PrimeRLFormat
from orchestrator.handoff.primerl.micro_batches import MicroBatchArrays as MicroBatchArrays
from orchestrator.handoff.primerl.micro_batches import PackedSample as PackedSample
from orchestrator.handoff.primerl.micro_batches import pack_step as pack_step
from orchestrator.handoff.primerl.rank_file import MicroBatch as MicroBatch
from orchestrator.handoff.primerl.rank_file import RoutedExperts as RoutedExperts
from orchestrator.handoff.primerl.rank_file import decode_rank_file as decode_rank_file
from orchestrator.handoff.primerl.rank_file import encode_rank_file as encode_rank_file
from orchestrator.handoff.primerl.reader import PrimeRLStepRead as PrimeRLStepRead
from orchestrator.handoff.primerl.reader import ranks_ready as ranks_ready
from orchestrator.handoff.primerl.reader import read_primerl_step as read_primerl_step
from orchestrator.handoff.primerl.store import MANIFEST_FILE as MANIFEST_FILE
from orchestrator.handoff.primerl.store import MANIFEST_FORMAT as MANIFEST_FORMAT
from orchestrator.handoff.primerl.store import PrimeRLStep as PrimeRLStep
from orchestrator.handoff.primerl.store import (
    is_complete_primerl_step as is_complete_primerl_step,
)
from orchestrator.handoff.primerl.store import primerl_step_dir as primerl_step_dir
from orchestrator.handoff.primerl.store import publish_primerl_step as publish_primerl_step
from orchestrator.handoff.primerl.store import rank_file_name as rank_file_name
from orchestrator.handoff.primerl.store import shipped_primerl_steps as shipped_primerl_steps
from orchestrator.handoff.primerl.store import (
    unfinished_primerl_steps as unfinished_primerl_steps,
)

__all__ = [
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "PRIME_RL_FORMAT",
    "MicroBatch",
    "MicroBatchArrays",
    "NothingToShip",
    "PackedSample",
    "PrimeRLFormat",
    "PrimeRLStep",
    "PrimeRLStepRead",
    "RoutedExperts",
    "decode_rank_file",
    "encode_rank_file",
    "is_complete_primerl_step",
    "pack_step",
    "primerl_step_dir",
    "publish_primerl_step",
    "rank_file_name",
    "ranks_ready",
    "read_primerl_step",
    "shipped_primerl_steps",
    "unfinished_primerl_steps",
]

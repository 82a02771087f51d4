"""The hand-off to prime-rl's trainer: each step packed into micro batches per data rank
and written as `rollouts/step_N/rank_R.bin` (docs/protocol.md § The prime-rl hand-off)."""

from orchestrator.handoff.primerl.micro_batches import MicroBatchArrays as MicroBatchArrays
from orchestrator.handoff.primerl.micro_batches import PackedSample as PackedSample
from orchestrator.handoff.primerl.micro_batches import pack_step as pack_step
from orchestrator.handoff.primerl.rank_file import MicroBatch as MicroBatch
from orchestrator.handoff.primerl.rank_file import RoutedExperts as RoutedExperts
from orchestrator.handoff.primerl.rank_file import decode_rank_file as decode_rank_file
from orchestrator.handoff.primerl.rank_file import encode_rank_file as encode_rank_file

__all__ = [
    "MicroBatch",
    "MicroBatchArrays",
    "PackedSample",
    "RoutedExperts",
    "decode_rank_file",
    "encode_rank_file",
    "pack_step",
]

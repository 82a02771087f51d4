"""prime-rl's hand-off as a `HandoffFormat`: `<rollouts_dir>/step_7/rank_R.bin` per data rank.

Ships with `publish_primerl_step` (the routing rows read from the payload files while the
step is written; a sample whose payload cannot be read is dropped), lists with
`shipped_primerl_steps`, refuses to resume over step directories it did not write for
this many ranks, and reads a step as prime-rl's trainer does (`read_primerl_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from orchestrator.core.rollouts import TrainSample
from orchestrator.errors import UserError
from orchestrator.handoff.contract import HandoffSettings, Shipment, StepProblem, StepRead
from orchestrator.handoff.dropped import DroppedSample
from orchestrator.handoff.primerl.reader import ranks_ready, read_primerl_step
from orchestrator.handoff.primerl.store import (
    MANIFEST_FILE,
    primerl_step_dir,
    publish_primerl_step,
    shipped_primerl_steps,
    unfinished_primerl_steps,
)
from orchestrator.handoff.step_dirs import StepLayout

__all__ = ["PRIME_RL_FORMAT", "PrimeRLFormat"]


class PrimeRLFormat:
    """prime-rl's `list[MicroBatch]` per data rank (docs/protocol.md § The prime-rl
    hand-off)."""

    name = "prime-rl"
    # prime-rl's trainer publishes its weights as broadcasts/step_N/STABLE.
    weights_layout: StepLayout | None = "prime-rl"

    def describe(self, settings: HandoffSettings) -> str:
        return (
            f"prime-rl micro batches (step_7/rank_R.bin for {settings.data_world_size} data "
            f"rank(s), {settings.seq_len} tokens each)"
        )

    def check(self, settings: HandoffSettings) -> str | None:
        if settings.weights_layout != self.weights_layout:
            return (
                f'requires trainer.weights_layout = "{self.weights_layout}" (got '
                f'"{settings.weights_layout}"): prime-rl\'s trainer publishes its weights '
                "as broadcasts/step_N/STABLE"
            )
        return None

    def ship(
        self, settings: HandoffSettings, step: int, samples: Sequence[TrainSample]
    ) -> Shipment:
        shipped = publish_primerl_step(
            settings.batches_dir,
            step,
            samples,
            data_world_size=settings.data_world_size,
            seq_len=settings.seq_len,
            env_name=settings.env_name,
            fsync=settings.fsync,
        )
        return Shipment(shipped.path, shipped.samples, shipped.dropped, shipped.micro_batches)

    def shipped_steps(self, settings: HandoffSettings) -> list[int]:
        return shipped_primerl_steps(settings.batches_dir, settings.data_world_size)

    def refuse_resume(self, settings: HandoffSettings) -> None:
        """Refuse step directories this daemon did not write in full for
        `data_world_size` ranks: another orchestrator's, or another number of ranks'."""
        rollouts_dir, ranks = settings.batches_dir, settings.data_world_size
        unfinished = unfinished_primerl_steps(rollouts_dir, ranks)
        if unfinished:
            raise UserError(
                f"{rollouts_dir}/step_{unfinished[0]} is not a step this daemon shipped for "
                f"trainer.data_world_size = {ranks} (it lacks {MANIFEST_FILE} or a "
                f"rank_R.bin; {len(unfinished)} such step(s)): written by another "
                "orchestrator, or for another number of data ranks; point "
                "trainer.batches_dir at a fresh rollouts directory (or remove them)"
            )

    def step_dir(self, settings: HandoffSettings, step: int) -> Path:
        return primerl_step_dir(settings.batches_dir, step)

    def is_step_shipped(self, settings: HandoffSettings, step_dir: Path) -> bool:
        # What prime-rl's ranks wait for: their rank files, not the manifest.
        return ranks_ready(settings.data_world_size, step_dir)

    def read_step(
        self, settings: HandoffSettings, step_dir: Path, step: int, *, verify: bool
    ) -> StepRead:
        """Decode every rank file and check it against the manifest; the samples the
        daemon dropped before shipping (the manifest's `dropped`) are reported dropped."""
        read = read_primerl_step(step_dir, step, settings.data_world_size, verify=verify)
        problems = list(read.problems)
        dropped = []
        for entry in read.dropped:
            try:
                dropped.append(DroppedSample(**entry))
            except TypeError as exc:
                problems.append(
                    StepProblem("bad_batch", str(step_dir), f"malformed dropped entry: {exc}")
                )
        return StepRead(read.samples, read.payload_bytes, tuple(problems), tuple(dropped))


PRIME_RL_FORMAT = PrimeRLFormat()

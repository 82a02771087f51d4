"""The two batch formats the daemon ships in (`[trainer] format`), and what "shipped"
means for each.

- "native", ours: `<batches_dir>/step_000007/batch.bin` (`orchestrator.handoff.store`),
  one file a trainer of this project reads with `read_batch`;
- "prime-rl": prime-rl's trainer's own input, `<rollouts_dir>/step_7/rank_R.bin` per data
  rank and a manifest (`orchestrator.handoff.primerl.store`).

Either way the complete step directories on disk are the truth about what was shipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

BatchFormat = Literal["native", "prime-rl"]
BATCH_FORMATS: tuple[BatchFormat, ...] = get_args(BatchFormat)


def shipped_steps_in(
    batches_dir: Path, *, batch_format: BatchFormat = "native", data_world_size: int = 1
) -> list[int]:
    """The shipped steps in `batches_dir` in `batch_format`, sorted (`shipped_steps`, or
    `shipped_primerl_steps` with `data_world_size` rank files). A missing directory holds
    none. Raises OSError when it cannot be listed, ValueError for an unknown format."""
    from orchestrator.handoff.primerl.store import shipped_primerl_steps
    from orchestrator.handoff.store import shipped_steps

    if batch_format == "native":
        return shipped_steps(batches_dir)
    if batch_format == "prime-rl":
        return shipped_primerl_steps(batches_dir, data_world_size)
    raise ValueError(f"unknown batch format {batch_format!r} (one of {BATCH_FORMATS})")

"""What a trainer hand-off format is (`[trainer] format`): the one seam every caller uses.

A format ships a step of `TrainSample`s into a directory and is the only judge of what
it shipped there: the complete step directories on disk are the truth about "shipped".
Two exist, each in its own folder with its own face (`orchestrator.handoff.registry`
lists them):

- "native", ours: `<batches_dir>/step_000007/batch.bin` (`orchestrator.handoff.native`),
  one file a trainer of this project reads with `read_batch`;
- "prime-rl": prime-rl's trainer's own input, `<rollouts_dir>/step_7/rank_R.bin` per data
  rank and a manifest (`orchestrator.handoff.primerl`).

The daemon's shipping and start-up, the config's checks, `check-config` and the local
trainer ask the registry for a `HandoffFormat` by name and never compare names
themselves. A format sees only `HandoffSettings`, a value the config builds
(`Config.handoff_settings`), so nothing in the hand-off imports the config.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import attrs

from orchestrator.core.rollouts import TrainSample
from orchestrator.handoff.dropped import DroppedSample
from orchestrator.handoff.step_dirs import StepLayout

__all__ = [
    "HandoffFormat",
    "HandoffSettings",
    "Shipment",
    "StepProblem",
    "StepRead",
]


@attrs.frozen
class HandoffSettings:
    """What a format needs to know of the run, from the config's `[trainer]` (and
    `[env]`) values; the names are the config's keys, which a format's `check` names.

    `batches_dir` is where steps are shipped (`trainer.batches_dir`, resolved);
    `weights_layout` how the trainer names its versions; `data_world_size` the trainer's
    data-parallel ranks; `seq_len` the tokens a micro batch holds (`trainer.seq_len`
    resolved: `batch.max_seq_len` when 0 in the config; 0 here only where nothing is
    packed); `env_name` the environment the samples come from; `fsync` false skips the
    fsyncs (tests, benchmarks).
    """

    batches_dir: Path
    weights_layout: StepLayout = "native"
    data_world_size: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    seq_len: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    env_name: str = ""
    fsync: bool = True


@attrs.frozen
class Shipment:
    """A shipped step: its directory, the samples in it, those left out for an unreadable
    payload (a format that reads payloads when it ships, as prime-rl's does: the native
    trainer reads payloads itself), and the micro batches per data rank (None for a
    format without micro batches)."""

    path: Path
    samples: int
    dropped: tuple[DroppedSample, ...] = ()
    micro_batches: int | None = None


@attrs.frozen
class StepProblem:
    """One thing wrong with a shipped step, as its trainer would meet it: `kind`
    (`bad_batch`: a file of the step cannot be read; `bad_micro_batch`: a micro batch
    breaks a rule; `routing_mismatch`: routing rows differ from the payload files;
    `payload_missing`, `payload_corrupt`, `bad_payload`, `io_error`: a payload file cannot
    be read), the file concerned and a one-line message."""

    kind: str
    file: str
    message: str


@attrs.frozen
class StepRead:
    """What reading a shipped step as its trainer does found: the samples trained on,
    the payload bytes read, the problems (each one a violation of the hand-off), and the
    samples dropped for broken payload files (by the reader, or before shipping)."""

    samples: int
    payload_bytes: int
    problems: tuple[StepProblem, ...] = ()
    dropped: tuple[DroppedSample, ...] = ()


class HandoffFormat(Protocol):
    """A trainer hand-off format. Every method but `describe` and `check` may block (file
    I/O): call them from a worker thread in async code."""

    @property
    def name(self) -> str:
        """The `[trainer] format` value that selects it."""
        ...

    @property
    def weights_layout(self) -> StepLayout | None:
        """The layout its trainer publishes versions in, when the format fixes one."""
        ...

    def describe(self, settings: HandoffSettings) -> str:
        """What it ships, for `check-config`'s "ships:" line."""
        ...

    def check(self, settings: HandoffSettings) -> str | None:
        """Why it cannot ship with `settings`, completing "trainer.format = <name> ...",
        or None when it can."""
        ...

    def ship(
        self, settings: HandoffSettings, step: int, samples: Sequence[TrainSample]
    ) -> Shipment:
        """Ship step `step` of `samples` into `settings.batches_dir`, atomically.

        Raises `BatchExists` when the step was shipped already (nothing changed),
        `NothingToShip` when it dropped every sample (nothing written), ValueError for a
        step or samples it cannot ship, OSError when writing fails.
        """
        ...

    def shipped_steps(self, settings: HandoffSettings) -> list[int]:
        """The steps shipped in `settings.batches_dir`, sorted; a missing directory holds
        none. Raises OSError when it cannot be listed."""
        ...

    def refuse_resume(self, settings: HandoffSettings) -> None:
        """Raise `orchestrator.errors.UserError` when `settings.batches_dir` holds what
        this format would not have written and cannot resume over."""
        ...

    def step_dir(self, settings: HandoffSettings, step: int) -> Path:
        """The directory step `step` is shipped as."""
        ...

    def is_step_shipped(self, settings: HandoffSettings, step_dir: Path) -> bool:
        """Whether its trainer may read `step_dir` now (what it waits for)."""
        ...

    def read_step(
        self, settings: HandoffSettings, step_dir: Path, step: int, *, verify: bool
    ) -> StepRead:
        """Read the shipped step in `step_dir` as its trainer does (every payload byte,
        digests checked with `verify`); every problem is reported, none raised."""
        ...

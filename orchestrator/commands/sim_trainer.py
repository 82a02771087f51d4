"""`orchestrator sim-trainer --config FILE [--set KEY=VALUE ...] [--weights-layout LAYOUT]
[--format FORMAT] [--data-world-size N]`: the local trainer.

Reads each batch the orchestrator ships (every payload byte, digests verified), then
publishes the next version, until `max_steps` (0: until SIGINT/SIGTERM). Versions are
published in the config's `trainer.weights_layout` unless `--weights-layout` says
otherwise ("prime-rl": `step_7/STABLE`, as prime-rl's trainer writes them). It reads the
config's `trainer.format` unless `--format` says otherwise: "prime-rl" stands in for
prime-rl's trainer, reading `step_N/rank_R.bin` for `trainer.data_world_size` ranks
(`--data-world-size`), and publishes in the "prime-rl" layout. Logs one line
per step on stderr and keeps `<run_dir>/trainer/report.json` up to date. A sample with a
corrupt payload is dropped (logged with its rollout and server) and the rest of its batch
trained on. Exit status: 0 when no batch violated the hand-off (dropped corrupt samples
included), 1 when one did (a missing payload file, a malformed batch), 2 for bad input.
"""

from __future__ import annotations

import argparse
import signal
from typing import TYPE_CHECKING

from orchestrator.errors import UserError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from orchestrator.sim.trainer import SimTrainerConfig, TrainerStats

HELP = "run the local trainer: read each shipped batch's payloads, then publish a version"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--config FILE`, any number of `--set KEY=VALUE`, `--weights-layout`, `--format`,
    `--data-world-size`, `--log-json`."""
    from orchestrator.config import add_config_arguments
    from orchestrator.handoff import STEP_LAYOUTS, format_names

    add_config_arguments(parser)
    parser.add_argument(
        "--weights-layout",
        choices=STEP_LAYOUTS,
        default=None,
        help=(
            "name the published versions' directories step_000007 (native) or step_7"
            " (prime-rl); default: the config's trainer.weights_layout"
        ),
    )
    parser.add_argument(
        "--format",
        choices=format_names(),
        default=None,
        help=(
            "read native batches (step_000007/batch.bin) or prime-rl's step_7/rank_R.bin,"
            " publishing step_7/STABLE; default: the config's trainer.format"
        ),
    )
    parser.add_argument(
        "--data-world-size",
        type=_positive_int,
        default=None,
        metavar="N",
        help="prime-rl format: the data ranks to read; default: trainer.data_world_size",
    )
    parser.add_argument("--log-json", action="store_true", help="JSON log lines on stderr")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    """Train until `max_steps` or a signal; return 1 if any violation was seen, else 0.

    Raises `UserError` (ConfigError) for a bad config, and for a batches, weights or
    report directory that cannot be created or written.
    """
    import structlog
    import trio

    from orchestrator.config import config_from_args
    from orchestrator.logs import configure_logging
    from orchestrator.sim.fleet import sim_trainer_config

    trainer_config = _with_flags(sim_trainer_config(config_from_args(args)), args)
    configure_logging(json_lines=True if args.log_json else None)
    try:
        stats = trio.run(_train_until_done_or_signal, trainer_config)
    except (OSError, BaseExceptionGroup) as exc:
        os_error = _only_os_error(exc)
        if os_error is None:
            raise
        raise UserError(f"local trainer: {os_error}") from None
    if stats is None:
        return 0
    structlog.get_logger("orchestrator.sim.trainer").info(
        "trainer stopped",
        steps=stats.steps,
        last_step=stats.last_step,
        samples=stats.samples,
        dropped=len(stats.dropped),
        payload_bytes=stats.payload_bytes,
        violations=len(stats.violations),
        report=str(trainer_config.report_path),
    )
    return 1 if stats.violations else 0


def _with_flags(config: SimTrainerConfig, args: argparse.Namespace) -> SimTrainerConfig:
    """The config's trainer settings with the command line's flags applied. `--format F`
    publishes in the weights layout F's trainer uses when F fixes one ("prime-rl" does)
    unless `--weights-layout` is given. Raises UserError for a combination the trainer
    refuses."""
    import attrs

    from orchestrator.handoff import handoff_format

    batch_format = config.format if args.format is None else args.format
    layout = config.weights_layout
    if args.format is not None:
        layout = handoff_format(args.format).weights_layout or layout
    if args.weights_layout is not None:
        layout = args.weights_layout
    ranks = config.data_world_size if args.data_world_size is None else args.data_world_size
    try:
        return attrs.evolve(
            config, format=batch_format, weights_layout=layout, data_world_size=ranks
        )
    except ValueError as exc:
        raise UserError(f"sim-trainer: {exc}") from None


async def _train_until_done_or_signal(config: SimTrainerConfig) -> TrainerStats | None:
    """Run the trainer until it returns or a signal comes; None if stopped before it started."""
    import trio

    from orchestrator.sim.trainer import serve_trainer

    async def train_then_stop(*, task_status: trio.TaskStatus[TrainerStats]) -> None:
        await serve_trainer(config, task_status=task_status)
        nursery.cancel_scope.cancel()

    async def stop_on_signal(signals: AsyncIterator[int]) -> None:
        async for _ in signals:
            # Work in a worker thread (a read, a publish) completes before the trainer
            # stops: a version is never half-published.
            nursery.cancel_scope.cancel()
            return

    stats: TrainerStats | None = None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_on_signal, signals)
            stats = await nursery.start(train_then_stop)
    return stats


def _only_os_error(exc: BaseException) -> OSError | None:
    """The OSError `exc` is or wraps (through nested groups) alone, else None."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, OSError) else None

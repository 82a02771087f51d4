"""`orchestrator sim-trainer --config FILE [--set KEY=VALUE ...] [--weights-layout LAYOUT]`:
the local trainer.

Reads each batch the orchestrator ships (every payload byte, digests verified), then
publishes the next version, until `max_steps` (0: until SIGINT/SIGTERM). Versions are
published in the config's `trainer.weights_layout` unless `--weights-layout` says
otherwise ("prime-rl": `step_7/STABLE`, as prime-rl's trainer writes them). Logs one line
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
    """`--config FILE`, any number of `--set KEY=VALUE`, `--weights-layout`, `--log-json`."""
    from orchestrator.config import add_config_arguments
    from orchestrator.handoff import STEP_LAYOUTS

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
    parser.add_argument("--log-json", action="store_true", help="JSON log lines on stderr")


def run(args: argparse.Namespace) -> int:
    """Train until `max_steps` or a signal; return 1 if any violation was seen, else 0.

    Raises `UserError` (ConfigError) for a bad config, and for a batches, weights or
    report directory that cannot be created or written.
    """
    import attrs
    import structlog
    import trio

    from orchestrator.config import config_from_args
    from orchestrator.logs import configure_logging
    from orchestrator.sim.fleet import sim_trainer_config

    trainer_config = sim_trainer_config(config_from_args(args))
    if args.weights_layout is not None:
        trainer_config = attrs.evolve(trainer_config, weights_layout=args.weights_layout)
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

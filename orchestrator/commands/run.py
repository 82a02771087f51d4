"""`orchestrator run --config FILE [--set key=value ...]`: the daemon.

Start-up checks everything that can fail before anything on disk changes
(`orchestrator.daemon.preflight`). SIGINT and SIGTERM are caught from the first line of `run`
on: a signal during start-up stops the run there, the first one while running stops it
gracefully within `shutdown.grace_s`, a second one stops it at once (`orchestrator.daemon.stop`).
Every end prints the summary; docs/operations.md § Signals has the exit codes.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from types import FrameType

HELP = "run the orchestrator daemon (with the local fleet and trainer when [sim] asks)"

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from orchestrator.config import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument(
        "--summary-json",
        metavar="FILE",
        help="also write the end-of-run summary as JSON to FILE",
    )


class _EarlySignals:
    """Plain handlers that only record SIGINT/SIGTERM, for the time before trio's receiver
    takes over (imports, config, start-up checks) and after it gives them back: a signal
    then is acted on as soon as the run can, instead of killing the process silently."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous = {signum: signal.signal(signum, self._record) for signum in STOP_SIGNALS}

    def restore(self) -> None:
        """Give the signals back to the handlers they had (the command is over)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signum)

    def take(self) -> list[int]:
        taken, self.received[:] = list(self.received), []
        return taken


def run(args: argparse.Namespace) -> int:
    early = _EarlySignals()
    try:
        return _run(args, early)
    finally:
        early.restore()


def _run(args: argparse.Namespace, early: _EarlySignals) -> int:
    import trio

    from orchestrator.commands.launch import launch_run
    from orchestrator.commands.summary import (
        check_invariants,
        invariants_hold,
        render_summary,
        summary_data,
    )
    from orchestrator.config import config_from_args
    from orchestrator.daemon import RunOutcome, Stop
    from orchestrator.daemon.inference.server_pool import InferenceUnavailable
    from orchestrator.daemon.preflight import preflight
    from orchestrator.daemon.run_totals import run_totals
    from orchestrator.logs import configure_logging

    config = config_from_args(args)
    configure_logging()

    async def main() -> tuple[RunOutcome, Stop]:
        stop = Stop(grace_s=config.shutdown.grace_s)
        with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
            for signum in early.take():
                stop.request(signal.Signals(signum).name)
            async with trio.open_nursery() as nursery:

                async def watch_signals() -> None:
                    async for signum in signals:
                        stop.request(signal.Signals(signum).name)

                nursery.start_soon(watch_signals)
                outcome = await launch_run(
                    config, stop=stop, metrics_sockets=checked.metrics_sockets
                )
                nursery.cancel_scope.cancel()
        return outcome, stop

    from orchestrator.handoff.trainer_report import REPORT_PATH

    with preflight(config) as checked:
        try:
            outcome, stop = trio.run(main)
        except BaseExceptionGroup as group:
            unavailable, rest = group.split(InferenceUnavailable)
            if unavailable is None or rest is not None:
                raise
            print(f"orchestrator run: error: {_first_leaf(unavailable)}", file=sys.stderr)
            return 1
    stopped = outcome.stopped
    invariants = check_invariants(
        handoff=config.handoff,
        settings=config.handoff_settings,
        payload_root=config.payload_root,
        trainer_report=config.run_dir / REPORT_PATH,
        last_step=outcome.state.shipping.last_shipped,
        bound=outcome.state.versions.collected_below,
        stopped=stopped,
    )
    data = summary_data(
        run_totals(outcome.state, outcome.sink),
        invariants,
        duration_s=outcome.duration_s,
        first_step=outcome.first_step,
        evaluation=outcome.state.evaluation,
        cpu_s=outcome.cpu_s,
        # The worker processes that ended (all of them, once the run's tasks closed).
        workers_cpu_s=_children_cpu_s(),
    )
    data["stopped_by"] = stop.reason if stopped else None
    data["forced_by"] = stop.forced_by if stopped else None
    print(render_summary(data), file=sys.stderr)
    if args.summary_json:
        with open(args.summary_json, "w") as out:
            json.dump(data, out, indent=1)
    halt = outcome.state.dispatch.halt_reason
    if halt is not None:
        # The run ended itself: a configuration fault (a server started without what the
        # run needs, a wrong key), or rollouts that keep finishing with nothing trainable
        # (the task solved, or never rewarded, or every reward failing). It stopped as if
        # asked, and says why last.
        print(f"orchestrator run: {halt.line}", file=sys.stderr)
        return 2
    if not invariants_hold(data):
        return 1
    if stopped and stop.forced_by is not None:
        # The graceful part was cut short: say so to whoever waits for the exit status.
        return 128 + signal.Signals[stop.forced_by].value
    return 0


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first

"""`orchestrator run --config FILE [--set key=value ...]`: the daemon."""

from __future__ import annotations

import argparse
import json
import signal
import sys

HELP = "run the orchestrator daemon (with the local fleet and trainer when [sim] asks)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from orchestrator.config import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument(
        "--summary-json",
        metavar="FILE",
        help="also write the end-of-run summary as JSON to FILE",
    )


def run(args: argparse.Namespace) -> int:
    import structlog
    import trio

    from orchestrator.config import config_from_args
    from orchestrator.daemon import RunOutcome, run_daemon
    from orchestrator.logs import configure_logging
    from orchestrator.progress import hold_run_lock
    from orchestrator.server_pool import InferenceUnavailable
    from orchestrator.summary import (
        check_invariants,
        invariants_hold,
        render_summary,
        summary_data,
    )

    config = config_from_args(args)
    configure_logging()
    log = structlog.get_logger("orchestrator")

    async def main() -> RunOutcome | None:
        outcome: RunOutcome | None = None
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def daemon() -> None:
                    nonlocal outcome
                    outcome = await run_daemon(config)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(daemon)
                async for signum in signals:
                    log.info("stopping", signal=signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break
        return outcome

    with hold_run_lock(config.state_dir):
        try:
            outcome = trio.run(main)
        except BaseExceptionGroup as group:
            unavailable, rest = group.split(InferenceUnavailable)
            if unavailable is None or rest is not None:
                raise
            print(f"orchestrator run: error: {_first_leaf(unavailable)}", file=sys.stderr)
            return 1
    if outcome is None:
        log.info("stopped before the end of the run; start it again to resume")
        return 0
    invariants = check_invariants(
        batches_dir=config.batches_dir,
        payload_root=config.payload_root,
        trainer_report=config.run_dir / "trainer" / "report.json",
        last_step=outcome.state.next_step - 1,
        bound=outcome.state.bound,
    )
    data = summary_data(
        outcome.state,
        dict(outcome.sink.counters),
        invariants,
        duration_s=outcome.duration_s,
        first_step=outcome.first_step,
    )
    print(render_summary(data), file=sys.stderr)
    if args.summary_json:
        with open(args.summary_json, "w") as out:
            json.dump(data, out, indent=1)
    return 0 if invariants_hold(data) else 1


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first

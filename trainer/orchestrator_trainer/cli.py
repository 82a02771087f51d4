"""`orchestrator-trainer --config FILE [--set KEY=VALUE ...]`: train on the run's batches.

Reads the run's own config file (the one the daemon runs with): where batches are
shipped and versions published, the model folder (`[model] path`), the trainer's keys
(`[train]`). Trains until `max_steps` versions are published (0: until SIGINT or
SIGTERM, which stop it between steps: a version is never half-published). Exit status
0 when done or stopped, 2 with one line for bad input.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import NoReturn

from orchestrator.errors import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from orchestrator.config import add_config_arguments

    parser = _Parser(
        prog="orchestrator-trainer",
        description="Train on the batches a rollout-orchestrator run ships, publishing a "
        "full checkpoint per version (router replay for Qwen3-MoE and Mixtral).",
    )
    add_config_arguments(parser)
    parser.add_argument("--log-json", action="store_true", help="JSON log lines on stderr")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    try:
        from orchestrator.config import config_from_args
        from orchestrator.logs import configure_logging

        config = config_from_args(args)
        configure_logging(json_lines=True if args.log_json else None)
        from orchestrator_trainer.loop import log, train

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)
        last = train(config, stop=lambda: stopping)
    except UserError as exc:
        print(f"orchestrator-trainer: error: {exc}", file=sys.stderr)
        return 2
    log.info("trainer stopped", version=last)
    return 0


if __name__ == "__main__":
    sys.exit(main())

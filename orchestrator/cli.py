"""The `orchestrator` command: a thin dispatcher over one module per subcommand.

Each subcommand lives in `orchestrator.commands.<name>` and defines `HELP` (one line),
`add_arguments(parser)` and `run(args) -> int`. Every module is imported to build the
parser, so their top-level imports stay light: heavy imports go inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import NoReturn

from orchestrator.errors import UserError

SUBCOMMANDS: dict[str, str] = {
    "run": "orchestrator.commands.run",
    "gc": "orchestrator.commands.gc",
    "status": "orchestrator.commands.status",
    "report": "orchestrator.commands.report",
    "check-config": "orchestrator.commands.check_config",
    "sim-inference": "orchestrator.commands.sim_inference",
    "sim-trainer": "orchestrator.commands.sim_trainer",
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _available() -> dict[str, str]:
    """The subcommands whose module exists in this build."""
    return {
        name: module
        for name, module in SUBCOMMANDS.items()
        if importlib.util.find_spec(module) is not None
    }


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="orchestrator",
        description="Asynchronous RL rollout orchestrator with a versioned payload collector.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name, module_name in _available().items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args._run(args)
    except (UserError, BaseExceptionGroup) as exc:
        user_error = _only_user_error(exc)
        if user_error is None:
            raise
        print(f"orchestrator {args.command}: error: {user_error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `orchestrator status | head`: the reader went away; that is not an error.
        _silence_stdout()
        return 0
    return code


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _only_user_error(exc: BaseException) -> UserError | None:
    """The UserError behind `exc`, also when trio wrapped it in exception groups.

    None when anything else is in the group: that is a bug and keeps its traceback.
    """
    if isinstance(exc, UserError):
        return exc
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return _only_user_error(exc.exceptions[0])
    return None


if __name__ == "__main__":
    sys.exit(main())

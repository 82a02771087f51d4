"""`orchestrator check-config FILE [--set KEY=VALUE ...]`: validate a config, print it resolved."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from orchestrator.config import Config, add_config_arguments, config_from_args, config_to_toml

if TYPE_CHECKING:
    from orchestrator.daemon.inference.credentials import BearerToken

HELP = "validate a config file and print it resolved, with its derived values"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """FILE (positional), any number of `--set KEY=VALUE` overrides, and `--probe`."""
    add_config_arguments(parser, positional=True)
    parser.add_argument(
        "--probe",
        action="store_true",
        help="also ask each [inference] urls server for /health and /v1/models (2 s each) "
        "and say what it found, one line per server; exit 2 when one cannot serve the run",
    )


def run(args: argparse.Namespace) -> int:
    """Print the resolved config as TOML (exit 0). A bad config raises ConfigError, and
    real tasks that do not load (a dataset, a column, the tokenizer, a reward function)
    or a bearer token that cannot be read raise UserError: one line, exit 2. With
    `--probe`, a line per server on stderr, and exit 2 (nothing on stdout) when a
    server cannot serve the run."""
    from orchestrator.daemon.inference.credentials import load_bearer_token
    from orchestrator.logs import configure_logging
    from orchestrator.tasks.build import check_tasks

    config = config_from_args(args)
    # Standard output is the resolved config alone and an error is one line on stderr:
    # what the trial's reward pool logs on its way (a worker killed at its end on a busy
    # machine) is not shown; the trial's findings are the report's lines or the error.
    configure_logging(level=logging.CRITICAL)
    token = load_bearer_token(config.inference)
    tried = check_tasks(config)
    if args.probe and not probe(config, token):
        return 2
    sys.stdout.write(derived_values_comment(config, token, tried) + "\n" + config_to_toml(config))
    return 0


def probe(config: Config, token: BearerToken | None) -> bool:
    """`--probe`: one line per server on stderr (an error line for each that cannot serve
    the run); whether all can."""
    from orchestrator.commands.probe import probe_servers
    from orchestrator.handoff.progress import load_progress

    inference = config.inference
    if not inference.urls:
        local = config.sim.inference_servers
        print(f"probe: no [inference] urls (the run starts {local} local servers)", file=sys.stderr)
        return True
    settings = config.handoff_settings
    shipped = settings.batches_dir.exists() and config.handoff.shipped_steps(settings)
    fresh = not shipped and load_progress(config.state_dir) is None
    results = probe_servers(
        inference.urls,
        model=inference.model,
        authorization=None if token is None else token.authorization,
        fresh=fresh,
    )
    for result in results:
        prefix = "" if result.ok else "orchestrator check-config: error: "
        print(prefix + result.line, file=sys.stderr)
    return all(result.ok for result in results)


def derived_values_comment(
    config: Config, token: BearerToken | None = None, tried: Sequence[str] = ()
) -> str:
    """TOML comment lines with what the daemon derives from the config, and why; with
    the bearer token read from where the config says (never the token itself), and what
    the trial of the tasks scored (`tried`, `check_tasks`)."""
    mode = "by handle" if config.by_handle else "inline"
    inference = config.inference
    ships = config.handoff.describe(config.handoff_settings)
    lines = [
        "# Resolved config (every key, defaults included); derived values:",
        f"#   payload mode: {mode} ({config.payload_mode_reason})",
        f"#   payload root: {config.payload_root}",
        f"#   batches_dir:  {config.batches_dir}",
        f"#   weights_dir:  {config.weights_dir}",
        f"#   ships:        {ships}",
        f"#   state_dir:    {config.state_dir}",
        f"#   reply cap:    {config.max_reply_bytes} bytes ({_how(inference.max_reply_bytes)})",
        f"#   reply budget: {config.max_buffered_reply_bytes} bytes "
        f"({_how(inference.max_buffered_reply_bytes)})",
        f"#   bearer token: {'none' if token is None else f'read from {token.source}'}",
    ]
    lines += [f"#   tried:        {line}" for line in tried]
    return "\n".join(lines) + "\n"


def _how(configured: int) -> str:
    return "set" if configured else "derived"

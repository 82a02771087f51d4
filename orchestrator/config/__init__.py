"""The run's configuration: a TOML file (plus `--set` overrides) as frozen, validated values.

`load_config` reads the file, applies the overrides and builds a `Config`; every problem
(a misspelt key, a wrong type, an impossible value, a rule across keys) is a ConfigError
whose message is one line naming the file and the dotted key. The sections and their
rules live in `orchestrator.config.sections` (with `checks`, `converter`, `errors`,
`sources`, `reply_limits`, and `toml` for writing it back); this module is the public face.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from cattrs.errors import BaseValidationError

from orchestrator.config.converter import make_config_converter
from orchestrator.config.errors import ConfigError, InvalidValue, first_problem
from orchestrator.config.sections import SIM_VLLM_VERSION as SIM_VLLM_VERSION
from orchestrator.config.sections import BatchConfig as BatchConfig
from orchestrator.config.sections import Config as Config
from orchestrator.config.sections import EnvConfig as EnvConfig
from orchestrator.config.sections import EvalConfig as EvalConfig
from orchestrator.config.sections import FinalTokenRoute as FinalTokenRoute
from orchestrator.config.sections import InferenceConfig as InferenceConfig
from orchestrator.config.sections import MetricsConfig as MetricsConfig
from orchestrator.config.sections import ModelConfig as ModelConfig
from orchestrator.config.sections import PayloadConfig as PayloadConfig
from orchestrator.config.sections import PayloadField as PayloadField
from orchestrator.config.sections import PayloadMode as PayloadMode
from orchestrator.config.sections import ProgressConfig as ProgressConfig
from orchestrator.config.sections import RewardsConfig as RewardsConfig
from orchestrator.config.sections import ShutdownConfig as ShutdownConfig
from orchestrator.config.sections import SimConfig as SimConfig
from orchestrator.config.sections import StalenessConfig as StalenessConfig
from orchestrator.config.sections import ToyEnvName as ToyEnvName
from orchestrator.config.sections import TrainConfig as TrainConfig
from orchestrator.config.sections import TrainerConfig as TrainerConfig
from orchestrator.config.sections import WandbConfig as WandbConfig
from orchestrator.config.sources import (
    Override,
    apply_overrides,
    parse_override,
    read_toml_file,
)
from orchestrator.config.toml import config_to_toml as config_to_toml

__all__ = [
    "SIM_VLLM_VERSION",
    "BatchConfig",
    "Config",
    "ConfigError",
    "EnvConfig",
    "EvalConfig",
    "FinalTokenRoute",
    "InferenceConfig",
    "MetricsConfig",
    "ModelConfig",
    "PayloadConfig",
    "PayloadField",
    "PayloadMode",
    "ProgressConfig",
    "RewardsConfig",
    "ShutdownConfig",
    "SimConfig",
    "StalenessConfig",
    "ToyEnvName",
    "TrainConfig",
    "TrainerConfig",
    "WandbConfig",
    "add_config_arguments",
    "config_from_args",
    "config_to_toml",
    "load_config",
]

_CONVERTER = make_config_converter()


def load_config(path: Path, overrides: Sequence[str] = ()) -> Config:
    """Read the TOML file at `path`, apply `--set` overrides (`KEY=VALUE`), build a Config.

    Relative paths resolve against the current directory. Raises ConfigError, one line
    naming the file and the dotted key, for a missing or unreadable file, invalid TOML, a
    malformed override, an unknown key, a value of the wrong type or an impossible value.
    """
    parsed = [parse_override(text) for text in overrides]
    document = apply_overrides(read_toml_file(path), parsed, source=path)
    if isinstance(document.get("env"), dict):
        raise ConfigError(
            f"{path}: [env] is a single table: environments are [[env]] entries now (a "
            "dataset with reward functions each); the simulator's toy environment and its "
            "keys moved to [sim] (env, prompt_len_min, prompt_len_max, max_tokens, "
            "max_turns), the curriculum to [batch]"
        )
    try:
        return _CONVERTER.structure(document, Config)
    except (BaseValidationError, InvalidValue) as exc:
        problem = first_problem(exc, Config)
        raise ConfigError(f"{_origin(path, problem.key, parsed)}: {problem.message}") from None


def _origin(path: Path, key: str, overrides: Sequence[Override]) -> str:
    """The file, or the file and the `--set` that supplied `key`."""
    for override in reversed(overrides):
        if key == override.key or key.startswith((f"{override.key}.", f"{override.key}[")):
            return f"{path} (--set {override.key})"
    return str(path)


def add_config_arguments(parser: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """Add `--config FILE` (required) and repeatable `--set KEY=VALUE` to `parser`.

    With `positional=True` the file is a positional `FILE` argument instead (check-config).
    Either way it lands in `args.config`, and the overrides in `args.overrides`.
    """
    file_help = "the run's TOML config file"
    if positional:
        parser.add_argument("config", metavar="FILE", type=Path, help=file_help)
    else:
        parser.add_argument("--config", metavar="FILE", type=Path, required=True, help=file_help)
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help=(
            "override a config key with a TOML value, e.g. --set staleness.max_off_policy_steps=3"
            ' or --set inference.urls=["http://a:8000"]; a bare word is a string (repeatable)'
        ),
    )


def config_from_args(args: argparse.Namespace) -> Config:
    """The Config named by arguments added with `add_config_arguments`; raises ConfigError."""
    overrides: list[str] = args.overrides
    return load_config(Path(args.config), overrides)

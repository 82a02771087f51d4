"""The run's configuration: a TOML file (plus `--set` overrides) as frozen, validated values.

`load_config` reads the file, applies the overrides and builds a `Config`; every problem
(a misspelt key, a wrong type, an impossible value, a rule across keys) is a ConfigError
whose message is one line naming the file and the dotted key. The sections and their
rules live in `_config_sections`; this module is the public face.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Sequence
from pathlib import Path

import attrs
from cattrs.errors import BaseValidationError

from orchestrator._config_converter import make_config_converter
from orchestrator._config_errors import ConfigError, InvalidValue, first_problem
from orchestrator._config_sections import BatchConfig as BatchConfig
from orchestrator._config_sections import Config as Config
from orchestrator._config_sections import EnvConfig as EnvConfig
from orchestrator._config_sections import EnvName as EnvName
from orchestrator._config_sections import FinalTokenRoute as FinalTokenRoute
from orchestrator._config_sections import InferenceConfig as InferenceConfig
from orchestrator._config_sections import MetricsConfig as MetricsConfig
from orchestrator._config_sections import PayloadConfig as PayloadConfig
from orchestrator._config_sections import PayloadField as PayloadField
from orchestrator._config_sections import PayloadMode as PayloadMode
from orchestrator._config_sections import ProgressConfig as ProgressConfig
from orchestrator._config_sections import ShutdownConfig as ShutdownConfig
from orchestrator._config_sections import SimConfig as SimConfig
from orchestrator._config_sections import StalenessConfig as StalenessConfig
from orchestrator._config_sections import TrainerConfig as TrainerConfig
from orchestrator._config_sources import (
    Override,
    apply_overrides,
    parse_override,
    read_toml_file,
)
from orchestrator._config_toml import format_toml_table

__all__ = [
    "BatchConfig",
    "Config",
    "ConfigError",
    "EnvConfig",
    "EnvName",
    "FinalTokenRoute",
    "InferenceConfig",
    "MetricsConfig",
    "PayloadConfig",
    "PayloadField",
    "PayloadMode",
    "ProgressConfig",
    "ShutdownConfig",
    "SimConfig",
    "StalenessConfig",
    "TrainerConfig",
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


def config_to_toml(config: Config) -> str:
    """The config as TOML that `load_config` reads back to an equal Config.

    Every key is written, defaults included; a directory left to its default (None) is
    written as a comment saying what it resolves to.
    """
    top: dict[str, object] = {}
    tables: list[str] = []
    for field in attrs.fields(Config):
        value = getattr(config, field.name)
        if attrs.has(type(value)):
            section = typing.cast(attrs.AttrsInstance, value)
            tables.append(_section_to_toml(field.name, section, config))
        else:
            top[field.name] = value
    return "\n".join([format_toml_table("", top), *tables])


def _section_to_toml(name: str, section: attrs.AttrsInstance, config: Config) -> str:
    present: dict[str, object] = {}
    defaulted: list[str] = []
    for field in attrs.fields(type(section)):
        value = getattr(section, field.name)
        if value is None:
            defaulted.append(field.name)
        else:
            present[field.name] = value
    text = format_toml_table(name, present)
    resolved = {
        "root": config.payload_root,
        "batches_dir": config.batches_dir,
        "weights_dir": config.weights_dir,
    }
    for key in defaulted:
        text += f"# {key} is not set: it defaults to {resolved.get(key, 'nothing')}\n"
    return text

"""The config written as TOML (for `check-config`, and files that `load_config` reads back).

tomli-w writes the values. It writes no comments, so each table is written on its own and
followed by its comments: a directory left to its default is not a key (TOML has no null,
and a re-read file must keep following `run_dir`), but a comment saying where it resolves.
"""

from __future__ import annotations

from pathlib import Path, PurePath
from typing import Any

import attrs
import tomli_w

from orchestrator.config.sections import Config


def config_to_toml(config: Config) -> str:
    """The config as TOML that `load_config` reads back to an equal Config.

    Every key is written, defaults included; a directory left to its default (None) is
    written as a comment saying what it resolves to.
    """
    document = attrs.asdict(config, value_serializer=_toml_value)
    top = {
        key: _without_nones(value) for key, value in document.items() if not isinstance(value, dict)
    }
    tables = [
        _table_to_toml(name, table, config)
        for name, table in document.items()
        if isinstance(table, dict)
    ]
    return "\n".join([tomli_w.dumps(top), *tables])


def _table_to_toml(name: str, table: dict[str, Any], config: Config) -> str:
    defaults = _default_directories(config)
    present = {key: _without_nones(value) for key, value in table.items() if value is not None}
    comments = [
        f"# {key} is not set: it defaults to {defaults.get(f'{name}.{key}', 'nothing')}\n"
        for key, value in table.items()
        if value is None
    ]
    return tomli_w.dumps({name: present}) + "".join(comments)


def _without_nones(value: object) -> object:
    """An array of tables (`[[env]]`, `[[eval.env]]`) without its unset keys (TOML has
    no null)."""
    if isinstance(value, list | tuple) and all(isinstance(item, dict) for item in value):
        return [{k: v for k, v in item.items() if v is not None} for item in value]
    return value


def _default_directories(config: Config) -> dict[str, Path | str]:
    """What each optional key resolves to when it is not set."""
    follows = "the [model] tokenizer's" if config.model.tokenizer is not None else None
    vocab_size, eos = config.sim.tokens()
    return {
        "payload.root": config.payload_root,
        "trainer.batches_dir": config.batches_dir,
        "trainer.weights_dir": config.weights_dir,
        "sim.vocab_size": f"{follows} vocabulary size" if follows else str(vocab_size),
        "sim.eos_token_id": f"{follows} eos id" if follows else str(eos),
    }


def _toml_value(_: object, __: attrs.Attribute[Any] | None, value: object) -> object:
    # tomli-w writes strings, not paths (attrs.asdict has made tuples lists already).
    return str(value) if isinstance(value, PurePath) else value

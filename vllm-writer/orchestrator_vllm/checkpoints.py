"""What a checkpoint directory holds, read from its safetensors headers alone (pure
Python: no torch, no tensor data read), and whether it fits the model a server runs.

`POST /update_weights {"weight_dir"}` loads a directory only when `checkpoint_problem`
finds nothing wrong with it, so a missing, partial or mismatched checkpoint is refused
before any weight of the running model is touched, and the server keeps serving the
weights it had.

A safetensors file is an 8-byte little-endian header length, that many bytes of JSON
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then
the data; a file shorter than its header says is cut short (a copy still in progress).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping

#: A tensor as the header describes it: (dtype, shape).
TensorSpec = tuple[str, tuple[int, ...]]
Inventory = Mapping[str, TensorSpec]

#: The largest header this reader accepts (safetensors itself caps it at 100 MB).
MAX_HEADER_BYTES = 100 * 2**20
_STEP_NAME = re.compile(r"step_(\d+)")


class CheckpointProblem(Exception):
    """A checkpoint directory that cannot be loaded (one line)."""


def read_inventory(directory: str) -> dict[str, TensorSpec]:
    """Every tensor of the `*.safetensors` files in `directory`, by name. Raises
    `CheckpointProblem` when the directory is missing, holds no such file, a file is
    unreadable, malformed or shorter than its header says, or a name is in two files."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    except OSError as exc:
        raise CheckpointProblem(f"cannot list {directory}: {exc.strerror or exc}") from None
    if not names:
        raise CheckpointProblem(f"{directory} holds no *.safetensors file")
    inventory: dict[str, TensorSpec] = {}
    for name in names:
        for tensor, spec in _file_inventory(os.path.join(directory, name)).items():
            if tensor in inventory:
                raise CheckpointProblem(f"tensor {tensor} is in two files of {directory}")
            inventory[tensor] = spec
    return inventory


def _file_inventory(path: str) -> dict[str, TensorSpec]:
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            head = file.read(8)
            if len(head) < 8:
                raise CheckpointProblem(f"{path} is not a safetensors file (too short)")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointProblem(f"{path} is cut short or not a safetensors file")
            header = json.loads(file.read(length))
    except OSError as exc:
        raise CheckpointProblem(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError):
        raise CheckpointProblem(f"{path} has a malformed safetensors header") from None
    if not isinstance(header, dict):
        raise CheckpointProblem(f"{path} has a malformed safetensors header")
    data_bytes = size - 8 - length
    specs: dict[str, TensorSpec] = {}
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            spec = (str(dtype), tuple(int(d) for d in shape))
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise CheckpointProblem(f"{path} has a malformed entry for {tensor}") from None
        if not 0 <= begin <= end <= data_bytes:
            raise CheckpointProblem(
                f"{path} is cut short: {tensor} ends at byte {end} of {data_bytes}"
            )
        specs[tensor] = spec
    return specs


def checkpoint_problem(
    expected: Inventory, found: Inventory, *, tied: frozenset[str] = frozenset()
) -> str | None:
    """Why a checkpoint with the tensors `found` cannot replace one with `expected` (the
    model's own, as it started), or None: a tensor missing (a partial checkpoint), one
    the model does not have, or one of another shape or dtype. A `tied` tensor (an
    output head tied to the embeddings) may be absent: transformers' `save_pretrained`
    leaves it out, and vLLM's loader takes it from the embeddings."""
    missing = sorted(set(expected) - set(found) - tied)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return f"the checkpoint is partial: {missing[0]}{more} missing"
    extra = sorted(set(found) - set(expected))
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        return f"the checkpoint holds tensors the model does not have: {extra[0]}{more}"
    for name in sorted(set(expected) & set(found)):
        if found[name] != expected[name]:
            (want_dtype, want_shape), (dtype, shape) = expected[name], found[name]
            return (
                f"{name} does not fit the model: {dtype} {list(shape)} where the model has "
                f"{want_dtype} {list(want_shape)}"
            )
    return None


def ties_head(model_dir: str) -> bool:
    """Whether the model folder's `config.json` ties the output head to the embeddings
    (`tie_word_embeddings`, at its top or in its `text_config`); False when unreadable."""
    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    text = config.get("text_config")
    inner = text.get("tie_word_embeddings") if isinstance(text, dict) else None
    return bool(config.get("tie_word_embeddings", inner))


def version_of(weight_dir: str) -> str:
    """The policy version a weight directory holds, for vLLM's weight version: N of a
    `step_N` / `step_00000N` directory (either layout of the trainer's), else the
    directory's name."""
    name = os.path.basename(os.path.normpath(weight_dir))
    match = _STEP_NAME.fullmatch(name)
    return str(int(match.group(1))) if match else name

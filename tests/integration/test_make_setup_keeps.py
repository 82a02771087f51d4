"""`make setup` keeps what a user installed into the project's environment (issue 55,
finding 2): a reward's library installed with `uv pip install` survived no make target
while every target ran an exact `uv sync`.

Real: the project's environment is made in `tmp_path` (`UV_PROJECT_ENVIRONMENT`, uv's
cache links the packages: about 2 s, nothing from the network), a wheel built here by
hand (a wheel is a zip of the package and its metadata) is installed into it offline, and
the repository's own `make setup` runs against it, its uv commands as the Makefile writes
them but for `--compile-bytecode`: compiling some 300 packages again took 2 minutes of
the suite's 5 (the wrapper `uv` drops that one flag; the sync flags under test stay).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(folder: Path, name: str, version: str = "0.1") -> Path:
    """A pure-Python wheel of one module `name` (its `VALUE = 42`)."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": b"VALUE = 42\n",
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        ).encode(),
        f"{dist_info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = [_record_line(path, data) for path, data in files.items()]
    record.append(f"{dist_info}/RECORD,,")
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


def test_a_package_the_user_installed_survives_make_setup(tmp_path: Path) -> None:
    uv = shutil.which("uv")
    make = shutil.which("make")
    if uv is None or make is None:
        pytest.skip("needs uv and make on PATH")
    venv = tmp_path / "venv"
    env = {
        **os.environ,
        "UV_PROJECT_ENVIRONMENT": str(venv),
        "UV_OFFLINE": "1",
        "UV_PYTHON_DOWNLOADS": "never",
    }
    env.pop("VIRTUAL_ENV", None)
    sync = [uv, "sync", "--frozen", "--python", "python3", "--quiet"]
    created = subprocess.run(sync, cwd=REPO, env=env, capture_output=True, text=True)
    if created.returncode != 0:
        pytest.skip(f"the project's packages are not in uv's cache: {created.stderr[-300:]}")
    wheel = build_wheel(tmp_path, "users_reward_lib")
    python = str(venv / "bin" / "python")
    subprocess.run(
        [uv, "pip", "install", "--quiet", "--python", python, str(wheel)],
        cwd=REPO,
        env=env,
        check=True,
    )

    wrapper = tmp_path / "uv"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        'args=(); for a in "$@"; do [ "$a" = --compile-bytecode ] || args+=("$a"); done\n'
        f'exec {uv} "${{args[@]}}"\n'
    )
    wrapper.chmod(0o755)
    setup = subprocess.run(
        [make, "--no-print-directory", "setup", f"UV={wrapper}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )

    assert setup.returncode == 0, setup.stderr
    kept = subprocess.run(
        [python, "-c", "import users_reward_lib; print(users_reward_lib.VALUE)"],
        capture_output=True,
        text=True,
    )
    assert kept.stdout.strip() == "42", f"make setup removed it: {kept.stderr[-300:]}"

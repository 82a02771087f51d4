"""A learning run through the whole loop: real vLLM (`orchestrator-vllm serve`, routing by
handle, versions loaded through `/update_weights`), the daemon, the reference trainer
(`orchestrator-trainer`) and the run's own config (configs/learn.toml). What
`make demo-learn` runs and the stage's learning test checks.

Runs in the project's venv; vLLM and the trainer run in the stage's venv.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
from _vllm_kit import (
    ROOT,
    Server,
    install_writer,
    key_file,
    tiny_model,
    trainer_command,
    vllm_server,
)

CONFIG = ROOT / "configs" / "learn.toml"
#: The policy learned when the mean reward of the last five steps is at least this much
#: above the first five's, and the eval's mean reward after at least this much above
#: before. A random policy scores about 0.25 (the share of digit ids, by characters).
MARGIN = 0.2
#: Steps compared at each end of the run.
ENDS = 5


@attrs.frozen
class LearningCurve:
    """What a learning run measured: reward per step, eval before and after, mismatch."""

    rewards: tuple[float, ...]
    eval_before: float
    eval_after: float
    mismatch: tuple[float | None, ...]
    mismatch_no_replay: tuple[float | None, ...]
    seconds_per_step: float

    @property
    def first(self) -> float:
        return statistics.fmean(self.rewards[:ENDS])

    @property
    def last(self) -> float:
        return statistics.fmean(self.rewards[-ENDS:])

    @property
    def learned(self) -> bool:
        return self.last - self.first >= MARGIN and self.eval_after - self.eval_before >= MARGIN

    def lines(self) -> list[str]:
        with_replay = [kl for kl in self.mismatch if kl is not None]
        without = [kl for kl in self.mismatch_no_replay if kl is not None]
        lines = [
            f"mean reward, first {ENDS} steps: {self.first:.3f}; last {ENDS}: {self.last:.3f}",
            f"eval mean reward, version 0: {self.eval_before:.3f}; last version: "
            f"{self.eval_after:.3f}",
            f"trainer: {self.seconds_per_step:.2f} s per step",
        ]
        if with_replay:
            lines.append(
                f"on-policy mismatch KL, median over {len(with_replay)} steps: "
                f"{statistics.median(with_replay):.2e} with router replay"
                + (f", {statistics.median(without):.2e} without" if without else "")
            )
        verdict = "learned" if self.learned else "did NOT learn"
        lines.append(f"{verdict} (margin {MARGIN} on both)")
        return lines


def read_curve(run_dir: Path) -> LearningCurve:
    trainer = [json.loads(line) for line in (run_dir / "trainer.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]

    def eval_mean(line: dict) -> float:  # type: ignore[type-arg]
        results = list(line["envs"].values())
        return statistics.fmean(result["reward_mean"] for result in results)

    return LearningCurve(
        rewards=tuple(line["reward_mean"] for line in trainer),
        eval_before=eval_mean(evals[0]),
        eval_after=eval_mean(evals[-1]),
        mismatch=tuple(line["mismatch_kl"] for line in trainer),
        mismatch_no_replay=tuple(line["mismatch_kl_no_replay"] for line in trainer),
        seconds_per_step=statistics.fmean(line["seconds"] for line in trainer),
    )


def learning_run(  # type: ignore[no-untyped-def]
    run_dir: Path,
    *more: str,
    server: Server | None = None,
    server_flags: tuple[str, ...] = (),
    log=print,
    config: Path = CONFIG,
    model: Path | None = None,
    routing: bool = True,
    trainer_threads: int = 1,
    probe: Callable[[Server, str], None] | None = None,
) -> LearningCurve:
    """Run `config` (configs/learn.toml) into `run_dir` (emptied first) with `more`
    overrides, on `server` (an `orchestrator-vllm serve` of `model`, the tiny MoE unless
    given, holding its base weights) or else on one started for it with `server_flags`
    too (and routing capture when `routing`); its curve. `probe(server, "before")` runs
    before the daemon starts, `probe(server, "after")` once it is done (the server then
    holds the last version). Raises AssertionError when a process fails."""
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    model = model or tiny_model()
    with contextlib.ExitStack() as stack:
        if server is None:
            writer_root = run_dir / "server-payloads"
            writer_root.mkdir()
            install_writer()
            log(f"starting orchestrator-vllm on {model} (about 30 s) ...")
            flags = ("--enforce-eager", *server_flags)
            server = stack.enter_context(
                vllm_server(
                    model, run_dir / "vllm", *flags, routing=routing, writer_root=writer_root
                )
            )
            log(f"vLLM ready at {server.url}; its log: {server.log}")
        assert server.payload_root is not None, "the server writes no payloads by handle"
        # The run's payload root, below the server's: its own, as the daemon wipes it.
        payload_root = server.payload_root / hashlib.sha256(bytes(run_dir)).hexdigest()[:12]
        overrides = [
            f'run_dir="{run_dir}"',
            f'model.path="{model}"',
            f'payload.root="{payload_root}"',
            f'inference.urls=["{server.url}"]',
            *([key_file(server, run_dir)] if server.api_key else []),
            *more,
        ]
        sets = [arg for override in overrides for arg in ("--set", override)]
        trainer_log = run_dir / "trainer.log"
        with trainer_log.open("wb") as out:
            trainer = subprocess.Popen(
                [str(trainer_command()), "--config", str(config), *sets],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                # One thread for the tiny model: its few matrix products gain nothing
                # from a second, and vLLM's engine needs the other core.
                env={**os.environ, "OMP_NUM_THREADS": str(trainer_threads)},
            )
        if probe is not None:
            probe(server, "before")
        try:
            daemon = subprocess.run(
                [sys.executable, "-m", "orchestrator.cli", "run", "--config", str(config), *sets],
                cwd=ROOT,
                timeout=900,
            )
            assert daemon.returncode == 0, f"the daemon exited {daemon.returncode}"
            assert trainer.wait(timeout=120) == 0, f"the trainer failed: {trainer_log}"
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
        if probe is not None:
            probe(server, "after")
    report = [sys.executable, "-m", "orchestrator.cli", "report", "--config", str(config), *sets]
    subprocess.run(report, cwd=ROOT, check=True)
    return read_curve(run_dir)

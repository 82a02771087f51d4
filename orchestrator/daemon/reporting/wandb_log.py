"""The run's records mirrored to Weights & Biases (`[wandb] enabled`, the optional `wandb`
extra): each `steps.jsonl` line as `train/...` against `train/step`, each `evals.jsonl`
line as `eval/<env>/...` against `eval/version`.

wandb's calls block (its service is another process), so they run in one worker thread
at a time, in order; one that fails is logged once and the mirror stops, never the run.
The W&B run's id is kept in `<state_dir>/wandb_id`, so a resumed run continues the same
W&B run. Offline mode (the default) writes under `<run_dir>/wandb` for `wandb sync`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import structlog
import trio

from orchestrator.config import Config, WandbConfig
from orchestrator.errors import UserError

log = structlog.get_logger(__name__)


def step_metrics(line: Mapping[str, Any]) -> dict[str, float]:
    """A `steps.jsonl` line as flat W&B metrics (numbers only; running totals by name)."""
    out: dict[str, float] = {"train/step": line["step"], "train/version": line["version"]}
    for key in ("samples", "reward_mean", "staleness_max", "staleness_mean", "inflight_limit"):
        if isinstance(line.get(key), int | float):
            out[f"train/{key}"] = line[key]
    out["train/payload_bytes"] = line.get("payload_bytes", 0)
    for env, reward in (line.get("reward_by_env") or {}).items():
        if reward is not None:
            out[f"train/reward/{env}"] = reward
    for group in ("rollouts", "failures", "discards", "bytes_deleted"):
        for key, value in (line.get(group) or {}).items():
            out[f"train/{group}/{key}"] = value
    return out


def eval_metrics(line: Mapping[str, Any]) -> dict[str, float]:
    """An `evals.jsonl` line as flat W&B metrics."""
    out: dict[str, float] = {"eval/version": line["version"]}
    for env, result in line["envs"].items():
        for key in ("reward_mean", "samples", "failed", "completion_tokens_mean"):
            if isinstance(result.get(key), int | float):
                out[f"eval/{env}/{key}"] = result[key]
        for k, value in (result.get("pass_at") or {}).items():
            out[f"eval/{env}/pass@{k}"] = value
        for name, value in (result.get("metrics") or {}).items():
            out[f"eval/{env}/metrics/{name}"] = value
    return out


@attrs.define(eq=False)
class WandbLog:
    """An open W&B run the daemon logs to; see `open_wandb_log`."""

    _run: Any
    _order: trio.CapacityLimiter = attrs.field(factory=lambda: trio.CapacityLimiter(1))
    _broken: bool = False

    async def log(self, metrics: Mapping[str, float]) -> None:
        if self._broken:
            return
        try:
            await trio.to_thread.run_sync(self._run.log, dict(metrics), limiter=self._order)
        except Exception as exc:  # W&B is a mirror: its failure never ends the run
            self._broken = True
            log.error("wandb: logging failed, the mirror stops", error=repr(exc)[:300])


def _run_id(state_dir: Path) -> str:
    path = state_dir / "wandb_id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        run_id = secrets.token_hex(8)
        state_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(run_id + "\n")
        return run_id


def _init(settings: WandbConfig, run_dir: Path, state_dir: Path) -> Any:
    try:
        import wandb
    except ImportError:
        raise UserError(
            "wandb.enabled needs wandb, which is not installed: "
            "pip install 'rollout-orchestrator[wandb]' (or uv sync --extra wandb)"
        ) from None
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        run = wandb.init(
            project=settings.project,
            entity=settings.entity or None,
            name=settings.name or run_dir.name,
            id=_run_id(state_dir),
            resume="allow",
            mode=settings.mode,
            dir=str(run_dir),
        )
        run.define_metric("train/step")
        run.define_metric("train/*", step_metric="train/step")
        run.define_metric("eval/version")
        run.define_metric("eval/*", step_metric="eval/version")
    except Exception as exc:
        raise UserError(f"wandb: cannot start the W&B run: {repr(exc)[:300]}") from None
    return run


@asynccontextmanager
async def open_wandb_log(config: Config) -> AsyncIterator[WandbLog | None]:
    """The W&B run of `config` (None when `[wandb]` is off), finished on exit. Raises
    `UserError` when wandb is missing or its run cannot start."""
    if not config.wandb.enabled:
        yield None
        return
    run = await trio.to_thread.run_sync(_init, config.wandb, config.run_dir, config.state_dir)
    log.info("wandb", mode=config.wandb.mode, project=config.wandb.project, id=run.id)
    try:
        yield WandbLog(run)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(60):
            await trio.to_thread.run_sync(run.finish, abandon_on_cancel=True)

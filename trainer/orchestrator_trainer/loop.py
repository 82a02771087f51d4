"""The trainer's loop: for each step after the last published version, wait for its
batch, read it (payloads by handle or inline, every byte's digest checked where the
segment has one), train one step, publish the version, append the step's line.

A sample whose payload files are broken is left out of the step and logged with its
rollout and server (`read_batch(on_corrupt="drop")`); the rest of the batch trains.
After every step it rewrites the trainer's report, `<run_dir>/trainer/report.json`, as
the simulated trainer does (`orchestrator.handoff.trainer_report`: the same counts, drops
and violations, the format's one home), so the run's summary checks "no payload
violations" against it; a batch it cannot read is a violation written there before the
trainer stops.
Blocking: this is a plain torch program, and waits by polling the batches directory
every `[trainer] poll_interval_s`, which works on every filesystem.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import attrs
import structlog

from orchestrator import BatchError, read_batch
from orchestrator.config import Config
from orchestrator.errors import UserError
from orchestrator.handoff import handoff_format, latest_published_version, weights_step_dir
from orchestrator.handoff.trainer_report import (
    REPORT_PATH,
    Violation,
    dropped_entries,
    initial_stats,
    write_report,
)
from orchestrator_trainer.checkpoints import drop_previous_state, write_version
from orchestrator_trainer.policy import load_policy
from orchestrator_trainer.step_log import append_record, mismatch_warning
from orchestrator_trainer.steps import train_step

log = structlog.get_logger("orchestrator_trainer")


class TrainerError(UserError):
    """A run this trainer cannot train (one line)."""


def check_run(config: Config) -> Path:
    """The model folder to start from; TrainerError for a run this trainer cannot train."""
    if config.trainer.format != "native":
        raise TrainerError(
            f'reads native batches only; trainer.format = "{config.trainer.format}" is for '
            "that trainer's own reader"
        )
    if config.model.path is None:
        raise TrainerError(
            "[model] path must name the model folder to train (config.json, weights)"
        )
    return config.model.path


def train(config: Config, *, stop: Callable[[], bool] = lambda: False) -> int:
    """Train until `max_steps` is published (0: until `stop()`); return the last
    published version. Raises TrainerError (one line) for a run it cannot train, a batch
    it cannot read."""
    model_dir = check_run(config)
    layout = config.trainer.weights_layout
    weights_dir = config.weights_dir
    weights_dir.mkdir(parents=True, exist_ok=True)
    latest = latest_published_version(weights_dir, layout=layout)
    source = model_dir if latest == 0 else weights_step_dir(weights_dir, latest, layout=layout)
    policy = load_policy(source, latest, config.train, seed=config.seed)
    handoff = handoff_format(config.trainer.format)
    settings = config.handoff_settings
    report = config.run_dir / REPORT_PATH
    stats = initial_stats(report, latest)
    write_report(report, stats)
    log.info(
        "trainer started",
        version=latest,
        weights=str(source),
        moe_layers=policy.replay.layers,
        router_replay=config.train.router_replay and policy.replay.layers > 0,
        max_steps=config.max_steps,
    )
    step = latest + 1
    while config.max_steps == 0 or step <= config.max_steps:
        step_dir = handoff.step_dir(settings, step)
        while True:
            if stop():
                return step - 1
            if handoff.is_step_shipped(settings, step_dir):
                break
            time.sleep(config.trainer.poll_interval_s)
        started = time.monotonic()
        try:
            batch = read_batch(step_dir, verify=True, on_corrupt="drop")
        except BatchError as exc:
            stats.violations.append(Violation(step, "bad_batch", str(step_dir), str(exc)))
            write_report(report, stats)
            raise TrainerError(f"step {step}: {exc}") from None
        # Each logged with its rollout and server; a missing payload file is a violation.
        dropped, violations = dropped_entries(step, batch.dropped)
        record = train_step(policy, batch, config.train)
        stats.add_step(
            step,
            samples=len(batch.samples),
            payload_bytes=batch.payload_nbytes,
            violations=violations,
            dropped=dropped,
        )
        # Before the version is published: the daemon checks the report once it has
        # applied the last version, and may end at once.
        write_report(report, stats)
        writing = time.monotonic()
        write_version(policy, weights_dir, step, layout=layout, model_dir=model_dir)
        drop_previous_state(weights_dir, step, layout=layout)
        policy.version = step
        now = time.monotonic()
        record = attrs.evolve(
            record, seconds=now - started, time=time.time(), checkpoint_s=now - writing
        )
        append_record(config.trainer_steps_file, record)
        log.info(
            "trained",
            step=step,
            samples=record.samples,
            tokens=record.tokens,
            loss=round(record.loss, 6),
            reward=round(record.reward_mean, 4),
            grad_norm=round(record.grad_norm, 4),
            clipped=round(record.clipped_share, 4),
            mismatch_kl=record.mismatch_kl,
            mismatch_kl_no_replay=record.mismatch_kl_no_replay,
            seconds=round(record.seconds, 3),
            forward_s=round(record.forward_s, 3),
            backward_s=round(record.backward_s, 3),
            optimizer_s=round(record.optimizer_s, 3),
            checkpoint_s=round(record.checkpoint_s, 3),
        )
        warning = mismatch_warning(record, config.train.mismatch_warn_kl)
        if warning is not None:
            log.warning(warning)
        step += 1
    return step - 1

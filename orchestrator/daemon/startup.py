"""Start-up sync (docs/design.md §7): a fresh run wipes the payload root; a resumed run keeps it,
waits for the trainer to publish the last shipped step, applies it, and collects."""

from __future__ import annotations

import functools
from pathlib import Path

import attrs
import structlog
import trio
from payload_gc import PayloadGCError, wipe_root_async

from orchestrator.errors import UserError
from orchestrator.handoff import (
    LEGACY_BATCH_FILE,
    StepLayout,
    load_progress,
    remove_partial_batches,
)
from orchestrator.handoff.formats import BatchFormat, shipped_steps_in
from orchestrator.handoff.primerl.store import MANIFEST_FILE, unfinished_primerl_steps
from orchestrator.handoff.step_dirs import complete_steps
from orchestrator.handoff.weights import newest_published_version

log = structlog.get_logger("orchestrator.startup")


@attrs.frozen
class StartPoint:
    """Where a run starts: the last shipped step (0 for a fresh run) and whether it resumes."""

    resume_step: int
    resumed: bool


def find_start_point(
    batches_dir: Path,
    state_dir: Path,
    *,
    batch_format: BatchFormat = "native",
    data_world_size: int = 1,
) -> StartPoint:
    """Fresh when no batch was shipped and no progress was saved; otherwise resume after the
    last complete batch directory in `batch_format` (the source of truth for "shipped";
    for "prime-rl", a `step_N` holding the manifest and `data_world_size` rank files).
    Blocking.

    Leftover temp directories of a batch cut short by a crash are removed first. Raises
    UserError when `batches_dir` holds batches of the old JSON format 1, which this
    version neither writes nor reads (it cannot resume such a run), or (prime-rl) step
    directories this daemon did not write in full for `data_world_size` ranks: another
    orchestrator's steps, or steps shipped for another number of ranks.
    """
    removed = remove_partial_batches(batches_dir) if batches_dir.exists() else 0
    if removed:
        log.warning("removed partial batches", count=removed, batches_dir=str(batches_dir))
    if batch_format == "native":
        _refuse_legacy_batches(batches_dir)
    else:
        _refuse_foreign_primerl_steps(batches_dir, data_world_size)
    steps = (
        shipped_steps_in(batches_dir, batch_format=batch_format, data_world_size=data_world_size)
        if batches_dir.exists()
        else []
    )
    progress = load_progress(state_dir)
    if not steps and progress is None:
        return StartPoint(0, resumed=False)
    return StartPoint(steps[-1] if steps else 0, resumed=True)


def _refuse_legacy_batches(batches_dir: Path) -> None:
    legacy = complete_steps(batches_dir, LEGACY_BATCH_FILE)
    if legacy:
        raise UserError(
            f"{batches_dir} holds batches of the old JSON format 1 (step {legacy[-1]}: "
            f"{LEGACY_BATCH_FILE}); this version ships format 2 (batch.bin) and cannot "
            "resume that run: start a new run directory"
        )


def _refuse_foreign_primerl_steps(rollouts_dir: Path, data_world_size: int) -> None:
    unfinished = unfinished_primerl_steps(rollouts_dir, data_world_size)
    if unfinished:
        step = unfinished[0]
        raise UserError(
            f"{rollouts_dir}/step_{step} is not a step this daemon shipped for "
            f"trainer.data_world_size = {data_world_size} (it lacks {MANIFEST_FILE} or a "
            f"rank_R.bin; {len(unfinished)} such step(s)): written by another orchestrator, "
            "or for another number of data ranks; point trainer.batches_dir at a fresh "
            "rollouts directory (or remove them)"
        )


async def wipe_payload_root(root: Path) -> None:
    """The fresh-run wipe, with payload_gc's refusals turned into one-line errors. What it
    could not remove stops the run, except busy files (deleted while still open)."""
    try:
        report = await wipe_root_async(root)
    except PayloadGCError as exc:
        raise UserError(f"cannot start a fresh run: {exc}") from None
    log.info("wiped payload root", root=str(root), files=getattr(report, "files", None))
    if report.busy:
        # Files deleted while still open elsewhere: their filesystem removes them once
        # closed, and their names (`.nfs*`, `.fuse_hidden*`) can meet no file of the new
        # run; the directories holding them are collected like any other.
        log.warning("the wipe left busy files", root=str(root), busy=list(report.busy[:5]))
    left = [f"{name} (mount point)" for name in report.kept]
    left += [f"{error.name} ({error.message})" for error in report.errors]
    if left:
        # A fresh run's versions start again at v0: anything left would be taken for them
        # (and a mount point would be refused for every rollout of its version).
        raise UserError(
            f"cannot start a fresh run: the wipe of {root} left {', '.join(left[:5])}"
            f"{f' and {len(left) - 5} more' if len(left) > 5 else ''} in place; "
            "unmount or remove them, then start again"
        )


async def wait_for_version(
    weights_dir: Path,
    version: int,
    *,
    poll_interval_s: float,
    layout: StepLayout = "native",
) -> None:
    """Wait until `v{version}` is published in `layout` (v0 always is), opening its exact
    path as the policy watcher does (a network filesystem revalidates it). The caller sets
    the deadline."""
    if version <= 0:
        return
    logged = False
    probe = functools.partial(
        newest_published_version, weights_dir, above=version - 1, up_to=version, layout=layout
    )
    while True:
        if await trio.to_thread.run_sync(probe) is not None:
            return
        if not logged:
            log.info("waiting for the trainer to publish", version=version)
            logged = True
        await trio.sleep(poll_interval_s)

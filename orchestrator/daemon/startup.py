"""Start-up sync (docs/design.md §7): a fresh run wipes the payload root; a resumed run keeps it,
waits for the trainer to publish the last shipped step, applies it, and collects.

Before any of it, `check_moe_reload` refuses a run whose weight updates the servers would
silently get wrong (a mixture-of-experts model reloaded by a vLLM release that drops its
expert weights: `orchestrator.wire.MOE_RELOAD_BROKEN`)."""

from __future__ import annotations

import functools
import json
import ssl
from collections.abc import Sequence
from pathlib import Path

import attrs
import structlog
import trio
from payload_gc import PayloadGCError, wipe_root_async

from orchestrator.config import Config
from orchestrator.daemon.inference.credentials import BearerToken
from orchestrator.daemon.inference.http11 import HTTPFailure, Requester
from orchestrator.daemon.inference.http_clients import control_client
from orchestrator.errors import UserError
from orchestrator.handoff import (
    HandoffFormat,
    HandoffSettings,
    StepLayout,
    load_progress,
    newest_published_version,
    remove_partial_batches,
)
from orchestrator.wire import MOE_RELOAD_BROKEN, VERSION_PATH, moe_reload_refusal

log = structlog.get_logger(__name__)

#: How long the start-up check waits for the servers' `GET /version`, all at once.
VERSION_TIMEOUT_S = 5.0


#: The keys of a Hugging Face `config.json` that count a MoE's routed experts (Qwen3-MoE
#: and Qwen2-MoE, DeepSeek, Mixtral).
_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def is_moe(config: Config) -> bool:
    """Whether the run's model is a mixture of experts, as far as the run says: it
    requests routing (`routed_experts` exists on MoE models only), sets the routing
    shape (`payload.num_experts`), or its model folder's `config.json` (`[model] path`)
    counts experts. Blocking (reads that file); an unreadable one says nothing."""
    if "routed_experts" in config.payload.fields or config.payload.num_experts > 0:
        return True
    if config.model.path is None:
        return False
    try:
        model = json.loads((config.model.path / "config.json").read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(model, dict) and any(
        isinstance(model.get(key), int) and model[key] > 0 for key in _EXPERT_KEYS
    )


async def check_moe_reload(
    config: Config, servers: Sequence[str], token: BearerToken | None = None
) -> None:
    """Refuse (`UserError`, `moe_reload_refusal`'s line) a `weight_update = "vllm"` run
    of a MoE model against servers whose `GET /version` names a release in
    `MOE_RELOAD_BROKEN`. Servers whose version cannot be read (down, 404, not JSON)
    within `VERSION_TIMEOUT_S` are not refused: one warning says the check was not made
    for them. Does nothing (no request) for another protocol or a dense model."""
    protocol = config.inference.weight_update
    moe = await trio.to_thread.run_sync(is_moe, config)
    if protocol != "vllm" or not moe or not servers:
        return
    versions: dict[str, str | None] = {}
    # Loading the trust store blocks for up to a second: in a worker thread.
    tls: ssl.SSLContext = await trio.to_thread.run_sync(ssl.create_default_context)
    async with control_client(tls, token) as client:
        with trio.move_on_after(VERSION_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                for url in servers:
                    nursery.start_soon(_read_version, client, url.rstrip("/"), versions)
    refusal = moe_reload_refusal(protocol, [v for v in versions.values() if v is not None], moe=moe)
    if refusal is not None:
        raise UserError(refusal)
    unread = [url for url in servers if versions.get(url.rstrip("/")) is None]
    if unread:
        log.warning(
            "cannot check the servers' vLLM version: a mixture-of-experts model reloaded "
            f"by vLLM {', '.join(MOE_RELOAD_BROKEN)} computes with expert weights that are "
            "not the checkpoint's",
            servers=unread[:5],
            more=max(0, len(unread) - 5),
        )


async def _read_version(client: Requester, url: str, versions: dict[str, str | None]) -> None:
    versions[url] = None
    try:
        response = await client.request("GET", url + VERSION_PATH)
        answer = json.loads(response.body) if response.status == 200 else None
    except (HTTPFailure, ValueError):
        return
    if isinstance(answer, dict) and isinstance(answer.get("version"), str):
        versions[url] = answer["version"]


@attrs.frozen
class StartPoint:
    """Where a run starts: the last shipped step (0 for a fresh run) and whether it resumes."""

    resume_step: int
    resumed: bool


def find_start_point(
    handoff: HandoffFormat, settings: HandoffSettings, state_dir: Path
) -> StartPoint:
    """Fresh when no batch was shipped and no progress was saved; otherwise resume after the
    last complete step directory `handoff` finds in `settings.batches_dir` (the source of
    truth for "shipped", as the format says: for "prime-rl", a `step_N` holding the
    manifest and `data_world_size` rank files). Blocking.

    Leftover temp directories of a step cut short by a crash are removed first. Raises
    UserError when the format refuses to resume over what the directory holds (its
    `refuse_resume`: for "native", batches of the old JSON format 1, which this version
    neither writes nor reads; for "prime-rl", step directories this daemon did not write
    in full for `data_world_size` ranks).
    """
    batches_dir = settings.batches_dir
    removed = remove_partial_batches(batches_dir) if batches_dir.exists() else 0
    if removed:
        log.warning("removed partial batches", count=removed, batches_dir=str(batches_dir))
    handoff.refuse_resume(settings)
    steps = handoff.shipped_steps(settings) if batches_dir.exists() else []
    progress = load_progress(state_dir)
    if not steps and progress is None:
        return StartPoint(0, resumed=False)
    return StartPoint(steps[-1] if steps else 0, resumed=True)


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

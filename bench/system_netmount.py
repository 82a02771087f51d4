"""Shared filesystem over a loopback mount: how late new weights are seen, and what a
collection costs, on a local disk, on sshfs with its caches and on sshfs without.

The mount is `tests/netmount/mount.sh` (sshfs through a throwaway sshd on 127.0.0.1):
`cache` is sshfs's defaults (its directory cache keeps names and attributes for 20 s, the
kernel keeps entries and attributes for 1 s), `nocache` turns every cache off. Whatever
stands for "another host" (the trainer publishing weights, the inference servers' payload
files) writes on the server's side of the mount, past the client's caches, as a host
elsewhere on the network would; the daemon's side reads through the mount.

1. **Seeing a version** (the probe alone): a trainer publishes `step_N/STABLE` on the
   server's side; the reader probes every 0.1 s, as the policy watcher does, until it sees
   it. Before this change the watcher listed `weights/` (`published_versions`); now it
   opens `step_N/STABLE` by its exact path for each candidate version
   (`newest_published_version`). Delay from the write to the first probe that sees it,
   and what one probe costs.
2. **Applying a version** (the daemon end to end): `run_daemon` in this process with
   `force_polling` and a 1 s poll interval, two `sim-inference` servers and a
   `sim-trainer` (0.3 s a step) as processes, the trainer on the server's side. Delay from
   each `STABLE`'s mtime to the daemon's applied version, and the run's wall time; once
   with the listing watcher as it was before this change, once with the current one.
3. **Collecting**: `payload_gc.collect_below_sync` on a root of `--files` payload files
   in `--versions` version directories (written on the server's side), deleting the
   older half.

    uv run --frozen --group bench python bench/system_netmount.py
        [--steps N] [--files N] [--versions N] [--skip-daemon]

Needs root and /dev/fuse (mount.sh installs sshfs and openssh-server when missing); where
the mount cannot be made, the sshfs rows say why and only the local disk is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import trio
import watchfiles
from _report import git_revision, machine, write_section
from payload_gc import collect_below_sync
from system_fleet import (
    REPO,
    ModelShape,
    pin_self,
    plan_cores,
    quiet_daemon_logs,
    run_overrides,
    running_daemon,
    sim_servers,
    sim_trainer,
    stamp,
)

import orchestrator.daemon.run as daemon_run
from orchestrator.config import load_config
from orchestrator.daemon.policy import PolicyWatcher
from orchestrator.handoff import (
    STABLE_MARKER,
    newest_published_version,
    publish_weights,
    published_versions,
)

MOUNT = REPO / "tests" / "netmount" / "mount.sh"
UMOUNT = REPO / "tests" / "netmount" / "umount.sh"
DEMO = REPO / "configs" / "sim.toml"
FILESYSTEMS = ("local", "cache", "nocache")
DESCRIBE = {
    "local": "local disk",
    "cache": "sshfs, default caches",
    "nocache": "sshfs, no caches",
}
PROBE_INTERVAL_S = 0.1
# A probe that has not seen the version by then is reported as not seen.
PROBE_GIVE_UP_S = 60.0
DAEMON_POLL_INTERVAL_S = 1.0
# The daemon's payloads cost next to nothing: what is measured is the hand-off.
SHAPE = ModelShape(layers=1, top_k=8, num_experts=128)


@attrs.frozen
class Place:
    """Where a filesystem is seen from: `client` (the daemon's side) and `server` (where
    another host's writes land). The same directory on a local disk."""

    client: Path
    server: Path


@contextlib.contextmanager
def place(filesystem: str, base: Path) -> Iterator[Place | str]:
    """A fresh directory on `filesystem`, or the reason it cannot be had."""
    if filesystem == "local":
        directory = Path(tempfile.mkdtemp(prefix="local-", dir=base))
        yield Place(directory, directory)
        return
    done = subprocess.run(
        [str(MOUNT), filesystem], capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        yield done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "mount failed"
        return
    mount_point = Path(done.stdout.strip().splitlines()[-1])
    try:
        yield Place(mount_point, mount_point.parent / "export")
    finally:
        subprocess.run([str(UMOUNT), str(mount_point)], check=True, stdin=subprocess.DEVNULL)


# --- 1. Seeing a version -----------------------------------------------------------------


def seen_by_listing(weights_dir: Path, step: int) -> bool:
    """Before: the listing the watcher made at each wake-up."""
    return bool(published_versions(weights_dir, above=step - 1))


def seen_by_opening(weights_dir: Path, step: int) -> bool:
    """Now: the candidate's exact path."""
    return newest_published_version(weights_dir, above=step - 1, up_to=step) is not None


PROBES: dict[str, Callable[[Path, int], bool]] = {
    "listing": seen_by_listing,
    "exact path": seen_by_opening,
}


@attrs.frozen
class ProbeResult:
    delays_s: list[float | None]
    probe_s: list[float]


def measure_probe(where: Place, probe: Callable[[Path, int], bool], steps: int) -> ProbeResult:
    """Publish `steps` versions on the server's side, each after a few probes that find
    nothing (a watcher waiting), and time the probes until each is seen."""
    client, server = where.client / "weights", where.server / "weights"
    server.mkdir()
    delays: list[float | None] = []
    costs: list[float] = []

    def timed(step: int) -> bool:
        started = time.perf_counter()
        seen = probe(client, step)
        costs.append(time.perf_counter() - started)
        return seen

    for step in range(1, steps + 1):
        for _ in range(3):
            assert not timed(step)
            time.sleep(PROBE_INTERVAL_S)
        publish_weights(server, step)
        written = time.monotonic()
        delay: float | None = None
        while time.monotonic() - written < PROBE_GIVE_UP_S:
            if timed(step):
                delay = time.monotonic() - written
                break
            time.sleep(PROBE_INTERVAL_S)
        delays.append(delay)
    return ProbeResult(delays, costs)


# --- 2. Applying a version ---------------------------------------------------------------


@attrs.define
class ListingPolicyWatcher(PolicyWatcher):
    """The policy watcher as it was before looking by exact path: watchfiles (polling with
    `force_polling`), and a listing of `weights/` at every wake-up."""

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        config = self.config
        await trio.to_thread.run_sync(lambda: config.weights_dir.mkdir(parents=True, exist_ok=True))
        task_status.started()
        timeout_ms = max(int(config.trainer.poll_interval_s * 1000), 50)
        watch = watchfiles.awatch(
            config.weights_dir,
            force_polling=config.trainer.force_polling,
            poll_delay_ms=timeout_ms,
            debounce=50,
            step=20,
            rust_timeout=timeout_ms,
            yield_on_timeout=True,
        )
        await self.check_for_new_version()
        async with contextlib.aclosing(watch) as changes:
            async for _ in changes:
                await self.check_for_new_version()

    async def check_for_new_version(self) -> None:
        config = self.config
        versions = await trio.to_thread.run_sync(
            functools.partial(
                published_versions,
                config.weights_dir,
                above=self.state.versions.applied,
                layout=config.trainer.weights_layout,
            ),
            limiter=self.file_limiter,
        )
        usable = [v for v in versions if v <= self.state.shipping.next_step - 1]
        if usable and usable[-1] > self.state.versions.applied:
            await self.apply(usable[-1])


@attrs.frozen
class DaemonResult:
    delays_s: list[float]
    wall_s: float


def measure_daemon(where: Place, watcher: str, steps: int) -> DaemonResult:
    """One run of `steps` steps; per step N, the delay from `STABLE`'s mtime (server side)
    to the daemon applying version N or a newer one."""
    cores = plan_cores()
    run_dir = where.client / "run"
    overrides = [f"max_steps={steps}", "trainer.force_polling=true"]
    overrides.append(f"trainer.poll_interval_s={DAEMON_POLL_INTERVAL_S}")
    # (wall time, applied version) at each change of the applied version.
    applied: list[tuple[float, int]] = []
    with contextlib.ExitStack() as stack:
        urls = stack.enter_context(sim_servers(2, SHAPE, cores.fleet))
        config = load_config(DEMO, run_overrides(run_dir, urls, SHAPE, overrides))
        trainer_overrides = [
            *run_overrides(run_dir, urls, SHAPE, overrides),
            f'trainer.batches_dir="{where.server / "run" / "batches"}"',
            f'trainer.weights_dir="{where.server / "run" / "weights"}"',
            # The trainer's own side is a local disk: inotify sees the daemon's batches.
            "trainer.force_polling=false",
        ]
        original = daemon_run.PolicyWatcher  # type: ignore[attr-defined]
        if watcher == "listing":
            daemon_run.PolicyWatcher = ListingPolicyWatcher  # type: ignore[attr-defined]
        try:
            started = time.monotonic()
            log = where.client.parent / f"trainer-{watcher}.log"
            if where.client == where.server:
                log = where.client / f"trainer-{watcher}.log"
            stack.enter_context(sim_trainer(trainer_overrides, cores.fleet, log))

            async def run() -> None:
                async with running_daemon(config) as daemon:
                    state = daemon.state
                    while daemon.outcome is None:
                        if not applied or applied[-1][1] != state.versions.applied:
                            applied.append((time.time(), state.versions.applied))
                        await state.wait_changed()

            trio.run(run)
            wall = time.monotonic() - started
        finally:
            daemon_run.PolicyWatcher = original  # type: ignore[attr-defined]
    delays = []
    weights = where.server / "run" / "weights"
    for step in range(1, steps + 1):
        stable = weights / f"step_{step:06d}" / STABLE_MARKER
        # A version published while the daemon was busy may be skipped for a newer one:
        # it counts as seen when that one is applied.
        at = next((when for when, version in applied if version >= step), None)
        if at is not None and stable.exists():
            delays.append(at - stable.stat().st_mtime)
    return DaemonResult(delays, wall)


# --- 3. Collecting -----------------------------------------------------------------------


@attrs.frozen
class CollectResult:
    files: int
    deleted: int
    seconds: float


def measure_collection(where: Place, files: int, versions: int) -> CollectResult:
    """Write `files` payload files in `versions` version directories on the server's
    side, then collect the older half through the client's side."""
    server_root = where.server / "payloads"
    server_root.mkdir()
    (server_root / ".payload-root").write_text("")
    per_version = files // versions
    payload = b"\0" * 512
    for version in range(versions):
        directory = server_root / f"v{version}"
        directory.mkdir()
        for index in range(per_version):
            (directory / f"{index:08x}.bin").write_bytes(payload)
    started = time.perf_counter()
    report = collect_below_sync(where.client / "payloads", versions // 2)
    seconds = time.perf_counter() - started
    return CollectResult(per_version * versions, report.files, seconds)


# --- The report ----------------------------------------------------------------------------


def _seconds(value: float) -> str:
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.1f} s"


def _fmt_delay(delays: list[float | None], expected: int) -> str:
    """Median and max of the delays seen, and how many of `expected` were seen."""
    seen = [d for d in delays if d is not None]
    if not seen:
        return f"none seen in {PROBE_GIVE_UP_S:.0f} s"
    text = f"{_seconds(statistics.median(seen))} (max {_seconds(max(seen))})"
    return text + (f", {len(seen)} of {expected}" if len(seen) < expected else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="versions published per round")
    parser.add_argument("--files", type=int, default=30_000, help="payload files collected")
    parser.add_argument("--versions", type=int, default=10, help="version directories")
    parser.add_argument("--skip-daemon", action="store_true", help="leave out part 2")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("system_netmount: needs root (FUSE mounts, a throwaway sshd)", file=sys.stderr)
    pin_self(plan_cores().daemon)
    quiet_daemon_logs()
    command = " ".join(
        ["uv run --frozen --group bench python bench/system_netmount.py", *sys.argv[1:]]
    )
    probes: dict[tuple[str, str], ProbeResult] = {}
    daemons: dict[tuple[str, str], DaemonResult] = {}
    collections: dict[str, CollectResult] = {}
    unavailable: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="system-netmount-", dir=args.dir) as tmp:
        base = Path(tmp)
        for filesystem in FILESYSTEMS:
            for name, probe in PROBES.items():
                with place(filesystem, base) as where:
                    if isinstance(where, str):
                        unavailable[filesystem] = where
                        break
                    result = measure_probe(where, probe, args.steps)
                    probes[filesystem, name] = result
                    print(
                        f"{stamp()} {filesystem:8s} {name:10s}: seen after "
                        f"{_fmt_delay(result.delays_s, args.steps)}; a probe takes "
                        f"{statistics.median(result.probe_s) * 1e3:.2f} ms",
                        flush=True,
                    )
            if filesystem in unavailable:
                print(f"{stamp()} {filesystem}: {unavailable[filesystem]}", flush=True)
                continue
            if not args.skip_daemon:
                for watcher in ("listing", "exact path"):
                    with place(filesystem, base) as where:
                        assert not isinstance(where, str)
                        outcome = measure_daemon(where, watcher, args.steps)
                    daemons[filesystem, watcher] = outcome
                    print(
                        f"{stamp()} {filesystem:8s} daemon, {watcher:10s}: {args.steps} steps "
                        f"in {outcome.wall_s:.1f} s, applied "
                        f"{_fmt_delay(list(outcome.delays_s), args.steps)} after STABLE",
                        flush=True,
                    )
            with place(filesystem, base) as where:
                assert not isinstance(where, str)
                collected = measure_collection(where, args.files, args.versions)
            collections[filesystem] = collected
            print(
                f"{stamp()} {filesystem:8s} collection: {collected.deleted:,} of "
                f"{collected.files:,} files deleted in {collected.seconds:.2f} s",
                flush=True,
            )
    markdown = report(args, command, probes, daemons, collections, unavailable)
    print(markdown)
    write_section("system_netmount", markdown)
    return 0


def report(
    args: argparse.Namespace,
    command: str,
    probes: dict[tuple[str, str], ProbeResult],
    daemons: dict[tuple[str, str], DaemonResult],
    collections: dict[str, CollectResult],
    unavailable: dict[str, str],
) -> str:
    lines = [
        "## System: shared filesystem over a loopback mount (`bench/system_netmount.py`)",
        "",
        f"`{command}` at revision {git_revision()}; {machine()}.",
        "",
        "sshfs through a throwaway sshd on 127.0.0.1 (`tests/netmount/mount.sh`): *default",
        "caches* is what a plain `sshfs host:dir mnt` gives (sshfs's directory cache, 20 s;",
        "the kernel's entry and attribute caches, 1 s), *no caches* is `dir_cache=no` with",
        "the kernel's entry, attribute and negative timeouts at 0. The trainer, and whatever",
        "else stands for another host, writes on the server's side of the mount.",
        "",
        f"**Seeing a version.** {args.steps} versions published one after another; the",
        f"reader probes every {PROBE_INTERVAL_S} s. Delay from the `STABLE` write to the",
        "first probe that sees it (median, max), and the median cost of one probe. *Listing*",
        "is how the policy watcher looked before (`published_versions`), *exact path* how",
        "it looks now (`newest_published_version`).",
        "",
        "| filesystem | listing: seen after | a probe | exact path: seen after | a probe |",
        "|---|---|---|---|---|",
    ]
    for filesystem in FILESYSTEMS:
        if filesystem in unavailable:
            lines.append(
                f"| {DESCRIBE[filesystem]} | not measured: {unavailable[filesystem]} | | | |"
            )
            continue
        cells = []
        for name in PROBES:
            result = probes[filesystem, name]
            cells += [
                _fmt_delay(result.delays_s, args.steps),
                f"{statistics.median(result.probe_s) * 1e3:.2f} ms",
            ]
        lines.append(f"| {DESCRIBE[filesystem]} | " + " | ".join(cells) + " |")
    if daemons:
        lines += [
            "",
            f"**Applying a version.** The daemon (`force_polling`, `poll_interval_s ="
            f" {DAEMON_POLL_INTERVAL_S}`) and the local trainer (0.3 s a step) for",
            f"{args.steps} steps: delay from each `STABLE`'s mtime to the daemon applying that",
            "version or a newer one (median, max), and the run's wall time from the servers'",
            "start. The *listing watcher* is the policy watcher as it was before, kept in the",
            "benchmark (watchfiles polling `weights/`, a listing at each wake-up).",
            "",
            "| filesystem | listing watcher (before) | run | exact-path probes (now) | run |",
            "|---|---|---|---|---|",
        ]
        for filesystem in FILESYSTEMS:
            if (filesystem, "listing") not in daemons:
                continue
            cells = []
            for watcher in ("listing", "exact path"):
                outcome = daemons[filesystem, watcher]
                cells += [
                    _fmt_delay(list(outcome.delays_s), args.steps),
                    f"{outcome.wall_s:.1f} s",
                ]
            lines.append(f"| {DESCRIBE[filesystem]} | " + " | ".join(cells) + " |")
    if collections:
        some = next(iter(collections.values()))
        lines += [
            "",
            f"**Collecting.** `collect_below_sync` on a root of {some.files:,} files of 512",
            f"bytes in {args.versions} version directories, deleting the older half; the files",
            "were written on the server's side.",
            "",
            "| filesystem | files deleted | collection |",
            "|---|---|---|",
        ]
        for filesystem in FILESYSTEMS:
            if filesystem in collections:
                done = collections[filesystem]
                lines.append(
                    f"| {DESCRIBE[filesystem]} | {done.deleted:,} | {done.seconds:.2f} s |"
                )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

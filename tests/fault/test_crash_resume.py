"""Crash safety: the daemon is SIGKILLed at random moments and restarted, like on a cluster.

Everything runs as a separate process: two `sim-inference` servers, the `sim-trainer`,
and the daemon (`orchestrator run`), which the test kills with SIGKILL `--kills` times
(default 20) and restarts each time. The kill moments come from `random.Random(SEED)`
and are aimed at four phases: start-up (before dispatching begins), mid-dispatch, right
after a batch (or its temp directory) appears, and during a payload collection (while the
collector's lock is held). After the last kill the daemon runs to the end, and the run
must look as if nothing had happened: every batch shipped exactly once and never
rewritten, the trainer read every payload, nothing below the bound is left, and nothing
outside the payload root was touched.

The same harness runs with `[trainer] format = "prime-rl"` (two data ranks, prime-rl's
`rollouts/step_N/rank_R.bin` and `broadcasts/step_N/STABLE`, the local trainer standing in
for prime-rl's), with fewer kills: every step's rank files appear at once, none is
shipped twice or rewritten, and each resumed life continues after the last complete step.

It runs once more with disaggregated prefill/decode by handle (each server process a
router in front of a prefill and a decode server, `sim-inference --disaggregated`), one
kill per phase: both sides' payload files of every rollout are collected or shipped like any
other, and nothing below the bound is left.

To reproduce a failure, run the same seed and `--kills`; the daemon's log of each life is
in `<tmp_path>/logs/daemon-NNN.log`.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time
from pathlib import Path

import attrs
import pytest
from _fault_kit import (
    Children,
    orchestrator_command,
    plant_tree,
    snapshot_tree,
    start_sim_server,
    urls_override,
    write_run_config,
)
from payload_gc import min_fresh_version

from orchestrator.config import Config
from orchestrator.handoff import (
    BATCH_FILE,
    PARTIAL_BATCH_PREFIX,
    PROGRESS_FILE,
    HandoffSettings,
    batch_step_dir,
    handoff_format,
    published_versions,
)
from orchestrator.handoff.primerl import MANIFEST_FILE, primerl_step_dir, rank_file_name

SEED = 20261129
PHASES = ("startup", "dispatch", "batch", "collection")
# How often the harness looks at the run's files while it waits for a kill moment.
POLL_S = 0.002
# A daemon that reaches none of its phases in this long is stuck, not slow.
PHASE_DEADLINE_S = 60.0
FINAL_RUN_DEADLINE_S = 120.0
VERSION_DIR = re.compile(r"v([0-9]+)")
# payload_gc's own entries in a payload root: its marker and its control directory.
CONTROL_NAMES = (".payload-root", ".payload-gc")


@attrs.frozen
class KillPlan:
    """Where one kill is aimed: a phase, and how long after its trigger to strike.

    `on_partial` (batch phase only): strike as soon as the batch's temp directory
    exists, before it is renamed into place, rather than once the batch is complete.
    `in_sync` (start-up phase only): count the delay from the daemon's `resuming` log
    line, so the kill lands in the start-up sync (the wait for the last shipped version,
    its update and collection) rather than in the interpreter's imports.
    """

    phase: str
    delay_s: float
    on_partial: bool = False
    in_sync: bool = False


def draw_kill_plans(rng: random.Random, kills: int) -> list[KillPlan]:
    """`kills` plans, the phases in equal shares and shuffled, delays drawn per phase."""
    phases = [PHASES[i % len(PHASES)] for i in range(kills)]
    rng.shuffle(phases)
    plans = []
    for phase in phases:
        if phase == "startup":
            # The interpreter's imports take 0.6 to 1 s from spawn (a run was seen
            # dispatching 0.85 s after it on an idle machine), the start-up sync a few
            # hundred ms after them. Alternate between the two.
            in_sync = sum(p.phase == "startup" for p in plans) % 2 == 1
            delay = rng.uniform(0.0, 0.15) if in_sync else rng.uniform(0.0, 0.5)
            plans.append(KillPlan(phase, delay, in_sync=in_sync))
        elif phase == "dispatch":
            plans.append(KillPlan(phase, rng.uniform(0.02, 0.6)))
        elif phase == "batch":
            plans.append(KillPlan(phase, rng.uniform(0.0, 0.01), on_partial=rng.random() < 0.5))
        else:
            plans.append(KillPlan(phase, rng.uniform(0.0, 0.01)))
    return plans


@attrs.frozen
class KillRecord:
    """What the harness saw at one kill."""

    index: int
    plan: KillPlan
    triggered: bool  # the planned trigger fired (start-up: dispatching had not begun)
    after_s: float  # since the daemon was spawned
    shipped_before: int
    shipped_after: int
    partial_batch_left: bool
    collection_lock_held: bool
    startup_sync_began: bool  # the daemon had logged that it was resuming


@attrs.define
class BatchLedger:
    """Each batch's files' identities (inode, mtime) the first time it is seen: batch.bin,
    or every rank file and the manifest of a prime-rl step. A shipped batch is never
    rewritten, so the identities must never change."""

    batches_dir: Path
    batch_format: str = "native"
    data_world_size: int = 1
    identities: dict[int, tuple[tuple[int, int], ...]] = attrs.field(factory=dict)
    rewritten: list[str] = attrs.field(factory=list)

    def files(self, step: int) -> list[Path]:
        if self.batch_format == "native":
            return [batch_step_dir(self.batches_dir, step) / BATCH_FILE]
        step_dir = primerl_step_dir(self.batches_dir, step)
        ranks = [step_dir / rank_file_name(rank) for rank in range(self.data_world_size)]
        return [*ranks, step_dir / MANIFEST_FILE]

    def shipped(self) -> list[int]:
        settings = HandoffSettings(self.batches_dir, data_world_size=self.data_world_size)
        return handoff_format(self.batch_format).shipped_steps(settings)

    def scan(self) -> int:
        """Record new batches, note rewritten ones; return the highest step shipped."""
        for step in self.shipped():
            try:
                stats = [path.stat() for path in self.files(step)]
            except FileNotFoundError:
                self.rewritten.append(f"batch {step} disappeared")
                continue
            identity = tuple((stat.st_ino, stat.st_mtime_ns) for stat in stats)
            first = self.identities.setdefault(step, identity)
            if first != identity:
                self.rewritten.append(f"batch {step}: {first} -> {identity}")
        return max(self.identities, default=0)


@attrs.frozen
class RunFiles:
    """Where the harness looks for the daemon's phases."""

    config: Config

    def dispatching_pid(self) -> int | None:
        """The pid in progress.json: the daemon saves it right before dispatching starts."""
        try:
            progress = json.loads((self.config.state_dir / PROGRESS_FILE).read_bytes())
            return int(progress["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def partial_batch_present(self) -> bool:
        try:
            with os.scandir(self.config.batches_dir) as entries:
                return any(entry.name.startswith(PARTIAL_BATCH_PREFIX) for entry in entries)
        except FileNotFoundError:
            return False

    def collection_lock_pid(self) -> int | None:
        """The pid of the collector holding `<root>/.payload-gc/lock`, if one does."""
        try:
            raw = (self.config.payload_root / ".payload-gc" / "lock").read_bytes()
            return int(json.loads(raw)["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


def run_lives(
    children: Children,
    config_path: Path,
    files: RunFiles,
    ledger: BatchLedger,
    plans: list[KillPlan],
    max_steps: int,
) -> list[KillRecord]:
    """Spawn the daemon once per plan and SIGKILL it at the planned moment."""
    records = []
    for index, plan in enumerate(plans):
        daemon = children.spawn(
            f"daemon-{index:03d}", orchestrator_command("run", "--config", str(config_path))
        )
        spawned = time.monotonic()
        shipped_before = ledger.scan()
        triggered = wait_for_kill_moment(children, daemon, plan, files, ledger, max_steps)
        lock_held = files.collection_lock_pid() == daemon.pid
        if plan.phase == "startup":
            triggered = files.dispatching_pid() != daemon.pid
        daemon.kill()
        daemon.wait()
        records.append(
            KillRecord(
                index=index,
                plan=plan,
                triggered=triggered,
                after_s=round(time.monotonic() - spawned, 3),
                shipped_before=shipped_before,
                shipped_after=ledger.scan(),
                partial_batch_left=files.partial_batch_present(),
                collection_lock_held=lock_held,
                startup_sync_began='"resuming"' in children.log_text(daemon),
            )
        )
    return records


def wait_for_kill_moment(
    children: Children,
    daemon: subprocess.Popen[bytes],
    plan: KillPlan,
    files: RunFiles,
    ledger: BatchLedger,
    max_steps: int,
) -> bool:
    """Wait until `plan`'s trigger fires (and its delay passes); return whether it fired.

    A batch kill planned once every batch has shipped waits for a collection instead.
    Raises AssertionError when the daemon exits on its own or reaches no phase in time.
    """
    spawned = time.monotonic()
    shipped_at_spawn = ledger.scan()
    phase = plan.phase
    if phase == "batch" and shipped_at_spawn >= max_steps:
        phase = "collection"
    fired_at: float | None = spawned if phase == "startup" and not plan.in_sync else None
    while True:
        now = time.monotonic()
        if fired_at is not None and now - fired_at >= plan.delay_s:
            return True
        code = daemon.poll()
        assert code is None, f"the daemon exited with {code} before its planned kill ({plan}); " + (
            "the run finished: raise max_steps for this many kills"
            if code == 0
            else "log:\n" + children.log_tail(daemon)
        )
        assert now - spawned < PHASE_DEADLINE_S, (
            f"the daemon reached no {phase} phase in {PHASE_DEADLINE_S} s; log:\n"
            + children.log_tail(daemon)
        )
        shipped = ledger.scan()
        if fired_at is None and phase == "startup" and files.dispatching_pid() == daemon.pid:
            # A fresh run has no start-up sync: strike now (it counts as a missed aim).
            return True
        if fired_at is None and (
            (phase == "startup" and '"resuming"' in children.log_text(daemon))
            or (phase == "dispatch" and files.dispatching_pid() == daemon.pid)
            or (phase == "batch" and shipped > shipped_at_spawn)
            or (phase == "batch" and plan.on_partial and files.partial_batch_present())
            or (phase == "collection" and files.collection_lock_pid() == daemon.pid)
        ):
            fired_at = now
            continue
        time.sleep(POLL_S)


def version_dirs(root: Path) -> list[int]:
    """The k of every `v<k>` entry directly in `root`."""
    return sorted(int(p.name[1:]) for p in root.iterdir() if VERSION_DIR.fullmatch(p.name))


def payload_files(root: Path) -> list[Path]:
    """Every file below `root` except payload_gc's own (its marker, lock and audit log)."""
    return [
        path.relative_to(root)
        for path in root.rglob("*")
        if not path.is_dir() and path.relative_to(root).parts[0] not in CONTROL_NAMES
    ]


def version_of(relative: Path) -> int:
    """k when `relative` is `v<k>/<file>`; -1 (below every bound) for anything else."""
    match = VERSION_DIR.fullmatch(relative.parts[0])
    return int(match.group(1)) if match and len(relative.parts) == 2 else -1


def format_overrides(batch_format: str, output_dir: Path) -> list[str]:
    """The config of a run in `batch_format`: prime-rl's with two data ranks, shipping to
    and following `output_dir`'s rollouts/ and broadcasts/, as with prime-rl's trainer."""
    if batch_format == "native":
        return []
    return [
        'trainer.format="prime-rl"',
        'trainer.weights_layout="prime-rl"',
        "trainer.data_world_size=2",
        f'trainer.batches_dir="{output_dir / "rollouts"}"',
        f'trainer.weights_dir="{output_dir / "broadcasts"}"',
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("batch_format", "disaggregated"),
    [("native", False), ("prime-rl", False), ("native", True)],
    ids=["native", "prime-rl", "pd"],
)
def test_sigkilled_daemon_resumes_without_loss_reshipping_or_stray_deletion(
    tmp_path: Path, children: Children, kills: int, batch_format: str, disaggregated: bool
) -> None:
    # Enough steps that kills aimed at new batches do not run out of them: a life killed
    # while dispatching can ship up to four batches first (the trainer kept publishing
    # while the daemon was down), and 14 steps for 20 kills ran out now and then.
    max_steps = max(20, kills)
    if batch_format == "prime-rl":
        # The same phases, two kills each by default: the writer differs, not the daemon.
        kills = max(len(PHASES), kills * 2 // 5)
    elif disaggregated:
        # The same phases, one kill each by default: the fleet differs, not the daemon.
        kills = max(len(PHASES), kills // 5)
    if batch_format == "prime-rl" or disaggregated:
        # Fewer kills, fewer steps: their lives shipped 0 to 2 batches in all (8 and 4
        # kills), and the final run, which makes the rest, is most of their time.
        max_steps = max(12, kills + 4)
    rng = random.Random(SEED)
    plans = draw_kill_plans(rng, kills)
    m = 2
    server_options = ["--disaggregated"] if disaggregated else []
    servers = [start_sim_server(children, f"server-{i}", extra=server_options) for i in range(2)]
    run_dir = tmp_path / "run"
    config_path = tmp_path / "run.toml"
    config = write_run_config(
        config_path,
        run_dir,
        f"max_steps={max_steps}",
        f"staleness.max_off_policy_steps={m}",
        "staleness.max_async_steps=1",
        "sim.inference_servers=0",
        "sim.trainer=false",
        urls_override([server.url for server in servers]),
        "inference.request_timeout_s=5.0",
        f"inference.disaggregated={str(disaggregated).lower()}",
        *format_overrides(batch_format, tmp_path / "prime-rl-output"),
    )
    sentinel_beside = plant_tree(tmp_path / "beside-the-run")
    sentinel_inside = plant_tree(run_dir / "keep")
    trainer = children.spawn(
        "trainer", orchestrator_command("sim-trainer", "--config", str(config_path))
    )

    files = RunFiles(config)
    ledger = BatchLedger(config.batches_dir, config.trainer.format, config.trainer.data_world_size)
    records = run_lives(children, config_path, files, ledger, plans, max_steps)

    final = children.spawn(
        "daemon-final", orchestrator_command("run", "--config", str(config_path))
    )
    try:
        final_code = final.wait(timeout=FINAL_RUN_DEADLINE_S)
    except subprocess.TimeoutExpired:
        final_code = None
    assert final_code == 0, (
        f"final run: exit {final_code}; log:\n{children.log_tail(final, 30)}\n"
        f"the trainer's log:\n{children.log_tail(trainer, 15)}"
    )
    assert trainer.wait(timeout=30) == 0, children.log_tail(trainer)
    ledger.scan()

    killed = "\n".join(str(record) for record in records)
    # Shown with `pytest -s`: where each kill landed.
    print(f"\n{len(records)} kills over {max_steps} steps:\n{killed}")
    # At least `kills` kills, and each phase was hit at least once as planned.
    assert len(records) == kills
    if kills >= len(PHASES):
        for phase in PHASES:
            assert any(r.triggered and r.plan.phase == phase for r in records), (
                f"no kill landed in the {phase} phase:\n{killed}"
            )

    # The trainer saw no missing or corrupt payload, and trained on every step 1..N.
    report = json.loads((run_dir / "trainer" / "report.json").read_text())
    assert report["violations"] == [], report["violations"]
    assert report["first_step"] == 1 and report["last_step"] == max_steps
    assert report["steps"] == max_steps
    layout = config.trainer.weights_layout
    assert published_versions(config.weights_dir, layout=layout) == list(range(1, max_steps + 1))

    # Batches 1..N each shipped once: exactly those complete directories, none rewritten,
    # and no temp directory of a publish cut short is left.
    assert ledger.shipped() == list(range(1, max_steps + 1))
    if batch_format == "prime-rl":
        # Nothing but the steps, in prime-rl's spelling, each whole.
        expected = sorted(f"step_{n}" for n in range(1, max_steps + 1))
        assert sorted(os.listdir(config.batches_dir)) == expected
    assert ledger.rewritten == [], f"{ledger.rewritten}\n{killed}"
    assert not files.partial_batch_present()

    # After the final collection, nothing below the bound remains, and every payload file
    # left lies directly in a v<k> at or above it.
    bound = min_fresh_version(max_steps + 1, m)
    left = version_dirs(config.payload_root)
    assert all(k >= bound for k in left), f"left below v{bound}: {sorted(left)}"
    misplaced = [
        str(path) for path in payload_files(config.payload_root) if version_of(path) < bound
    ]
    assert misplaced == [], misplaced

    # Nothing outside the payload root was touched.
    assert snapshot_tree(tmp_path / "beside-the-run") == sentinel_beside
    assert snapshot_tree(run_dir / "keep") == sentinel_inside

    # The servers stayed up through it all.
    assert all(server.process.poll() is None for server in servers)

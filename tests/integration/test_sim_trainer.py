"""The local trainer with real files: reads batches, publishes versions, counts violations
and dropped samples."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio
from sample_kit import Turn, by_handle_sample, inline_sample

from orchestrator.handoff import (
    BATCH_FILE,
    TrainSample,
    latest_published_version,
    publish_batch,
    published_versions,
    read_batch_file,
)
from orchestrator.sim.trainer import Dropped, SimTrainerConfig, TrainerStats, serve_trainer

PROMPT, COMPLETION, LAYERS, TOP_K = 12, 8, 6, 4
LENGTH = PROMPT + COMPLETION
# routed_experts [20, 6, 4] uint8 + sampling_mask [20, 3] int32.
SAMPLE_PAYLOAD_BYTES = LENGTH * LAYERS * TOP_K + LENGTH * 3 * 4


def _turn(seed: int) -> Turn:
    """The routing and sampling mask of a one-turn sample, as a server returns them."""
    rng = np.random.default_rng(seed)
    routing = rng.integers(0, 64, size=(LENGTH - 1, LAYERS, TOP_K)).astype(np.uint8)
    mask = rng.integers(0, 500, size=(COMPLETION, 3)).astype(np.int32)
    return {"routed_experts": (routing, 0), "sampling_mask": (mask, PROMPT)}


def _fields(seed: int) -> dict[str, Any]:
    """Sample `seed`'s own fields: its group, its rollout, tokens from `seed` on."""
    return {
        "prompt": PROMPT,
        "logprob": -0.1,
        "group_id": f"g{seed}",
        "rollout_id": f"r{seed}",
        "token_ids": range(seed, seed + LENGTH),
    }


def by_handle(payload_root: Path, seed: int) -> TrainSample:
    """A one-turn sample whose payload file is written like a server writes it, in v0."""
    return by_handle_sample(payload_root / "v0", [_turn(seed)], LENGTH, **_fields(seed))


def inline(seed: int) -> TrainSample:
    return inline_sample([_turn(seed)], LENGTH, **_fields(seed))


@attrs.frozen
class Run:
    batches_dir: Path
    weights_dir: Path
    payload_root: Path
    report_path: Path

    def config(self, max_steps: int, **changes: Any) -> SimTrainerConfig:
        config = SimTrainerConfig(
            batches_dir=self.batches_dir,
            weights_dir=self.weights_dir,
            train_time_s=0.0,
            max_steps=max_steps,
            force_polling=True,
            poll_interval_s=0.05,
            report_path=self.report_path,
        )
        return attrs.evolve(config, **changes)

    def ship(self, step: int, seeds: range) -> Path:
        samples = [by_handle(self.payload_root, seed) for seed in seeds]
        return publish_batch(self.batches_dir, step, samples, fsync=False)

    def report(self) -> dict[str, object]:
        report: dict[str, object] = json.loads(self.report_path.read_text())
        return report


async def wait_until_published(weights_dir: Path, step: int) -> None:
    """Poll the weights directory (another task publishes into it) until `step` is there."""
    for _ in range(1000):
        if latest_published_version(weights_dir) >= step:
            return
        await trio.sleep(0.01)
    raise AssertionError(f"v{step} was not published")


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return Run(
        batches_dir=tmp_path / "batches",
        weights_dir=tmp_path / "weights",
        payload_root=tmp_path / "payloads",
        report_path=tmp_path / "trainer" / "report.json",
    )


async def test_trains_on_virtual_time_then_stops_after_max_steps(
    run: Run, autojump_clock: trio.testing.MockClock
) -> None:
    for step in (1, 2, 3):
        samples = [by_handle(run.payload_root, 10 * step), inline(10 * step + 1)]
        publish_batch(run.batches_dir, step, samples, fsync=False)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        stats = await nursery.start(serve_trainer, run.config(3, train_time_s=0.5))
        assert stats.first_step == 1
    # Reading and publishing happen in threads; only the training sleeps take time.
    assert trio.current_time() - start == 1.5
    assert published_versions(run.weights_dir) == [1, 2, 3]
    assert stats == TrainerStats(
        first_step=1,
        last_step=3,
        steps=3,
        samples=6,
        payload_bytes=6 * SAMPLE_PAYLOAD_BYTES,
        violations=[],
    )
    assert TrainerStats.from_json(run.report()) == stats


async def test_reads_batches_as_they_are_shipped(run: Run) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            stats = await nursery.start(serve_trainer, run.config(3))
            for step in (1, 2, 3):
                # Each version appears only after its batch was shipped.
                assert published_versions(run.weights_dir) == list(range(1, step))
                run.ship(step, range(2))
                await wait_until_published(run.weights_dir, step)
    assert (stats.steps, stats.samples, stats.violations) == (3, 6, [])
    assert stats.payload_bytes == 6 * SAMPLE_PAYLOAD_BYTES
    assert run.report()["last_step"] == 3


async def test_inotify_without_polling_sees_the_batch(run: Run) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            # A poll interval far longer than the test: only an event can wake it in time.
            config = run.config(1, force_polling=False, poll_interval_s=60.0)
            await nursery.start(serve_trainer, config)
            await trio.sleep(0.2)  # let the watcher start
            run.ship(1, range(1))
    assert published_versions(run.weights_dir) == [1]


async def test_a_deleted_payload_file_is_a_violation_and_training_goes_on(run: Run) -> None:
    run.ship(1, range(2))
    run.ship(2, range(2, 4))
    run.ship(3, range(4, 6))
    victim = next((run.payload_root / "v0").iterdir())
    victim.unlink()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            stats = await nursery.start(serve_trainer, run.config(3))
    assert published_versions(run.weights_dir) == [1, 2, 3]
    assert stats.steps == 3
    [violation] = stats.violations
    assert violation.kind == "payload_missing"
    assert violation.file == str(victim)
    assert str(victim) in violation.message
    # Only the sample whose file is gone was left out: a missing file is still a
    # violation (the hand-off broke), but the rest of its batch was trained on.
    [dropped] = stats.dropped
    assert (dropped.step, dropped.reason, dropped.file) == (
        violation.step,
        "payload_missing",
        str(victim),
    )
    assert stats.samples == 5
    assert run.report()["violations"] == [attrs.asdict(violation)]


async def test_a_malformed_batch_is_a_violation_a_corrupt_sample_is_not(run: Run) -> None:
    run.ship(1, range(1))
    bad = run.batches_dir / "step_000002"
    bad.mkdir()
    (bad / BATCH_FILE).write_bytes(b"ROBATCH\n\x02\x00\x00\x00\xff\xff\x00\x00")
    corrupt = run.ship(3, range(1, 2))
    segment = read_batch_file(corrupt / BATCH_FILE).samples[0].payload["routed_experts"][0]
    victim = run.payload_root / "v0" / segment.file
    data = bytearray(victim.read_bytes())
    data[3] ^= 1
    victim.write_bytes(bytes(data))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            stats = await nursery.start(serve_trainer, run.config(3))
    kinds = [(v.step, v.kind, v.file) for v in stats.violations]
    assert kinds == [(2, "bad_batch", str(bad / BATCH_FILE))]
    assert [(d.step, d.reason, d.file) for d in stats.dropped] == [
        (3, "payload_corrupt", str(victim))
    ]
    assert published_versions(run.weights_dir) == [1, 2, 3]


async def test_a_corrupt_sample_is_dropped_named_and_no_violation(
    run: Run, capfd: pytest.CaptureFixture[str]
) -> None:
    server = "http://127.0.0.1:8101"
    samples = [
        attrs.evolve(by_handle(run.payload_root, seed), server=f"http://127.0.0.1:810{seed}")
        for seed in range(3)
    ]
    batch_dir = publish_batch(run.batches_dir, 1, samples, fsync=False)
    # The server of sample 1 wrote a wrong digest: its bytes no longer match it.
    segment = read_batch_file(batch_dir / BATCH_FILE).samples[1].payload["sampling_mask"][0]
    victim = run.payload_root / "v0" / segment.file
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            stats = await nursery.start(serve_trainer, run.config(1))
    assert published_versions(run.weights_dir) == [1]
    assert stats.violations == []
    assert (stats.steps, stats.samples) == (1, 2)
    assert stats.payload_bytes == 2 * SAMPLE_PAYLOAD_BYTES
    [dropped] = stats.dropped
    assert dropped == Dropped(
        step=1,
        group_id="g1",
        rollout_id="r1",
        server=server,
        reason="payload_corrupt",
        file=str(victim),
        message=dropped.message,
    )
    assert "rollout r1" in dropped.message and server in dropped.message
    assert TrainerStats.from_json(run.report()) == stats
    assert run.report()["dropped"] == [attrs.asdict(dropped)]
    # One log line for the drop, naming the rollout and the server.
    [line] = [line for line in capfd.readouterr().out.splitlines() if "sample dropped" in line]
    assert "rollout=r1" in line and f"server={server}" in line and str(victim) in line


def test_a_report_without_dropped_samples_still_reads() -> None:
    # Written before samples could be dropped: resuming from it must not count afresh.
    old = {
        "format": "rollout-orchestrator.trainer-report/1",
        "first_step": 1,
        "last_step": 2,
        "steps": 2,
        "samples": 4,
        "payload_bytes": 10,
        "violations": [],
    }
    assert TrainerStats.from_json(old) == TrainerStats(
        first_step=1, last_step=2, steps=2, samples=4, payload_bytes=10
    )


async def test_a_restarted_trainer_resumes_after_the_latest_version(run: Run) -> None:
    for step in (1, 2, 3, 4):
        run.ship(step, range(step, step + 1))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            first = await nursery.start(serve_trainer, run.config(2))
        assert published_versions(run.weights_dir) == [1, 2]
        # Kill it mid-publish of v3: the directory exists but holds no STABLE marker.
        (run.weights_dir / "step_000003").mkdir()
        async with trio.open_nursery() as nursery:
            second = await nursery.start(serve_trainer, run.config(4))
            assert second.first_step == 1  # the report's counts are carried on
    assert published_versions(run.weights_dir) == [1, 2, 3, 4]
    assert (first.steps, second.steps, second.samples, second.last_step) == (2, 4, 4, 4)


async def test_resume_without_a_report_counts_from_the_resume_step(run: Run) -> None:
    for step in (1, 2):
        run.ship(step, range(step, step + 1))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_trainer, run.config(1))
        run.report_path.write_text("not json")
        async with trio.open_nursery() as nursery:
            stats = await nursery.start(serve_trainer, run.config(2))
    assert (stats.first_step, stats.steps, stats.last_step) == (2, 1, 2)


async def test_nothing_to_do_when_max_steps_is_already_published(run: Run) -> None:
    run.ship(1, range(1))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_trainer, run.config(1))
        async with trio.open_nursery() as nursery:
            stats = await nursery.start(serve_trainer, run.config(1))
    assert (stats.first_step, stats.steps, stats.last_step) == (1, 1, 1)
    assert published_versions(run.weights_dir) == [1]


async def test_cancelling_a_waiting_trainer_stops_it_promptly(run: Run) -> None:
    # The watcher thread cannot be interrupted; the wait wakes it every 0.5 s however
    # long the poll interval, so the cancellation lands well within the deadline.
    config = run.config(0, force_polling=False, poll_interval_s=60.0)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            stats = await nursery.start(serve_trainer, config)
            await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
    assert (stats.steps, stats.last_step) == (0, 0)
    assert published_versions(run.weights_dir) == []


def test_config_rejects_impossible_values(run: Run) -> None:
    with pytest.raises(ValueError, match="train_time_s must be >= 0"):
        run.config(1, train_time_s=-1.0)
    with pytest.raises(ValueError, match="max_steps must be >= 0"):
        run.config(-1)
    with pytest.raises(ValueError, match="poll_interval_s must be > 0"):
        run.config(1, poll_interval_s=0.0)

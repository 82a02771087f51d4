"""The daemon end to end as prime-rl's orchestrator: it ships `rollouts/step_N/rank_R.bin`
for two data ranks, the local trainer stands in for prime-rl's (decoding every rank file,
checking every micro batch and the routing rows against the payload files) and publishes
`broadcasts/step_N/STABLE`, and every invariant holds."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import trio

from orchestrator.commands.inspect import read_run_on_disk
from orchestrator.commands.launch import launch_run
from orchestrator.commands.summary import check_invariants
from orchestrator.config import Config, load_config
from orchestrator.core.rollouts import TrainSample
from orchestrator.daemon import RunOutcome
from orchestrator.handoff import HANDOFF_FORMATS, HandoffSettings, Shipment, published_versions
from orchestrator.handoff.primerl import (
    MANIFEST_FILE,
    PrimeRLFormat,
    decode_rank_file,
    shipped_primerl_steps,
)
from orchestrator.payload import PayloadSegment

DEMO = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"


def primerl_config(tmp_path: Path, *overrides: str) -> Config:
    output_dir = tmp_path / "prime-rl"
    return load_config(
        DEMO,
        [
            f'run_dir="{tmp_path / "run"}"',
            "sim.train_time_s=0.02",
            "trainer.poll_interval_s=0.1",
            'trainer.format="prime-rl"',
            'trainer.weights_layout="prime-rl"',
            "trainer.data_world_size=2",
            f'trainer.batches_dir="{output_dir / "rollouts"}"',
            f'trainer.weights_dir="{output_dir / "broadcasts"}"',
            *overrides,
        ],
    )


def assert_invariants(config: Config, outcome: RunOutcome, steps: int) -> None:
    invariants = check_invariants(
        handoff=config.handoff,
        settings=config.handoff_settings,
        payload_root=config.payload_root,
        trainer_report=config.run_dir / "trainer" / "report.json",
        last_step=steps,
        bound=outcome.state.versions.collected_below,
    )
    for invariant in invariants:
        assert invariant.held is True, invariant


def assert_prime_rl_layout(config: Config, steps: int) -> list[dict[str, Any]]:
    """Step dirs `step_1..N`, each with both ranks' files and the manifest; the ranks
    decode as prime-rl's `list[MicroBatch]`, the same number each. Returns the manifests."""
    rollouts = config.batches_dir
    expected = [f"step_{n}" for n in range(1, steps + 1)]
    assert sorted(p.name for p in rollouts.iterdir()) == sorted(expected)
    assert shipped_primerl_steps(rollouts, 2) == list(range(1, steps + 1))
    manifests = []
    for name in expected:
        step_dir = rollouts / name
        assert sorted(p.name for p in step_dir.iterdir()) == [
            MANIFEST_FILE,
            "rank_0.bin",
            "rank_1.bin",
        ]
        ranks = [decode_rank_file((step_dir / f"rank_{r}.bin").read_bytes()) for r in (0, 1)]
        assert len(ranks[0]) == len(ranks[1]) >= 1
        manifests.append(json.loads((step_dir / MANIFEST_FILE).read_text()))
    assert published_versions(config.weights_dir, layout="prime-rl") == list(range(1, steps + 1))
    assert sorted(p.name for p in config.weights_dir.iterdir()) == expected
    return manifests


@pytest.mark.slow
async def test_the_daemon_ships_prime_rl_steps_by_handle_for_two_ranks(tmp_path: Path) -> None:
    config = primerl_config(tmp_path, "max_steps=4")
    with trio.fail_after(120):
        outcome = await launch_run(config)
    assert outcome.state.shipping.next_step == 5 and outcome.state.versions.settled == 4
    assert_invariants(config, outcome, 4)
    manifests = assert_prime_rl_layout(config, 4)
    report = json.loads((config.run_dir / "trainer" / "report.json").read_text())
    assert (report["steps"], report["violations"], report["dropped"]) == (4, [], [])
    assert report["samples"] == 4 * config.batch.size
    # By handle: every sequence names its payload files, and the trainer read them all.
    sequences = [
        sequence
        for manifest in manifests
        for rank in manifest["ranks"]
        for batch in rank["micro_batches"]
        for sequence in batch["sequences"]
    ]
    assert sequences and all(s["routing"] == "by_handle" for s in sequences)
    assert report["payload_bytes"] > 0
    # The collector ran as usual: prime-rl's trainer reads step N before publishing N.
    assert outcome.state.versions.collected_below == 2
    assert outcome.state.payload.files_deleted["collection"] > 0
    # `orchestrator status` counts prime-rl steps as shipped.
    snapshot = read_run_on_disk(config)
    assert (snapshot.shipped_step, snapshot.published_version) == (4, 4)


@pytest.mark.slow
async def test_the_daemon_ships_prime_rl_steps_with_inline_routing(tmp_path: Path) -> None:
    config = primerl_config(tmp_path, "max_steps=2", 'payload.mode="inline"')
    assert config.by_handle is False
    with trio.fail_after(120):
        outcome = await launch_run(config)
    assert_invariants(config, outcome, 2)
    manifests = assert_prime_rl_layout(config, 2)
    routing = {
        sequence["routing"]
        for manifest in manifests
        for rank in manifest["ranks"]
        for batch in rank["micro_batches"]
        for sequence in batch["sequences"]
    }
    assert routing == {"inline"}
    report = json.loads((config.run_dir / "trainer" / "report.json").read_text())
    assert (report["steps"], report["violations"]) == (2, [])
    assert report["payload_bytes"] > 0


def flip_first_byte(segment: PayloadSegment, payload_dir: str, flipped: set[Path]) -> None:
    path = Path(payload_dir) / segment.file
    if segment.is_fill or path in flipped:
        return
    flipped.add(path)
    with path.open("r+b") as file:
        file.seek(segment.offset)
        byte = file.read(1)
        file.seek(segment.offset)
        file.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.slow
async def test_payloads_broken_after_admission_never_stop_the_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The servers add digests, so the writer (verifying them) sees the flipped bytes.
    config = primerl_config(tmp_path, "max_steps=3", "sim.payload_digests=true")
    attempts: list[tuple[int, int]] = []
    flipped: set[Path] = set()

    class PublishAfterBreaking(PrimeRLFormat):
        def ship(
            self, settings: HandoffSettings, step: int, samples: Sequence[TrainSample]
        ) -> Shipment:
            # The first attempt loses every sample's payload; later ones, one sample's.
            attempts.append((step, len(samples)))
            for sample in samples if len(attempts) == 1 else samples[:1]:
                assert sample.payload_dir is not None
                flip_first_byte(sample.payload["routed_experts"][0], sample.payload_dir, flipped)
            return super().ship(settings, step, samples)

    monkeypatch.setitem(HANDOFF_FORMATS, "prime-rl", PublishAfterBreaking())
    with structlog.testing.capture_logs() as logs, trio.fail_after(120):
        outcome = await launch_run(config)
    # Step 1 shipped nothing the first time and was filled again from new samples.
    assert [step for step, _ in attempts[:2]] == [1, 1]
    not_shipped = "batch not shipped: no sample's payload could be read"
    assert any(entry["event"] == not_shipped for entry in logs)
    assert outcome.state.versions.settled == 3
    assert_invariants(config, outcome, 3)
    assert_prime_rl_layout(config, 3)
    report = json.loads((config.run_dir / "trainer" / "report.json").read_text())
    assert report["violations"] == []
    dropped = report["dropped"]
    assert dropped and {d["reason"] for d in dropped} == {"payload_corrupt"}
    assert all(d["server"].startswith("http://127.0.0.1:") for d in dropped)
    # Every sample that did not ship is counted: the first attempt's and the later drops.
    assert outcome.sink.counters["untrainable"] >= attempts[0][1] + len(dropped)
    warnings = [e for e in logs if e["event"] == "sample dropped: payload unreadable"]
    assert all(w["rollout"] and w["server"] for w in warnings)

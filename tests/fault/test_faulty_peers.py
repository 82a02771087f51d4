"""Faulty peers: local inference servers that answer 500, hang, cut replies short, point
segments outside the payload directory or fail to write their payloads.

The daemon runs in-process with its local fleet and trainer (`[sim] inference_servers = 2,
trainer = true`). The run must complete, count every failure by kind, never train on a
poisoned rollout, leave no payload file it cannot explain, and never delete anything
outside the payload root, not even the file a traversal segment names.

The same run under disaggregated prefill/decode (each server a router in front of a
prefill and a decode server, faults injected on both sides), by handle and inline. The
router answers a side's cut-short reply with a 500, as the real one does, so there a
malformed reply is counted as `http_5xx`; by handle, both sides' files of every rollout
are deleted or collected like any other.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import trio
from _fault_kit import run_config, snapshot_tree
from payload_gc import min_fresh_version

from orchestrator.commands.launch import launch_run
from orchestrator.config import Config
from orchestrator.core.rollouts import GroupResult
from orchestrator.core.sink import TrainSink
from orchestrator.daemon import RunOutcome
from orchestrator.handoff import (
    BATCH_FILE,
    HANDOFF_FORMATS,
    HandoffSettings,
    NativeFormat,
    Shipment,
    TrainSample,
    batch_step_dir,
    read_batch,
    read_batch_file,
    shipped_steps,
)
from orchestrator.sim._response import TRAVERSAL_FILE_NAME

STEPS = 6
M = 2
# With these rates, fault seed 2 gives each server every kind of fault (a traversal name
# among the bad segments) within its first 15 requests; a run makes hundreds.
FAULTS = (
    "sim.http_500_rate=0.10",
    "sim.hang_rate=0.05",
    "sim.malformed_rate=0.01",
    "sim.bad_segment_rate=0.05",
    "sim.payload_error_rate=0.05",
    "sim.fault_seed=2",
)


DEPLOYMENTS = {
    "aggregated": (),
    "pd-by-handle": ("inference.disaggregated=true",),
    "pd-inline": ("inference.disaggregated=true", 'payload.mode="inline"'),
}


def faulty_config(run_dir: Path, *overrides: str) -> Config:
    return run_config(
        run_dir,
        *overrides,
        f"max_steps={STEPS}",
        f"staleness.max_off_policy_steps={M}",
        *FAULTS,
        # Hangs time out quickly; enough retries that a turn rarely fails for good.
        "inference.request_timeout_s=0.5",
        "inference.retries=5",
        "inference.retry_backoff_s=0.05",
        # Half the demo's batches and rollouts in flight (16, 32): still hundreds of
        # requests, each kind of fault within every server's first 15.
        "batch.size=8",
        "inference.max_inflight=16",
    )


def spy_on_poisoned(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The rollout ids of every poisoned sample the sink is handed, as the run goes."""
    poisoned: set[str] = set()
    admit = TrainSink.admit

    def admit_and_note(sink: TrainSink, group: GroupResult, next_step: int) -> list[str]:
        for rollout in group.rollouts:
            for sample in rollout.samples:
                if (sample.untrainable or "").startswith("poisoned"):
                    poisoned.add(rollout.rollout_id)
        return admit(sink, group, next_step)

    monkeypatch.setattr(TrainSink, "admit", admit_and_note)
    return poisoned


def read_each_batch_as_shipped(monkeypatch: pytest.MonkeyPatch) -> dict[int, set[str]]:
    """Read every batch the daemon ships, verifying every payload digest, right after it
    is published; return the rollout ids of each batch's samples.

    Right after publishing, because that is when a batch must be whole: once the trainer
    has read it and its version is collected, its oldest payload versions are gone by
    design. The daemon applies `v{s}` only after it has counted batch `s` as shipped,
    which happens after this returns, so no collection can race the read.
    """
    rollout_ids: dict[int, set[str]] = {}

    class PublishThenRead(NativeFormat):
        # Runs in the daemon's shipping worker thread, before the step counts as shipped.
        def ship(
            self, settings: HandoffSettings, step: int, samples: Sequence[TrainSample]
        ) -> Shipment:
            shipment = super().ship(settings, step, samples)
            batch = read_batch(shipment.path, verify=True)
            rollout_ids[step] = {sample.rollout_id for sample in batch.samples}
            return shipment

    monkeypatch.setitem(HANDOFF_FORMATS, "native", PublishThenRead())
    return rollout_ids


def referenced_files(batches_dir: Path) -> set[Path]:
    """Every payload file a shipped batch points into."""
    files: set[Path] = set()
    for step in shipped_steps(batches_dir):
        path = batch_step_dir(batches_dir, step) / BATCH_FILE
        for sample in read_batch_file(path).samples:
            for segments in sample.payload.values():
                files.update(
                    Path(sample.payload_dir, segment.file)
                    for segment in segments
                    if sample.payload_dir and segment.file
                )
    return files


def unexplained_files(root: Path, bound: int, referenced: set[Path]) -> list[str]:
    """Payload files that neither a shipped batch nor a version at or above `bound` explains."""
    unexplained = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if path.is_dir() or relative.parts[0] in (".payload-root", ".payload-gc"):
            continue
        in_fresh_version = (
            len(relative.parts) == 2
            and relative.parts[0][:1] == "v"
            and relative.parts[0][1:].isdigit()
            and int(relative.parts[0][1:]) >= bound
        )
        if not in_fresh_version and path not in referenced:
            unexplained.append(str(relative))
    return unexplained


def events(logs: Sequence[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    return [entry for entry in logs if entry.get("event") == name]


@pytest.mark.slow
@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
async def test_faulty_fleet_completes_counts_failures_and_never_trains_on_bad_payloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deployment: str
) -> None:
    run_dir = tmp_path / "run"
    config = faulty_config(run_dir, *DEPLOYMENTS[deployment])
    by_handle = config.by_handle
    disaggregated = config.inference.disaggregated
    # Where a traversal segment's name, `<root>/v<k>/../../etc/x.bin`, lands: a real file
    # that must survive every discard, sweep and collection.
    target = (config.payload_root / "v0" / TRAVERSAL_FILE_NAME).resolve()
    assert target == run_dir / "etc" / "x.bin"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"not a payload: never delete me\n")
    before = snapshot_tree(run_dir / "etc")
    poisoned_ids = spy_on_poisoned(monkeypatch)
    shipped = read_each_batch_as_shipped(monkeypatch)

    with structlog.testing.capture_logs() as logs, trio.fail_after(120):
        outcome: RunOutcome = await launch_run(config)
    state = outcome.state
    # Shown with `pytest -s`.
    print(f"\nfailures {dict(state.dispatch.failures)}, rollouts {dict(state.dispatch.rollouts)}")
    print(f"discards {dict(outcome.sink.counters)}, deleted {dict(state.payload.files_deleted)}")

    assert state.shipping.next_step == STEPS + 1 and state.versions.settled == STEPS
    assert shipped_steps(config.batches_dir) == list(range(1, STEPS + 1))
    # Every kind of fault was seen and counted, none was fatal. Segment faults exist by
    # handle only; the P/D router turns a side's cut-short reply into a 500.
    kinds = ["http_5xx", "timeout"]
    kinds += [] if disaggregated else ["malformed"]
    kinds += ["poisoned_payload"] if by_handle else []
    for kind in kinds:
        assert state.dispatch.failures[kind] > 0, dict(state.dispatch.failures)
    if disaggregated:
        assert state.dispatch.failures["malformed"] == 0, dict(state.dispatch.failures)
    if not by_handle:
        assert state.dispatch.failures["poisoned_payload"] == 0, dict(state.dispatch.failures)
        assert state.dispatch.rollouts["poisoned"] == 0 and not poisoned_ids
    else:
        assert state.dispatch.rollouts["poisoned"] > 0, dict(state.dispatch.rollouts)
        # The spy saw the poisoned rollouts the dispatcher counted (groups still running at
        # the end are cancelled, so some counted ones may never reach the sink).
        assert 0 < len(poisoned_ids) <= state.dispatch.rollouts["poisoned"]
        assert outcome.sink.counters["untrainable"] > 0
        # A traversal name was among the bad segments, and was refused, not followed.
        # (Its texts are what the rejections remember; the log has one line per interval.)
        reasons = [
            text for text, _ in state.dispatch.rejections.most_common("poisoned_payload", 100)
        ]
        assert any("traversal" in reason for reason in reasons), reasons[:5]
        assert any("payload_error" in reason for reason in reasons), reasons[:5]
        lines = [e for e in events(logs, "rollout failure") if e["kind"] == "poisoned_payload"]
        assert lines and all(e["log_level"] == "warning" for e in lines)
        assert len(lines) < state.dispatch.failures["poisoned_payload"]

    # No poisoned rollout was trained on: every shipped batch read back in full with its
    # digests verified, and no sample came from a poisoned rollout.
    assert sorted(shipped) == list(range(1, STEPS + 1))
    for step, rollout_ids in shipped.items():
        assert rollout_ids, step
        assert not rollout_ids & poisoned_ids, (step, rollout_ids & poisoned_ids)
    report = json.loads((run_dir / "trainer" / "report.json").read_text())
    assert report["violations"] == [] and report["steps"] == STEPS

    # Every payload file left is explained by a shipped batch or a version at or above
    # the bound, and the file a traversal name points at is untouched.
    bound = min_fresh_version(STEPS + 1, M)
    assert state.versions.collected_below == bound
    referenced = referenced_files(config.batches_dir)
    assert unexplained_files(config.payload_root, bound, referenced) == []
    assert snapshot_tree(run_dir / "etc") == before
    if by_handle:
        # Discards deleted files as they went (under P/D, both sides' of each rollout):
        # what is left in the fresh versions is what shipped or is still queued.
        assert state.payload.files_deleted["discard"] > 0, dict(state.payload.files_deleted)
    if by_handle and disaggregated:
        # Every shipped sample's routing came from both sides' files.
        for step in shipped_steps(config.batches_dir):
            path = batch_step_dir(config.batches_dir, step) / BATCH_FILE
            for sample in read_batch_file(path).samples:
                routing = sample.payload["routed_experts"]
                assert len({segment.file for segment in routing}) >= 2

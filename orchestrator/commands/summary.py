"""The end-of-run summary and the invariants it checks (docs/design.md §11).

Invariants, checked from what is on disk, not from what the daemon believes:
- batches 1..N are contiguous: the complete batch directories (of the run's format:
  `step_000007/batch.bin`, or prime-rl's `step_7/rank_R.bin`) are exactly steps 1..N;
- the trainer saw no violation: no missing payload file, no unreadable batch (its report,
  when it wrote one). Samples it dropped for a corrupt payload are the inference servers'
  fault, not the daemon's: the detail counts them by server, but they fail nothing;
- after the last collection no `v<k>` below the bound remains in the payload root.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
from payload_gc import PayloadGCError, RootMissing, human_bytes, scan_root

from orchestrator.daemon.run_state import Evaluation
from orchestrator.daemon.run_totals import RunTotals
from orchestrator.handoff import HandoffFormat, HandoffSettings


@attrs.frozen
class Invariant:
    name: str
    held: bool | None  # None: could not be checked (e.g. no trainer report)
    detail: str


def check_invariants(
    *,
    handoff: HandoffFormat,
    settings: HandoffSettings,
    payload_root: Path,
    trainer_report: Path,
    last_step: int,
    bound: int | None,
    stopped: bool = False,
) -> list[Invariant]:
    """Check the run's invariants on disk. Blocking.

    `stopped`: the run was stopped by a signal. Requests it cancelled may still write
    files into versions below the bound, which the next collection removes (docs/design.md §3):
    what is left below the bound is then reported, but cannot be held against the run.
    `handoff` and its `settings` (the config's) say what a shipped step is, and where.
    """
    steps = handoff.shipped_steps(settings) if settings.batches_dir.exists() else []
    expected = list(range(1, last_step + 1))
    contiguous = Invariant(
        "batches contiguous",
        steps == expected,
        f"batches 1..{last_step} shipped once each"
        if steps == expected
        else f"shipped steps {steps[:5]}...{steps[-5:]} != 1..{last_step}",
    )
    violations: Invariant
    try:
        report = json.loads(trainer_report.read_text())
        count = len(report.get("violations", []))
        violations = Invariant(
            "no payload violations",
            count == 0,
            f"the trainer read {report.get('samples', '?')} samples of "
            f"{report.get('steps', '?')} batches, {count} violations "
            f"(missing payloads, unreadable batches); {_dropped_detail(report)}",
        )
    except (OSError, ValueError, AttributeError, TypeError):
        violations = Invariant("no payload violations", None, "no trainer report to check")
    collected = _collected_below(payload_root, bound)
    if stopped and collected.held is False:
        collected = Invariant(
            collected.name,
            None,
            f"{collected.detail}, written by requests the stop cancelled; "
            "the next collection removes them",
        )
    return [contiguous, violations, collected]


def _collected_below(payload_root: Path, bound: int | None) -> Invariant:
    """No `v<k>` below `bound` is left in the root, as payload_gc lists it (without
    following a link). A missing root holds none; one payload_gc refuses is unchecked."""
    name = "collected below bound"
    if bound is None:
        return Invariant(name, None, "no collection ran")
    try:
        entries = scan_root(payload_root, measure=False)
    except RootMissing:
        entries = []
    except (PayloadGCError, OSError) as exc:
        return Invariant(name, None, f"cannot list the payload root: {exc}")
    versions = (entry.version for entry in entries)
    stale = sorted(v for v in versions if v is not None and v < bound)
    if stale:
        return Invariant(name, False, f"left below v{bound}: {stale}")
    return Invariant(name, True, f"only v<k> >= v{bound} remain")


def _dropped_detail(report: dict[str, Any]) -> str:
    """How many samples the trainer dropped for broken payloads, by server."""
    dropped = report.get("dropped", [])
    if not dropped:
        return "no sample dropped"
    by_server = Counter(str(d.get("server") or "unknown server") for d in dropped)
    servers = ", ".join(f"{server} {n}" for server, n in sorted(by_server.items()))
    return f"{len(dropped)} samples dropped for broken payloads ({servers})"


def summary_data(
    totals: RunTotals,
    invariants: list[Invariant],
    *,
    duration_s: float,
    first_step: int,
    evaluation: Evaluation | None = None,
    cpu_s: float | None = None,
    workers_cpu_s: float | None = None,
) -> dict[str, Any]:
    """The summary's figures as JSON-able data (`--summary-json`): the run's `totals` at
    its end, its invariants, its evals (`evaluation`, the run state's), and the CPU
    seconds of the daemon's process over the run (`cpu_s`) and of its worker processes
    that ended (`workers_cpu_s`: reward and environment workers), None when not known."""
    completed = totals.rollouts.get("completed", 0)
    return {
        "steps": totals.last_shipped,
        "first_step": first_step,
        "applied_version": totals.applied_version,
        "bound": totals.collected_below,
        "duration_s": round(duration_s, 2),
        "rollouts": dict(totals.rollouts),
        "failures": dict(totals.failures),
        "discards": dict(totals.discards),
        "payload_files_written": totals.files_written,
        "payload_bytes_written": totals.bytes_written,
        "files_deleted": dict(totals.files_deleted),
        "bytes_deleted": dict(totals.bytes_deleted),
        "peak_payload_bytes": totals.peak_payload_bytes,
        "final_payload_bytes": totals.payload_bytes,
        "envs": {
            name: {
                "scored": env.scored,
                "mean_reward": None if env.mean_reward is None else round(env.mean_reward, 4),
                "shipped": env.shipped,
                "discards": dict(env.discards),
                "prompts_skipped": env.prompts_skipped,
                "metrics": {name: round(mean, 4) for name, mean in sorted(env.metrics.items())},
            }
            for name, env in totals.envs.items()
        },
        "evals": None if evaluation is None else _evals_data(evaluation),
        "cpu": {
            "daemon_s": None if cpu_s is None else round(cpu_s, 2),
            "daemon_s_per_rollout": (
                round(cpu_s / completed, 6) if cpu_s is not None and completed else None
            ),
            "workers_s": None if workers_cpu_s is None else round(workers_cpu_s, 2),
        },
        "invariants": [attrs.asdict(i) for i in invariants],
    }


def _cpu_line(cpu: dict[str, Any] | None) -> str | None:
    """`cpu            daemon 9.8 s, 30.6 ms per completed rollout; workers 2.1 s`."""
    if not cpu or cpu.get("daemon_s") is None:
        return None
    per = cpu.get("daemon_s_per_rollout")
    line = f"cpu            daemon {cpu['daemon_s']} s"
    if per is not None:
        line += f", {per * 1000:.2f} ms per completed rollout"
    if cpu.get("workers_s") is not None:
        line += f"; reward and environment workers {cpu['workers_s']} s"
    return line


def _evals_data(evaluation: Evaluation) -> dict[str, Any] | None:
    """The run's evals: how many, their failures, and the last one's line (None: no eval)."""
    if evaluation.last is None:
        return None
    return {
        "evals": evaluation.evals,
        "failures": dict(evaluation.failures),
        "last": evaluation.last.to_json(),
    }


def render_summary(data: dict[str, Any]) -> str:
    """The summary as a few aligned lines for a person."""

    def pairs(mapping: dict[str, int]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(mapping.items())) or "none"

    deleted_files = sum(data["files_deleted"].values())
    deleted_bytes = sum(data["bytes_deleted"].values())
    lines = [
        "",
        "== run summary ==",
        f"steps          {data['steps']} (this process started at {data['first_step']}), "
        f"applied v{data['applied_version']}, bound v{data['bound']}, {data['duration_s']} s",
        f"rollouts       {pairs(data['rollouts'])}",
        f"failures       {pairs(data['failures'])}",
        f"discards       {pairs(data['discards'])}",
        f"payload        written {data['payload_files_written']} files / "
        f"{human_bytes(data['payload_bytes_written'])}; deleted {deleted_files} files / "
        f"{human_bytes(deleted_bytes)} ({_deleted_by_path(data)})",
        f"disk           peak {human_bytes(data['peak_payload_bytes'])}, "
        f"at exit {human_bytes(data['final_payload_bytes'])}",
    ]
    cpu = _cpu_line(data.get("cpu"))
    if cpu is not None:
        lines.append(cpu)
    for name, env in data.get("envs", {}).items():
        mean = "n/a" if env["mean_reward"] is None else f"{env['mean_reward']:.3f}"
        skipped = f", {env['prompts_skipped']} prompts skipped" if env["prompts_skipped"] else ""
        metrics = ", ".join(f"{k} {v:.3g}" for k, v in env.get("metrics", {}).items())
        lines.append(
            f"env {name or '(unnamed)':<10} mean reward {mean} over {env['scored']} rollouts, "
            f"{env['shipped']} samples shipped; discards {pairs(env['discards'])}{skipped}"
            + (f"; metrics (means) {metrics}" if metrics else "")
        )
    evals = data.get("evals")
    if evals:
        last = evals["last"]
        for name, env in last["envs"].items():
            mean = "n/a" if env["reward_mean"] is None else f"{env['reward_mean']:.3f}"
            passes = ", ".join(f"pass@{k} {v:.3f}" for k, v in (env["pass_at"] or {}).items())
            lines.append(
                f"eval {name:<9} v{last['version']}: mean reward {mean} over {env['samples']} "
                f"samples{', ' + passes if passes else ''}; {env['failed']} failed "
                f"({evals['evals']} evals in evals.jsonl)"
            )
    lines.append("invariants")
    if data.get("stopped_by"):
        how = "at once (second signal)" if data.get("forced_by") else "gracefully"
        lines.insert(
            2,
            f"stopped        by {data['stopped_by']}, {how}, before the end of the run; "
            "the same command resumes it",
        )
    for inv in data["invariants"]:
        mark = {True: "ok  ", False: "FAIL", None: "n/a "}[inv["held"]]
        lines.append(f"  {mark} {inv['name']}: {inv['detail']}")
    return "\n".join(lines)


def _deleted_by_path(data: dict[str, Any]) -> str:
    """Files and bytes deleted by path (`discard 204 / 2.8 MiB, collection ...`): what
    discarded rollouts wrote and cost is the `discard` part."""
    files, sizes = data["files_deleted"], data["bytes_deleted"]
    return (
        ", ".join(
            f"{path} {count} / {human_bytes(sizes.get(path, 0))}"
            for path, count in sorted(files.items())
        )
        or "none"
    )


def invariants_hold(data: dict[str, Any]) -> bool:
    return all(inv["held"] is not False for inv in data["invariants"])

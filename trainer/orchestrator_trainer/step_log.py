"""`<run_dir>/trainer.jsonl`: one line per training step, and the mismatch warning.

No torch: what a step measured, as numbers. The line's fields are the report's
(`orchestrator report` draws loss, grad norm, clipped share and the mismatch KL with and
without replay beside the reward); `FORMAT` names their version.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

FORMAT = "rollout-orchestrator.trainer-step/1"


@attrs.define
class Mismatch:
    """Sums of the per-token mismatch KL over on-policy samples, overall and per server."""

    kl_sum: float = 0.0
    tokens: int = 0
    samples: int = 0
    by_server: dict[str, list[float]] = attrs.Factory(dict)

    def add(self, server: str | None, kl_sum: float, tokens: int) -> None:
        self.kl_sum += kl_sum
        self.tokens += tokens
        self.samples += 1
        totals = self.by_server.setdefault(server or "unknown", [0.0, 0.0])
        totals[0] += kl_sum
        totals[1] += tokens

    @property
    def mean(self) -> float | None:
        """The mean KL per token, None without tokens."""
        return self.kl_sum / self.tokens if self.tokens else None

    def server_means(self) -> dict[str, float]:
        return {server: kl / tokens for server, (kl, tokens) in self.by_server.items() if tokens}


@attrs.frozen
class StepRecord:
    """What one step did. `version` is the weights the trainer held while training batch
    `step` (`step - 1`); it publishes version `step` after."""

    step: int
    version: int
    samples: int
    tokens: int
    loss: float
    grad_norm: float
    clipped_share: float
    reward_mean: float
    seconds: float
    on_policy_samples: int
    mismatch_kl: float | None
    mismatch_kl_no_replay: float | None
    mismatch_by_server: Mapping[str, float]
    dropped: int = 0
    time: float = 0.0
    # Where the step's seconds went: the forwards (with the loss and the mismatch), the
    # backwards, clipping and the optimizer step, writing and publishing the version.
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    checkpoint_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        fields = attrs.asdict(self)
        fields["mismatch_by_server"] = dict(self.mismatch_by_server)
        return {"format": FORMAT, **{k: _finite(v) for k, v in fields.items()}}


def _finite(value: object) -> object:
    """JSON has no NaN or infinity: such a figure is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def append_record(path: Path, record: StepRecord) -> None:
    """Append `record` as one line (opened, written, flushed, closed: a reader never sees
    half a line unless the machine dies mid-write, and a reader skips such a line)."""
    line = json.dumps(record.to_json(), separators=(",", ":"), allow_nan=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def mismatch_warning(record: StepRecord, threshold: float) -> str | None:
    """The one line to say when the on-policy mismatch is over `threshold`, else None:
    which version and which server (the worst first) gave tokens the trainer's own
    weights of that version do not give."""
    if record.mismatch_kl is None or record.mismatch_kl <= threshold:
        return None
    servers = sorted(record.mismatch_by_server.items(), key=lambda item: -item[1])
    worst = ", ".join(f"{server} {kl:.3g}" for server, kl in servers if kl > threshold)
    return (
        f"step {record.step}: training-inference mismatch KL {record.mismatch_kl:.3g} over "
        f"{threshold:g} on {record.on_policy_samples} samples of version {record.version} "
        f"(by server: {worst or 'none over alone'}): the servers do not run the weights "
        f"of version {record.version}, or run them otherwise (a weight update that did not "
        "load, another dtype or kernel)"
    )

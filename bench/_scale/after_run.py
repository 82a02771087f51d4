"""After the run, with the fleet stopped: the last batch read and written again, what
publishing alone costs an idle loop, the queue's deep size and the trainer's reads in the
run."""

from __future__ import annotations

import datetime
import functools
import json
import math
import statistics
import time
from pathlib import Path

import attrs
import numpy as np
import trio
from _deep_size import deep_size

import orchestrator.handoff.native.store as handoff_store
from _scale.probe import Ship
from _scale.profiles import profile_of
from _scale.recorders import AllLags
from _scale.workload import FINE_LAG_INTERVAL_S, REPEATS
from orchestrator.core.rollouts import TrainSample
from orchestrator.core.sink import QueuedSample
from orchestrator.daemon.metrics import serve_loop_lag_monitor
from orchestrator.handoff import Batch, read_batch


@attrs.frozen
class Timed:
    seconds: list[float]
    profile: list[tuple[float, float, str]]  # (own s, cumulative s, function)
    # What the call produced, for the report (bytes of arrays read, by kind).
    detail: dict[str, float] = attrs.Factory(dict)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def time_read(batch_dir: Path, expected: int) -> Timed:
    """`read_batch(verify=True)` as the sim trainer calls it, timed `REPEATS` times and
    once under cProfile."""

    def read() -> Batch:
        return read_batch(batch_dir, verify=True, on_corrupt="drop")

    seconds = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        batch = read()
        seconds.append(time.perf_counter() - started)
        if len(batch.samples) != expected or batch.dropped:
            raise RuntimeError(
                f"system_scale: read {len(batch.samples)} samples of {expected} from "
                f"{batch_dir}, {len(batch.dropped)} dropped"
            )
    samples = batch.samples
    masks = [s.sampling_mask for s in samples if s.sampling_mask is not None]
    detail = {
        "positions": float(sum(len(s.token_ids) for s in samples)),
        "loss_positions": float(sum(int(np.count_nonzero(s.loss_mask)) for s in samples)),
        "mask_bytes": float(sum(mask.nbytes for mask in masks)),
        "mask_width": float(max((mask.shape[1] for mask in masks), default=0)),
        "routing_bytes": float(
            sum(s.routed_experts.nbytes for s in samples if s.routed_experts is not None)
        ),
    }
    del batch, samples, masks
    return Timed(seconds, profile_of(read), detail)


def time_write(samples: list[TrainSample], step: int, base: Path, *, fsync: bool) -> Timed:
    count = 0

    def write() -> None:
        nonlocal count
        count += 1
        target = base / f"republish-{'fsync' if fsync else 'nofsync'}-{count}"
        handoff_store.publish_batch(target, step, samples, fsync=fsync)

    seconds = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        write()
        seconds.append(time.perf_counter() - started)
    return Timed(seconds, profile_of(write))


def publish_alone_lags(samples: list[TrainSample], step: int, base: Path) -> list[float]:
    """Lags of an otherwise idle event loop (the 1 ms monitor alone) while the batch is
    published from a worker thread as the daemon does (`publish_batch`, fsync),
    `REPEATS` times: what publishing costs the loop by itself (the interpreter lock, and
    the one core the daemon's threads share)."""

    async def main() -> list[float]:
        lags = AllLags(window_s=1e9)
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(serve_loop_lag_monitor, lags, interval_s=FINE_LAG_INTERVAL_S)
            )
            for attempt in range(REPEATS):
                await trio.sleep(0.1)
                publish = functools.partial(
                    handoff_store.publish_batch, base / f"alone-{attempt}", step, samples
                )
                await trio.to_thread.run_sync(publish)
            await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
        return [lag for _, lag in lags.wakeups]

    return trio.run(main)


@attrs.frozen
class QueueCost:
    samples: int
    tokens: int
    deep_bytes: int
    array_bytes: int  # token_ids + loss_mask + logprobs


def queue_cost(queue: list[QueuedSample]) -> QueueCost:
    arrays = sum(
        q.sample.token_ids.nbytes + q.sample.loss_mask.nbytes + q.sample.logprobs.nbytes
        for q in queue
    )
    return QueueCost(
        samples=len(queue),
        tokens=sum(len(q.sample.token_ids) for q in queue),
        deep_bytes=deep_size(queue),
        array_bytes=arrays,
    )


def trainer_reads(log_path: Path, ships: list[Ship]) -> list[tuple[int, float]]:
    """Per step the trainer trained on: seconds from the batch being published (or the
    previous step's `trained` line, if later) to its `trained` line."""
    trained: dict[int, float] = {}
    for line in log_path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "trained":
            at = datetime.datetime.fromisoformat(entry["timestamp"]).timestamp()
            trained[int(entry["step"])] = at
    published = {ship.step: ship.published_at for ship in ships}
    reads = []
    for step in sorted(trained):
        if step not in published:
            continue
        start = max(published[step], trained.get(step - 1, -math.inf))
        reads.append((step, trained[step] - start))
    return reads

"""The daemon's figures that live in its state and its sink, as metric families read at
scrape time: nothing is copied into the library as it happens."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import attrs
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from orchestrator.core.rollouts import Discard
from orchestrator.core.sink import TrainSink
from orchestrator.daemon.metrics.recorders import CollectionTimes, LoopStats
from orchestrator.daemon.run_state import RunState
from orchestrator.daemon.run_totals import RunTotals, run_totals

# Label values reported even at zero, so that `rate()` and alerts see a series from the
# first scrape on instead of one that appears with the first event. Values found in the
# state that are not listed here are reported too, after these.
ROLLOUT_OUTCOMES = ("completed", "failed", "poisoned", "stopped", "reward_failed")
# The dispatcher's failure kinds: the inference client's, then its own four
# (orchestrator/daemon/rejections.py records every one).
FAILURE_KINDS = (
    "connect",
    "transport",
    "timeout",
    "http_5xx",
    "http_4xx",
    "unauthorized",
    "malformed",
    "oversized",
    "poisoned_payload",
    "stitching",
    "routing_gap",
    "environment",
    "trajectory_mismatch",
)
DISCARD_REASONS = tuple(reason.value for reason in Discard)
DELETION_PATHS = ("discard", "sweep", "collection", "wipe")


def counts_with(known: Iterable[str], counts: Mapping[str, int]) -> list[tuple[str, int]]:
    """`(key, count)` for every known key in order (0 when absent), then the other keys of
    `counts`, sorted."""
    known = tuple(known)
    extra = sorted(key for key in counts if key not in known)
    return [(key, int(counts.get(key, 0))) for key in (*known, *extra)]


def _by_label(
    name: str, documentation: str, label: str, known: Iterable[str], counts: Mapping[str, int]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=[label])
    for key, count in counts_with(known, counts):
        family.add_metric([key], count)
    return family


@attrs.define(eq=False)
class RunCollector:
    """The families read from the run's `RunState` and `TrainSink`.

    `collect` is synchronous and reads them without `await`, so on trio's thread it sees
    one consistent moment (it must run there: nothing else guards the state).
    """

    state: RunState
    sink: TrainSink

    def collect(self) -> Iterator[Metric]:
        state, p = self.state, "orchestrator_"
        totals = run_totals(state, self.sink)
        step = totals.last_shipped  # the last batch shipped (0 before the first)
        yield _by_label(
            f"{p}rollouts_total",
            "Rollouts finished, by outcome (completed, failed, poisoned).",
            "outcome",
            ROLLOUT_OUTCOMES,
            totals.rollouts,
        )
        yield _by_label(
            f"{p}rollout_failures_total",
            "Failed inference requests and poisoned payloads, by kind.",
            "kind",
            FAILURE_KINDS,
            totals.failures,
        )
        yield _by_label(
            f"{p}discards_total",
            "Units (samples, or rollouts without samples) discarded by the sink, by reason.",
            "reason",
            DISCARD_REASONS,
            totals.discards,
        )
        yield _by_label(
            f"{p}payload_files_deleted_total",
            "Payload files deleted, by path (discard, sweep, collection, wipe).",
            "path",
            DELETION_PATHS,
            totals.files_deleted,
        )
        yield _by_label(
            f"{p}payload_bytes_deleted_total",
            "Payload bytes deleted, by path (discard, sweep, collection, wipe).",
            "path",
            DELETION_PATHS,
            totals.bytes_deleted,
        )
        yield CounterMetricFamily(
            f"{p}payload_files_written_total",
            "Payload files written by inference servers for this run's rollouts.",
            value=totals.files_written,
        )
        yield CounterMetricFamily(
            f"{p}payload_bytes_written_total",
            "Payload bytes written by inference servers for this run's rollouts.",
            value=totals.bytes_written,
        )
        yield GaugeMetricFamily(
            f"{p}payload_disk_bytes",
            "Bytes under the payload root at the last measurement.",
            value=totals.payload_bytes,
        )
        yield GaugeMetricFamily(
            f"{p}payload_disk_peak_bytes",
            "The most bytes measured under the payload root during this run.",
            value=totals.peak_payload_bytes,
        )
        yield GaugeMetricFamily(
            f"{p}applied_version",
            "The policy version rollouts are dispatched under.",
            value=totals.applied_version,
        )
        yield GaugeMetricFamily(
            f"{p}step", "The last batch shipped to the trainer (0 before the first).", value=step
        )
        yield GaugeMetricFamily(  # no sample before the first collection
            f"{p}collection_bound",
            "The last collection bound: every v<k> directory with k below it was deleted.",
            value=totals.collected_below,
        )
        yield GaugeMetricFamily(
            f"{p}staleness_steps",
            "Batches shipped ahead of the applied policy version (step - applied_version).",
            value=step - totals.applied_version,
        )
        yield GaugeMetricFamily(
            f"{p}inflight_rollouts",
            "Rollouts dispatched and not yet handed to the sink.",
            value=totals.inflight_rollouts,
        )
        yield GaugeMetricFamily(
            f"{p}inflight_limit",
            "The most rollouts the dispatcher lets run at once now (adaptive or fixed).",
            value=state.limits.rollouts or 0,
        )
        yield GaugeMetricFamily(
            f"{p}queued_samples",
            "Scored samples waiting in the sink for a batch.",
            value=totals.queued_samples,
        )
        yield CounterMetricFamily(
            f"{p}samples_shipped_total",
            "Samples shipped to the trainer in batches.",
            value=totals.samples_shipped,
        )
        yield from _by_env(p, totals)
        yield from _evals(p, state)


def _evals(p: str, state: RunState) -> Iterator[Metric]:
    """Evals beside training: rollouts and failures, in flight, and the last eval's
    results by eval env (docs/design.md § Evals)."""
    evaluation = state.evaluation
    yield CounterMetricFamily(
        f"{p}evals_total", "Evals finished (each runs every eval env).", value=evaluation.evals
    )
    yield _by_label(
        f"{p}eval_rollouts_total",
        "Eval rollouts finished, by outcome (scored, failed).",
        "outcome",
        ("scored", "failed"),
        evaluation.rollouts,
    )
    yield _by_label(
        f"{p}eval_failures_total",
        "Failed eval requests, environment steps and rewards, by kind.",
        "kind",
        (*FAILURE_KINDS, "reward_failed"),
        evaluation.failures,
    )
    yield GaugeMetricFamily(
        f"{p}eval_inflight_rollouts",
        "Eval rollouts in flight (counted against the in-flight limit).",
        value=evaluation.inflight,
    )
    last = evaluation.last
    version = GaugeMetricFamily(
        f"{p}eval_version", "The version the last eval was started for, by env.", labels=["env"]
    )
    reward = GaugeMetricFamily(
        f"{p}eval_reward_mean", "The last eval's mean reward, by env.", labels=["env"]
    )
    pass_at = GaugeMetricFamily(
        f"{p}eval_pass_at_k",
        "The last eval's pass@k, by env and k (only where every reward is 0 or 1).",
        labels=["env", "k"],
    )
    length = GaugeMetricFamily(
        f"{p}eval_completion_tokens_mean",
        "The last eval's mean completion length in tokens, by env.",
        labels=["env"],
    )
    for result in () if last is None else last.results:
        version.add_metric([result.env], last.version if last is not None else 0)
        if result.reward_mean is not None:
            reward.add_metric([result.env], result.reward_mean)
        for k, value in (result.pass_at or {}).items():
            pass_at.add_metric([result.env, str(k)], value)
        if result.completion_tokens_mean is not None:
            length.add_metric([result.env], result.completion_tokens_mean)
    yield from (version, reward, pass_at, length)


def _by_env(p: str, totals: RunTotals) -> Iterator[Metric]:
    """The sink's tally by environment (its `[[env]]` name): mean reward is
    `env_reward_sum_total / env_rollouts_scored_total`."""
    scored = CounterMetricFamily(
        f"{p}env_rollouts_scored_total", "Rollouts scored, by environment.", labels=["env"]
    )
    rewards = CounterMetricFamily(
        f"{p}env_reward_sum_total",
        "The sum of the scored rollouts' rewards, by environment (it can go down: rewards "
        "may be negative).",
        labels=["env"],
    )
    shipped = CounterMetricFamily(
        f"{p}env_samples_shipped_total", "Samples shipped, by environment.", labels=["env"]
    )
    discards = CounterMetricFamily(
        f"{p}env_discards_total",
        "Units discarded, by environment and reason.",
        labels=["env", "reason"],
    )
    skipped = CounterMetricFamily(
        f"{p}env_prompts_skipped_total",
        "Prompts an environment skipped (a dataset row over the prompt budget), by environment.",
        labels=["env"],
    )
    metric_means = GaugeMetricFamily(
        f"{p}env_metric_mean",
        "The environment's own metrics (a verifiers rubric's), mean over its scored "
        "rollouts, by environment and metric.",
        labels=["env", "metric"],
    )
    for env, env_totals in totals.envs.items():
        for name, mean in sorted(env_totals.metrics.items()):
            metric_means.add_metric([env, name], mean)
        scored.add_metric([env], env_totals.scored)
        rewards.add_metric([env], env_totals.reward_sum)
        shipped.add_metric([env], env_totals.shipped)
        for reason, count in sorted(env_totals.discards.items()):
            discards.add_metric([env, reason], count)
        if env_totals.prompts_skipped:
            skipped.add_metric([env], env_totals.prompts_skipped)
    yield from (scored, rewards, shipped, discards, skipped, metric_means)


def metrics_registry(
    state: RunState, sink: TrainSink, loop_stats: LoopStats, collections: CollectionTimes
) -> CollectorRegistry:
    """A registry of its own for one daemon run (never the library's global one: tests run
    several daemons in one process), serving the families in this order: the run's state
    and sink, the collection durations, the event loop lag."""
    registry = CollectorRegistry()
    registry.register(RunCollector(state, sink))
    registry.register(collections)
    registry.register(loop_stats)
    return registry

"""The daemon's metrics registry: its figures as prometheus-client encodes them, checked by
parsing the output with a small exposition-format parser written here, independent of the
code and of the library."""

from __future__ import annotations

import math
import re
from collections import Counter

import attrs
import prometheus_client
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from orchestrator.core.evals import EvalReport, EvalSample, summarize
from orchestrator.core.rollouts import Discard, GroupResult, RolloutResult, Sample
from orchestrator.core.sink import SinkLimits, TrainSink
from orchestrator.core.staleness import Staleness
from orchestrator.daemon.metrics import CollectionTimes, LoopStats, metrics_registry
from orchestrator.daemon.run_state import RunState, Shipping

# -- a small parser for the text exposition format 0.0.4 ----------------------------------

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}

Labels = tuple[tuple[str, str], ...]


@attrs.define
class Family:
    help: str | None = None
    type: str | None = None
    samples: dict[tuple[str, Labels], float] = attrs.field(factory=dict)


def _unescape(text: str) -> str:
    return re.sub(r"\\.", lambda match: _UNESCAPE[match.group(0)], text)


def _parse_labels(text: str) -> Labels:
    labels: list[tuple[str, str]] = []
    position = 0
    while position < len(text):
        match = _LABEL.match(text, position)
        assert match, f"bad labels {text!r} at {position}"
        labels.append((match.group(1), _unescape(match.group(2))))
        position = match.end()
    return tuple(labels)


def _family_of(name: str, families: dict[str, Family]) -> Family:
    if name in families:
        return families[name]
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and families.get(base, Family()).type == "histogram":
            return families[base]
    raise AssertionError(f"sample {name} before its # TYPE line")


def parse_exposition(text: str) -> dict[str, Family]:
    """Families by name; fails on anything that is not valid exposition text."""
    assert text.endswith("\n"), "the text must end with a line feed"
    families: dict[str, Family] = {}
    # Lines end with "\n" only: str.splitlines would also split at "\r" or "\x85" inside
    # a label value, which the format leaves unescaped.
    for line in text.split("\n")[:-1]:
        if line.startswith("# HELP "):
            name, _, help_text = line.removeprefix("# HELP ").partition(" ")
            family = families.setdefault(name, Family())
            assert family.help is None, f"second HELP for {name}"
            family.help = re.sub(r"\\[\\n]", lambda m: _UNESCAPE[m.group(0)], help_text)
        elif line.startswith("# TYPE "):
            name, _, kind = line.removeprefix("# TYPE ").partition(" ")
            assert kind in {"counter", "gauge", "histogram", "summary", "untyped"}, line
            family = families.setdefault(name, Family())
            assert family.type is None and not family.samples, f"misplaced TYPE for {name}"
            family.type = kind
        else:
            match = _SAMPLE.fullmatch(line)
            assert match, f"bad sample line {line!r}"
            name, labels, value = match.groups()
            key = (name, _parse_labels(labels[1:-1]) if labels else ())
            family = _family_of(name, families)
            assert key not in family.samples, f"duplicate sample {key}"
            family.samples[key] = float(value)  # float() reads +Inf, -Inf and NaN too
    return families


def value(families: dict[str, Family], name: str, **labels: str) -> float:
    family = _family_of(name, families)
    return family.samples[(name, tuple(labels.items()))]


# -- a hand-built daemon state ------------------------------------------------------------

LIMITS = SinkLimits(
    batch_size=2,
    constant_size=True,
    staleness=Staleness(1),
    curriculum_min_mean_reward=0.0,
    curriculum_max_mean_reward=1.0,
    max_seq_len=64,
)


def _member(
    rollout_id: str, reward: float, *, loss: int = 2, failed: bool = False
) -> RolloutResult:
    if failed:
        return RolloutResult(rollout_id, dispatch_version=0, failed="connect: refused")
    sample = Sample(
        rollout_id=rollout_id,
        token_ids=(1, 2, 3, 4),
        loss_mask=(0,) * (4 - loss) + (1,) * loss,
        logprobs=(0.0,) * 4,
        files=frozenset({f"/payloads/v0/{rollout_id}.bin"}),
    )
    return RolloutResult(rollout_id, dispatch_version=0, reward=reward, samples=(sample,))


def _group(group_id: str, *members: RolloutResult) -> GroupResult:
    return GroupResult(group_id, start_version=0, rollouts=members)


def busy_sink() -> TrainSink:
    """A sink that has seen every kind of discard (curriculum: twice) but `swept`."""
    sink = TrainSink(LIMITS)
    sink.admit(_group("a", _member("a0", 1.0), _member("a1", 0.0), _member("a2", 0.0)), 1)
    sink.admit(_group("b", _member("b0", 0.0, failed=True), _member("b1", 0.0, failed=True)), 1)
    sink.admit(_group("c", _member("c0", 0.5), _member("c1", 0.5)), 1)  # no signal
    sink.admit(_group("d", _member("d0", 2.0), _member("d1", 3.0)), 1)  # curriculum
    sink.admit(_group("e", _member("e0", 1.0), _member("e1", 0.0)), 5)  # stale at step 5
    sink.assemble(1)  # group a: 2 samples ship, 1 is pruned
    sink.admit(_group("f", _member("f0", 1.0), _member("f1", 0.0), _member("f2", 0, loss=0)), 1)
    return sink


def busy_state() -> RunState:
    state = RunState(Staleness(1, 1), Shipping(0))
    state.versions.applied = 3
    state.shipping.next_step = 6
    state.versions.collected_below = 2
    state.dispatch.inflight_rollouts = 7
    state.limits.rollouts = 40
    state.dispatch.rollouts.update(completed=40, failed=2, poisoned=1)
    state.dispatch.failures.update(connect=2, poisoned_payload=1)
    state.payload.files_deleted.update(discard=11, sweep=3, collection=120)
    state.payload.bytes_deleted.update(discard=1100, sweep=300, collection=12_000_000)
    state.payload.files_written = 150
    state.payload.bytes_written = 15_000_000
    state.payload.record_measured(9_000_000)
    state.payload.record_measured(2_500_000)
    evaluation = state.evaluation
    evaluation.evals, evaluation.inflight = 2, 3
    evaluation.rollouts.update(scored=30, failed=2)
    evaluation.failures.update(timeout=1, reward_failed=1)
    samples = [EvalSample(e, 2, float(e % 2), 10 + e) for e in range(4) for _ in range(2)]
    evaluation.last = EvalReport(
        version=2,
        step=3,
        started_at=0.0,
        duration_s=1.0,
        results=(summarize("arith-eval", samples, rollouts_per_example=2),),
    )
    return state


def test_the_sink_scenario_covers_the_discard_reasons() -> None:
    # Guard for the tests below: their figures come from this scenario.
    assert busy_sink().counters == {
        "stale": 2,
        "swept": 0,
        "no_signal": 2,
        "curriculum": 2,
        "untrainable": 1,
        "pruned": 1,
        "failed": 2,
        "reward_failed": 0,
    }


# -- the tests ------------------------------------------------------------------------------

FAMILIES = {
    "orchestrator_rollouts_total": "counter",
    "orchestrator_rollout_failures_total": "counter",
    "orchestrator_discards_total": "counter",
    "orchestrator_payload_files_deleted_total": "counter",
    "orchestrator_payload_bytes_deleted_total": "counter",
    "orchestrator_payload_files_written_total": "counter",
    "orchestrator_payload_bytes_written_total": "counter",
    "orchestrator_payload_disk_bytes": "gauge",
    "orchestrator_payload_disk_peak_bytes": "gauge",
    "orchestrator_applied_version": "gauge",
    "orchestrator_step": "gauge",
    "orchestrator_collection_bound": "gauge",
    "orchestrator_staleness_steps": "gauge",
    "orchestrator_inflight_rollouts": "gauge",
    "orchestrator_inflight_limit": "gauge",
    "orchestrator_queued_samples": "gauge",
    "orchestrator_samples_shipped_total": "counter",
    "orchestrator_env_rollouts_scored_total": "counter",
    "orchestrator_env_reward_sum_total": "counter",
    "orchestrator_env_samples_shipped_total": "counter",
    "orchestrator_env_discards_total": "counter",
    "orchestrator_env_prompts_skipped_total": "counter",
    "orchestrator_env_metric_mean": "gauge",
    "orchestrator_collection_duration_seconds": "histogram",
    "orchestrator_collection_last_duration_seconds": "gauge",
    "orchestrator_event_loop_lag_seconds": "histogram",
    "orchestrator_event_loop_worst_lag_seconds": "gauge",
    "orchestrator_evals_total": "counter",
    "orchestrator_eval_rollouts_total": "counter",
    "orchestrator_eval_failures_total": "counter",
    "orchestrator_eval_inflight_rollouts": "gauge",
    "orchestrator_eval_version": "gauge",
    "orchestrator_eval_reward_mean": "gauge",
    "orchestrator_eval_pass_at_k": "gauge",
    "orchestrator_eval_completion_tokens_mean": "gauge",
}


def render_metrics(
    state: RunState,
    sink: TrainSink,
    loop: LoopStats | None = None,
    collections: CollectionTimes | None = None,
) -> str:
    """What a scrape of a daemon with this state, sink and recorders returns."""
    registry = metrics_registry(state, sink, loop or LoopStats(), collections or CollectionTimes())
    return generate_latest(registry).decode("utf-8")


def _render_busy() -> tuple[RunState, TrainSink, dict[str, Family]]:
    state, sink = busy_state(), busy_sink()
    loop = LoopStats()
    for now, lag in [(1.0, 0.0004), (2.0, 0.2), (3.0, 0.003)]:
        loop.record(now, lag)
    collections = CollectionTimes()
    for seconds in (0.02, 0.3, 7.5):
        collections.observe_collection(seconds)
    text = render_metrics(state, sink, loop, collections)
    return state, sink, parse_exposition(text)


def test_every_family_is_present_with_help_and_type() -> None:
    _, _, families = _render_busy()
    assert {name: family.type for name, family in families.items()} == FAMILIES
    for name, family in families.items():
        assert family.help, name
        assert family.type != "counter" or name.endswith("_total"), name


def test_the_env_families_equal_the_sink_s_tally() -> None:
    _, sink, families = _render_busy()
    (env,) = sink.by_env  # the busy sink's groups name no env
    tally = sink.by_env[env]
    assert value(families, "orchestrator_env_rollouts_scored_total", env=env) == tally.scored
    assert value(families, "orchestrator_env_reward_sum_total", env=env) == tally.reward_sum
    assert value(families, "orchestrator_env_samples_shipped_total", env=env) == sink.shipped
    for reason, count in tally.discards.items():
        assert value(families, "orchestrator_env_discards_total", env=env, reason=reason) == count
    # The env's discards are all the sink's.
    assert tally.discards == {r: n for r, n in sink.counters.items() if n}


def test_the_eval_families_equal_the_last_eval() -> None:
    _, _, families = _render_busy()
    assert value(families, "orchestrator_evals_total") == 2
    assert value(families, "orchestrator_eval_rollouts_total", outcome="failed") == 2
    assert value(families, "orchestrator_eval_failures_total", kind="reward_failed") == 1
    assert value(families, "orchestrator_eval_failures_total", kind="connect") == 0
    assert value(families, "orchestrator_eval_inflight_rollouts") == 3
    assert value(families, "orchestrator_eval_version", env="arith-eval") == 2
    assert value(families, "orchestrator_eval_reward_mean", env="arith-eval") == 0.5
    # Prompts 1 and 3 pass both samples, 0 and 2 none: pass@1 = pass@2 = 0.5.
    assert value(families, "orchestrator_eval_pass_at_k", env="arith-eval", k="2") == 0.5
    assert value(families, "orchestrator_eval_completion_tokens_mean", env="arith-eval") == 11.5


def test_counters_by_label_equal_the_state() -> None:
    state, _, families = _render_busy()
    for outcome, count in state.dispatch.rollouts.items():
        assert value(families, "orchestrator_rollouts_total", outcome=outcome) == count
    for kind, count in state.dispatch.failures.items():
        assert value(families, "orchestrator_rollout_failures_total", kind=kind) == count
    for path in ("discard", "sweep", "collection"):
        files = value(families, "orchestrator_payload_files_deleted_total", path=path)
        assert files == state.payload.files_deleted[path]
        freed = value(families, "orchestrator_payload_bytes_deleted_total", path=path)
        assert freed == state.payload.bytes_deleted[path]
    assert value(families, "orchestrator_payload_bytes_deleted_total", path="collection") == (
        12_000_000
    )
    # Known label values that never happened are reported as 0, not left out.
    assert value(families, "orchestrator_rollout_failures_total", kind="timeout") == 0
    assert value(families, "orchestrator_rollout_failures_total", kind="oversized") == 0
    assert value(families, "orchestrator_payload_files_deleted_total", path="wipe") == 0


def test_every_discard_reason_is_reported_with_the_sink_counts() -> None:
    _, sink, families = _render_busy()
    reported = {
        dict(labels)["reason"]: count
        for (_, labels), count in families["orchestrator_discards_total"].samples.items()
    }
    assert reported == sink.counters
    assert set(reported) == {reason.value for reason in Discard}


def test_a_new_sink_reports_every_discard_reason_at_zero() -> None:
    state = RunState(Staleness(1, 1), Shipping(0))
    families = parse_exposition(render_metrics(state, TrainSink(LIMITS)))
    samples = families["orchestrator_discards_total"].samples
    assert {dict(labels)["reason"]: count for (_, labels), count in samples.items()} == {
        reason.value: 0 for reason in Discard
    }


def test_plain_figures_equal_the_state_and_sink() -> None:
    state, sink, families = _render_busy()
    written = value(families, "orchestrator_payload_files_written_total")
    assert written == state.payload.files_written == 150
    written = value(families, "orchestrator_payload_bytes_written_total")
    assert written == state.payload.bytes_written == 15_000_000
    assert value(families, "orchestrator_payload_disk_bytes") == state.payload.bytes == 2_500_000
    peak = value(families, "orchestrator_payload_disk_peak_bytes")
    assert peak == state.payload.peak_bytes == 9_000_000
    assert value(families, "orchestrator_applied_version") == state.versions.applied == 3
    assert value(families, "orchestrator_step") == state.shipping.next_step - 1 == 5
    assert value(families, "orchestrator_collection_bound") == state.versions.collected_below == 2
    # next_step - 1 - applied_version
    assert value(families, "orchestrator_staleness_steps") == 6 - 1 - 3
    assert (
        value(families, "orchestrator_inflight_rollouts") == state.dispatch.inflight_rollouts == 7
    )
    assert value(families, "orchestrator_inflight_limit") == state.limits.rollouts == 40
    assert value(families, "orchestrator_queued_samples") == sink.queued_samples == 2
    assert value(families, "orchestrator_samples_shipped_total") == sink.shipped == 2


def test_histograms_are_cumulative_and_end_with_inf() -> None:
    _, _, families = _render_busy()
    name = "orchestrator_collection_duration_seconds"
    assert value(families, f"{name}_bucket", le="0.025") == 1
    assert value(families, f"{name}_bucket", le="0.25") == 1
    assert value(families, f"{name}_bucket", le="0.5") == 2
    assert value(families, f"{name}_bucket", le="10.0") == 3
    assert value(families, f"{name}_bucket", le="+Inf") == 3
    assert value(families, f"{name}_count") == 3
    assert value(families, f"{name}_sum") == pytest.approx(7.82)
    assert value(families, "orchestrator_collection_last_duration_seconds") == 7.5

    name = "orchestrator_event_loop_lag_seconds"
    buckets = [
        (float(dict(labels)["le"]), count)
        for (sample, labels), count in families[name].samples.items()
        if sample == f"{name}_bucket"
    ]
    assert buckets[-1] == (math.inf, 3)
    assert [le for le, _ in buckets] == sorted(le for le, _ in buckets)
    assert [count for _, count in buckets] == sorted(count for _, count in buckets)
    assert value(families, f"{name}_bucket", le="0.001") == 1
    assert value(families, f"{name}_bucket", le="0.005") == 2
    assert value(families, "orchestrator_event_loop_worst_lag_seconds") == 0.2


def test_unknown_figures_are_announced_without_a_sample() -> None:
    state = RunState(Staleness(1, 1), Shipping(0))
    families = parse_exposition(render_metrics(state, TrainSink(LIMITS)))
    for name in (
        "orchestrator_collection_bound",  # no collection yet
        "orchestrator_collection_last_duration_seconds",
        "orchestrator_event_loop_worst_lag_seconds",  # the monitor has not woken yet
    ):
        assert families[name].type == FAMILIES[name]
        assert families[name].samples == {}, name
    # An idle recorder is a measurement: zero observations, not an unknown.
    for name in ("orchestrator_collection_duration_seconds", "orchestrator_event_loop_lag_seconds"):
        assert value(families, f"{name}_count") == 0
        assert value(families, f"{name}_sum") == 0
        assert value(families, f"{name}_bucket", le="+Inf") == 0


def test_label_values_are_escaped() -> None:
    state = RunState(Staleness(1, 1), Shipping(0))
    nasty = 'say "hi"\\now\nnext line'
    state.dispatch.failures[nasty] = 4
    text = render_metrics(state, TrainSink(LIMITS))
    assert 'kind="say \\"hi\\"\\\\now\\nnext line"} 4.0\n' in text
    families = parse_exposition(text)
    assert value(families, "orchestrator_rollout_failures_total", kind=nasty) == 4


@settings(max_examples=60)
@given(kinds=st.dictionaries(st.text(max_size=12), st.integers(0, 2**53), max_size=5))
def test_any_label_value_survives_a_round_trip(kinds: dict[str, int]) -> None:
    state = RunState(Staleness(1, 1), Shipping(0))
    state.dispatch.failures = Counter(kinds)
    families = parse_exposition(render_metrics(state, TrainSink(LIMITS)))
    for kind, count in kinds.items():
        assert value(families, "orchestrator_rollout_failures_total", kind=kind) == count


def test_each_registry_reads_its_own_run_and_the_global_registry_is_untouched() -> None:
    # Tests start several daemons in one process: each has a registry of its own.
    first, second = busy_state(), RunState(Staleness(1, 1), Shipping(0))
    first_times, second_times = CollectionTimes(), CollectionTimes()
    first_times.observe_collection(1.0)
    registries = [
        metrics_registry(first, busy_sink(), LoopStats(), first_times),
        metrics_registry(second, TrainSink(LIMITS), LoopStats(), second_times),
    ]
    completed = ("orchestrator_rollouts_total", {"outcome": "completed"})
    assert [r.get_sample_value(*completed) for r in registries] == [40, 0]
    count = "orchestrator_collection_duration_seconds_count"
    assert [r.get_sample_value(count) for r in registries] == [1, 0]
    default = generate_latest(prometheus_client.REGISTRY).decode()
    assert "orchestrator_" not in default


def test_a_scrape_reads_the_state_at_scrape_time() -> None:
    state, sink = busy_state(), busy_sink()
    registry = metrics_registry(state, sink, LoopStats(), CollectionTimes())
    completed = ("orchestrator_rollouts_total", {"outcome": "completed"})
    assert registry.get_sample_value(*completed) == 40
    state.dispatch.rollouts["completed"] += 100
    state.versions.applied += 1
    assert registry.get_sample_value(*completed) == 140
    assert registry.get_sample_value("orchestrator_applied_version") == 4
    assert registry.get_sample_value("orchestrator_staleness_steps") == 6 - 1 - 4

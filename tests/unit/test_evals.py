"""The pure logic of evals: the schedule of versions, the fleet share, pass@k and what an
env's samples come to."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.config import ConfigError, load_config
from orchestrator.core.evals import (
    EvalSample,
    EvalSchedule,
    eval_capacity,
    pass_at_k,
    pass_ks,
    summarize,
)


def evaluated(schedule: EvalSchedule, applied: list[int], *, resumed: bool = False) -> list[int]:
    """The versions evaluated when the applied version takes these values in turn."""
    out = [applied[0]] if schedule.first_due(applied[0], resumed=resumed) else []
    for previous, version in itertools.pairwise(applied):
        if schedule.due(previous, version):
            out.append(version)
    return out


def test_every_interval_and_the_base_model_and_the_last_version() -> None:
    schedule = EvalSchedule(interval=10, max_steps=25)
    assert evaluated(schedule, list(range(26))) == [0, 10, 20, 25]


def test_without_the_base_model_the_first_eval_is_the_first_boundary() -> None:
    schedule = EvalSchedule(interval=4, eval_base_model=False, max_steps=8)
    assert evaluated(schedule, list(range(9))) == [4, 8]


def test_interval_zero_evaluates_only_the_base_model_and_the_last() -> None:
    assert evaluated(EvalSchedule(max_steps=5), list(range(6))) == [0, 5]
    # A run without max_steps has no last version.
    assert evaluated(EvalSchedule(), list(range(100))) == [0]


def test_a_version_past_a_boundary_is_due_when_the_boundary_was_skipped() -> None:
    # The watcher saw 8 then 11 (9, 10 published before it looked, or while an eval ran).
    schedule = EvalSchedule(interval=5, max_steps=20)
    assert evaluated(schedule, [0, 3, 8, 11, 12, 19, 21]) == [0, 8, 11, 19, 21]


def test_a_resumed_run_evaluates_its_first_version_unless_told_to_skip() -> None:
    assert evaluated(EvalSchedule(interval=10), [7, 8, 10], resumed=True) == [7, 10]
    skip = EvalSchedule(interval=10, skip_eval_on_resume=True)
    assert evaluated(skip, [7, 8, 10], resumed=True) == [10]
    # Resuming right at a boundary still evaluates it: it is due by the interval.
    assert evaluated(skip, [10, 11], resumed=True) == [10]
    # The base model is version 0 of a fresh run only.
    assert evaluated(EvalSchedule(interval=0, skip_eval_on_resume=True), [3], resumed=True) == []


@given(st.integers(1, 10), st.lists(st.integers(0, 3), min_size=1, max_size=30))
def test_each_boundary_is_evaluated_once_at_the_first_version_past_it(
    interval: int, jumps: list[int]
) -> None:
    applied = [0]
    for jump in jumps:
        applied.append(applied[-1] + jump)
    schedule = EvalSchedule(interval=interval, eval_base_model=False)
    done = evaluated(schedule, applied)
    assert len(done) == len(set(done))
    for boundary in range(interval, applied[-1] + 1, interval):
        first_past = min(v for v in applied if v >= boundary)
        assert first_past in done


def test_the_eval_share_of_the_inflight_limit() -> None:
    assert eval_capacity(0.25, 32, training_over=False) == 8
    assert eval_capacity(0.25, 3, training_over=False) == 1  # never none
    assert eval_capacity(0.25, 32, training_over=True) == 32


def test_pass_at_k_matches_its_definition() -> None:
    # 5 samples, 2 pass: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10.
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 0, 5) == 0.0
    assert pass_at_k(5, 4, 2) == 1.0
    assert pass_ks(1) == (1,)
    assert pass_ks(4) == (1, 2, 4)
    assert pass_ks(6) == (1, 2, 4, 6)


@given(st.integers(1, 12).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_pass_at_k_is_the_chance_some_of_k_draws_pass(n_c: tuple[int, int]) -> None:
    n, c = n_c
    for k in range(1, n + 1):
        # By counting: the k-subsets with no passing sample, of all k-subsets.
        expected = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_summarize_reports_rewards_pass_at_k_lengths_versions_and_failures() -> None:
    samples = [
        EvalSample(0, version=3, reward=1.0, completion_tokens=10),
        EvalSample(0, version=3, reward=0.0, completion_tokens=20),
        EvalSample(1, version=4, reward=0.0, completion_tokens=30),
        EvalSample(1, version=4, reward=0.0, completion_tokens=40),
        EvalSample(2, version=4, failed="timeout"),
        EvalSample(2, version=4, reward=1.0, completion_tokens=5),
    ]
    result = summarize("arith", samples, rollouts_per_example=2, skipped_prompts=1)
    assert result.samples == 5 and result.failed == 1 and result.prompts == 3
    assert result.reward_mean == pytest.approx(2 / 5)
    # Prompt 2 lost a sample: pass@k is over the prompts whose every sample was scored.
    assert result.pass_at == {1: pytest.approx(0.25), 2: pytest.approx(0.5)}
    assert result.completion_tokens_mean == pytest.approx(21.0)
    assert result.completion_tokens_max == 40
    assert result.versions == (3, 4)
    assert result.failures == {"timeout": 1}
    line = result.to_json()
    assert line["pass_at"] == {"1": 0.25, "2": 0.5} and line["skipped_prompts"] == 1


def test_the_environments_metrics_are_averaged_over_the_scored_samples_reporting_them() -> None:
    samples = [
        EvalSample(0, 1, 1.0, 3, metrics={"turns": 2.0, "chars": 4.0}),
        EvalSample(0, 1, 0.0, 3, metrics={"turns": 1.0}),
        EvalSample(1, 1, failed="timeout", metrics={"turns": 9.0}),
        EvalSample(1, 1, 0.0, 3),
    ]
    result = summarize("vf", samples, rollouts_per_example=2)
    assert result.metrics == {"chars": 4.0, "turns": 1.5}
    assert result.to_json()["metrics"] == {"chars": 4.0, "turns": 1.5}
    assert summarize("plain", samples[3:], rollouts_per_example=1).to_json()["metrics"] == {}


def test_pass_at_k_is_left_out_where_rewards_are_not_zero_or_one() -> None:
    samples = [EvalSample(0, 1, 0.5, 3), EvalSample(0, 1, 1.0, 3)]
    assert summarize("chat", samples, rollouts_per_example=2).pass_at is None


def test_an_eval_of_only_failures_has_no_mean() -> None:
    result = summarize("x", [EvalSample(0, 1, failed="reward_failed")], rollouts_per_example=1)
    assert result.reward_mean is None and result.pass_at is None
    assert result.completion_tokens_mean is None and result.failures == {"reward_failed": 1}


def test_the_eval_section_is_checked(tmp_path) -> None:
    base = tmp_path / "run.toml"
    base.write_text(
        'run_dir = "run"\n[sim]\ninference_servers = 1\n[eval]\ninterval = 2\n'
        '[[eval.env]]\nname = "e"\ndataset = "d.jsonl"\nprompt = "q"\nrewards = ["m:f"]\n'
    )
    with pytest.raises(ConfigError, match=r"model\.tokenizer.*eval\.env"):
        load_config(base)
    with pytest.raises(ConfigError, match=r"eval\.inflight_share"):
        load_config(base, ['model.tokenizer="tok"', "eval.inflight_share=1.5"])
    config = load_config(base, ['model.tokenizer="tok"'])
    assert config.eval.enabled and config.evals_file == config.run_dir / "evals.jsonl"
    plugin = tmp_path / "plugin.toml"
    plugin.write_text(
        'run_dir = "run"\n[model]\ntokenizer = "tok"\n[sim]\ninference_servers = 1\n'
        '[[eval.env]]\nname = "game"\nfactory = "m:make"\n'
    )
    with pytest.raises(ConfigError, match=r"eval\.num_examples = -1 must be set"):
        load_config(plugin)

"""Evals beside training, as pure logic: which versions are evaluated, how much of the
fleet an eval may take, and what one eval's samples come to (docs/design.md § Evals).

An eval runs a fixed set of held-out prompts (`EvalTask`: an environment and how many of
its prompts) against the servers under whatever version they hold, scores the samples
with the environment's rewards, and reports per env: mean reward, pass@k where every
reward is 0 or 1, completion lengths, and the versions the samples were generated under
(a policy update may land while an eval runs). Nothing of an eval is trained on.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from orchestrator.core.environments import Environment
from orchestrator.core.rollouts import MetricMeans


@attrs.frozen
class EvalTask:
    """One env evaluated: its environment (prompts by index, episodes, rewards) and the
    prompts of each eval, indices `0 .. examples - 1` (the same ones every time)."""

    name: str
    environment: Environment = attrs.field(eq=False)
    examples: int = attrs.field(validator=attrs.validators.ge(1))


@attrs.frozen
class EvalSchedule:
    """Which applied versions are evaluated (prime-rl's `[orchestrator.eval]` rule).

    `interval` (0: none), the base model (`eval_base_model`: version 0 of a fresh run),
    the last version of a run with `max_steps`, and the version a resumed run starts at
    (unless `skip_eval_on_resume`). Versions may be skipped by the policy watcher (the
    trainer published two before the daemon looked) or pass while an eval runs: the
    version after them is due when a due one lies between.
    """

    interval: int = 0
    eval_base_model: bool = True
    skip_eval_on_resume: bool = False
    max_steps: int = 0

    def first_due(self, version: int, *, resumed: bool) -> bool:
        """Whether the run's first applied version (0 fresh, the resume step resumed) is
        evaluated."""
        if not resumed:
            return self.eval_base_model
        return not self.skip_eval_on_resume or (version > 0 and self.due(version - 1, version))

    def due(self, previous: int, version: int) -> bool:
        """Whether `version` is evaluated, the last version looked at being `previous`:
        a multiple of the interval or the last step in `(previous, version]`."""
        if version <= previous:
            return False
        if self.max_steps and previous < self.max_steps <= version:
            return True
        if self.interval:
            return version // self.interval > previous // self.interval
        return False


def eval_capacity(share: float, limit: int, *, training_over: bool) -> int:
    """Eval rollouts that may be in flight beside training's: `share` of the in-flight
    `limit` (at least one), or all of it once nothing more will be trained on."""
    if training_over:
        return max(1, limit)
    return max(1, math.floor(share * limit))


@attrs.frozen
class EvalSample:
    """One eval rollout: the prompt it sampled, its reward (None when it failed: `failed`
    is the kind of failure, "timeout", "reward_failed", ...), its completion tokens over
    every turn, the version it was sent under."""

    example: int
    version: int
    reward: float | None = None
    completion_tokens: int = 0
    failed: str | None = None
    #: The environment's own metrics of this rollout (a verifiers rubric's), by name.
    metrics: Mapping[str, float] = attrs.field(factory=dict)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a prompt with `c` passing samples of `n` (Chen et al. 2021):
    the chance that some of `k` samples drawn without replacement passes."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_ks(n: int) -> tuple[int, ...]:
    """The k reported for `n` samples per prompt: powers of two below `n`, and `n`."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i < n]
    return (*ks, n)


@attrs.frozen
class EnvEvalResult:
    """One env's part of an eval."""

    env: str
    samples: int
    failed: int
    prompts: int
    reward_mean: float | None
    pass_at: Mapping[int, float] | None  # None unless every reward is 0 or 1
    completion_tokens_mean: float | None
    completion_tokens_max: int
    versions: tuple[int, ...]
    failures: Mapping[str, int] = attrs.field(factory=dict)
    skipped_prompts: int = 0
    #: The mean of each metric the environment reported, over the scored samples that
    #: reported it.
    metrics: Mapping[str, float] = attrs.field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "failed": self.failed,
            "prompts": self.prompts,
            "skipped_prompts": self.skipped_prompts,
            "reward_mean": _rounded(self.reward_mean),
            "pass_at": None
            if self.pass_at is None
            else {str(k): _rounded(v) for k, v in self.pass_at.items()},
            "completion_tokens_mean": _rounded(self.completion_tokens_mean),
            "completion_tokens_max": self.completion_tokens_max,
            "versions": list(self.versions),
            "failures": dict(self.failures),
            "metrics": {name: _rounded(mean) for name, mean in self.metrics.items()},
        }


def summarize(
    env: str,
    samples: Sequence[EvalSample],
    *,
    rollouts_per_example: int,
    skipped_prompts: int = 0,
) -> EnvEvalResult:
    """What one env's eval samples come to. pass@k is over the prompts whose every
    sample was scored, for k up to `rollouts_per_example`."""
    scored = [s for s in samples if s.reward is not None]
    rewards = [s.reward for s in scored if s.reward is not None]
    failures = Counter(s.failed for s in samples if s.failed is not None)
    lengths = [s.completion_tokens for s in scored]
    by_example: dict[int, list[float]] = {}
    for sample in scored:
        assert sample.reward is not None
        by_example.setdefault(sample.example, []).append(sample.reward)
    return EnvEvalResult(
        env=env,
        samples=len(scored),
        failed=len(samples) - len(scored),
        prompts=len({s.example for s in samples}),
        reward_mean=sum(rewards) / len(rewards) if rewards else None,
        pass_at=_pass_at(by_example.values(), rollouts_per_example),
        completion_tokens_mean=sum(lengths) / len(lengths) if lengths else None,
        completion_tokens_max=max(lengths, default=0),
        versions=tuple(sorted({s.version for s in samples})),
        failures=dict(sorted(failures.items())),
        skipped_prompts=skipped_prompts,
        metrics=_metric_means(scored),
    )


def _pass_at(groups: Iterable[list[float]], n: int) -> dict[int, float] | None:
    complete = [rewards for rewards in groups if len(rewards) == n]
    if not complete or any(r not in (0.0, 1.0) for rewards in complete for r in rewards):
        return None
    return {
        k: sum(pass_at_k(n, int(sum(rewards)), k) for rewards in complete) / len(complete)
        for k in pass_ks(n)
    }


def _metric_means(samples: Sequence[EvalSample]) -> dict[str, float]:
    means = MetricMeans()
    for sample in samples:
        means.add(sample.metrics)
    return means.means()


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


@attrs.frozen
class EvalReport:
    """One eval: the version it was started for, its envs' results, when and how long."""

    version: int
    step: int  # the last batch shipped when it started
    started_at: float  # Unix time
    duration_s: float
    results: tuple[EnvEvalResult, ...]
    resumed: bool = False

    def to_json(self) -> dict[str, Any]:
        """The line `evals.jsonl` holds for it."""
        return {
            "version": self.version,
            "step": self.step,
            "started_at": round(self.started_at, 3),
            "duration_s": round(self.duration_s, 3),
            "resumed": self.resumed,
            "envs": {result.env: result.to_json() for result in self.results},
        }

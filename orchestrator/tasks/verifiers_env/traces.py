"""What the daemon needs from a finished verifiers episode: its reward, metrics, every
model call's sampled tokens in order, and why it failed, if it did (`episode_outcome`).

verifiers 0.4.0 records a rollout as a graph of message nodes (`Trace.nodes`). Each model
call commits exactly one *sampled* node, appended in the order the calls return, whose
`token_ids` are the generation prompt's scaffold (`<|im_start|>assistant\\n`, never
sampled) followed by the completion the server returned, and whose `mask` is True on the
completion only; the prompt's own messages are nodes with no sampled token. So the call's
completion is its sampled node's tokens under the mask (`completions`). Reading runs of
`sampled_mask` off `Trace.branches` says the same for one conversation, but a trace with
several branches (a compacted or rewritten history) repeats shared nodes in each, and two
calls with nothing between them would merge into one run; the nodes say it once each.

Pure functions over duck-typed objects (no verifiers import): the worker runs them on
verifiers' objects, the tests on recorded ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from orchestrator.tasks.verifiers_env.protocol import MAX_ERROR_CHARS, one_line


class Node(Protocol):
    """verifiers' `MessageNode`, as read here."""

    @property
    def sampled(self) -> bool: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def mask(self) -> Sequence[bool]: ...


def completions(nodes: Iterable[Node]) -> list[list[int]]:
    """Each model call's sampled tokens, in the order the calls were committed: the
    sampled nodes' tokens under their mask. Raises ValueError when a node's mask and
    tokens differ in length (a trace this reading does not understand)."""
    calls: list[list[int]] = []
    for node in nodes:
        if not node.sampled:
            continue
        ids, mask = node.token_ids, node.mask
        if len(ids) != len(mask):
            raise ValueError(
                f"a sampled node has {len(ids)} tokens and a mask of {len(mask)}: "
                "its completion cannot be read"
            )
        calls.append([int(token) for token, sampled in zip(ids, mask, strict=True) if sampled])
    return calls


def _error_line(error: Any) -> str:
    """verifiers' `Error` (type, message) as one line: a message of several lines (a
    program's stderr, ending with its traceback) by its first and last."""
    lines = [line.strip() for line in str(error.message).splitlines() if line.strip()]
    message = f"{lines[0]} ... {lines[-1]}" if len(lines) > 1 else "".join(lines)
    if len(message) > MAX_ERROR_CHARS and len(lines) > 1:
        keep = max(MAX_ERROR_CHARS // 2 - len(str(error.type)), 40)
        message = f"{lines[0][:keep]} ... {lines[-1][-keep:]}"
    return one_line(f"{error.type}: {message}")


def _metrics(values: Mapping[str, Any]) -> dict[str, float]:
    """The metrics that hold a finite number (None: the metric did not run)."""
    metrics: dict[str, float] = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            metrics[str(name)] = float(value)
    return metrics


def episode_outcome(episode: Any) -> dict[str, Any]:
    """The `run` answer for a verifiers `Episode`: `reward` (None when there is none, and
    then `error` says why), `metrics`, `completions` (every model call's sampled tokens),
    `stop_condition`, `error` (None when the episode went well).

    The episode's one trainable trace is the rollout (an environment whose episodes train
    several agents at once is refused: the daemon keeps one sample per rollout). Its
    reward is the weighted sum of the rewards that ran; an error recorded on the episode or
    the trace, or a trace that did not finish well, fails it."""
    trainable = [trace for trace in episode.traces if trace.agent.trainable]
    if len(trainable) != 1:
        return {
            "reward": None,
            "metrics": {},
            "completions": [],
            "stop_condition": None,
            "error": (
                f"the episode has {len(trainable)} trainable traces (agents): a rollout "
                "is one agent's"
            ),
        }
    (trace,) = trainable
    outcome: dict[str, Any] = {
        "reward": None,
        "metrics": _metrics(trace.metrics),
        "completions": [],
        "stop_condition": trace.stop_condition,
        "error": None,
    }
    try:
        outcome["completions"] = completions(trace.nodes)
    except ValueError as exc:
        outcome["error"] = one_line(str(exc))
        return outcome
    # The trace's own error first: the episode's is often its consequence (an Env whose
    # agent failed raises when it goes on).
    if trace.errors:
        outcome["error"] = _error_line(trace.errors[-1])
    elif episode.errors:
        outcome["error"] = _error_line(episode.errors[-1])
    elif not trace.ok:
        outcome["error"] = f"the trace did not finish well (stop condition {trace.stop_condition})"
    if outcome["error"] is not None:
        return outcome
    rewards = [reward for reward in trace.rewards.values() if reward is not None]
    if not rewards:
        outcome["error"] = (
            f"no reward was recorded (stop condition {trace.stop_condition}; "
            "does the task have a @vf.reward?)"
        )
        return outcome
    reward = math.fsum(float(r.score) * float(r.weight) for r in rewards)
    if not math.isfinite(reward):
        outcome["error"] = f"the reward is {reward}, not a finite number"
        return outcome
    outcome["reward"] = reward
    return outcome

"""What the daemon reads off a finished verifiers episode (orchestrator/tasks/verifiers_env/
traces.py): every model call's sampled tokens from the trace's message nodes, the reward,
metrics and error. The nodes below are recorded from verifiers 0.4.0 running the demo's
two-turn environment (demo/verifiers_envs/vf_twoturn) through its training client, with
demo/model's tokenizer: each call commits one sampled node, the generation prompt's
scaffold (<|im_start|>assistant\\n, ids 1 595 892 201) unmasked before the completion."""

from __future__ import annotations

from types import SimpleNamespace as Record
from typing import Any

import pytest

from orchestrator.tasks.verifiers_env.traces import completions, episode_outcome

F, T = False, True


def node(sampled: bool, ids: list[int], mask: list[bool] | None = None) -> Record:
    return Record(sampled=sampled, token_ids=ids, mask=[F] * len(ids) if mask is None else mask)


# Two turns, both ending on <|im_end|> (2): "42", then "17" "3".
TWO_TURNS = [
    node(F, [1, 1021, 201, 370, 365, 294, 259, 310, 16, 2, 201]),  # system
    node(F, [1, 509, 284, 201, 279, 277, 468, 369, 720, 33, 2, 201]),  # user
    node(T, [1, 595, 892, 201, 478, 2], [F, F, F, F, T, T]),  # assistant
    node(F, [201, 1, 509, 284, 201, 366, 269, 67, 75, 70, 223, 9, 478, 9, 16, 2, 201]),
    node(T, [1, 595, 892, 201, 621, 17, 2], [F, F, F, F, T, T, T]),
]
# The first completion cut at max_tokens: the template's <|im_end|> that closes it was
# never sampled, and opens the next (user) node.
CUT_SHORT = [
    *TWO_TURNS[:2],
    node(T, [1, 595, 892, 201, 700, 12, 95, 411], [F, F, F, F, T, T, T, T]),
    node(F, [2, 201, 1, 509, 284, 201, 366, 269, 2, 201]),
    TWO_TURNS[4],
]


def test_each_calls_completion_is_its_sampled_nodes_masked_tokens_in_order() -> None:
    assert completions(TWO_TURNS) == [[478, 2], [621, 17, 2]]
    assert completions(CUT_SHORT) == [[700, 12, 95, 411], [621, 17, 2]]
    assert completions(TWO_TURNS[:2]) == []


def test_a_node_whose_mask_does_not_match_its_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="3 tokens and a mask of 2"):
        completions([node(T, [1, 2, 3], [F, T])])


# A harness program's failure as verifiers records it: its stderr's tail.
HARNESS_EXITED = """harness 'null' exited 1: Traceback (most recent call last):
  File "/root/.cache/verifiers/runtimes/scripts/dd38.py", line 984, in main
    await run_chat_loop(args, compactor, messages, dispatch, servers, tool_client)
openai.InternalServerError: Error code: 502 - Special token '<tool_call>' not found
"""


def trace(**fields: Any) -> Record:
    values: dict[str, Any] = {
        "agent": Record(trainable=True),
        "nodes": TWO_TURNS,
        "metrics": {"first_correct": 1.0, "skipped": None},
        "rewards": {"correct": Record(score=1.0, weight=1.0)},
        "stop_condition": "user_closed",
        "errors": [],
        "ok": True,
    }
    values.update(fields)
    return Record(**values)


def episode(*traces: Record, errors: list[Record] | None = None) -> Record:
    return Record(traces=list(traces), errors=errors or [])


def test_a_good_episode_gives_its_weighted_reward_metrics_and_completions() -> None:
    rewards = {
        "correct": Record(score=1.0, weight=1.0),
        "short": Record(score=0.5, weight=0.5),
        "not_run": None,
    }
    assert episode_outcome(episode(trace(rewards=rewards))) == {
        "reward": 1.25,
        "metrics": {"first_correct": 1.0},
        "completions": [[478, 2], [621, 17, 2]],
        "stop_condition": "user_closed",
        "error": None,
    }


def test_a_judge_that_does_not_train_is_left_out() -> None:
    judge = trace(agent=Record(trainable=False), nodes=[])
    assert episode_outcome(episode(judge, trace()))["reward"] == 1.0


@pytest.mark.parametrize(
    ("outcome_of", "error"),
    [
        (
            episode(trace(errors=[Record(type="ProviderError", message="Error code: 500 - x")])),
            "ProviderError: Error code: 500 - x",
        ),
        (
            episode(trace(), errors=[Record(type="EnvError", message="TwoTurnEnv.run(): boom")]),
            "EnvError: TwoTurnEnv.run(): boom",
        ),
        (  # the agent's failure, not what the environment raised because of it
            episode(
                trace(errors=[Record(type="HarnessError", message=HARNESS_EXITED)]),
                errors=[Record(type="EnvError", message="TwoTurnEnv.run(): the exchange is over")],
            ),
            "HarnessError: harness 'null' exited 1: Traceback (most recent call last): ... "
            "openai.InternalServerError: Error code: 502 - Special token '<tool_call>' not found",
        ),
        (
            episode(trace(ok=False, stop_condition="agent_timeout")),
            "the trace did not finish well (stop condition agent_timeout)",
        ),
        (
            episode(trace(rewards={"correct": None})),
            "no reward was recorded (stop condition user_closed; does the task have a @vf.reward?)",
        ),
        (
            episode(trace(rewards={"correct": Record(score=float("nan"), weight=1.0)})),
            "the reward is nan, not a finite number",
        ),
        (episode(trace(), trace()), "the episode has 2 trainable traces (agents)"),
    ],
)
def test_a_failed_episode_has_no_reward_and_one_line_saying_why(
    outcome_of: Record, error: str
) -> None:
    outcome = episode_outcome(outcome_of)
    assert outcome["reward"] is None
    assert outcome["error"].startswith(error), outcome["error"]
    assert "\n" not in outcome["error"]


def test_the_completions_of_a_failed_episode_are_kept() -> None:
    failed = trace(ok=False, errors=[Record(type="ProviderError", message="503")])
    assert episode_outcome(episode(failed))["completions"] == [[478, 2], [621, 17, 2]]

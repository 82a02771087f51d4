"""The simulator's toy environments on the daemon's environment seam: prompts by index
(the same index, the same prompt: a resumed run goes on instead of replaying), replies and
scores as coroutines over token arrays."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.core.environments import Environment, Prompt
from orchestrator.sim.environments import TOY_ENVIRONMENTS, toy_environment


def make(name: str, seed: int = 7) -> Environment:
    return toy_environment(
        name,
        prompt_len_min=4,
        prompt_len_max=12,
        vocab_size=64,
        max_turns=3,
        max_tokens=16,
        seed=seed,
    )


@pytest.mark.parametrize("name", TOY_ENVIRONMENTS)
async def test_the_same_index_gives_the_same_prompt_and_indices_differ(name: str) -> None:
    env = make(name)
    first = [await env.prompt(i) for i in range(50)]
    assert [await env.prompt(i) for i in range(50)] == first
    assert len({p.prompt_id for p in first}) == 50
    assert all(4 <= len(p.token_ids) <= 12 for p in first)
    assert all(0 < int(t) < 64 for p in first for t in p.token_ids)
    # Each prompt says how it is sampled: the env's max_tokens, its turns.
    assert {p.sampling.max_tokens for p in first} == {16}
    assert {p.sampling.max_turns for p in first} <= {1, 3}
    # Another seed, other prompts.
    assert await make(name, seed=8).prompt(0) != first[0]


async def test_mixed_draws_from_both_and_answers_as_the_one_it_drew_from() -> None:
    env = make("mixed")
    prompts = [await env.prompt(i) for i in range(40)]
    assert {p.env for p in prompts} == {"math", "chat"}
    assert {p.sampling.max_turns for p in prompts if p.env == "chat"} == {3}
    assert {p.sampling.max_turns for p in prompts if p.env == "math"} == {1}
    assert all(p.prompt_id.startswith(p.env) for p in prompts)


async def test_chat_replies_until_max_turns_and_math_never() -> None:
    chat, math = make("chat"), make("math")
    prompt = await chat.prompt(0)
    completion = np.array([5, 9, 11], dtype=np.int32)
    reply = await chat.reply(prompt, 0, completion)
    assert reply is not None and reply.dtype == np.int32 and 8 <= len(reply) < 32
    assert np.array_equal(reply, await chat.reply(prompt, 0, completion))  # deterministic
    assert await chat.reply(prompt, 2, completion) is None  # the third turn is the last
    assert await chat.reply(prompt, 0, completion[:0]) is None  # nothing said: it ends
    assert await math.reply(await math.prompt(0), 0, completion) is None


async def test_scores_follow_the_hidden_difficulty() -> None:
    math = make("math")
    easy = Prompt("e", [1, 2], "math", {"difficulty": 0.0})
    hard = Prompt("h", [1, 2], "math", {"difficulty": 1.0})
    completions = [np.array([i, i + 1], dtype=np.int32) for i in range(1, 30)]
    assert {await math.score(easy, [c]) for c in completions} == {1.0}
    assert {await math.score(hard, [c]) for c in completions} <= {0.0, 0.5}
    chat = make("chat")
    middling = Prompt("m", [1, 2], "chat", {"difficulty": 0.5})
    scores = {await chat.score(middling, completions[i : i + 2]) for i in range(20)}
    assert len(scores) > 1 and all(0.0 <= s <= 1.0 for s in scores)


def test_an_unknown_name_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown environment 'poetry' \(one of"):
        make("poetry")


async def test_an_episode_follows_its_env_s_rules_turn_by_turn() -> None:
    chat = make("chat")
    prompt = await chat.prompt(1)
    first, second = chat.episode(prompt), chat.episode(prompt)
    completion = np.array([5, 9, 11], dtype=np.int32)
    assert np.array_equal(
        await first.reply(prompt.token_ids, completion), await chat.reply(prompt, 0, completion)
    )
    # Each episode counts its own turns: the third reply ends the first one only.
    await first.reply(prompt.token_ids, completion)
    assert await first.reply(prompt.token_ids, completion) is None
    assert await second.reply(prompt.token_ids, completion) is not None
    assert await first.score([completion]) == await chat.score(prompt, [completion])
    mixed = make("mixed")
    math_prompt = next(p for p in [await mixed.prompt(i) for i in range(20)] if p.env == "math")
    assert await mixed.episode(math_prompt).reply(math_prompt.token_ids, completion) is None

"""The demo's own reward function, as a user writes one: a module in the directory the
run starts in, named in the config as "demo.rewards:digit_share".

The demo's inference servers are the simulator's, whose completions are random tokens of
the tokenizer's vocabulary: they almost never give the right number, so a reward of
correctness alone would leave nearly every group without signal. This shaping reward
grades how much of the completion is digits.
"""

from __future__ import annotations


def digit_share(completion: str) -> float:
    """The share of the completion's non-space characters that are digits (0 when empty)."""
    characters = [c for c in completion if not c.isspace()]
    if not characters:
        return 0.0
    return sum(c.isdigit() for c in characters) / len(characters)

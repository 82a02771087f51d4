"""A plugin environment (`[[env]] factory = "module:function"`, `args = {...}`): multi-turn
and tool tasks written as a small object that speaks messages; the daemon turns them into
tokens (docs/design.md § Real tasks).

The factory is called once at start-up with `args` as keyword arguments and returns an
object with:

- `prompt(index) -> messages` or `(messages, info)`: episode `index`'s first messages (the
  same index, the same episode: a resumed run continues);
- `step(messages, info) -> messages | None`: given the conversation so far, which ends with
  the model's reply, the next messages (a user's answer, a tool's result), or None when the
  episode ends;
- optionally `score(messages, info) -> float`: the episode's reward; without it the env's
  `rewards` functions score it, with `messages` the whole conversation.

Its methods are plain functions, run in worker threads (never on the event loop), each
under `[rewards] timeout_s`, at most `LIVE_CALLS` at once per env. A call past its deadline
is abandoned (a thread cannot be killed): it gives back its place at once and runs on
unseen; while `MAX_LATE_CALLS` of them still run, further calls fail at once (a plugin
that hangs every call must not pile up threads without end), and the env resumes as they
return. A later turn's prompt is bridged onto the tokens the server
returned (`ChatTokenizer.bridge`): earlier tokens are never re-tokenized. A `step` that
raises fails its rollout (counted `environment`); a `score` that raises, hangs or returns
something that is not a finite number discards it as `reward_failed`.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import attrs
import numpy as np
import trio

from orchestrator.core.environments import Episode, Prompt, PromptSkipped, Sampling, ScoreFailed
from orchestrator.errors import UserError
from orchestrator.tasks.chat import ChatTokenizer, decode_completions
from orchestrator.tasks.reward_functions import RewardSpec
from orchestrator.tasks.reward_pool import RewardExecutor, score_episode

Message = dict[str, Any]

#: Plugin calls one env runs at once.
LIVE_CALLS = 4
#: Abandoned calls (past the deadline, still running) an env may have before it refuses
#: new calls.
MAX_LATE_CALLS = 16


class PluginBusy(Exception):
    """Too many of the plugin's calls still run past their deadline: the call was not made."""


def _messages(value: object, what: str) -> list[Message]:
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value
    ):
        raise TypeError(f"{what} must be a list of chat messages ({{role, content}} dicts)")
    return [dict(m) for m in value]


@attrs.define(eq=False)
class PluginEnvironment:
    """One `[[env]]` with a factory; see the module docstring."""

    name: str
    plugin: Any
    tokenizer: ChatTokenizer
    sampling: Sampling
    rewards: tuple[RewardSpec, ...]
    pool: RewardExecutor
    budget: int
    timeout_s: float
    limiter: trio.CapacityLimiter = attrs.field(factory=lambda: trio.CapacityLimiter(LIVE_CALLS))
    _skips_in_a_row: int = 0
    # Plugin calls whose thread still runs, the abandoned ones included (a lock: threads
    # count themselves out).
    _running: int = 0
    _running_lock: threading.Lock = attrs.field(factory=threading.Lock)
    # The threads themselves are not limited by trio: `limiter`, held by the calling task
    # only until the deadline, is the limit.
    _threads: trio.CapacityLimiter = attrs.field(factory=lambda: trio.CapacityLimiter(math.inf))

    async def call(self, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)` in a worker thread, under the deadline (a call past it is
        left to finish on its own, its result unused). Raises `trio.TooSlowError` past
        the deadline, `PluginBusy` while too many abandoned calls still run."""
        async with self.limiter:
            # Counted from inside the thread, so a call cancelled before it starts is
            # never counted; the calls holding `limiter` may not have started yet.
            if self._running >= LIVE_CALLS + MAX_LATE_CALLS:
                raise PluginBusy(
                    f"{MAX_LATE_CALLS} or more calls still run past the deadline "
                    f"([rewards] timeout_s = {self.timeout_s:g})"
                )
            with trio.fail_after(self.timeout_s):
                return await trio.to_thread.run_sync(
                    self._counted, function, *args, limiter=self._threads, abandon_on_cancel=True
                )

    def _counted(self, function: Callable[..., Any], *args: Any) -> Any:
        with self._running_lock:
            self._running += 1
        try:
            return function(*args)
        finally:
            with self._running_lock:
                self._running -= 1

    async def prompt(self, index: int) -> Prompt:
        try:
            result = await self.call(self.plugin.prompt, index)
            messages, info = result if isinstance(result, tuple) else (result, {})
            messages = _messages(messages, "prompt()")
            if not isinstance(info, dict):
                raise TypeError("prompt()'s info must be a dict")
            tokens = await trio.to_thread.run_sync(
                self.tokenizer.render_prompt, messages, limiter=self.limiter
            )
        except (Exception, trio.TooSlowError) as exc:
            self._skipped(f"episode {index}: prompt() failed ({exc!r:.200})")
        if len(tokens) > self.budget:
            self._skipped(
                f"episode {index}: a prompt of {len(tokens)} tokens is over the budget of "
                f"{self.budget} (batch.max_seq_len - max_tokens)"
            )
        self._skips_in_a_row = 0
        info = {"prompt": messages, "info": info, "index": index}
        return Prompt(f"{self.name}-{index}", tokens, self.name, info, self.sampling)

    def _skipped(self, reason: str) -> NoReturn:
        self._skips_in_a_row += 1
        if self._skips_in_a_row > 1000:
            raise UserError(f"env {self.name}: 1000 episodes in a row cannot start ({reason})")
        raise PromptSkipped(self.name, reason)

    def episode(self, prompt: Prompt) -> Episode:
        return PluginEpisode(self, prompt, list(prompt.info["prompt"]))

    async def decode(self, ids: np.ndarray) -> str:
        (text,) = await decode_completions(self.tokenizer, [ids], self.limiter)
        return text


@attrs.define
class PluginEpisode:
    """One rollout's conversation with the plugin."""

    env: PluginEnvironment
    prompt: Prompt
    messages: list[Message]

    async def reply(self, prompt_ids: np.ndarray, completion_ids: np.ndarray) -> np.ndarray | None:
        env = self.env
        self.messages.append({"role": "assistant", "content": await env.decode(completion_ids)})
        step = await env.call(env.plugin.step, list(self.messages), self.prompt.info["info"])
        if step is None:
            return None
        new = _messages(step, "step()")
        if not new:
            return None
        bridged = await trio.to_thread.run_sync(
            env.tokenizer.bridge, prompt_ids, completion_ids, new, limiter=env.limiter
        )
        self.messages.extend(new)
        start = len(prompt_ids) + len(completion_ids)
        return np.asarray(bridged[start:])

    async def score(self, completions: Sequence[np.ndarray]) -> float:
        env, info = self.env, self.prompt.info
        own = getattr(env.plugin, "score", None)
        if own is not None:
            return await self._own_score(own)
        last = self.messages[-1]
        return await score_episode(
            env.pool,
            env.name,
            env.rewards,
            prompt=info["prompt"],
            messages=self.messages,
            completion=last["content"] if last.get("role") == "assistant" else "",
            answer=info["info"].get("answer"),
            info=info["info"],
        )

    async def _own_score(self, score: Callable[..., Any]) -> float:
        try:
            value = await self.env.call(score, list(self.messages), self.prompt.info["info"])
        except trio.TooSlowError:
            raise ScoreFailed("timeout", "score() gave no value in time") from None
        except PluginBusy as exc:
            raise ScoreFailed("timeout", f"score() not called: {exc}") from None
        except Exception as exc:
            raise ScoreFailed("raised", f"score() raised {exc!r:.200}") from None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ScoreFailed("bad_value", f"score() returned {value!r:.100}, not a number")
        if not math.isfinite(float(value)):
            raise ScoreFailed("bad_value", f"score() returned {value!r}, not a finite number")
        return float(value)

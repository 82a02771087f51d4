"""The model's tokenizer and chat template, applied as vLLM applies them, and exact bridging.

`ChatTokenizer.load(folder)` reads a tokenizer from a local model folder (never the Hugging
Face hub) with transformers. It turns chat messages into the prompt token ids sent to
vLLM's tokens-in generate API, names the ids that end a generation, decodes completions
for rewards, and builds the next prompt of a multi-turn episode (`bridge`).

As vLLM: its chat endpoint renders the template to text and tokenizes that text with
`add_special_tokens=False` (vllm/entrypoints/openai/chat_completion/protocol.py: "the chat
template takes care of adding the special tokens"), so a BOS is never added twice; its
`/inference/v1/generate` takes the ids as they are (vllm/entrypoints/serve/disagg/protocol.py).
Its stop ids are the tokenizer's eos id plus the `eos_token_id` (an int or a list) of the
model's generation config (vllm/v1/engine/input_processor.py calls
`SamplingParams.update_from_generation_config` in vllm/sampling_params.py with
`ModelConfig.try_get_generation_config()`, which reads `generation_config.json` and else
`config.json`: vllm/transformers_utils/config.py).

Bridging. The next turn's prompt must start with exactly the previous prompt and the
sampled completion: those tokens are what the model saw and produced, what the trainer
learns from and what the captured expert-routing rows describe. Re-rendering the whole
chat re-tokenizes them, and templates that strip reasoning from earlier assistant turns
(Qwen3's, prime-rl issues #947 and #1334) then change them. So `bridge` appends to the
sampled ids only what the template writes after an assistant's content: the close of that
turn (unless the completion already ended with it), the new messages and the generation
prompt. It learns that text from the template itself, by rendering a base conversation
with and without the new messages; see `bridge` for the rule and its limits.

Why not prime-rl's `renderers` package: its `bridge_to_next_turn` is hand-written per
model family, and its `DefaultRenderer` (the one any local model folder gets unless
configured) returns None, meaning "re-render", which is what we must not do. The generic
bridge here works for any template whose earlier turns render the same when messages are
added, and says so with `BridgeError` when that cannot be shown. A later
`[model] renderer = "qwen3"` option could use such a hand-written renderer instead: it
would add per-message token attribution without re-rendering, tool-call and reasoning
parsing of completions, and bridging for templates the generic check rejects.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import attrs
import numpy as np
import numpy.typing as npt
import trio

from orchestrator.core.arrays import token_array
from orchestrator.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["BridgeError", "ChatTokenizer", "Message", "TokenizerError", "decode_completions"]

#: A chat message as the template reads it: at least "role" and "content".
Message = Mapping[str, Any]

# Files one of which a folder must hold for transformers to find a tokenizer in it.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
)

# The base conversation whose renders show what the template writes around an assistant
# turn. The reply is an unusual word so that it cannot be confused with template text.
_BASE_PROMPT: tuple[Message, ...] = ({"role": "user", "content": "x"},)
_BASE_REPLY = "yq7"


#: transformers' own "no limit" (its VERY_LARGE_INTEGER) for `model_max_length`.
_NO_LENGTH_LIMIT = int(1e30)
#: Up to this many tokens, completions are decoded on the event loop: about 5 µs for 16
#: tokens and 0.2 ms for 1,000 on the reference machine, where a worker thread's round trip
#: costs some 55 µs of CPU and two of the scheduler's rounds. Longer ones go to a thread.
INLINE_DECODE_TOKENS = 2048


class TokenizerError(UserError):
    """A model folder's tokenizer cannot be loaded or lacks what the task needs."""


class BridgeError(UserError):
    """The chat template cannot be shown to extend a conversation without re-rendering it."""


#: Held while transformers is imported and a tokenizer loaded: its lazy module is not
#: thread-safe on first use (a second thread's `transformers.AutoTokenizer` can fail with
#: AttributeError while the first still resolves it; `check-config` loads environments
#: side by side). A load takes milliseconds once the import is done.
_LOADING = threading.Lock()


@functools.cache
def _transformers() -> Any:
    """transformers, imported on first use (it takes seconds) with its logging tamed.
    Call it holding `_LOADING`."""
    # transformers logs an advisory "PyTorch was not found" line at import; no torch is
    # installed on purpose (only tokenizers are used). This is its switch for advisories.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers

    # Its own stderr handler would write plain lines into the daemon's JSON log: send its
    # records to the root logger instead, which `orchestrator.logs` renders.
    transformers.utils.logging.disable_default_handler()
    transformers.utils.logging.enable_propagation()
    return transformers


@attrs.frozen(eq=False)
class ChatTokenizer:
    """A model's tokenizer and chat template. Build it with `ChatTokenizer.load`."""

    folder: Path
    tokenizer: PreTrainedTokenizerBase = attrs.field(repr=False)
    #: The ids that end a generation, the tokenizer's eos id first, as vLLM stops on them.
    stop_token_ids: tuple[int, ...]
    #: Extra variables every render of the chat template gets (`enable_thinking`, ...).
    template_kwargs: Mapping[str, Any] = attrs.field(factory=dict)

    @classmethod
    def load(
        cls,
        folder: Path,
        *,
        require_chat_template: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> ChatTokenizer:
        """Load the tokenizer in the local model `folder` (blocks on file reads).
        `template_kwargs` go to every render of the chat template.

        Raises TokenizerError when the folder is missing, holds no tokenizer, its
        generation config is malformed, or (with `require_chat_template`) the tokenizer
        has no chat template.
        """
        cls.check_folder(folder)
        try:
            with _LOADING:
                auto = _transformers().AutoTokenizer
                tokenizer = cast(
                    "PreTrainedTokenizerBase", auto.from_pretrained(folder, local_files_only=True)
                )
        # Any failure means the folder's files are not a usable tokenizer; the Rust
        # `tokenizers` library raises plain Exception for a tokenizer.json it cannot read.
        except Exception as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise TokenizerError(
                f"cannot load the tokenizer in {folder}: {type(error).__name__}: {first_line}"
            ) from error
        if require_chat_template and not tokenizer.chat_template:
            raise TokenizerError(
                f"the tokenizer in {folder} has no chat template "
                "(tokenizer_config.json's chat_template or chat_template.jinja)"
            )
        # The daemon keeps its own budget (batch.max_seq_len): a prompt longer than the
        # folder's model_max_length is not the tokenizer's to warn about on every call.
        tokenizer.model_max_length = _NO_LENGTH_LIMIT
        return cls(
            folder, tokenizer, _stop_token_ids(folder, tokenizer), dict(template_kwargs or {})
        )

    @staticmethod
    def check_folder(folder: Path) -> None:
        """What `load` checks first, in a few file stats: `folder` is a folder that holds
        tokenizer files. Raises TokenizerError."""
        if not folder.is_dir():
            raise TokenizerError(f"model folder {folder} does not exist or is not a folder")
        if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            raise TokenizerError(
                f"model folder {folder} has no tokenizer files ({', '.join(_TOKENIZER_FILES)})"
            )

    @property
    def vocab_size(self) -> int:
        """The number of ids the tokenizer knows, added tokens included (all ids are below)."""
        return len(self.tokenizer)

    def render_prompt(self, messages: Sequence[Message]) -> np.ndarray:
        """The prompt ids for `messages`: the template with the generation prompt, tokenized.

        Equal to `apply_chat_template(messages, tokenize=True, add_generation_prompt=True)`.
        Raises TokenizerError when the tokenizer has no chat template.
        """
        return token_array(self._encode(self._render(messages, add_generation_prompt=True)))

    def decode(self, ids: npt.ArrayLike) -> str:
        """The text of `ids` with special tokens left out (a completion's text, for rewards)."""
        decoded = self.tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=True)
        return cast(str, decoded)

    def bridge(
        self,
        prev_prompt_ids: npt.ArrayLike,
        completion_ids: npt.ArrayLike,
        new_messages: Sequence[Message],
    ) -> np.ndarray:
        """The next turn's prompt: `prev_prompt_ids + completion_ids`, unchanged, then the rest.

        The rest is the text the template writes after an assistant's content when
        `new_messages` follow it: the close of the assistant turn, the new messages and the
        generation prompt. It comes from two renders of a base conversation: P, a user
        message with the generation prompt (the shape of every prompt the model saw), and
        F, that conversation with a reply and `new_messages` added, with the generation
        prompt. F must start with P followed by the reply, or (a generation prompt that
        pre-fills, as `enable_thinking=false` does) with the base conversation's history
        and then hold the reply (else BridgeError: the template renders an earlier turn
        differently once messages follow it); the text after the reply is the rest,
        tokenized as a whole as the full render would tokenize it. (P, not a
        render of the user message and the reply: Qwen3's template gives a final assistant
        turn an empty `<think>` block that it drops once a user message follows.)

        When the completion ended with a stop id and the rest starts with the completion's
        last tokens (ChatML's `<|im_end|>` before its newline), those are not repeated.
        Otherwise (truncated by max_tokens, or stopped by an eos that is not the template's
        close) the whole close is appended after the sampled ids.

        Limits: the new messages are rendered after one base user turn and reply, so a
        template whose framing depends on more of the history (message counts, tools,
        dates, a system message it moves) is shown correct only for that shape; what the
        model wrote is kept as sampled even where a full render would write it otherwise.
        Raises ValueError for no new messages, BridgeError as above, TokenizerError when
        the tokenizer has no chat template.
        """
        if not new_messages:
            raise ValueError("bridge needs at least one new message")
        prompt, completion = _ids(prev_prompt_ids), _ids(completion_ids)
        rest = self._encode(self._text_after_reply(new_messages))
        skip = _close_overlap(completion.tolist(), rest, frozenset(self.stop_token_ids))
        return token_array(np.concatenate([prompt, completion, _ids(rest[skip:])]))

    def _text_after_reply(self, new_messages: Sequence[Message]) -> str:
        reply: Message = {"role": "assistant", "content": _BASE_REPLY}
        extended = self._render([*_BASE_PROMPT, reply, *new_messages], add_generation_prompt=True)
        seen = self._render(_BASE_PROMPT, add_generation_prompt=True) + _BASE_REPLY
        if extended.startswith(seen):
            return extended[len(seen) :]
        # A generation prompt that pre-fills part of the reply (Qwen3's empty think block
        # with enable_thinking=false) is not how the template writes the turn in the
        # history: anchor at the history before the turn, and the reply in it.
        history = self._render(_BASE_PROMPT, add_generation_prompt=False)
        at = extended.find(_BASE_REPLY, len(history))
        if not extended.startswith(history) or at < 0:
            raise BridgeError(
                f"the chat template of {self.folder} renders an earlier assistant turn "
                "differently once messages are added, so bridging cannot be proven"
            )
        return extended[at + len(_BASE_REPLY) :]

    def _render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        if not self.tokenizer.chat_template:
            raise TokenizerError(f"the tokenizer in {self.folder} has no chat template")
        text = self.tokenizer.apply_chat_template(
            [dict(message) for message in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )
        return cast(str, text)

    def _encode(self, text: str) -> list[int]:
        # As apply_chat_template(tokenize=True) and vLLM's chat endpoint: the template
        # writes the special tokens itself.
        fast = _fast_encoder(self.tokenizer)
        if fast is not None:
            return cast(list[int], fast([text], add_special_tokens=False)[0].ids)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return cast(list[int], ids)


def _fast_encoder(tokenizer: PreTrainedTokenizerBase) -> Any | None:
    """The Rust tokenizer's `encode_batch_fast` (tokenizers 0.21 on: no character offsets,
    the GIL released), when calling it gives what calling `tokenizer` without truncation or
    padding gives: a fast tokenizer whose backend has neither set and splits special tokens
    as `tokenizer` says. Else None: the caller goes through `tokenizer`, which sets them so.

    A 5,000-token prompt tokenizes in 2.9 ms this way against 4.0 ms through transformers'
    call, which computes the offsets and builds a `BatchEncoding` (docs/design.md §12).
    """
    backend: Any = getattr(tokenizer, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if (
        fast is None
        or backend.truncation is not None
        or backend.padding is not None
        or backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False))
    ):
        return None
    return fast


def _ids(value: npt.ArrayLike) -> np.ndarray:
    """Token ids as a 1-D int32 array; an empty list too (numpy would make it float)."""
    array = np.asarray(value)
    if array.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {array.shape}")
    return token_array(array if array.size else array.astype(np.int32))


def _close_overlap(completion: list[int], rest: list[int], stop_ids: frozenset[int]) -> int:
    """How many leading ids of `rest` the completion already ends with (0 unless it stopped).

    A completion that stopped on a stop id has written the template's close up to and
    including that id (`<|im_end|>` of ChatML's `<|im_end|>\\n`); the rest then starts
    with the same ids. The first occurrence of the stop id in `rest` is the one: a later
    one closes a new message, which the model cannot have written before stopping.
    """
    if not completion or completion[-1] not in stop_ids or completion[-1] not in rest:
        return 0
    length = rest.index(completion[-1]) + 1
    return length if completion[-length:] == rest[:length] else 0


def _stop_token_ids(folder: Path, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The tokenizer's eos id, then the generation config's eos ids (as vLLM stops on)."""
    ids: list[int] = []
    if isinstance(tokenizer.eos_token_id, int):
        ids.append(tokenizer.eos_token_id)
    for name in ("generation_config.json", "config.json"):
        if (folder / name).is_file():
            ids.extend(_config_eos_ids(folder / name))
            # As transformers' GenerationConfig.from_pretrained: config.json only when
            # there is no generation_config.json.
            break
    stop_ids = tuple(dict.fromkeys(ids))
    if not stop_ids:
        raise TokenizerError(
            f"the tokenizer in {folder} has no eos token and no generation config names one"
        )
    return stop_ids


def _config_eos_ids(path: Path) -> list[int]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TokenizerError(f"cannot read {path}: {error}") from error
    eos = config.get("eos_token_id") if isinstance(config, dict) else None
    if eos is None:
        return []
    values = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TokenizerError(f"{path}: eos_token_id must be a token id or a list of them")
    return cast(list[int], values)


async def decode_completions(
    tokenizer: ChatTokenizer, completions: Sequence[npt.ArrayLike], limiter: trio.CapacityLimiter
) -> list[str]:
    """The texts of `completions` (`ChatTokenizer.decode`): on the loop when they are short
    (`INLINE_DECODE_TOKENS` in all), else in a worker thread under `limiter`."""
    if sum(np.size(ids) for ids in completions) <= INLINE_DECODE_TOKENS:
        return [tokenizer.decode(ids) for ids in completions]
    return await trio.to_thread.run_sync(
        lambda: [tokenizer.decode(ids) for ids in completions], limiter=limiter
    )

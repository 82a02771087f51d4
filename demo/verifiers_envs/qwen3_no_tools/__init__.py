"""renderers' Qwen3 renderer for a vocabulary without Qwen3's tool-call tokens: demo/model's
(1024 tokens; of Qwen3's specials it has `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`,
`<think>` and `</think>`, and no `<tool_call>`, `</tool_call>`, `<tool_response>`,
`</tool_response>`), whose chat template is Qwen3's without tools. renderers' own `qwen3`
refuses such a tokenizer when it is built (an assertion per missing token), and its
`default` re-renders the whole conversation every turn; this one renders and bridges as
`qwen3` does, and refuses tools. A custom renderer, as renderers takes one:

    renderer = {name = "custom", import_path = "qwen3_no_tools.Qwen3NoToolsRenderer",
                thinking_retention = "all"}

(`thinking_retention = "all"`: bridge across a new user turn too; Qwen3's default renders
such a turn anew.)
"""

from __future__ import annotations

from typing import Any

from renderers.configs import Qwen3RendererConfig
from renderers.qwen3 import Qwen3Renderer

__all__ = ["Qwen3NoToolsRenderer"]

TOOL_TOKENS = frozenset({"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"})
#: The id a missing tool token gets: no sampled token equals it, so no completion parses
#: as a tool call.
MISSING = -1


class Qwen3NoToolsRenderer(Qwen3Renderer):
    """`Qwen3Renderer` on a tokenizer that may lack the tool tokens; refuses tools then."""

    config_class = Qwen3RendererConfig

    def __init__(self, tokenizer: Any, config: Qwen3RendererConfig | None = None) -> None:
        super().__init__(tokenizer, config)
        self._has_tools = MISSING not in (
            self._tool_call,
            self._tool_call_end,
            self._tool_response,
            self._tool_response_end,
        )

    def _token_id(self, token: str) -> int:
        if token in TOOL_TOKENS:
            tid = self._tokenizer.convert_tokens_to_ids(token)
            if not isinstance(tid, int) or tid == self._tokenizer.unk_token_id:
                return MISSING
        return super()._token_id(token)

    def _refuse_tools(self, messages: list[Any], tools: Any) -> None:
        if self._has_tools:
            return
        if tools or any(
            message.get("role") == "tool" or message.get("tool_calls") for message in messages
        ):
            raise ValueError(
                "this tokenizer has no <tool_call>/<tool_response> tokens: "
                "Qwen3NoToolsRenderer renders no tools"
            )

    def render(self, messages: list[Any], *, tools: Any = None, **kwargs: Any) -> Any:
        self._refuse_tools(messages, tools)
        return super().render(messages, tools=tools, **kwargs)

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list[Any],
        *,
        tools: Any = None,
    ) -> Any:
        self._refuse_tools(new_messages, tools)
        return super().bridge_to_next_turn(
            previous_prompt_ids, previous_completion_ids, new_messages, tools=tools
        )

"""Upstream vLLM's reply form ("upstream"): vLLM as released.

`logprobs.content` entries for the sampled tokens, routing as a base64 `.npy` in the
model's capture dtype (its rows start at the request's `routed_experts_prompt_start`,
which the reply does not repeat), the sampling mask as one list of ids per token. Upstream
vLLM has no by-handle mode: it ignores `payload_dir` and answers inline.
"""

from __future__ import annotations

from typing import Any

import attrs

from orchestrator.reply_form_names import ReplyFormName
from orchestrator.wire.arrays import ROUTING_DTYPES, decode_npy, encode_mask_lists, encode_npy

from .._model import Completion
from ._protocol import MaskRows, RoutingIds

__all__ = ["UPSTREAM", "UpstreamForm"]


def _content(completion: Completion) -> list[dict[str, Any]]:
    """vLLM's `logprobs.content`: the sampled token of each step and its logprob, and (the
    request asks for one) the same token as the top-1 entry, as vLLM 0.30.0 answers."""
    return [
        {
            "token": f"token_id:{token}",
            "logprob": logprob,
            "bytes": None,
            "top_logprobs": [{"token": f"token_id:{token}", "logprob": logprob, "bytes": None}],
        }
        for token, logprob in zip(
            completion.token_ids.tolist(), completion.logprobs.tolist(), strict=True
        )
    ]


@attrs.frozen
class UpstreamForm:
    """Upstream vLLM's reply form (see the module docstring)."""

    @property
    def name(self) -> ReplyFormName:
        return "upstream"

    @property
    def by_handle(self) -> None:
        return None

    def inline_choice(
        self,
        index: int,
        completion: Completion,
        *,
        logprobs: bool,
        routing: RoutingIds | None,
        routing_start: int,
        mask: MaskRows | None,
    ) -> dict[str, Any]:
        return {
            "index": index,
            "token_ids": completion.token_ids.tolist(),
            "finish_reason": completion.finish_reason,
            "logprobs": {"content": _content(completion)} if logprobs else None,
            "routed_experts": None if routing is None else self.encode_routing(routing, None),
            "sampling_mask": None if mask is None else encode_mask_lists(mask),
        }

    def holds_routing(self, value: object) -> bool:
        return isinstance(value, str)

    def encode_routing(self, ids: RoutingIds, start: int | None) -> object:
        return encode_npy(ids)

    def decode_routing(self, value: object, what: str) -> tuple[RoutingIds, int | None]:
        return decode_npy(value, what, dtypes=ROUTING_DTYPES, ndim=3), None


UPSTREAM = UpstreamForm()

"""prime-rl's reply form ("prime-rl"): prime-rl's vLLM extension.

The sampled tokens' logprobs packed in `completion_logprobs` (`logprobs` null), routing
packed with its `start` in the dtype the reply's ids need (uint8 when every id fits, else
uint16: decided per reply), the sampling mask in CSR form; or, by handle (a request with
`extra_args.payload_dir`), `payload` segments naming one file per choice, routing and mask
null then. `payload_error` is this project's extension: a choice whose file could not be
written says why, with `payload` null.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from orchestrator.reply_form_names import ReplyFormName
from orchestrator.wire.arrays import (
    ROUTING_DTYPES,
    decode_packed_routing,
    encode_mask_csr,
    encode_packed,
    routing_dtype_for,
)

from .._model import Completion
from ._protocol import ByHandleForm, MaskRows, RoutingIds

__all__ = ["PRIME_RL", "PrimeRLByHandle", "PrimeRLForm", "narrow_routing"]


def narrow_routing(ids: RoutingIds) -> RoutingIds:
    """Routing ids as prime-rl sends them: uint8 when every id of this reply fits."""
    narrowed: RoutingIds = ids.astype(routing_dtype_for(ids), copy=False)
    return narrowed


def _choice(
    index: int,
    completion: Completion,
    *,
    logprobs: bool,
    routing: object,
    mask: object,
    payload: list[dict[str, Any]] | None,
    payload_error: str | None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "token_ids": completion.token_ids.tolist(),
        "finish_reason": completion.finish_reason,
        "logprobs": None,
        "completion_logprobs": (
            encode_packed(completion.logprobs.astype(np.float32)) if logprobs else None
        ),
        "routed_experts": routing,
        "sampling_mask": mask,
        "payload": payload,
    }
    if payload_error is not None:
        choice["payload_error"] = payload_error
    return choice


@attrs.frozen
class PrimeRLByHandle:
    """prime-rl's by-handle choices: the routing file holds the narrowed ids."""

    def payload_routing(self, ids: RoutingIds) -> RoutingIds:
        return narrow_routing(ids)

    def choice(
        self,
        index: int,
        completion: Completion,
        *,
        logprobs: bool,
        payload: list[dict[str, Any]] | None,
        payload_error: str | None = None,
    ) -> dict[str, Any]:
        return _choice(
            index,
            completion,
            logprobs=logprobs,
            routing=None,
            mask=None,
            payload=payload,
            payload_error=payload_error,
        )


_BY_HANDLE = PrimeRLByHandle()


@attrs.frozen
class PrimeRLForm:
    """prime-rl's reply form (see the module docstring)."""

    @property
    def name(self) -> ReplyFormName:
        return "prime-rl"

    @property
    def by_handle(self) -> ByHandleForm:
        return _BY_HANDLE

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
        return _choice(
            index,
            completion,
            logprobs=logprobs,
            routing=(
                None
                if routing is None
                else self.encode_routing(narrow_routing(routing), routing_start)
            ),
            mask=None if mask is None else encode_mask_csr(mask),
            payload=None,
            payload_error=None,
        )

    def holds_routing(self, value: object) -> bool:
        return isinstance(value, dict)

    def encode_routing(self, ids: RoutingIds, start: int | None) -> object:
        if start is None:
            raise ValueError("prime-rl's packed routing carries its start")
        return encode_packed(ids, start=start)

    def decode_routing(self, value: object, what: str) -> tuple[RoutingIds, int | None]:
        ids, start = decode_packed_routing(value, what, dtypes=ROUTING_DTYPES, ndim=3)
        return ids, start


PRIME_RL = PrimeRLForm()

"""What a reply form is: the small protocol every form module implements.

A reply form is how one server family answers vLLM's generate request: the keys of a
choice, how its arrays are encoded inline, whether it honours `payload_dir` (by handle),
and how its inline routing reads back (the P/D router merges two sides' routing). The
body around the choices (`request_id`, `usage`, `kv_transfer_params`) and vLLM's error
body are the same for every form (`orchestrator.sim._response`).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from orchestrator.reply_form_names import ReplyFormName

from .._model import Completion

__all__ = ["ByHandleForm", "MaskRows", "ReplyForm", "RoutingIds"]

#: Routing rows `[positions, layers, top_k]` of expert ids, in the model's dtype.
RoutingIds = npt.NDArray[np.unsignedinteger]
#: Sampling-mask rows `[completion tokens, widest]`, padded with `-1`.
MaskRows = npt.NDArray[np.int32]


class ReplyForm(Protocol):
    """One server family's reply form (one module of `orchestrator.sim.reply_forms`).

    Every choice carries every key of its form, null when not captured or not asked for.
    """

    @property
    def name(self) -> ReplyFormName:
        """The form's name (`[sim] reply_form`, `--reply-form`)."""
        ...

    @property
    def by_handle(self) -> ByHandleForm | None:
        """How the form answers a request with `extra_args.payload_dir`; None: it ignores
        `payload_dir` and answers inline, as upstream vLLM does."""
        ...

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
        """Choice `index` with its arrays inline: `routing` rows from position
        `routing_start` (None: not captured), `mask` (None: not captured), the sampled
        tokens' logprobs when the request asked for them (`logprobs`)."""
        ...

    def holds_routing(self, value: object) -> bool:
        """Whether an inline `routed_experts` value is in this form (by its JSON type)."""
        ...

    def encode_routing(self, ids: RoutingIds, start: int | None) -> object:
        """Inline routing rows `ids` from position `start`, as this form's choice carries
        them (`start` None: a form whose routing does not carry its start)."""
        ...

    def decode_routing(self, value: object, what: str) -> tuple[RoutingIds, int | None]:
        """An inline `routed_experts` value of this form back to its rows and their first
        position (None when the form does not carry it: the request's
        `routed_experts_prompt_start`). Raises `orchestrator.wire.arrays.WireFormatError`
        naming `what`."""
        ...


class ByHandleForm(Protocol):
    """How a form answers by handle: one file per choice in `payload_dir`, segments
    naming it in the choice."""

    def payload_routing(self, ids: RoutingIds) -> RoutingIds:
        """Routing ids as this form writes them into a payload file (its dtype)."""
        ...

    def choice(
        self,
        index: int,
        completion: Completion,
        *,
        logprobs: bool,
        payload: list[dict[str, Any]] | None,
        payload_error: str | None = None,
    ) -> dict[str, Any]:
        """Choice `index` by handle: `payload` the wire segments (`[]`: nothing
        captured), or None with `payload_error` saying why the file is missing."""
        ...

"""Disaggregated prefill/decode (P/D), pure logic: what the router sends each side, what
each side checks, and how the router merges the two replies (docs/protocol.md §
Disaggregated prefill/decode).

The router (PrimeIntellect-ai/router, `vllm_pd_router.rs`) sends the request first to a
prefill server with `max_tokens = 1` (`min_tokens` capped at 1, no streaming) and
`kv_transfer_params = {"do_remote_decode": true, ...}`, then the original request to a
decode server with the `kv_transfer_params` the prefill answered (where to fetch the
prompt's KV blocks), and answers with the decode server's reply. Routing needs merging:
the prefill server ran the prompt forward, the decode server only from its first forward
pass, the prompt's last token, on. Inline, the router keeps the prefill's rows and the
decode's rows after as many as the prefill sent (`routed_experts_merge.rs`); by handle,
this router forwards both sides' segments, prefill's first, and the daemon stitches them
with the same rule, checking the row both computed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from orchestrator.wire.arrays import WireFormatError

from ._wire import BadRequest
from .reply_forms import routing_form

__all__ = [
    "KV_BLOCK_TOKENS",
    "PDMergeError",
    "SimRole",
    "check_decode_request",
    "check_prefill_request",
    "decode_request",
    "kv_block_ids",
    "merge_choices",
    "pad_rows",
    "prefill_kv_transfer_params",
    "prefill_request",
]

#: What a simulated server is: a whole server, or one side of a P/D deployment.
SimRole = Literal["aggregated", "prefill", "decode"]
SIM_ROLES: tuple[SimRole, ...] = ("aggregated", "prefill", "decode")

#: Tokens per KV block (vLLM's default block size).
KV_BLOCK_TOKENS = 16


class PDMergeError(Exception):
    """Replies the router cannot merge: one line, answered as a 500 (as the real router)."""


def kv_block_ids(prompt_hashes: npt.NDArray[np.uint64]) -> list[int]:
    """Ids of a prompt's KV blocks, as a prefill server announces them: each the hash of
    the prefix that ends the block (53 bits, exact in any JSON reader). A decode server
    computes the same from its own prompt, so blocks of another prompt are noticed."""
    ends = np.arange(KV_BLOCK_TOKENS - 1, len(prompt_hashes), KV_BLOCK_TOKENS)
    if len(prompt_hashes) % KV_BLOCK_TOKENS:
        ends = np.append(ends, len(prompt_hashes) - 1)
    return [int(h) >> 11 for h in prompt_hashes[ends]]


def prefill_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The router's request to the prefill side: one token, not streamed, with
    `kv_transfer_params` asking it to keep the prompt's KV for a remote decode."""
    request = copy.deepcopy(dict(body))
    params = request.get("sampling_params")
    if isinstance(params, dict):
        params["max_tokens"] = 1
        min_tokens = params.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > 1:
            params["min_tokens"] = 1
    else:
        request["sampling_params"] = {"max_tokens": 1, "min_tokens": 1}
    request["stream"] = False
    request.pop("stream_options", None)
    request["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return request


def decode_request(body: Mapping[str, Any], prefill_reply: Mapping[str, Any]) -> dict[str, Any]:
    """The router's request to the decode side: the original one, with the
    `kv_transfer_params` the prefill side answered (when it answered any)."""
    request = dict(body)
    params = prefill_reply.get("kv_transfer_params")
    if params is not None:
        request["kv_transfer_params"] = params
    return request


def prefill_kv_transfer_params(
    engine_id: str, host: str, port: int, block_ids: Sequence[int]
) -> dict[str, Any]:
    """What a prefill server answers in `kv_transfer_params`: where its KV blocks are."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": list(block_ids),
        "remote_host": host,
        "remote_port": port,
    }


def check_prefill_request(kv: Mapping[str, Any] | None) -> None:
    """A prefill server serves only requests a P/D router prepared. Raises `BadRequest`."""
    if kv is None or kv.get("do_remote_decode") is not True:
        raise BadRequest(
            "a prefill server serves P/D requests: kv_transfer_params.do_remote_decode "
            "must be true (send requests through the prefill/decode router)"
        )


def check_decode_request(kv: Mapping[str, Any] | None, block_ids: Sequence[int]) -> None:
    """A decode server needs the prompt's KV from a prefill server: the request must name
    the blocks of this very prompt. Raises `BadRequest`."""
    if kv is None or kv.get("do_remote_prefill") is not True:
        raise BadRequest(
            "a decode server needs the prompt's KV from a prefill server: "
            "kv_transfer_params.do_remote_prefill must be true (send requests through "
            "the prefill/decode router)"
        )
    if kv.get("remote_block_ids") != list(block_ids):
        raise BadRequest("kv_transfer_params.remote_block_ids are not this prompt's KV blocks")


def pad_rows(
    routing: npt.NDArray[np.unsignedinteger], first: int, start: int
) -> npt.NDArray[np.unsignedinteger]:
    """Routing rows from position `first` left-padded with zero rows to start at `start`:
    what a decode server sends inline, since the router drops as many of its leading rows
    as the prefill sent (prime-rl's `pad_to_start`; the padding is never used)."""
    if first <= start:
        return routing
    padding = np.zeros((first - start, *routing.shape[1:]), dtype=routing.dtype)
    return np.concatenate([padding, routing])


def merge_choices(
    prefill_choice: Mapping[str, Any] | None, decode_choices: list[dict[str, Any]]
) -> None:
    """Merge the prefill side's routing into every decode choice, in place.

    Inline (`routed_experts` on the prefill choice), as `routed_experts_merge.rs` merges:
    the prefill's rows, then the decode's rows after as many as the prefill sent (the
    decode's leading rows are its padding and its first forward pass, which the prefill
    also computed); the first position is the prefill's; `uint8` and `uint16` sides widen
    to `uint16`. By handle (a `payload` list on either side): the prefill side's segments
    first, then the decode side's, unclipped, so the daemon sees every file both wrote
    and the row both computed; a side's `payload_error` is passed on, named by side.

    Raises `PDMergeError` (one line) for replies that cannot be merged.
    """
    prefill = prefill_choice or {}
    by_handle = isinstance(prefill.get("payload"), list) or any(
        isinstance(choice.get("payload"), list) for choice in decode_choices
    )
    if by_handle or prefill.get("payload_error") is not None:
        for choice in decode_choices:
            _forward_segments(prefill, choice)
        return
    ours = prefill.get("routed_experts")
    if ours is None:
        if any(choice.get("routed_experts") is not None for choice in decode_choices):
            raise PDMergeError("decode response contained routed_experts, but prefill did not")
        return
    for choice in decode_choices:
        theirs = choice.get("routed_experts")
        if theirs is None:
            raise PDMergeError("decode choice routed_experts is missing")
        choice["routed_experts"] = _merge_routing(ours, theirs)


def _forward_segments(prefill: Mapping[str, Any], choice: dict[str, Any]) -> None:
    segments = [*_segments(prefill), *_segments(choice)]
    errors = [
        f"{side}: {error}"
        for side, error in (
            ("prefill", prefill.get("payload_error")),
            ("decode", choice.get("payload_error")),
        )
        if error is not None
    ]
    if errors:
        choice["payload_error"] = "; ".join(str(e) for e in errors)
    choice["payload"] = segments if segments or not errors else None


def _segments(choice: Mapping[str, Any]) -> list[Any]:
    segments = choice.get("payload")
    return list(segments) if isinstance(segments, list) else []


def _merge_routing(ours: object, theirs: object) -> object:
    """One decode choice's inline routing merged with the prefill's, in the reply form
    both are in (orchestrator.sim.reply_forms)."""
    form, other = routing_form(ours), routing_form(theirs)
    if form is None or other is None or form is not other:
        raise PDMergeError("prefill and decode routed_experts are in different forms")
    try:
        prompt, start = form.decode_routing(ours, "prefill routed_experts")
        whole, _ = form.decode_routing(theirs, "decode routed_experts")
    except WireFormatError as exc:
        raise PDMergeError(str(exc)) from None
    return form.encode_routing(_concat(prompt, whole), start)


def _concat(prompt: np.ndarray, whole: np.ndarray) -> np.ndarray:
    if whole.shape[1:] != prompt.shape[1:]:
        raise PDMergeError(
            f"cannot concatenate routed_experts with shapes {list(prompt.shape)} "
            f"and {list(whole.shape)}"
        )
    if len(whole) < len(prompt):
        raise PDMergeError(
            f"decode routed_experts has {len(whole)} rows, expected at least {len(prompt)}"
        )
    dtypes = {prompt.dtype.name, whole.dtype.name}
    if len(dtypes) > 1 and dtypes != {"uint8", "uint16"}:
        raise PDMergeError(
            f"cannot concatenate routed_experts with dtypes {prompt.dtype} and {whole.dtype}"
        )
    dtype = np.result_type(prompt.dtype, whole.dtype)
    return np.concatenate([prompt.astype(dtype), whole[len(prompt) :].astype(dtype)])

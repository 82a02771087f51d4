"""How many bytes the daemon reads of one generate reply, and of all replies together.

The generate client buffers each reply whole before parsing it, so without a bound a
broken or hostile server (or a proxy's error page, or a payload mode the config did not
expect) costs memory without limit, times the requests in flight. The per-reply cap
follows from what a reply in the run's payload mode can hold:

- **By handle** (or no payload fields): token ids and logprobs as JSON plus a few small
  records (segments, usage). `BYTES_PER_TOKEN` per completion token covers upstream
  vLLM's logprob objects (about 170 bytes each with the top-1 entry), and
  `REPLY_OVERHEAD` the rest: about 1.5 MiB for 2,048 completion tokens.
- **Inline**: the routing and mask arrays travel in the reply. When the config knows the
  model's shape (`payload.layers` and `payload.top_k`, or the local fleet's `[sim]`
  model: `Config.routing_shape`), the cap counts every position the reply may cover
  (`max_context_tokens` prompt tokens plus the completion) times `layers * top_k` expert
  ids of `ROUTING_ID_BYTES` (the widest dtype a server captures in), times 4/3 for
  base64, plus `MASK_BYTES_PER_TOKEN` per completion token (a mask as JSON lists, the
  longer of its two forms). Otherwise it is the fixed `INLINE_REPLY_BYTES` (256 MiB: a
  128k-token turn of a 64-layer top-8 model with more than 256 experts is about 171 MiB
  of base64).

A group's first turn asks for all its rollouts in one request (`choices`, vLLM's `n`):
its reply holds that many choices, and the cap counts them all.

The bound on all replies together defaults to what `max_inflight` rollouts' replies at
the cap take (a reply of `choices` choices counting for that many rollouts), but at most
`BUFFERED_REPLY_BYTES` (and never less than one reply at the cap, so a reply alone can
always be read).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

MIB = 1 << 20
GIB = 1 << 30
#: JSON bytes per completion token for its id and logprob: upstream vLLM's
#: `{"token":"token_id:12345","logprob":-0.58...,"bytes":null,"top_logprobs":[{...}]}` is
#: about 170 bytes; prime-rl's packed float32 is under 6.
BYTES_PER_TOKEN = 256
#: Everything else in a reply: request id, finish reason, usage, segment records.
REPLY_OVERHEAD = 1 * MIB
#: An inline reply from servers whose model shape the config does not know.
INLINE_REPLY_BYTES = 256 * MIB
#: The most bytes all in-flight replies may buffer together, unless configured.
BUFFERED_REPLY_BYTES = 1 * GIB
#: Widest sampling-mask row counted per completion token: the daemon asks for top_k 50
#: (`build_generate_request`), and the local servers cap an unbounded sampler at 64.
MASK_WIDTH = 64
#: A mask row as a JSON list (upstream vLLM): up to `MASK_WIDTH` ids of up to 6 digits
#: plus a separator and a space; prime-rl's CSR in base64 takes less.
MASK_BYTES_PER_TOKEN = MASK_WIDTH * 8
#: Bytes of one routed expert id at the widest dtype a server may capture in (int32).
ROUTING_ID_BYTES = 4


@attrs.frozen
class ModelShape:
    """What sizes the routing payload: `layers * top_k` expert ids per position."""

    layers: int
    top_k: int


def _base64_len(nbytes: int) -> int:
    return 4 * -(-nbytes // 3)


def derived_max_reply_bytes(
    *,
    by_handle: bool,
    fields: Sequence[str],
    max_tokens: int,
    max_context_tokens: int,
    model: ModelShape | None,
    choices: int = 1,
) -> int:
    """The per-reply cap for a run's payload mode (pure; see the module docstring).

    `max_tokens` is the completion bound of one choice, `max_context_tokens` a bound on
    its prompt, `model` the shape when the config knows it (the local fleet) or None,
    `choices` the most choices one reply holds.
    """
    tokens = choices * BYTES_PER_TOKEN * max_tokens + REPLY_OVERHEAD
    if by_handle or not fields:
        return tokens
    if model is None:
        return max(tokens, choices * INLINE_REPLY_BYTES)
    arrays = 0
    if "routed_experts" in fields:
        positions = max_context_tokens + max_tokens
        routing = positions * model.layers * model.top_k * ROUTING_ID_BYTES
        # An .npy header is a few hundred bytes; REPLY_OVERHEAD covers it.
        arrays += _base64_len(routing)
    if "sampling_mask" in fields:
        arrays += max_tokens * MASK_BYTES_PER_TOKEN
    return tokens + choices * arrays


def derived_max_buffered_reply_bytes(
    *, max_reply_bytes: int, max_inflight: int, choices: int = 1
) -> int:
    """The bound on bytes buffered across all in-flight replies: the replies of
    `max_inflight` rollouts (`choices` to a reply) at the cap, at most
    `BUFFERED_REPLY_BYTES`, at least one reply at the cap."""
    replies = -(-max_inflight // choices)
    return max(max_reply_bytes, min(replies * max_reply_bytes, BUFFERED_REPLY_BYTES))

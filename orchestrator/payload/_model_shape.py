"""The model's routing shape, against which every routing array a server sends is checked.

A mixture-of-experts model routes each token through `top_k` experts in each of `layers`
layers, so every row of routed expert ids has shape ``[layers, top_k]`` and every id is
below `num_experts`. A server that answers with another shape (or ids past the expert
count) is wrong about the model, and a sample built from its rows would fail
in the trainer: the daemon rejects such a turn at once (docs/operations.md
§ Security model).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
import numpy as np


@attrs.frozen
class RoutingShape:
    """`layers` x `top_k` routed experts per token; `num_experts` when known (`None`:
    any id the dtype holds is plausible)."""

    layers: int
    top_k: int
    num_experts: int | None = None

    def problem(self, row_shape: Sequence[int]) -> str | None:
        """Why routing rows of `row_shape` cannot come from this model, or `None`.

        The dtype says nothing here: a server may narrow each reply to uint8 while its ids
        fit, whatever the expert count (ids are checked where they are seen: inline here,
        by handle in the trainer's reader)."""
        if tuple(row_shape) != (self.layers, self.top_k):
            return (
                f"routing rows of shape {list(row_shape)}, the model's are "
                f"[{self.layers}, {self.top_k}] (layers, top_k)"
            )
        return None

    def ids_problem(self, ids: np.ndarray) -> str | None:
        """Why inline routing ids cannot come from this model (an id past the expert
        count), or `None`."""
        if self.num_experts is not None and ids.size and int(ids.max()) >= self.num_experts:
            return f"routed expert id {int(ids.max())} >= the model's {self.num_experts} experts"
        return None


#: Rows `repeated_ids_problem` looks at: evenly spread over the turn, so a fault of the
#: server (the same for every row) is seen at once, at a cost that stays small on the loop.
CHECKED_ROUTING_ROWS = 16


def repeated_ids_problem(ids: np.ndarray, first_position: int) -> str | None:
    """Why routing rows ``[positions, layers, top_k]`` (the first at `first_position`)
    cannot be a router's choice, or `None`: the top-k experts of one token in one layer are
    distinct by definition, so a row that names an expert twice was not computed by a
    router. Up to `CHECKED_ROUTING_ROWS` positions are checked. The reason names the likely
    cause: all-zero rows are what vLLM's CPU build returns when compiled (it needs
    `--enforce-eager`) and what a capture hook that was never attached leaves behind."""
    if ids.ndim != 3 or ids.shape[2] < 2 or not ids.shape[0]:
        return None
    count, checked = ids.shape[0], CHECKED_ROUTING_ROWS
    picked = (
        np.arange(count) if count <= checked else np.arange(checked) * (count - 1) // (checked - 1)
    )
    rows = ids if count <= checked else ids[picked]
    # Every pair of a row's k entries compared at once, gathered by the pairs' indices
    # (k - 1 shifted comparisons, or a sort along k, took two to three times as long;
    # this runs for every turn).
    first, second = _entry_pairs(ids.shape[2])
    same = rows[..., first] == rows[..., second]
    if not np.count_nonzero(same):
        return None
    repeats = same.any(axis=-1)  # [picked, layers]
    index, layer = (int(v) for v in np.argwhere(repeats)[0])
    position = first_position + int(picked[index])
    row = ids[picked[index], layer].tolist()
    if not rows.any():
        cause = (
            "all-zero routing: a vLLM CPU server compiled, not run with --enforce-eager, "
            "or a capture hook not attached"
        )
    else:
        cause = "routing no router chose: a broken capture (kernel or hook)"
    # The cause first: rejection texts are counted by their first 100 characters.
    return (
        f"{cause}; an expert repeats within a row ({int(repeats.sum())} of "
        f"{repeats.size} rows checked; position {position}, layer {layer}: {row})"
    )


@functools.cache
def _entry_pairs(k: int) -> tuple[np.ndarray, np.ndarray]:
    """The indices (i, j), i < j, of every pair of a row's `k` entries."""
    first, second = np.triu_indices(k, 1)
    return first, second

"""The model's routing shape, against which every routing array a server sends is checked.

A mixture-of-experts model routes each token through `top_k` experts in each of `layers`
layers, so every row of routed expert ids has shape ``[layers, top_k]`` and every id is
below `num_experts`. A server that answers with another shape (or ids past the expert
count) is wrong about the model, and a sample built from its rows would fail
in the trainer: the daemon rejects such a turn at once (docs/operations.md
§ Security model).
"""

from __future__ import annotations

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

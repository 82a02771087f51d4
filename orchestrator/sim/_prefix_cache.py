"""The simulated server's prefix cache: which token prefixes it has already computed.

Like vLLM's automatic prefix caching, it works in whole blocks of `block_size` tokens and
identifies a block by the hash of the entire prefix that ends with it, so a hit on block
`j` means tokens `0 .. (j+1)*block_size - 1` were computed before. Bounded, least
recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict

import attrs
import numpy as np
import numpy.typing as npt

__all__ = ["PrefixCache"]


@attrs.define
class PrefixCache:
    """A bounded LRU set of computed block prefixes (identity object with state)."""

    block_size: int
    capacity_blocks: int
    _blocks: OrderedDict[int, None] = attrs.field(init=False, factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_prefix_len(self, hashes: npt.NDArray[np.uint64], prompt_len: int) -> int:
        """Length of the longest cached prefix of the prompt, in whole blocks.

        `hashes` are the prompt's prefix hashes. The result is strictly below `prompt_len`
        (the last prompt token is always computed, since it produces the first sample) and
        counts only blocks cached contiguously from the start. Hits become most recent.
        """
        hit_blocks = 0
        for block in range((prompt_len - 1) // self.block_size):
            key = int(hashes[(block + 1) * self.block_size - 1])
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            hit_blocks += 1
        return hit_blocks * self.block_size

    def remember(self, hashes: npt.NDArray[np.uint64], computed_len: int) -> None:
        """Record the whole blocks of the first `computed_len` positions as computed."""
        ends = np.arange(self.block_size - 1, computed_len, self.block_size)
        for key in hashes[ends].tolist():
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        """Forget everything (new weights make every cached prefix stale)."""
        self._blocks.clear()

"""The staleness rule, in one place: how far behind the trainer a rollout may be, and
every bound that follows from it (docs/design.md §3).

`Staleness` holds the two limits; the config's `[staleness]` section is one (validated
at the config's edge), and every component that needs a bound asks it.
"""

from __future__ import annotations

import attrs
from payload_gc import min_fresh_version


@attrs.frozen
class Staleness:
    """`max_off_policy_steps` (m): how many policy versions a batch's groups may lag;
    `max_async_steps` (a, at most m): how far shipping may run ahead of the applied
    version.

    Raises `ValueError` for a negative limit, or `a > m` (rollouts that must be thrown
    away would be generated).
    """

    max_off_policy_steps: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    max_async_steps: int = attrs.field(default=1, validator=attrs.validators.ge(0))

    def __attrs_post_init__(self) -> None:
        problem = self.limits_problem()
        if problem is not None:
            raise ValueError(
                f"max_async_steps ({self.max_async_steps}) must not exceed "
                f"max_off_policy_steps ({self.max_off_policy_steps}): {problem}"
            )

    def limits_problem(self) -> str | None:
        """What is wrong with the two limits together (`a > m`), or None: the one home of
        that rule (the config reports it under its key)."""
        if self.max_async_steps > self.max_off_policy_steps:
            return "it would generate rollouts it must throw away"
        return None

    def min_fresh_version(self, step: int) -> int:
        """The oldest group start version batch `step` may hold: `(step - 1) - m` (may be
        negative early in a run)."""
        return min_fresh_version(step, self.max_off_policy_steps)

    def last_step(self, start_version: int) -> int:
        """The last batch a group started under `start_version` may go into:
        `start_version + 1 + m` (the inverse of `min_fresh_version`)."""
        return start_version + 1 + self.max_off_policy_steps

    def is_fresh(self, start_version: int, step: int) -> bool:
        """Whether a group started under `start_version` may still go into batch `step`."""
        return step <= self.last_step(start_version)

    def allowance(self, start_version: int, step: int) -> int:
        """The batches after `step` that may still ship before a group started under
        `start_version` is stale: `last_step(start_version) - step` (negative once it is)."""
        return self.last_step(start_version) - step

    def may_ship(self, step: int, applied_version: int) -> bool:
        """The batch gate: batch `step` ships once the applied version is at least
        `step - 1 - a`."""
        return applied_version >= step - 1 - self.max_async_steps

    def collection_bound(self, applied_version: int) -> int:
        """Once `v{applied_version}` is applied everywhere, every `v<k>` below this bound
        can be deleted: no unread batch can reference it."""
        return self.min_fresh_version(applied_version + 1)

    @property
    def batches_in_flight(self) -> int:
        """How many batches can be filling at once: the one the gate allows to ship and the
        `a` after it."""
        return self.max_async_steps + 1

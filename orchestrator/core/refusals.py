"""A fleet that refuses everything: the same client error from every server, for a while.

A 4xx answer is not retried (the same request would be refused again), so a server that
refuses every request fails every rollout at once and the dispatcher starts the next:
`orchestrator-vllm serve` started without `--payload-root` answered a by-handle run 400
("this server writes no payloads by handle: ...") about 50 times a second for 7 minutes
before anyone looked. That is a fault of the configuration, like a wrong API key, not of
a request, and no amount of retrying mends it.

`RefusalWatch` tells it apart from a few bad requests: the run is over when, for
`window_s` seconds and at least `MIN_REFUSALS` requests, every answer was a client error
with one and the same reason (its first `REASON_CHARS` characters, the server's URL left
out), and every server of the fleet gave it. A single answer that is not such a refusal
(a reply, or another reason) starts the watch again. Pure and clock-free: the caller
passes the time.
"""

from __future__ import annotations

from collections.abc import Collection

import attrs

#: Failure kinds that are the server refusing the request (not retried).
REFUSAL_KINDS = frozenset({"http_4xx", "unauthorized"})
#: Failure kinds without an answer: they neither count as a refusal nor end the watch.
NO_ANSWER_KINDS = frozenset({"connect", "transport", "timeout"})
#: Refusals needed besides the window: a slow fleet's two refusals in 30 s are not enough.
MIN_REFUSALS = 10
#: Two reasons are the same when they start alike (ids and paths come later in a text).
REASON_CHARS = 100


@attrs.define
class RefusalWatch:
    """See the module docstring. `window_s` 0: never ends a run."""

    window_s: float
    _reason: str | None = attrs.field(default=None, init=False)
    _since: float = attrs.field(default=0.0, init=False)
    _count: int = attrs.field(default=0, init=False)
    _servers: set[str] = attrs.field(factory=set, init=False)

    def answered(self) -> None:
        """A request got an answer that is not a refusal: the fleet is not refusing all."""
        self._reason = None

    def refused(self, now: float, server: str, reason: str, fleet: Collection[str]) -> str | None:
        """A request to `server` was refused for `reason` at `now`. Returns the line that
        ends the run when every server of `fleet` has refused every request for that
        reason for `window_s` (and `MIN_REFUSALS` times), else None."""
        # The server's own URL (in the texts of the failures) is not part of the reason.
        key = reason.replace(server, "")[:REASON_CHARS]
        if key != self._reason:
            self._reason, self._since, self._count = key, now, 0
            self._servers = set()
        self._count += 1
        self._servers.add(server)
        if self.window_s <= 0 or self._count < MIN_REFUSALS:
            return None
        if now - self._since < self.window_s or not self._servers.issuperset(fleet):
            return None
        return (
            f"every inference server refused every request for {now - self._since:.0f} s "
            f"({self._count} requests) with the same client error, which no retry mends: "
            f"{reason}"
        )

"""Every rejection the dispatcher sees goes through one `Rejections`: counted by kind,
remembered by its most common texts, and logged at warning level without flooding.

A rejection is a failed request attempt (`connect`, `transport`, `timeout`, `http_5xx`,
`http_4xx`, `malformed`, and any kind the inference client adds), a payload that cannot
be trusted (`poisoned_payload`), a rollout whose turns cannot be stitched into one sample
(`stitching`), routing dropped from a sample (`routing_gap`), or an environment that
drives its turns disagreeing with what was sampled (`trajectory_mismatch`);
docs/operations.md § Faults lists what each means. `record` does three things:

- counts the kind (the counter behind `rollout_failures_total{kind}` and the summary);
- counts the first `TEXT_CHARS` characters of the detail, per kind, keeping at most
  `max_texts` texts per kind (a new text evicts the least common), so a server answering
  the same garbage a thousand times shows up as one text with a count;
- logs `rollout failure` at warning level with kind, server and detail: the first one of
  each (kind, server) at once, then at most one every `log_interval_s`, carrying how many
  were left out since the last line (`suppressed`).

The clock is injected (trio's by default), so the rate limit runs on virtual time in tests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

import attrs
import structlog
import trio

from orchestrator.handoff import TopError

log = structlog.get_logger(__name__)

#: How much of a detail is remembered as its text.
TEXT_CHARS = 100
#: Log at most one line per (kind, server) this often, after the first.
LOG_INTERVAL_S = 10.0
#: Texts remembered per kind.
MAX_TEXTS = 20


@attrs.define
class _LogWindow:
    logged_at: float
    suppressed: int = 0


@attrs.define
class Rejections:
    """Counts, texts and rate-limited log lines of rejections (see the module docstring).

    `counts` may be shared with the owner (`Dispatch.failures` is this very Counter).
    """

    counts: Counter[str] = attrs.field(factory=Counter)
    clock: Callable[[], float] = trio.current_time
    log_interval_s: float = LOG_INTERVAL_S
    max_texts: int = MAX_TEXTS
    _texts: dict[str, Counter[str]] = attrs.field(factory=dict, init=False)
    _windows: dict[tuple[str, str], _LogWindow] = attrs.field(factory=dict, init=False)

    def record(self, kind: str, server: str, detail: str, **context: object) -> None:
        """Count one rejection of `kind` on `server`, remember its text, maybe log it.

        `context` (rollout id, attempt, ...) goes into the log line as is.
        """
        self.counts[kind] += 1
        self._remember(kind, detail[:TEXT_CHARS])
        now = self.clock()
        window = self._windows.get((kind, server))
        if window is not None and now - window.logged_at < self.log_interval_s:
            window.suppressed += 1
            return
        suppressed = 0 if window is None else window.suppressed
        self._windows[(kind, server)] = _LogWindow(now)
        log.warning(
            "rollout failure",
            kind=kind,
            server=server,
            detail=detail,
            suppressed=suppressed,
            **context,
        )

    def note(self, kind: str, detail: str) -> None:
        """Remember the text of a failure counted and logged elsewhere (a reward's: its
        pool counts and logs it), so that what ends a run can quote it."""
        self._remember(kind, detail[:TEXT_CHARS])

    def _remember(self, kind: str, text: str) -> None:
        texts = self._texts.setdefault(kind, Counter())
        if text not in texts and len(texts) >= self.max_texts:
            # The least common text goes (the oldest of equals: Counters keep order).
            least = min(texts, key=texts.__getitem__)
            del texts[least]
        texts[text] += 1

    def texts(self) -> dict[tuple[str, str], int]:
        """Every remembered text with its count, keyed by (kind, text) (a copy)."""
        return {(kind, text): n for kind, texts in self._texts.items() for text, n in texts.items()}

    def most_common(self, kind: str, n: int = 3) -> list[tuple[str, int]]:
        """The `n` most common texts of `kind`, most common first."""
        return self._texts.get(kind, Counter()).most_common(n)

    def top_error(self, since: Mapping[tuple[str, str], int] | None = None) -> TopError | None:
        """The most common text over every kind; with `since` (an earlier `texts()`),
        counting only what was seen after it. None when there is nothing."""
        return top_error(self.texts(), since or {})


def top_error(
    texts: Mapping[tuple[str, str], int], since: Mapping[tuple[str, str], int]
) -> TopError | None:
    """The (kind, text) whose count grew most from `since` to `texts`; None if none grew."""
    best: TopError | None = None
    for (kind, text), count in texts.items():
        grown = count - since.get((kind, text), 0)
        if grown > 0 and (best is None or grown > best.count):
            best = TopError(kind, text, grown)
    return best

"""The exceptions payload_gc raises: one base class, one subclass per refusal."""

from __future__ import annotations


class PayloadGCError(Exception):
    """Base class: every error payload_gc raises on purpose.

    Its message is one line that names the root (or file) and says what to do, so a
    command-line tool can print it as is, without a traceback.
    """


class RootMissing(PayloadGCError):
    """The payload root does not exist (nothing to collect)."""


class RootRefused(PayloadGCError):
    """The payload root is unsafe to work on: `/`, a home directory, a symbolic link,
    not a directory, or (for a wipe) a non-empty directory without the root marker."""


class LockHeld(PayloadGCError):
    """Another collector holds the root's lock (`<root>/.payload-gc/lock`).

    `host`, `pid` and `age_s` describe the holder as its lock file records it (`None`
    when the file could not be read, e.g. while its holder is still writing it).
    """

    def __init__(
        self, message: str, *, host: str | None, pid: int | None, age_s: float | None
    ) -> None:
        super().__init__(message)
        self.host = host
        self.pid = pid
        self.age_s = age_s

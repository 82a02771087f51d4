"""A trio run in a thread of its own, for what a module's tests share and is slow to start
(a worker process that imports for seconds): pytest-trio's fixtures live one test each,
so a module-scoped fixture opens its async context here and its tests, plain functions,
call into it (`TrioPortal.run`).

    @pytest.fixture(scope="module")
    def portal_and_thing():
        with TrioPortal() as portal:
            yield portal, portal.enter(open_thing)
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

import trio

T = TypeVar("T")


class TrioPortal:
    """`trio.run` in a thread, holding async contexts open until it is closed, each in a
    task of its own (a context's nursery is entered and left by the same task)."""

    def __init__(self) -> None:
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="trio-portal", daemon=True)
        self._stop: trio.Event | None = None
        self._nursery: trio.Nursery | None = None
        self._holders: list[tuple[trio.Event, trio.Event]] = []
        self._error: BaseException | None = None

    def __enter__(self) -> TrioPortal:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._stop is not None and self._thread.is_alive():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(timeout=120)
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            trio.run(self._host)
        except BaseException as exc:  # reported when the portal closes
            self._error = exc
        finally:
            self._ready.set()

    async def _host(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._ready.set()
            await self._stop.wait()
            # Contexts close in the reverse order they were entered.
            for release, done in reversed(self._holders):
                release.set()
                await done.wait()

    async def _hold(
        self,
        context: Callable[[], AbstractAsyncContextManager[T]],
        *,
        task_status: trio.TaskStatus[T] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        release, done = trio.Event(), trio.Event()
        self._holders.append((release, done))
        try:
            async with context() as value:
                task_status.started(value)
                await release.wait()
        finally:
            done.set()

    def run(self, function: Callable[..., Awaitable[T]], *args: Any) -> T:
        """`await function(*args)` in the portal's trio run, from a test."""
        return trio.from_thread.run(function, *args, trio_token=self._token)

    def enter(self, context: Callable[[], AbstractAsyncContextManager[T]]) -> T:
        """`async with context() as value:` held open until the portal closes; `value`."""

        async def entering() -> T:
            assert self._nursery is not None
            value: T = await self._nursery.start(self._hold, context)
            return value

        return self.run(entering)

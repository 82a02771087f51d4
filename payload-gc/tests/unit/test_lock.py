"""The collector's lock file: held, released, stale locks taken over, waiting for it.

Through collections where they can show it; payload_gc/_lock.py itself where the test needs
the lock held with no collection running, a crash between its steps, or its polling.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import payload_gc._lock as lock_module
import pytest
import trio
import trio.testing
from payload_gc import LockHeld, collect_below, collect_below_sync
from payload_gc._lock import (
    LOCK_POLL_MAX_S,
    STARTING_GRACE_S,
    HeldLock,
    current_owner,
    open_control_dir,
    try_acquire,
    wait_for_lock,
)
from payload_gc._tree import open_root


@pytest.fixture
def control_fd(tmp_path: Path) -> Iterator[int]:
    root_fd = open_root(str(tmp_path))
    fd = open_control_dir(root_fd, str(tmp_path))
    os.close(root_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _lock_file(root: Path) -> Path:
    return root / ".payload-gc" / "lock"


def _write_lock(root: Path, **fields: object) -> None:
    owner = current_owner()
    data = {
        "host": owner.host,
        "pid": owner.pid,
        "time": time.time() - 100,
        "token": "feedfeedfeedfeed",
        "boot_id": owner.boot_id,
        "start_ticks": owner.start_ticks,
    }
    data.update(fields)
    _lock_file(root).parent.mkdir(exist_ok=True)
    _lock_file(root).write_text(json.dumps(data))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_lock_file_names_its_owner(tmp_path: Path, control_fd: int) -> None:
    held = try_acquire(control_fd, str(tmp_path))
    data = json.loads(_lock_file(tmp_path).read_text())
    assert data["host"] == socket.gethostname()
    assert data["pid"] == os.getpid()
    assert abs(data["time"] - time.time()) < 60
    held.release()
    assert not _lock_file(tmp_path).exists()


def test_a_second_collector_gets_lock_held(tmp_path: Path, control_fd: int) -> None:
    held = try_acquire(control_fd, str(tmp_path))
    with pytest.raises(LockHeld) as caught:
        collect_below_sync(tmp_path, 5)
    assert caught.value.pid == os.getpid()
    assert caught.value.host == socket.gethostname()
    assert caught.value.age_s is not None
    message = str(caught.value)
    assert "\n" not in message
    assert f"locked by pid {os.getpid()} on {socket.gethostname()}" in message
    held.release()
    collect_below_sync(tmp_path, 5)


def _control_names(root: Path) -> list[str]:
    return sorted(p.name for p in (root / ".payload-gc").iterdir())


# A collector SIGKILLed while it makes the lock: just before its `lock.new-<hex>` is
# linked as the lock (argv[2] "before-link") or just after.
_KILLED_MAKING_THE_LOCK = """
import os, signal, sys
from payload_gc import collect_below_sync
link = os.link
def link_then_die(*args, **kwargs):
    if sys.argv[2] == "after-link":
        link(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
os.link = link_then_die
collect_below_sync(sys.argv[1], 1)
"""


@pytest.mark.parametrize("moment", ["before-link", "after-link"])
def test_a_collector_killed_while_making_the_lock_leaves_none_that_blocks(
    tmp_path: Path, moment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "v0").mkdir()
    child = subprocess.Popen([sys.executable, "-c", _KILLED_MAKING_THE_LOCK, str(tmp_path), moment])
    assert child.wait(timeout=60) == -signal.SIGKILL
    left = _control_names(tmp_path)
    # Never a lock without its owner: none yet, or one naming the dead collector.
    if moment == "before-link":
        assert "lock" not in left
    else:
        assert json.loads(_lock_file(tmp_path).read_text())["pid"] == child.pid
    # The lock being made is left behind, exactly one.
    assert len([name for name in left if name.startswith("lock.new-")]) == 1
    # The next collector goes ahead (taking the dead one's lock over) and, once the
    # leftover is old enough, removes it.
    monkeypatch.setattr(lock_module, "ASIDE_GRACE_S", -1.0)
    report = collect_below_sync(tmp_path, 1)
    assert [d.name for d in report.deleted] == ["v0"]
    assert _control_names(tmp_path) == ["audit.jsonl"]


def test_without_hard_links_the_lock_is_created_in_place(
    tmp_path: Path, control_fd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    held = try_acquire(control_fd, str(tmp_path))
    assert json.loads(_lock_file(tmp_path).read_text())["token"] == held.owner.token
    assert _control_names(tmp_path) == ["lock"]
    with pytest.raises(LockHeld, match=f"locked by pid {os.getpid()}"):
        try_acquire(control_fd, str(tmp_path))
    held.release()
    assert _control_names(tmp_path) == []


def test_a_link_made_but_reported_as_failed_is_still_ours(
    tmp_path: Path, control_fd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NFS: a link retried after its reply was lost finds its own name taken.
    link = os.link

    def made_then_lost(*args: object, **kwargs: object) -> None:
        link(*args, **kwargs)  # type: ignore[arg-type]
        raise FileExistsError(errno.EEXIST, "File exists")

    monkeypatch.setattr(os, "link", made_then_lost)
    held = try_acquire(control_fd, str(tmp_path))
    assert json.loads(_lock_file(tmp_path).read_text())["token"] == held.owner.token
    assert _control_names(tmp_path) == ["lock"]
    held.release()
    assert _control_names(tmp_path) == []


def test_stale_lock_of_a_dead_pid_is_taken_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "v0").mkdir()
    dead = _dead_pid()
    _write_lock(tmp_path, pid=dead, start_ticks=None)
    with caplog.at_level("WARNING", logger="payload_gc"):
        report = collect_below_sync(tmp_path, 1)
    # Said, with who held it and since when, not taken over without a word.
    (line,) = [r.getMessage() for r in caplog.records if "stale lock" in r.getMessage()]
    assert f"pid {dead} on {socket.gethostname()} held it since 20" in line
    assert [d.name for d in report.deleted] == ["v0"]
    assert not _lock_file(tmp_path).exists()
    assert sorted(p.name for p in (tmp_path / ".payload-gc").iterdir()) == ["audit.jsonl"]


def test_reused_pid_is_recognised_by_its_start_time(tmp_path: Path) -> None:
    owner = current_owner()
    if owner.start_ticks is None:
        pytest.fail("this test needs /proc (Linux)")
    # Our own, live pid, but a process that started at another time: the pid was reused.
    _write_lock(tmp_path, start_ticks=owner.start_ticks + 1)
    collect_below_sync(tmp_path, 1)
    assert not _lock_file(tmp_path).exists()


def test_lock_from_a_previous_boot_is_stale(tmp_path: Path) -> None:
    _write_lock(tmp_path, boot_id="00000000-0000-0000-0000-000000000000")
    collect_below_sync(tmp_path, 1)
    assert not _lock_file(tmp_path).exists()


def test_lock_from_another_host_is_never_broken(tmp_path: Path) -> None:
    _write_lock(tmp_path, host="other-node-17", pid=_dead_pid())
    with pytest.raises(LockHeld, match=r"locked by pid \d+ on other-node-17 for 10\d s"):
        collect_below_sync(tmp_path, 1)
    assert _lock_file(tmp_path).exists()


def test_live_lock_of_this_process_is_not_stale(tmp_path: Path) -> None:
    _write_lock(tmp_path)
    with pytest.raises(LockHeld):
        collect_below_sync(tmp_path, 1)


def test_a_young_empty_lock_is_a_collector_starting_not_one_to_delete(tmp_path: Path) -> None:
    # Its holder created the file and has not written its owner yet.
    _lock_file(tmp_path).parent.mkdir()
    _lock_file(tmp_path).write_text("")
    with pytest.raises(LockHeld) as caught:
        collect_below_sync(tmp_path, 1)
    message = str(caught.value)
    assert "another collector is starting" in message
    assert "retry" in message
    assert "delete" not in message
    assert caught.value.pid is None
    assert caught.value.age_s is not None and caught.value.age_s < STARTING_GRACE_S
    assert _lock_file(tmp_path).exists()


def test_an_old_unreadable_lock_names_its_age_and_when_to_delete_it(tmp_path: Path) -> None:
    _lock_file(tmp_path).parent.mkdir()
    _lock_file(tmp_path).write_text('{"not": "a lock"')
    an_hour_ago = time.time() - 3600
    os.utime(_lock_file(tmp_path), (an_hour_ago, an_hour_ago))
    with pytest.raises(LockHeld) as caught:
        collect_below_sync(tmp_path, 1)
    message = str(caught.value)
    assert "starting" not in message
    assert re.search(r"\b36\d\d s old\b", message), message
    assert "make sure no collector runs on any host" in message
    assert message.endswith("then delete the file")
    assert caught.value.pid is None
    assert _lock_file(tmp_path).exists()


def test_release_leaves_a_lock_that_is_not_ours(tmp_path: Path, control_fd: int) -> None:
    held = try_acquire(control_fd, str(tmp_path))
    _write_lock(tmp_path, token="someone-else")
    held.release()
    assert _lock_file(tmp_path).exists()


async def test_waiting_polls_with_backoff(autojump_clock: trio.testing.MockClock) -> None:
    attempts: list[float] = []

    def try_lock() -> None:
        attempts.append(trio.from_thread.run_sync(trio.current_time))
        if len(attempts) <= 7:
            raise LockHeld("held", host=None, pid=None, age_s=None)

    await wait_for_lock(try_lock)
    # Sleeps of 0.05, 0.1, 0.2, 0.4, 0.8, then the 1 s maximum.
    assert LOCK_POLL_MAX_S == 1.0
    assert attempts == pytest.approx([0.0, 0.05, 0.15, 0.35, 0.75, 1.55, 2.55, 3.55])
    assert trio.current_time() == pytest.approx(3.55)


async def test_async_collection_waits_for_the_lock_until_the_deadline(
    tmp_path: Path, control_fd: int, autojump_clock: trio.testing.MockClock
) -> None:
    (tmp_path / "v0").mkdir()
    held: HeldLock = await trio.to_thread.run_sync(try_acquire, control_fd, str(tmp_path))
    with pytest.raises(trio.TooSlowError):
        with trio.fail_after(30):
            await collect_below(tmp_path, 1)
    assert trio.current_time() == 30.0
    assert await trio.to_thread.run_sync((tmp_path / "v0").is_dir)
    # Still our lock: the waiting collector never broke it.
    assert await trio.to_thread.run_sync(_lock_file(tmp_path).exists)
    await trio.to_thread.run_sync(held.release)


def _is_dir(path: Path) -> bool:
    return path.is_dir()


async def test_async_collection_proceeds_once_the_lock_is_released(
    tmp_path: Path, control_fd: int, autojump_clock: trio.testing.MockClock
) -> None:
    (tmp_path / "v0").mkdir()
    held = try_acquire(control_fd, str(tmp_path))
    async with trio.open_nursery() as nursery:
        done = trio.Event()

        async def collect() -> None:
            report = await collect_below(tmp_path, 1)
            assert [d.name for d in report.deleted] == ["v0"]
            done.set()

        nursery.start_soon(collect)
        await trio.sleep(10)
        assert not done.is_set()
        # Checked and released right here, not in a thread: waiting for a thread would let
        # the virtual clock jump past the collector's polls.
        assert _is_dir(tmp_path / "v0")
        held.release()
        await done.wait()
        # Noticed at the next poll: at once if a poll was running in its thread as we
        # released, otherwise within one poll interval.
        assert 10.0 <= trio.current_time() <= 10.0 + LOCK_POLL_MAX_S
    assert not _is_dir(tmp_path / "v0")

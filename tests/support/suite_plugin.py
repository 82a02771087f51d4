"""The pytest plugin every suite shares, the orchestrator's (`tests/`) and payload-gc's
(`payload-gc/tests/`): logging configured by one test never leaks into the next, the `bind_mount`
fixture for the tests of mount points, the `shared_fs` marks, the `slow` tests first, and
the network-mount test mode. Loaded by the repository's root `conftest.py`
(`pytest_plugins`), so one implementation serves both trees whatever paths pytest is given.

**The network-mount mode.** `ORCH_TEST_NETMOUNT=cache` (or `nocache`) puts the `tmp_path`
of every test in `NETMOUNT_SUITES` (`tests/integration`, `tests/fault`, `tests/netmount`,
`payload-gc/tests/integration`), and so their payload roots, run directories, batches and
weights, on a FUSE network filesystem: sshfs over loopback, mounted once for the session
by `tests/netmount/mount.sh` (with sshfs's caches, or without) and taken down by
`umount.sh` at the end. Where it cannot be mounted (not root, no /dev/fuse, no package),
those tests are skipped with the script's reason. `make test-netmount` runs both modes.
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import structlog

BindMount = Callable[[Path, Path], AbstractContextManager[None]]

#: The repository's root: the paths below are relative to it.
REPO = Path(__file__).resolve().parents[2]
NETMOUNT_ENV = "ORCH_TEST_NETMOUNT"
NETMOUNT_MODES = ("cache", "nocache")
NETMOUNT_SCRIPTS = REPO / "tests" / "netmount"
# The test directories whose `tmp_path` the mode moves onto the mount.
NETMOUNT_SUITES = (
    "tests/integration",
    "tests/fault",
    "tests/netmount",
    "payload-gc/tests/integration",
)
#: The modules whose outcome can depend on the filesystem under the run (marked
#: `shared_fs`; `make test-netmount` runs only these, with `pytest -m shared_fs`):
#: they write, read, rename, fsync, list or delete payload files, batches or weights
#: through the code a mount can change (caches, attribute timeouts, busy files, renames),
#: or check the files a crash left. The rest talk HTTP, count, or score, which the
#: filesystem under `tmp_path` cannot change, and ran already on local disk.
SHARED_FS_MODULES = frozenset(
    {
        # The collector: listing, deleting, busy files, symbolic links, mounts, the wipe.
        *(
            f"payload-gc/tests/integration/test_{name}.py"
            for name in (
                "async_loop",
                "bind_mounts",
                "cli",
                "collect",
                "concurrency",
                "no_stat",
                "symlinks",
                "wipe",
            )
        ),
        # The collector under the daemon and the orchestrator's commands.
        *(
            f"tests/integration/test_gc_{name}.py"
            for name in ("busy", "command_busy", "daemon_account", "mounts")
        ),
        "tests/integration/test_status_gc_commands.py",
        # The daemon end to end: payload files written and checked, batches shipped,
        # versions seen in the weights directory, in both layouts and formats.
        "tests/integration/test_daemon.py",
        "tests/integration/test_daemon_primerl.py",
        "tests/integration/test_daemon_weights_layout.py",
        "tests/integration/test_dispatcher_rejections.py",
        "tests/integration/test_run_preflight.py",
        "tests/integration/test_weight_updates.py",
        # The servers' payload writes and the trainer's reads of every byte.
        "tests/integration/test_sim_inference.py",
        "tests/integration/test_sim_pd.py",
        "tests/integration/test_sim_trainer.py",
        "tests/integration/test_sim_trainer_primerl.py",
        # Crashes and broken payload files: what is on disk after.
        "tests/fault/test_crash_resume.py",
        "tests/fault/test_faulty_peers.py",
        "tests/fault/test_pd_payloads.py",
        # The mount itself, and weights published on it.
        "tests/netmount/test_mount_scripts.py",
        "tests/netmount/test_shared_weights.py",
    }
)
#: The modules whose tests run before the other `slow` ones, in this order. xdist's
#: `worksteal` hands each worker a contiguous share of the collection and steals from the
#: tail of a queue, so the first tests always run first, on the first worker:
#: test_verifiers_worker.py's module-scoped verifiers workers (seconds of CPU each start) are
#: then started by that one process, not by both; and the longest tests start early rather
#: than keep one worker busy at the end while the other has nothing left to take.
FIRST_MODULES = (
    "tests/integration/test_verifiers_worker.py",
    "tests/fault/test_crash_resume.py",
    "tests/integration/test_verifiers_run.py",
)
# Installing sshfs and openssh-server on a fresh machine takes a while.
_MOUNT_DEADLINE_S = 600


def netmount_mode() -> str | None:
    """The network-mount mode asked for (`ORCH_TEST_NETMOUNT`), or None when it is off."""
    return os.environ.get(NETMOUNT_ENV) or None


def _in_repo(path: Path) -> str | None:
    """`path` relative to the repository's root (posix), or None when it lies outside."""
    try:
        return Path(path).resolve().relative_to(REPO).as_posix()
    except ValueError:
        return None


def pytest_configure(config: pytest.Config) -> None:
    mode = netmount_mode()
    if mode is not None and mode not in NETMOUNT_MODES:
        raise pytest.UsageError(
            f"{NETMOUNT_ENV}={mode!r}: one of {', '.join(NETMOUNT_MODES)}, or unset"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of `SHARED_FS_MODULES` `shared_fs`, and run the `slow` ones first,
    those of `FIRST_MODULES` before the rest.

    In worker processes (`-n auto`) a long test taken last keeps one worker busy while the
    others have nothing left to take: started first, the short tests fill in around it.
    The order within each group stays the collection's.
    """
    first: dict[pytest.Item, int] = {}
    for item in items:
        module = _in_repo(item.path)
        if module in SHARED_FS_MODULES:
            item.add_marker(pytest.mark.shared_fs)
        if module in FIRST_MODULES:
            first[item] = FIRST_MODULES.index(module)
    items.sort(
        key=lambda item: (
            item.get_closest_marker("slow") is None,
            first.get(item, len(FIRST_MODULES)),
        )
    )


def pytest_report_header(config: pytest.Config) -> str | None:
    mode = netmount_mode()
    if mode is None:
        return None
    return f"{NETMOUNT_ENV}={mode}: tmp_path of {', '.join(NETMOUNT_SUITES)} on sshfs over loopback"


@pytest.fixture(scope="session")
def netmount_point() -> Iterator[Path]:
    """The session's sshfs mount point (`tests/netmount/mount.sh <mode>`), unmounted at
    the end. Skips every test that needs it, with the script's reason, where it cannot be
    mounted. Only for the network-mount mode."""
    mode = netmount_mode()
    if mode is None:
        raise RuntimeError(f"netmount_point is only used with {NETMOUNT_ENV} set")
    try:
        done = subprocess.run(
            [str(NETMOUNT_SCRIPTS / "mount.sh"), mode],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=_MOUNT_DEADLINE_S,
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"{NETMOUNT_ENV}={mode}: mount.sh took over {_MOUNT_DEADLINE_S} s")
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        pytest.skip(f"{NETMOUNT_ENV}={mode}: {reason[0]}")
    mount_point = Path(done.stdout.strip().splitlines()[-1])
    try:
        yield mount_point
    finally:
        subprocess.run(
            [str(NETMOUNT_SCRIPTS / "umount.sh"), str(mount_point)],
            check=True,
            stdin=subprocess.DEVNULL,
        )


def on_netmount(request: pytest.FixtureRequest) -> bool:
    """Whether this test's `tmp_path` is on the network mount."""
    if netmount_mode() is None:
        return False
    module = _in_repo(request.node.path)
    return module is not None and module.startswith(tuple(f"{s}/" for s in NETMOUNT_SUITES))


@pytest.fixture
def tmp_path(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """pytest's own `tmp_path`, or in the network-mount mode (for the suites it covers) a
    fresh directory on the mount."""
    if not on_netmount(request):
        return tmp_path
    mount_point: Path = request.getfixturevalue("netmount_point")
    name = re.sub(r"\W", "_", request.node.name)[:40]
    path = mount_point / f"{name}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@contextmanager
def _bind_mount(source: Path, target: Path) -> Iterator[None]:
    if os.geteuid() != 0:
        pytest.skip("needs root: a bind mount (mount --bind) is set up for this test")
    try:
        done = subprocess.run(
            ["mount", "--bind", str(source), str(target)], capture_output=True, text=True
        )
    except FileNotFoundError:
        pytest.skip("no mount command: cannot set up a bind mount")
    if done.returncode != 0:
        pytest.skip(f"mount --bind failed: {done.stderr.strip() or done.returncode}")
    try:
        yield
    finally:
        if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
            # Busy (e.g. a descriptor still open): detach it now, freed when released.
            subprocess.run(["umount", "--lazy", str(target)], check=True)


@pytest.fixture
def bind_mount() -> BindMount:
    """`with bind_mount(source, target):` mounts `source` on `target` for the block (same
    filesystem, so only the mount id tells them apart) and always unmounts after. Skips
    the test with the reason where it cannot: not root, or mounts not allowed (CI runs as
    root)."""
    return _bind_mount

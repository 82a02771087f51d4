"""Published policy weights: `<weights_dir>/step_000007/STABLE` means "v7 is published".

docs/design.md §3 and §5: the trainer reads batch `s`, trains on it, then publishes `v{s}` by
writing the step's files and the `STABLE` marker last. `v0` is the initial weights and
needs no marker. Readers (the orchestrator's policy watcher, the local trainer resuming
after a kill) only ever trust a step directory that holds `STABLE`.

The step directories are named by a layout (`orchestrator.handoff.step_dirs`): "native"
(`step_000007`, the default) or "prime-rl" (`step_7`, as prime-rl's trainer writes its
`broadcasts/step_7/STABLE`). `[trainer] weights_layout` picks it; every function here
takes it, and every caller passes the config's.

All functions block (they touch the filesystem): call them from a worker thread in async
code.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from orchestrator.handoff.durable import fsync_dir, replace_file_atomically
from orchestrator.handoff.step_dirs import (
    StepLayout,
    complete_steps,
    newest_complete_step,
    step_dir,
)

__all__ = [
    "MODEL_FILE",
    "STABLE_MARKER",
    "WEIGHTS_FORMAT",
    "latest_published_version",
    "newest_published_version",
    "publish_weights",
    "published_versions",
    "weights_step_dir",
]

STABLE_MARKER = "STABLE"
MODEL_FILE = "model.json"
WEIGHTS_FORMAT = "rollout-orchestrator.weights/1"


def json_line(obj: object) -> bytes:
    """`obj` as the hand-off writes JSON files (weights' `model.json`): compact UTF-8 JSON
    on one line, ending in a newline.

    Raises ValueError for a non-finite float.
    """
    return (json.dumps(obj, allow_nan=False, separators=(",", ":")) + "\n").encode()


def weights_step_dir(weights_dir: Path, step: int, *, layout: StepLayout = "native") -> Path:
    """The directory of the weights of version `step`: `<weights_dir>/step_000007`
    ("native") or `<weights_dir>/step_7` ("prime-rl"). It is also what an inference server
    is told to load (`/update_weights`).

    Raises ValueError for a negative step or an unknown layout.
    """
    return step_dir(weights_dir, step, layout)


def publish_weights(
    weights_dir: Path, step: int, *, layout: StepLayout = "native", fsync: bool = True
) -> Path:
    """Publish version `step`: write a small `model.json`, then the `STABLE` marker last.

    Each file is written to a temp file, fsynced and renamed into place, so a reader never
    sees a partial file, and `STABLE` appears only once `model.json` is durable. The step
    directory is named by `layout`. Creates the directories as needed. Publishing a step
    again (after a crash between the two files, say) rewrites both atomically. Returns
    the step directory.

    Raises ValueError for a step < 1 (v0 is the initial weights and is never published)
    or an unknown layout, OSError when writing fails.
    """
    if step < 1:
        raise ValueError(f"weights are published for steps >= 1 (v0 is implicit), got {step}")
    version_dir = weights_step_dir(weights_dir, step, layout=layout)
    created_parent = not weights_dir.exists()
    version_dir.mkdir(parents=True, exist_ok=True)
    if fsync:
        # The new directory name must be durable before the marker inside it means anything.
        fsync_dir(weights_dir)
        if created_parent:
            fsync_dir(weights_dir.parent)
    model = {"format": WEIGHTS_FORMAT, "step": step, "created_at": time.time()}
    replace_file_atomically(version_dir / MODEL_FILE, json_line(model), fsync=fsync)
    replace_file_atomically(version_dir / STABLE_MARKER, b"", fsync=fsync)
    return version_dir


def published_versions(
    weights_dir: Path, *, above: int = -1, layout: StepLayout = "native"
) -> list[int]:
    """The published versions above `above`, sorted: the step directories of `layout`
    holding `STABLE`.

    A missing `weights_dir` means none. Directories without the marker (a publish in
    progress, or one cut short by a crash) and every other name (the other layout's
    spelling included: `step_7` in "native", `step_000007` in "prime-rl") are ignored. Only
    directories above `above` are looked into, so a watcher polling for new versions does
    not re-examine every version of a long run. Raises OSError when `weights_dir` exists
    but cannot be listed, ValueError for an unknown layout.
    """
    return complete_steps(weights_dir, STABLE_MARKER, above=above, layout=layout)


def newest_published_version(
    weights_dir: Path, *, above: int, up_to: int, layout: StepLayout = "native"
) -> int | None:
    """The newest published version in `above + 1 .. up_to`, or None: what the policy
    watcher looks for, with `above` the applied version and `up_to` the last shipped step
    (a version is never published before its batch is read).

    Found by opening each candidate's exact path, `<weights_dir>/step_N/STABLE`, newest
    first, which a network filesystem's client revalidates where it may answer a listing
    from its cache (`orchestrator.handoff.step_dirs.newest_complete_step`; docs/design.md
    §5). The rule is `published_versions`'s: a real step directory of `layout` holding
    `STABLE`. A missing `weights_dir` means None. Raises OSError when `weights_dir` exists
    but cannot be opened, ValueError for an unknown layout.
    """
    return newest_complete_step(weights_dir, STABLE_MARKER, above=above, up_to=up_to, layout=layout)


def latest_published_version(weights_dir: Path, *, layout: StepLayout = "native") -> int:
    """The highest published version in `layout`, or 0 when none is (v0, the initial
    weights).

    Raises OSError when `weights_dir` exists but cannot be listed, ValueError for an
    unknown layout.
    """
    versions = published_versions(weights_dir, layout=layout)
    return versions[-1] if versions else 0

"""read_batch: by-handle and inline payloads give the same arrays; failures name files."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import msgspec
import numpy as np
import pytest
from sample_kit import inline_sample, stitched_payload, train_sample

if TYPE_CHECKING:
    from conftest import BindMount

from orchestrator.handoff import (
    BATCH_FILE,
    BatchError,
    TrainSample,
    publish_batch,
    read_batch,
    shipped_steps,
)
from orchestrator.payload import (
    FinalTokenRoute,
    PayloadCorrupt,
    PayloadMissing,
    PayloadSegment,
    write_payload_file,
)

LAYERS, TOP_K, NUM_EXPERTS = 4, 2, 16
DISPATCH_VERSION = 3


@attrs.frozen
class Turn:
    """One turn of a two-turn branch: its routing and mask arrays and their positions."""

    routing: np.ndarray
    routing_pos: int
    mask: np.ndarray
    mask_pos: int

    def arrays(self) -> dict[str, tuple[np.ndarray, int]]:
        """The turn as a server returns it: field -> (array, first position)."""
        return {
            "routed_experts": (self.routing, self.routing_pos),
            "sampling_mask": (self.mask, self.mask_pos),
        }


@attrs.frozen
class Branch:
    turns: tuple[Turn, ...]
    segments: tuple[dict[str, PayloadSegment], ...]
    token_ids: tuple[int, ...]
    prompt_len: int


def _turn(rng: np.random.Generator, prompt_len: int, completion_len: int, routing_pos: int) -> Turn:
    rows = prompt_len + completion_len - 1 - routing_pos
    routing = rng.integers(0, NUM_EXPERTS, size=(rows, LAYERS, TOP_K)).astype(np.uint8)
    mask = rng.integers(0, 1000, size=(completion_len, 3)).astype(np.int32)
    mask[:, 2] = -1  # padding: every row is narrower than the widest
    return Turn(routing, routing_pos, mask, prompt_len)


def make_branch(payload_dir: Path, seed: int = 0) -> Branch:
    """Two turns: prompt 10 + 5 sampled, then 3 env tokens and 6 sampled (24 tokens).

    The second turn's routing starts at 8 (a cached prefix), so position 8..13 is covered
    by both turns and the first wins.
    """
    rng = np.random.default_rng(seed)
    turns = (_turn(rng, 10, 5, 0), _turn(rng, 18, 6, 8))
    segments = []
    for turn in turns:
        written = write_payload_file(payload_dir, turn.arrays())
        segments.append({segment.field: segment for segment in written})
    token_ids = tuple(int(t) for t in rng.integers(0, 32000, size=24))
    return Branch(turns, tuple(segments), token_ids, prompt_len=10)


def _loss_mask(length: int) -> tuple[int, ...]:
    # Completion tokens of turn 1 (10..14) and turn 2 (18..23) are trained on.
    return tuple(int(10 <= i < 15 or 18 <= i < 24) for i in range(length))


def _fields(branch: Branch, length: int) -> dict[str, Any]:
    """The fields of the branch's sample of `length` tokens, all but its payload."""
    return {
        "version": DISPATCH_VERSION,
        "start_version": 2,
        "group_id": "g7",
        "rollout_id": "r7-0",
        "advantage": 0.75,
        "token_ids": branch.token_ids[:length],
        "loss_mask": _loss_mask(length),
    }


def by_handle(
    branch: Branch, payload_dir: Path, length: int, route: FinalTokenRoute = "repeat"
) -> TrainSample:
    segments = [segment for turn in branch.segments for segment in turn.values()]
    payload = stitched_payload(segments, length, route)
    return train_sample(payload_dir=str(payload_dir), payload=payload, **_fields(branch, length))


def inline(branch: Branch, length: int, route: FinalTokenRoute = "repeat") -> TrainSample:
    turns = [turn.arrays() for turn in branch.turns]
    return inline_sample(turns, length, route=route, **_fields(branch, length))


@pytest.fixture
def payload_dir(tmp_path: Path) -> Path:
    return tmp_path / "payloads" / f"v{DISPATCH_VERSION}"


@pytest.fixture
def branch(payload_dir: Path) -> Branch:
    return make_branch(payload_dir)


def _assert_same_arrays(a: Any, b: Any) -> None:
    for name in ("token_ids", "loss_mask", "advantages", "logprobs"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    for name in ("routed_experts", "sampling_mask"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype
        assert x.shape == y.shape
        assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("route", ["repeat", "sentinel"])
@pytest.mark.parametrize("length", [24, 20, 12])
def test_publish_then_read_gives_equal_arrays_by_handle_and_inline(
    tmp_path: Path, payload_dir: Path, branch: Branch, route: FinalTokenRoute, length: int
) -> None:
    batches_dir = tmp_path / "batches"
    samples = [
        by_handle(branch, payload_dir, length, route),
        inline(branch, length, route),
        train_sample(**_fields(branch, length)),
    ]
    batch_dir = publish_batch(batches_dir, 4, samples, fsync=False)
    assert shipped_steps(batches_dir) == [4]

    batch = read_batch(batch_dir)

    assert batch.step == 4
    handle, inlined, bare = batch.samples
    _assert_same_arrays(handle, inlined)
    assert handle.routed_experts is not None and handle.sampling_mask is not None
    assert handle.routed_experts.shape == (length, LAYERS, TOP_K)
    assert handle.routed_experts.dtype == (np.uint8 if route == "repeat" else np.int16)
    assert handle.sampling_mask.dtype == np.int32
    assert handle.sampling_mask.shape == (length, 3)
    # The arrays hold what the server wrote: row p of routing from the first turn
    # covering p, masks at completion positions, -1 on prompt positions.
    first, second = branch.turns
    np.testing.assert_array_equal(handle.routed_experts[:8], first.routing[:8])
    if length > 15:
        np.testing.assert_array_equal(
            handle.routed_experts[14 : length - 1], second.routing[6 : length - 9]
        )
    np.testing.assert_array_equal(handle.sampling_mask[:10], -1)
    np.testing.assert_array_equal(
        handle.sampling_mask[10 : min(length, 15)], first.mask[: min(length, 15) - 10]
    )
    last = handle.routed_experts[length - 1]
    if route == "repeat":
        np.testing.assert_array_equal(last, handle.routed_experts[length - 2])
    else:
        np.testing.assert_array_equal(last, -1)
    # Per-position loss data.
    assert handle.token_ids.dtype == np.int32
    assert handle.token_ids.tolist() == list(branch.token_ids[:length])
    assert handle.loss_mask.dtype == np.bool_
    assert handle.advantages.dtype == np.float32
    np.testing.assert_array_equal(handle.advantages, np.where(handle.loss_mask, 0.75, 0.0))
    assert handle.logprobs.dtype == np.float32
    assert (handle.group_id, handle.rollout_id, handle.reward) == ("g7", "r7-0", 1.0)
    assert (handle.start_version, handle.dispatch_version) == (2, DISPATCH_VERSION)
    assert handle.rows == range(length)
    assert bare.routed_experts is None and bare.sampling_mask is None
    assert bare.payload_nbytes == 0
    assert batch.payload_nbytes == 2 * handle.payload_nbytes > 0


def test_a_row_window_reads_exactly_those_rows(
    tmp_path: Path, payload_dir: Path, branch: Branch
) -> None:
    samples = [by_handle(branch, payload_dir, 24), inline(branch, 24), inline(branch, 12)]
    batch_dir = publish_batch(tmp_path / "batches", 1, samples, fsync=False)
    full = read_batch(batch_dir)
    for verify in (True, False):
        window = read_batch(batch_dir, rows=range(6, 16), verify=verify)
        for whole, part in zip(full.samples, window.samples, strict=True):
            rows = range(6, min(16, whole.length))
            assert part.rows == rows
            assert part.length == whole.length
            for name in (
                "token_ids",
                "loss_mask",
                "advantages",
                "logprobs",
                "routed_experts",
                "sampling_mask",
            ):
                np.testing.assert_array_equal(
                    getattr(part, name), getattr(whole, name)[rows.start : rows.stop]
                )
    assert read_batch(batch_dir, rows=range(30, 40)).samples[0].token_ids.shape == (0,)
    with pytest.raises(ValueError, match="step 1"):
        read_batch(batch_dir, rows=range(0, 10, 2))


class _FsPath:
    """A bare `os.PathLike[str]` that is not a `pathlib.Path`."""

    def __init__(self, path: str) -> None:
        self._path = path

    def __fspath__(self) -> str:
        return self._path


def test_read_batch_accepts_a_str_or_any_path_like(
    tmp_path: Path, payload_dir: Path, branch: Branch
) -> None:
    from orchestrator import read_batch as public_read_batch

    samples = [by_handle(branch, payload_dir, 24), inline(branch, 24)]
    batch_dir = publish_batch(tmp_path / "batches", 2, samples, fsync=False)
    expected = public_read_batch(batch_dir)
    for given in (str(batch_dir), _FsPath(str(batch_dir))):
        batch = public_read_batch(given)
        assert batch.step == 2
        for got, want in zip(batch.samples, expected.samples, strict=True):
            _assert_same_arrays(got, want)
    # A missing batch named by a str is still a BatchError naming the file.
    with pytest.raises(BatchError, match=r"step_000009/batch\.bin: cannot read"):
        public_read_batch(str(tmp_path / "batches" / "step_000009"))


def test_a_deleted_payload_file_raises_payload_missing_naming_it(
    tmp_path: Path, payload_dir: Path, branch: Branch
) -> None:
    batch_dir = publish_batch(tmp_path / "b", 1, [by_handle(branch, payload_dir, 24)], fsync=False)
    victim = payload_dir / branch.segments[1]["routed_experts"].file
    victim.unlink()
    for verify in (True, False):
        with pytest.raises(PayloadMissing) as caught:
            read_batch(batch_dir, verify=verify)
        assert str(victim) in str(caught.value)
        assert "\n" not in str(caught.value)


def test_a_flipped_byte_raises_payload_corrupt_when_verifying(
    tmp_path: Path, payload_dir: Path, branch: Branch
) -> None:
    batch_dir = publish_batch(tmp_path / "b", 1, [by_handle(branch, payload_dir, 24)], fsync=False)
    segment = branch.segments[0]["sampling_mask"]
    victim = payload_dir / segment.file
    data = bytearray(victim.read_bytes())
    data[segment.offset + 5] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(PayloadCorrupt) as caught:
        read_batch(batch_dir, verify=True)
    assert str(victim) in str(caught.value)
    assert "\n" not in str(caught.value)
    # Without verification the bytes are read as they are.
    read_batch(batch_dir, verify=False)


def _rewritten(batch_dir: Path, edit: Callable[[dict[str, Any]], object], step: int = 1) -> Path:
    """A copy of the batch in `batch_dir` as step `step`, its header changed by `edit`.

    Offsets are relative to the data section, so the arrays stay where the header says.
    """
    data = (batch_dir / BATCH_FILE).read_bytes()
    (length,) = struct.unpack_from("<I", data, 12)
    header = msgspec.msgpack.decode(data[16 : 16 + length])
    section = data[-(-(16 + length) // 64) * 64 :]
    edit(header)
    encoded = msgspec.msgpack.encode(header)
    prefix = struct.pack("<8sII", b"ROBATCH\n", 2, len(encoded)) + encoded
    padding = bytes(-(-len(prefix) // 64) * 64 - len(prefix))
    raw = batch_dir.parent / "raw"
    copies = len(list(raw.iterdir())) if raw.exists() else 0
    target = raw / str(copies) / f"step_{step:06d}"
    target.mkdir(parents=True)
    (target / BATCH_FILE).write_bytes(prefix + padding + section)
    return target


def _truncated(batch_dir: Path) -> Path:
    target = _rewritten(batch_dir, lambda header: None)
    data = (target / BATCH_FILE).read_bytes()
    (target / BATCH_FILE).write_bytes(data[: len(data) // 2])
    return target


def _setter(*path: str | int, value: object) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        node: Any = header
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _bad_cases(tmp_path: Path, branch: Branch, payload_dir: Path) -> list[tuple[Path, str]]:
    batches = tmp_path / "good"
    good = publish_batch(batches, 1, [by_handle(branch, payload_dir, 24)], fsync=False)
    inlined = publish_batch(batches, 2, [inline(branch, 24)], fsync=False)
    segment = ("samples", 0, "payload", "routed_experts", 0)
    return [
        (_truncated(good), "runs past the end of the file"),
        (_rewritten(good, _setter("step", value="1")), "Expected `int`, got `str` - at `$.step`"),
        (
            _rewritten(good, _setter("samples", 0, value={"token_ids": []})),
            "Object contains unknown field `token_ids` - at `$.samples[0]`",
        ),
        (_rewritten(good, _setter("format", value="other/1")), "unknown format 'other/1'"),
        (_rewritten(good, _setter("step", value=2)), "step 2 in the directory of step 1"),
        (
            _rewritten(good, _setter(*segment, "file", value="../v2/x.bin")),
            "samples[0]: bad payload segment: traversal",
        ),
        (
            _rewritten(
                good, _setter("samples", 0, "payload_dir", value=str(payload_dir.parent / "v2"))
            ),
            "is not v3, the sample's dispatch version",
        ),
        (
            _rewritten(
                inlined, _setter("samples", 0, "inline", "sampling_mask", "shape", value=[25, 3])
            ),
            "samples[0].inline.sampling_mask: shape [25, 3]: 25 rows, expected 24",
        ),
    ]


@pytest.mark.parametrize("case", range(8))
def test_malformed_batches_raise_batch_error_in_one_line(
    tmp_path: Path, payload_dir: Path, branch: Branch, case: int
) -> None:
    batch_dir, message = _bad_cases(tmp_path, branch, payload_dir)[case]
    with pytest.raises(BatchError) as caught:
        read_batch(batch_dir)
    text = str(caught.value)
    assert text.startswith(f"{batch_dir / BATCH_FILE}: ")
    assert message in text
    assert "\n" not in text


def test_a_missing_batch_file_is_a_batch_error(tmp_path: Path) -> None:
    with pytest.raises(BatchError, match=r"step_000001/batch\.bin: cannot read: No such file"):
        read_batch(tmp_path / "step_000001")


def test_a_batch_of_the_old_json_format_is_named_as_such(tmp_path: Path) -> None:
    batch_dir = tmp_path / "step_000001"
    batch_dir.mkdir()
    (batch_dir / "batch.json").write_text('{"format": "rollout-orchestrator.batch/1"}')
    with pytest.raises(BatchError) as caught:
        read_batch(batch_dir)
    assert str(caught.value) == (
        f"{batch_dir / 'batch.json'}: batch format 1 (JSON), written by an earlier version; "
        "this version reads format 2 (batch.bin) only"
    )


def test_the_arrays_are_writable_views_of_the_mapped_file(
    tmp_path: Path, payload_dir: Path, branch: Branch
) -> None:
    samples = [by_handle(branch, payload_dir, 24), inline(branch, 20)]
    batch_dir = publish_batch(tmp_path / "batches", 1, samples, fsync=False)
    before = (batch_dir / BATCH_FILE).read_bytes()
    handle, inlined = read_batch(batch_dir).samples
    for sample in (handle, inlined):
        for name in (
            "token_ids",
            "loss_mask",
            "advantages",
            "logprobs",
            "routed_experts",
            "sampling_mask",
        ):
            array = getattr(sample, name)
            assert array.flags.writeable, name
    # Zero-copy: the per-position arrays of both samples share the mapping.
    assert np.shares_memory(handle.token_ids.base, inlined.token_ids.base)
    assert inlined.routed_experts is not None
    inlined.routed_experts[:] = 0
    inlined.token_ids[:] = 0
    assert (batch_dir / BATCH_FILE).read_bytes() == before


# -- on_corrupt="drop": a broken sample is left out, named, and the rest is read ---------

SERVERS = ("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000")


def _three_servers_batch(tmp_path: Path, payload_dir: Path) -> tuple[Path, list[Branch]]:
    """Batch 1: three by-handle samples (own files, one per server), then an inline one."""
    branches = [make_branch(payload_dir, seed=seed) for seed in (1, 2, 3)]
    samples = [
        attrs.evolve(by_handle(b, payload_dir, 24), rollout_id=f"r{i}", server=SERVERS[i])
        for i, b in enumerate(branches)
    ]
    samples.append(attrs.evolve(inline(branches[0], 24), rollout_id="r-inline"))
    return publish_batch(tmp_path / "batches", 1, samples, fsync=False), branches


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_drop_leaves_out_a_sample_whose_bytes_were_corrupted_and_names_it(
    tmp_path: Path, payload_dir: Path
) -> None:
    batch_dir, branches = _three_servers_batch(tmp_path, payload_dir)
    clean = read_batch(batch_dir)
    assert clean.dropped == ()
    segment = branches[1].segments[0]["sampling_mask"]
    victim = payload_dir / segment.file
    _flip_byte(victim, segment.offset + 5)

    batch = read_batch(batch_dir, verify=True, on_corrupt="drop")

    assert [s.rollout_id for s in batch.samples] == ["r0", "r2", "r-inline"]
    assert [s.server for s in batch.samples] == [SERVERS[0], SERVERS[2], None]
    for got, want in zip(batch.samples, [clean.samples[i] for i in (0, 2, 3)], strict=True):
        _assert_same_arrays(got, want)
    [dropped] = batch.dropped
    assert (dropped.index, dropped.group_id, dropped.rollout_id, dropped.server) == (
        1,
        "g7",
        "r1",
        SERVERS[1],
    )
    assert (dropped.reason, dropped.file) == ("payload_corrupt", str(victim))
    assert "digest mismatch" in dropped.error
    text = str(dropped)
    assert "samples[1]" in text and "rollout r1" in text and SERVERS[1] in text
    assert str(victim) in text and "\n" not in text
    assert batch.payload_nbytes == 3 * clean.samples[0].payload_nbytes

    # The default still refuses the whole batch; so does an explicit "raise".
    with pytest.raises(PayloadCorrupt, match="digest mismatch"):
        read_batch(batch_dir)
    with pytest.raises(PayloadCorrupt, match="digest mismatch"):
        read_batch(batch_dir, on_corrupt="raise")
    # Without verification nothing can tell: nothing is dropped.
    assert read_batch(batch_dir, verify=False, on_corrupt="drop").dropped == ()


def test_drop_leaves_out_samples_whose_version_dir_became_a_mount_point(
    tmp_path: Path, payload_dir: Path, bind_mount: BindMount
) -> None:
    # The same files, but the version directory is now a mount point (here: bound onto
    # itself): the reader refuses it like a link, sample by sample.
    batch_dir, _ = _three_servers_batch(tmp_path, payload_dir)
    with bind_mount(payload_dir, payload_dir):
        batch = read_batch(batch_dir, on_corrupt="drop")
        assert [s.rollout_id for s in batch.samples] == ["r-inline"]
        assert [(d.rollout_id, d.reason) for d in batch.dropped] == [
            (f"r{i}", "bad_payload_file") for i in range(3)
        ]
        assert "mount point" in batch.dropped[0].error
        with pytest.raises(BatchError, match="mount point"):
            read_batch(batch_dir)


@pytest.mark.parametrize("verify", [True, False])
def test_drop_leaves_out_a_sample_whose_file_is_missing(
    tmp_path: Path, payload_dir: Path, verify: bool
) -> None:
    batch_dir, branches = _three_servers_batch(tmp_path, payload_dir)
    victim = payload_dir / branches[2].segments[1]["routed_experts"].file
    victim.unlink()
    batch = read_batch(batch_dir, verify=verify, on_corrupt="drop")
    assert [s.rollout_id for s in batch.samples] == ["r0", "r1", "r-inline"]
    [dropped] = batch.dropped
    assert (dropped.index, dropped.rollout_id, dropped.server) == (2, "r2", SERVERS[2])
    assert (dropped.reason, dropped.file) == ("payload_missing", str(victim))
    with pytest.raises(PayloadMissing):
        read_batch(batch_dir, verify=verify, on_corrupt="raise")


def test_drop_leaves_out_a_sample_whose_file_was_replaced_by_a_link(
    tmp_path: Path, payload_dir: Path
) -> None:
    batch_dir, branches = _three_servers_batch(tmp_path, payload_dir)
    victim = payload_dir / branches[0].segments[0]["routed_experts"].file
    real = victim.with_name("elsewhere.bin")
    victim.rename(real)
    victim.symlink_to(real.name)
    batch = read_batch(batch_dir, on_corrupt="drop")
    assert [s.rollout_id for s in batch.samples] == ["r1", "r2", "r-inline"]
    [dropped] = batch.dropped
    assert (dropped.rollout_id, dropped.reason, dropped.file) == (
        "r0",
        "bad_payload_file",
        str(victim),
    )
    with pytest.raises(BatchError, match=r"samples\[0\]: .*symlink"):
        read_batch(batch_dir)


@pytest.mark.parametrize("window", [range(0, 8), range(8, 16), range(16, 24), range(30, 40)])
def test_every_row_window_drops_the_same_samples_as_a_full_read(
    tmp_path: Path, payload_dir: Path, window: range
) -> None:
    batch_dir, branches = _three_servers_batch(tmp_path, payload_dir)
    # Sample r1: corrupt turn 2's routing, read by positions 14..23 only (window 0..8
    # reads none of its rows). Sample r2: lose turn 1's file (positions 0..14).
    turn2 = branches[1].segments[1]["routed_experts"]
    _flip_byte(payload_dir / turn2.file, turn2.offset + 5)
    (payload_dir / branches[2].segments[0]["routed_experts"].file).unlink()
    full = read_batch(batch_dir, on_corrupt="drop")
    assert [(d.rollout_id, d.reason) for d in full.dropped] == [
        ("r1", "payload_corrupt"),
        ("r2", "payload_missing"),
    ]

    part = read_batch(batch_dir, rows=window, on_corrupt="drop")

    assert part.dropped == full.dropped
    assert [s.rollout_id for s in part.samples] == ["r0", "r-inline"]
    for whole, rows in zip(full.samples, part.samples, strict=True):
        assert rows.rows == range(min(window.start, 24), min(window.stop, 24))
        assert rows.routed_experts is not None and whole.routed_experts is not None
        np.testing.assert_array_equal(
            rows.routed_experts, whole.routed_experts[rows.rows.start : rows.rows.stop]
        )
    # Raising alike, too: no rank reads a sample another rank refuses.
    with pytest.raises(PayloadCorrupt):
        read_batch(batch_dir, rows=window)


@pytest.mark.parametrize("case", range(8))
def test_drop_never_hides_a_malformed_batch(
    tmp_path: Path, payload_dir: Path, branch: Branch, case: int
) -> None:
    batch_dir, message = _bad_cases(tmp_path, branch, payload_dir)[case]
    with pytest.raises(BatchError, match=re.escape(message)):
        read_batch(batch_dir, on_corrupt="drop")


def test_an_unknown_on_corrupt_is_refused(tmp_path: Path, payload_dir: Path) -> None:
    batch_dir, _ = _three_servers_batch(tmp_path, payload_dir)
    with pytest.raises(ValueError, match="on_corrupt must be 'raise' or 'drop', got 'skip'"):
        read_batch(batch_dir, on_corrupt="skip")  # type: ignore[arg-type]

"""The reference reader in docs/protocol.md § Batches runs and agrees with read_batch, and
the documented example is what the writer writes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from sample_kit import inline_sample, stitched_payload, train_sample

from orchestrator.handoff import TrainSample, encode_batch, publish_batch, read_batch
from orchestrator.payload import (
    FinalTokenRoute,
    PayloadSegment,
    write_payload_file,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def batches_section() -> str:
    """The text of docs/protocol.md's `## Batches` section, up to the next `## ` heading."""
    [section] = re.findall(r"^## Batches\n.*?(?=^## |\Z)", DOC.read_text(), flags=re.S | re.M)
    return section


def reference_reader() -> dict[str, Any]:
    """Execute the documented reader (found by its marker comment); return its namespace."""
    text = batches_section()
    [code] = re.findall(r"```python\n(# reference reader.*?)```", text, flags=re.S)
    namespace: dict[str, Any] = {"__name__": "reference_reader"}
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace


def _samples(payload_dir: Path, route: FinalTokenRoute) -> list[TrainSample]:
    rng = np.random.default_rng(1)
    # Two turns: prompt 6 + 3 sampled; then 2 env tokens + 2 sampled (13 tokens), the
    # second turn's routing from position 4 (a cached prefix), uint16 ids.
    r1 = rng.integers(0, 300, size=(8, 3, 2)).astype(np.uint16)
    m1 = rng.integers(0, 99, size=(3, 4)).astype(np.int32)
    r2 = rng.integers(0, 300, size=(8, 3, 2)).astype(np.uint16)
    m2 = rng.integers(0, 99, size=(2, 2)).astype(np.int32)
    turns = [
        {"routed_experts": (r1, 0), "sampling_mask": (m1, 6)},
        {"routed_experts": (r2, 4), "sampling_mask": (m2, 11)},
    ]
    segments = [segment for turn in turns for segment in write_payload_file(payload_dir, turn)]
    loss_mask = [0] * 6 + [1] * 3 + [0] * 2 + [1] * 2
    samples = []
    for length in (13, 10):
        fields: dict[str, Any] = {
            "version": 3,
            "advantage": -0.25,
            "token_ids": range(length),
            "loss_mask": loss_mask[:length],
        }
        payload = stitched_payload(segments, length, route)
        samples += [
            train_sample(payload_dir=str(payload_dir), payload=payload, **fields),
            inline_sample(turns, length, route=route, **fields),
            train_sample(**fields),
        ]
    return samples


@pytest.mark.parametrize("route", ["repeat", "sentinel"])
def test_the_documented_reader_matches_read_batch(tmp_path: Path, route: FinalTokenRoute) -> None:
    samples = _samples(tmp_path / "payloads" / "v3", route)
    batch_dir = publish_batch(tmp_path / "batches", 7, samples, fsync=False)
    documented = reference_reader()["read_batch_bin"](batch_dir)
    ours = read_batch(batch_dir)
    assert len(documented) == len(ours.samples) == 6
    for theirs, mine in zip(documented, ours.samples, strict=True):
        expected = {
            "token_ids": mine.token_ids,
            "loss_mask": mine.loss_mask,
            "advantages": mine.advantages,
            "logprobs": mine.logprobs,
        }
        for field in ("routed_experts", "sampling_mask"):
            if getattr(mine, field) is not None:
                expected[field] = getattr(mine, field)
        assert theirs.keys() == expected.keys()
        for name, array in expected.items():
            assert theirs[name].dtype == array.dtype, name
            assert theirs[name].shape == array.shape, name
            assert theirs[name].tobytes() == array.tobytes(), name


def test_the_documented_reader_detects_corruption(tmp_path: Path) -> None:
    samples = _samples(tmp_path / "payloads" / "v3", "repeat")
    batch_dir = publish_batch(tmp_path / "batches", 7, samples[:1], fsync=False)
    victim = next((tmp_path / "payloads" / "v3").iterdir())
    data = bytearray(victim.read_bytes())
    data[0] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="digest mismatch"):
        reference_reader()["read_batch_bin"](batch_dir)


def test_the_documented_example_is_what_the_writer_writes() -> None:
    text = batches_section()
    segment = PayloadSegment(
        field="routed_experts",
        file="ebda645122dd470f9c659839fd37b470.bin",
        offset=0,
        pos=0,
        shape=(6, 2, 2),
        dtype="uint8",
        digest="b9eeee2787151c833875d6c8fe2c93bc",
    )
    common: dict[str, Any] = {
        "group_id": "g-000017",
        "start_version": 2,
        "dispatch_version": 3,
        "server": "http://10.1.0.4:8000",
    }
    routing = [[[3, 1], [0, 2]], [[1, 2], [3, 0]], [[2, 2], [1, 1]], [[-1, -1], [-1, -1]]]
    samples = [
        TrainSample(
            **common,
            rollout_id="g-000017/2",
            reward=1.0,
            advantage=0.5,
            token_ids=[100, 101, 102, 103, 104, 105],
            loss_mask=[0, 0, 0, 1, 1, 1],
            logprobs=[0, 0, 0, -0.25, -0.5, -1.0],
            payload_dir="/shared/run/payloads/v3",
            payload={"routed_experts": [segment]},
        ),
        TrainSample(
            **common,
            rollout_id="g-000017/3",
            reward=0.0,
            advantage=-0.5,
            token_ids=[100, 101, 102, 107],
            loss_mask=[0, 0, 1, 1],
            logprobs=[0, 0, -0.5, -1.25],
            inline={"routed_experts": np.array(routing, dtype=np.int16)},
        ),
    ]
    layout = encode_batch(7, samples, created_at=1764409871.25)
    header_len = int.from_bytes(layout.prefix[12:16], "little")
    assert (header_len, layout.data_start, layout.size) == (799, 832, 1120)
    assert "`H` is 799 bytes, so `D` is 832 and the file\nis 1,120 bytes" in text
    assert layout.prefix[:16].hex(" ") in text.replace("  ", " ")
    [shown] = re.findall(r"```json\n(.*?)```", text, flags=re.S)
    header = msgspec.msgpack.decode(layout.prefix[16 : 16 + header_len])
    assert json.loads(shown) == header
    assert [
        (offset, array.size) for offset, array in zip(layout.offsets, layout.arrays, strict=True)
    ] == [
        (0, 24),
        (24, 16),
        (64, 6),
        (70, 4),
        (128, 24),
        (152, 16),
        (192, 24),
        (216, 16),
        (256, 32),
    ]
    data = bytearray(layout.size)
    data[: len(layout.prefix)] = layout.prefix
    for offset, array in zip(layout.offsets, layout.arrays, strict=True):
        start = layout.data_start + offset
        data[start : start + array.size] = array.tobytes()
    # The byte map: the header, the padding, and each array's first and last byte.
    [header_end] = re.findall(r"bytes +16\.\.(\d+) +the header", text)
    assert int(header_end) == 15 + header_len
    [zeros] = re.findall(r"bytes +(\d+)\.\.(\d+) +zeros", text)
    assert (int(zeros[0]), int(zeros[1])) == (16 + header_len, layout.data_start - 1)
    refs = {name: header["columns"][name] for name in header["columns"]}
    refs["routed_experts"] = header["samples"][1]["inline"]["routed_experts"]
    expected_ranges = []
    for ref in refs.values():
        nbytes = int(np.prod(ref["shape"])) * np.dtype(ref["dtype"]).itemsize
        start = layout.data_start + ref["offset"]
        expected_ranges.append((start, start + nbytes - 1, ref["offset"]))
    shown_ranges = [
        tuple(int(n) for n in match)
        for match in re.findall(r"bytes +(\d+)\.\.(\d+) .*\(offset (\d+)\)", text)
    ]
    assert shown_ranges == expected_ranges
    # The columns' values, as shown.
    [table] = re.findall(r"```\n(token_ids .*?)```", text, flags=re.S)
    for line in table.splitlines():
        name, *values = line.replace("|", " ").split()
        ref = refs[name]
        start = layout.data_start + ref["offset"]
        column = np.frombuffer(data, dtype=ref["dtype"], count=ref["shape"][0], offset=start)
        assert [float(value) for value in values] == column.tolist(), name


def test_only_one_sentence_names_the_old_format() -> None:
    text = batches_section()
    assert "rollout-orchestrator.batch/1" not in text
    assert text.count("batch.json") == 1

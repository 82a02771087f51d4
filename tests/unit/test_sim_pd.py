"""The local fleet's prefill/decode pieces that are pure (orchestrator/sim/_pd.py): the
requests the router sends each side, what each side refuses, and the router's merge of the
two replies, inline as PrimeIntellect-ai/router's `routed_experts_merge.rs` merges and by
handle (both sides' segments forwarded, prefill's first).

Routing values are written here with numpy and base64 alone, not with the encoders the
router uses, so that a merge and its test cannot agree on a mistake.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest

from orchestrator.sim import prefix_hashes
from orchestrator.sim._pd import (
    KV_BLOCK_TOKENS,
    PDMergeError,
    check_decode_request,
    check_prefill_request,
    decode_request,
    kv_block_ids,
    merge_choices,
    pad_rows,
    prefill_kv_transfer_params,
    prefill_request,
)
from orchestrator.sim._wire import BadRequest


def packed(array: np.ndarray, start: int) -> dict[str, Any]:
    raw = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
    return {
        "data": base64.b64encode(raw).decode(),
        "shape": list(array.shape),
        "start": start,
        "dtype": array.dtype.name,
    }


def unpacked(value: dict[str, Any]) -> tuple[np.ndarray, int]:
    dtype = np.dtype(value["dtype"]).newbyteorder("<")
    array = np.frombuffer(base64.b64decode(value["data"]), dtype=dtype).reshape(value["shape"])
    return array, value["start"]


def npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def rows(*values: list[int], dtype: str = "uint8") -> np.ndarray:
    """Routing rows of one layer, top-2: `rows([1, 2], [3, 4])` is two positions."""
    return np.array(values, dtype=dtype).reshape(len(values), 1, 2)


# --- requests ----------------------------------------------------------------------------


def test_the_prefill_request_asks_for_one_token_and_keeps_the_kv() -> None:
    body: dict[str, Any] = {
        "request_id": "r",
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 64, "min_tokens": 8, "seed": 3},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = prefill_request(body)
    assert request["sampling_params"] == {"max_tokens": 1, "min_tokens": 1, "seed": 3}
    assert request["stream"] is False and "stream_options" not in request
    assert request["kv_transfer_params"]["do_remote_decode"] is True
    assert request["kv_transfer_params"]["do_remote_prefill"] is False
    # The client's request is not changed.
    assert body["sampling_params"]["max_tokens"] == 64 and body["stream"] is True
    assert prefill_request({"token_ids": [1]})["sampling_params"] == {
        "max_tokens": 1,
        "min_tokens": 1,
    }


def test_the_decode_request_is_the_original_with_the_prefills_kv() -> None:
    body = {"request_id": "r", "token_ids": [1, 2], "sampling_params": {"max_tokens": 64}}
    kv = prefill_kv_transfer_params("engine", "127.0.0.1", 8000, [7])
    request = decode_request(body, {"kv_transfer_params": kv})
    assert request == {**body, "kv_transfer_params": kv}
    assert decode_request(body, {"kv_transfer_params": None}) == body


def test_kv_blocks_name_the_prompt() -> None:
    prompt = np.arange(2 * KV_BLOCK_TOKENS + 3)
    blocks = kv_block_ids(prefix_hashes(prompt))
    assert len(blocks) == 3  # two full blocks and a partial one
    assert all(0 <= block < 2**53 for block in blocks)
    assert kv_block_ids(prefix_hashes(prompt[: 2 * KV_BLOCK_TOKENS])) == blocks[:2]
    other = prompt.copy()
    other[0] += 1
    assert kv_block_ids(prefix_hashes(other)) != blocks


def test_each_side_refuses_a_request_the_router_did_not_prepare() -> None:
    blocks = kv_block_ids(prefix_hashes(np.arange(20)))
    with pytest.raises(BadRequest, match="do_remote_decode"):
        check_prefill_request(None)
    with pytest.raises(BadRequest, match="do_remote_decode"):
        check_prefill_request({"do_remote_decode": False})
    check_prefill_request(prefill_request({})["kv_transfer_params"])
    with pytest.raises(BadRequest, match="do_remote_prefill"):
        check_decode_request(None, blocks)
    kv = prefill_kv_transfer_params("e", "h", 1, blocks)
    check_decode_request(kv, blocks)
    with pytest.raises(BadRequest, match="remote_block_ids"):
        check_decode_request({**kv, "remote_block_ids": blocks[:-1]}, blocks)


def test_a_decode_servers_inline_rows_are_padded_to_the_requested_start() -> None:
    decoded = rows([5, 6], [7, 8])  # positions 9 and 10
    padded = pad_rows(decoded, 9, 6)
    assert padded.dtype == np.uint8 and padded.shape == (5, 1, 2)
    assert padded[:3].tolist() == [[[0, 0]]] * 3 and np.array_equal(padded[3:], decoded)
    assert pad_rows(decoded, 9, 9) is decoded


# --- the router's inline merge -----------------------------------------------------------


def test_inline_merge_keeps_the_prefills_rows_and_the_decodes_after_them() -> None:
    # Prompt rows from start 2: positions 2, 3, 4 (the prompt's last token). The decode's
    # rows, padded to 2, are [pad, pad, its own row for 4, 5, 6].
    prefill = {"routed_experts": packed(rows([10, 11], [20, 21], [30, 31]), 2)}
    decode: dict[str, Any] = {
        "routed_experts": packed(rows([0, 0], [0, 0], [30, 31], [40, 41], [50, 51]), 2),
        "token_ids": [9, 9, 9],
    }
    merge_choices(prefill, [decode])
    merged, start = unpacked(decode["routed_experts"])
    assert start == 2
    assert merged.tolist() == rows([10, 11], [20, 21], [30, 31], [40, 41], [50, 51]).tolist()
    assert decode["token_ids"] == [9, 9, 9]


def test_inline_merge_keeps_the_prefills_row_where_the_sides_disagree() -> None:
    # The row both computed is taken from the prefill, unchecked: the router trusts it.
    prefill = {"routed_experts": packed(rows([1, 2]), 0)}
    decode = {"routed_experts": packed(rows([9, 9], [3, 4]), 0)}
    merge_choices(prefill, [decode])
    assert unpacked(decode["routed_experts"])[0].tolist() == rows([1, 2], [3, 4]).tolist()


def test_inline_merge_widens_uint8_and_uint16() -> None:
    prefill = {"routed_experts": packed(rows([10, 11]), 0)}
    decode = {"routed_experts": packed(rows([0, 0], [256, 300], dtype="uint16"), 0)}
    merge_choices(prefill, [decode])
    merged, _ = unpacked(decode["routed_experts"])
    assert merged.dtype == np.uint16
    assert merged.tolist() == rows([10, 11], [256, 300], dtype="uint16").tolist()


def test_inline_merge_of_npy_routing() -> None:
    prefill = {"routed_experts": npy(rows([10, 11], [20, 21]))}
    decode = {"routed_experts": npy(rows([0, 0], [20, 21], [30, 31]))}
    merge_choices(prefill, [decode])
    raw = base64.b64decode(decode["routed_experts"])
    merged = np.load(io.BytesIO(raw), allow_pickle=False)
    assert merged.tolist() == rows([10, 11], [20, 21], [30, 31]).tolist()


def test_inline_merge_without_routing_leaves_the_reply_alone() -> None:
    decode = {"routed_experts": None, "token_ids": [1]}
    merge_choices({"routed_experts": None}, [decode])
    merge_choices(None, [decode])
    assert decode == {"routed_experts": None, "token_ids": [1]}


@pytest.mark.parametrize(
    ("prefill", "decode", "words"),
    [
        (None, packed(rows([1, 2]), 0), "prefill did not"),
        (packed(rows([1, 2]), 0), None, "missing"),
        (packed(rows([1, 2], [3, 4]), 0), packed(rows([1, 2]), 0), "at least 2"),
        (packed(rows([1, 2]), 0), npy(rows([1, 2])), "different forms"),
        (
            packed(rows([1, 2]), 0),
            packed(np.zeros((2, 2, 1), dtype=np.uint8), 0),
            "cannot concatenate",
        ),
        (
            packed(rows([1, 2]), 0),
            packed(rows([1, 2], [3, 4], dtype="int32"), 0),
            "dtypes",
        ),
        (
            {"data": "!!", "shape": [1, 1, 2], "start": 0, "dtype": "uint8"},
            packed(rows([1, 2]), 0),
            "prefill routed_experts",
        ),
    ],
)
def test_replies_the_router_cannot_merge(prefill: Any, decode: Any, words: str) -> None:
    with pytest.raises(PDMergeError, match=words):
        merge_choices({"routed_experts": prefill}, [{"routed_experts": decode}])


# --- by handle ---------------------------------------------------------------------------


def segment(field: str, file: str, pos: int, rows_: int) -> dict[str, Any]:
    return {
        "field": field,
        "file": file,
        "offset": 0,
        "pos": pos,
        "rows": rows_,
        "dtype": "uint8" if field == "routed_experts" else "int32",
        "shape": [1, 2] if field == "routed_experts" else [3],
    }


def test_by_handle_forwards_both_sides_segments_prefill_first_unclipped() -> None:
    prefill_segments = [
        segment("routed_experts", "/p/v0/p.bin", 0, 5),
        segment("sampling_mask", "/p/v0/p.bin", 5, 1),
    ]
    decode_segments = [
        segment("routed_experts", "/p/v0/d.bin", 4, 3),
        segment("sampling_mask", "/p/v0/d.bin", 5, 3),
    ]
    decode = {"payload": list(decode_segments), "routed_experts": None}
    merge_choices({"payload": prefill_segments, "routed_experts": None}, [decode])
    assert decode["payload"] == [*prefill_segments, *decode_segments]
    assert "payload_error" not in decode


def test_by_handle_passes_a_sides_payload_error_on_with_the_other_sides_segments() -> None:
    decode_segments = [segment("routed_experts", "/p/v0/d.bin", 4, 3)]
    decode: dict[str, Any] = {"payload": list(decode_segments)}
    merge_choices({"payload": None, "payload_error": "disk full"}, [decode])
    assert decode["payload_error"] == "prefill: disk full"
    assert decode["payload"] == decode_segments

    decode = {"payload": None, "payload_error": "EIO"}
    merge_choices({"payload": []}, [decode])
    assert decode == {"payload": None, "payload_error": "decode: EIO"}


def test_by_handle_with_nothing_captured_is_an_empty_list() -> None:
    decode: dict[str, Any] = {"payload": []}
    merge_choices({"payload": []}, [decode])
    assert decode == {"payload": []}

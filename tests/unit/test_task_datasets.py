"""The dataset layer (orchestrator/tasks/datasets.py): the three forms read back exactly, its
errors, `require_columns`, `DataOrder`, and the memory a million rows cost. Real files in
`tmp_path`, written with json and pyarrow."""

from __future__ import annotations

import gc
import json
import random
import re
import tracemalloc
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from orchestrator.errors import UserError
from orchestrator.tasks.datasets import (
    DataOrder,
    Dataset,
    DatasetError,
    open_dataset,
    require_columns,
)

ROWS: list[dict[str, Any]] = [
    {
        "id": index,
        "question": question,
        "messages": [
            {"role": "system", "content": "Réponds en une ligne."},
            {"role": "user", "content": question},
        ],
        "score": index / 4,
        "hard": index % 2 == 0,
        "note": None if index % 3 else f"note {index} ✓",
    }
    for index, question in enumerate(
        [
            "2 + 2 ?",
            "Combien font six fois sept, déjà ?",
            "日本の首都はどこですか",
            "emoji 😀 — ok",
            'quote " and \\',
            "",
        ]
        * 3
    )
]
COLUMNS = ("id", "question", "messages", "score", "hard", "note")

Writer = Callable[[Path, list[dict[str, Any]]], Path]


def write_jsonl(folder: Path, rows: list[dict[str, Any]]) -> Path:
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), "utf-8")
    return path


def write_parquet(folder: Path, rows: list[dict[str, Any]]) -> Path:
    path = folder / "rows.parquet"
    # Row groups of 4 rows: reads cross row-group boundaries.
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
    return path


def write_saved(folder: Path, tables: list[pa.Table]) -> Path:
    """A folder laid out as `datasets`' `Dataset.save_to_disk` writes it: one Arrow IPC
    stream per shard, `data-{shard:05d}-of-{num_shards:05d}.arrow`, listed in `state.json`'s
    `_data_files`, beside `dataset_info.json`."""
    path = folder / "saved"
    path.mkdir()
    names = [f"data-{shard:05d}-of-{len(tables):05d}.arrow" for shard in range(len(tables))]
    for name, table in zip(names, tables, strict=True):
        schema = table.schema.with_metadata({"huggingface": json.dumps({"info": {}})})
        with pa.OSFile(str(path / name), "wb") as sink, pa.ipc.new_stream(sink, schema) as out:
            # Several record batches a file, as ArrowWriter writes them.
            out.write_table(table.replace_schema_metadata(schema.metadata), max_chunksize=2)
    state: dict[str, Any] = {
        "_data_files": [{"filename": name} for name in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    (path / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    (path / "dataset_info.json").write_text(json.dumps({"citation": "", "features": {}}))
    return path


def write_saved_rows(folder: Path, rows: list[dict[str, Any]]) -> Path:
    # Two data files, split unevenly.
    schema = pa.Table.from_pylist(rows).schema
    cut = len(rows) // 3
    return write_saved(
        folder,
        [pa.Table.from_pylist(part, schema=schema) for part in (rows[:cut], rows[cut:])],
    )


FORMS: dict[str, Writer] = {
    "jsonl": write_jsonl,
    "parquet": write_parquet,
    "save_to_disk": write_saved_rows,
}


@pytest.fixture(params=sorted(FORMS))
def dataset(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Dataset]:
    with open_dataset(FORMS[request.param](tmp_path, ROWS)) as opened:
        assert opened.form == request.param
        yield opened


def error_of(path: Path) -> str:
    with pytest.raises(DatasetError) as caught:
        open_dataset(path)
    message = str(caught.value)
    assert "\n" not in message
    assert isinstance(caught.value, UserError)
    return message


# --- Reading back ---------------------------------------------------------------------------


def test_each_form_reads_back_every_row_in_order(dataset: Dataset) -> None:
    assert len(dataset) == len(ROWS)
    assert dataset.columns == COLUMNS
    assert [dataset.row(index) for index in range(len(dataset))] == ROWS
    assert dataset.rows(range(len(dataset))) == ROWS


def test_each_form_reads_rows_by_random_index(dataset: Dataset) -> None:
    chosen = random.Random(7).choices(range(len(ROWS)), k=50)
    assert [dataset.row(index) for index in chosen] == [ROWS[index] for index in chosen]
    # A batch in shuffled order with repeats comes back in the order asked.
    assert dataset.rows(chosen) == [ROWS[index] for index in chosen]
    assert dataset.rows(np.array(chosen[::-1])) == [ROWS[index] for index in chosen[::-1]]
    assert dataset.rows([]) == []


def test_values_are_plain_python_with_unicode_and_nesting(dataset: Dataset) -> None:
    row = dataset.row(3)
    assert row["question"] == "emoji 😀 — ok"
    assert row["messages"] == [
        {"role": "system", "content": "Réponds en une ligne."},
        {"role": "user", "content": "emoji 😀 — ok"},
    ]
    assert type(row["id"]) is int
    assert type(row["score"]) is float
    assert type(row["hard"]) is bool
    assert row["note"] == "note 3 ✓"
    assert dataset.row(1)["note"] is None


def test_rows_out_of_range_raise_index_error(dataset: Dataset) -> None:
    with pytest.raises(IndexError, match=r"row 18 of a dataset of 18 rows"):
        dataset.row(len(ROWS))
    with pytest.raises(IndexError, match=r"row -1 of"):
        dataset.row(-1)
    with pytest.raises(IndexError, match=r"row 99 of"):
        dataset.rows([0, 99])


def test_close_releases_and_later_reads_fail(tmp_path: Path) -> None:
    for form, writer in FORMS.items():
        folder = tmp_path / form
        folder.mkdir()
        dataset = open_dataset(writer(folder, ROWS))
        assert dataset.row(0) == ROWS[0]
        dataset.close()
        dataset.close()
        with pytest.raises(ValueError, match=r"is closed"):
            dataset.row(0)
        with pytest.raises(ValueError, match=r"is closed"):
            dataset.rows([0])


def test_reads_from_several_threads_at_once(dataset: Dataset) -> None:
    chosen = [random.Random(seed).randrange(len(ROWS)) for seed in range(400)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(dataset.row, chosen))
    assert got == [ROWS[index] for index in chosen]


def test_jsonl_skips_blank_lines_and_reads_crlf_and_a_bom(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    lines = [json.dumps(row) for row in ROWS[:3]]
    text = f"\n\r\n{lines[0]}\r\n   \n\n  {lines[1]}\t\n\t \r\n{lines[2]}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    with open_dataset(path) as dataset:
        assert len(dataset) == 3
        assert dataset.rows(range(3)) == ROWS[:3]


def test_jsonl_columns_are_the_first_rows_and_missing_ones_are_none(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1, "b": "x"}\n{"b": "y", "c": [1, {"d": null}]}\n')
    with open_dataset(path) as dataset:
        assert dataset.columns == ("a", "b")
        assert dataset.row(1) == {"a": None, "b": "y", "c": [1, {"d": None}]}


def test_saved_folder_maps_its_data_files_zero_copy(tmp_path: Path) -> None:
    path = write_saved_rows(tmp_path, ROWS)
    before = pa.total_allocated_bytes()
    with open_dataset(path) as dataset:
        # The record batches point into the memory maps: Arrow allocated nothing for them.
        assert pa.total_allocated_bytes() - before < 4096
        assert dataset.rows(range(len(ROWS))) == ROWS


# --- Errors ---------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    path = tmp_path / "nothing.jsonl"
    assert error_of(path) == f"dataset {path}: no such file or folder"


def test_a_file_of_another_kind(tmp_path: Path) -> None:
    for name in ("rows.csv", "rows.json", "rows"):
        path = tmp_path / name
        path.write_text("a,b\n1,2\n")
        assert error_of(path) == (
            f"dataset {path}: not a .jsonl file, a .parquet file, or a folder written by"
            " datasets' save_to_disk"
        )


def test_a_parquet_file_that_is_not_parquet(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    path.write_text('{"a": 1}\n')
    message = error_of(path)
    assert message.startswith(f"dataset {path}: cannot read as parquet: ")
    assert "magic bytes" in message


def test_a_jsonl_line_that_is_not_an_object_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    for bad in ("[1, 2]", '"text"', "42", "null", "  x"):
        path.write_text(f'{{"a": 1}}\n\n{{"a": 2}}\n{bad}\n{{"a": 3}}\n')
        assert error_of(path) == f"dataset {path}: line 4 is not a JSON object"


def test_a_bad_jsonl_line_found_when_read_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"a": 2}\n{"a": 3\n{"a": "\xff"}\n{"a": 4} {}\n')
    with open_dataset(path) as dataset:
        assert len(dataset) == 5
        assert dataset.row(1) == {"a": 2}
        for index, line in ((2, 4), (3, 5), (4, 6)):
            with pytest.raises(DatasetError) as caught:
                dataset.row(index)
            assert re.fullmatch(
                rf"dataset {re.escape(str(path))}: line {line} is not a JSON object \(.+\)",
                str(caught.value),
            )


def test_a_bad_first_jsonl_line_fails_at_open(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('\n{"a": \n{"a": 2}\n')
    assert error_of(path).startswith(f"dataset {path}: line 2 is not a JSON object (")


def test_empty_datasets(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert error_of(empty) == f"dataset {empty}: empty (no rows)"
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n\r\n")
    assert error_of(blank) == f"dataset {blank}: empty (no rows, only blank lines)"
    no_rows = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"a": pa.array([], pa.int64())}), no_rows)
    assert error_of(no_rows) == f"dataset {no_rows}: empty (no rows)"
    saved = write_saved(tmp_path, [pa.table({"a": pa.array([], pa.int64())})] * 2)
    assert error_of(saved) == f"dataset {saved}: empty (no rows)"


def test_a_folder_without_state_json(tmp_path: Path) -> None:
    assert error_of(tmp_path) == (
        f"dataset {tmp_path}: a folder without state.json, so not one written by datasets'"
        " save_to_disk"
    )
    (tmp_path / "dataset_dict.json").write_text('{"splits": ["train"]}')
    assert error_of(tmp_path) == (
        f"dataset {tmp_path}: a DatasetDict folder (dataset_dict.json); name one split's"
        " folder inside it, e.g. its train folder"
    )


def test_a_folder_with_a_missing_data_file(tmp_path: Path) -> None:
    path = write_saved_rows(tmp_path, ROWS)
    (path / "data-00001-of-00002.arrow").unlink()
    assert error_of(path) == f"dataset {path}: missing data file data-00001-of-00002.arrow"


def test_a_folder_with_a_bad_state_json_or_data_file(tmp_path: Path) -> None:
    path = write_saved_rows(tmp_path, ROWS)
    state = path / "state.json"
    state.write_text('{"_data_files": "data.arrow"}')
    assert error_of(path) == (
        f'dataset {state}: no "_data_files" list of {{"filename": ...}} entries'
    )
    state.write_text("{")
    assert error_of(path).startswith(f"dataset {state}: not valid JSON (")
    state.write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00002.arrow"}]}))
    (path / "data-00000-of-00002.arrow").write_bytes(b"not an arrow stream")
    assert error_of(path).startswith(
        f"dataset {path / 'data-00000-of-00002.arrow'}: cannot read as an Arrow IPC stream: "
    )


def test_a_folder_whose_data_files_differ_in_schema(tmp_path: Path) -> None:
    path = write_saved(tmp_path, [pa.table({"a": [1]}), pa.table({"b": ["x"]})])
    assert error_of(path).startswith(f"dataset {path}: its data files do not share one schema (")


# --- require_columns ------------------------------------------------------------------------


def test_require_columns(dataset: Dataset) -> None:
    require_columns(dataset, {"env.arith.prompt": "question", "env.arith.answer": "id"})
    require_columns(dataset, {})
    with pytest.raises(DatasetError) as caught:
        require_columns(dataset, {"env.arith.prompt": "question", "env.arith.answer": "answer"})
    assert str(caught.value) == (
        f"env.arith.answer = 'answer': dataset {dataset.path} has no such column"
        " (its columns: id, question, messages, score, hard, note)"
    )


# --- DataOrder ------------------------------------------------------------------------------


def epoch_rows(order: DataOrder, epoch: int) -> list[int]:
    positions = range(epoch * order.length, (epoch + 1) * order.length)
    drawn = [order.row_at(position) for position in positions]
    assert {found for found, _ in drawn} == {epoch}
    return [row for _, row in drawn]


def test_each_epoch_is_a_permutation_and_epochs_differ() -> None:
    order = DataOrder(length=100, seed=3, key="arith")
    epochs = [epoch_rows(order, epoch) for epoch in range(4)]
    for rows in epochs:
        assert sorted(rows) == list(range(100))
    assert len({tuple(rows) for rows in epochs}) == 4
    assert epochs[0] != list(range(100))


def test_the_order_depends_on_seed_and_key_and_nothing_else() -> None:
    first = epoch_rows(DataOrder(length=50, seed=1, key="arith"), 0)
    assert epoch_rows(DataOrder(length=50, seed=1, key="arith"), 0) == first
    assert epoch_rows(DataOrder(length=50, seed=2, key="arith"), 0) != first
    assert epoch_rows(DataOrder(length=50, seed=1, key="gsm8k"), 0) != first
    assert epoch_rows(DataOrder(length=50, seed=-1, key="arith"), 0) != first


def test_a_fresh_order_continues_where_a_run_stopped() -> None:
    # The resume property: a new object, told only the position, draws what the old one
    # would have drawn next, including across epoch boundaries and back.
    running = DataOrder(length=7, seed=11, key="arith")
    drawn = [running.row_at(position) for position in range(40)]
    for stop in (0, 6, 7, 13, 29):
        resumed = DataOrder(length=7, seed=11, key="arith")
        assert [resumed.row_at(position) for position in range(stop, 40)] == drawn[stop:]
    assert running.row_at(3) == drawn[3]
    assert running.row_at(10**12) == DataOrder(7, 11, "arith").row_at(10**12)


def test_order_of_one_row_and_bad_arguments() -> None:
    assert [DataOrder(1, 0, "x").row_at(position) for position in range(3)] == [
        (0, 0),
        (1, 0),
        (2, 0),
    ]
    with pytest.raises(ValueError, match=r"length must be at least 1, got 0"):
        DataOrder(0, 0, "x")
    with pytest.raises(ValueError, match=r"position must not be negative, got -1"):
        DataOrder(3, 0, "x").row_at(-1)


# --- A million rows -------------------------------------------------------------------------

MILLION = 1_000_000
# The offset index alone is 8 MB; the rest of a million-row dataset must not show up here.
PYTHON_BUDGET = 30 * 2**20


def read_randomly_under_tracemalloc(path: Path) -> tuple[int, list[dict[str, Any]], Dataset]:
    chosen = random.Random(5).sample(range(MILLION), 1000)
    gc.collect()
    tracemalloc.start()
    try:
        dataset = open_dataset(path)
        got = dataset.rows(chosen)
        got += [dataset.row(index) for index in chosen[:20]]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    expected = [{"id": index, "q": f"q{index}"} for index in chosen + chosen[:20]]
    assert got == expected
    return peak, got, dataset


@pytest.mark.slow
def test_a_million_row_jsonl_costs_its_offset_index(tmp_path: Path) -> None:
    path = tmp_path / "million.jsonl"
    path.write_text("".join(f'{{"id": {index}, "q": "q{index}"}}\n' for index in range(MILLION)))
    peak, _, dataset = read_randomly_under_tracemalloc(path)
    with dataset:
        assert len(dataset) == MILLION
        print(f"jsonl: {path.stat().st_size / 2**20:.1f} MB file, peak {peak / 2**20:.1f} MB")
        assert peak < PYTHON_BUDGET


@pytest.mark.slow
def test_a_million_row_parquet_decodes_a_row_group_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "million.parquet"
    ids = pa.array(np.arange(MILLION, dtype=np.int64))
    questions = pc.binary_join_element_wise("q", ids.cast(pa.string()), "")
    pq.write_table(pa.table({"id": ids, "q": questions}), path, row_group_size=100_000)
    arrow_before = pa.total_allocated_bytes()
    peak, _, dataset = read_randomly_under_tracemalloc(path)
    with dataset:
        assert len(dataset) == MILLION
        # Arrow's own memory (not traced): the two row groups kept, not the ten. Evicted
        # ones can wait in pyarrow's reference cycles for the collector.
        gc.collect()
        kept = pa.total_allocated_bytes() - arrow_before
        print(f"parquet: python peak {peak / 2**20:.1f} MB, arrow kept {kept / 2**20:.1f} MB")
        assert peak < PYTHON_BUDGET
        whole = pq.read_metadata(path).row_group(0).total_byte_size * 10
        assert kept < whole / 3

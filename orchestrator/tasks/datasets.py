"""The user's datasets, of any size, read row by row, and the order rows are drawn in.

`open_dataset` takes one of three forms, decided by what the path is, and never loads a
file whole:

- **a `.jsonl` file**, one JSON object a line (blank lines skipped). One pass over a memory
  map indexes where the rows start (an int64 array: 8 MB for a million rows); a row is then
  read with one positional read (`os.pread`) and parsed. A line that does not begin with
  `{` is reported when the file is opened; a line that begins with `{` but is not valid
  JSON is reported when it is read. JSON lines have no schema: `columns` are the first
  row's keys, and a row that lacks one of them gets None there (as a parquet column would
  hold null).
- **a `.parquet` file**, read one row group at a time, when a row in it is asked for; the
  last two decoded row groups are kept. Rows drawn in a shuffled order land in a
  different row group almost every time, so read them in batches with `rows`, which
  decodes each row group once for the whole batch.
- **a folder written by Hugging Face `datasets`' `Dataset.save_to_disk`**, whose Arrow
  files are memory-mapped: their record batches point into the maps (zero-copy), so the
  rows cost address space, not memory.

The `save_to_disk` layout, as confirmed in huggingface/datasets (commit b7cb10b,
`src/datasets/arrow_dataset.py` `Dataset.save_to_disk` / `Dataset.load_from_disk`,
`arrow_writer.py` `ArrowWriter`, `table.py`, `config.py`): the folder holds `state.json`
(`config.DATASET_STATE_JSON_FILENAME`), a JSON object whose `"_data_files"` is a list of
`{"filename": "data-00000-of-00002.arrow"}` (`data-{shard:05d}-of-{num_shards:05d}.arrow`,
relative to the folder, in row order), besides `_fingerprint`, `_split` and the `_format_*`
keys; and `dataset_info.json` (`config.DATASET_INFO_FILENAME`: features, sizes; not needed
here). Each data file is an Arrow IPC *stream* (`ArrowWriter` writes with
`pa.RecordBatchStreamWriter`, the features in the schema's `huggingface` metadata);
`load_from_disk` memory-maps each (`pa.ipc.open_stream(pa.memory_map(filename))`) and
concatenates the tables in the order `_data_files` lists them, as done here. The
`_format_*` keys (a view's output format and column selection) are not applied: every
column is read. A `DatasetDict` folder (`dataset_dict.json`, a sub-folder per split) is
refused with a pointer to its splits.

**Threads.** Every read blocks (disk, decoding): call `row` and `rows` from a worker thread
(`trio.to_thread.run_sync`), never on the event loop. A `Dataset` may be shared by several
threads at once: JSON lines are read with positional reads, parquet decoding holds a lock,
and Arrow tables are immutable. `close` must wait until no read is in flight.

`DataOrder` is the pure part: which row the n-th draw takes, epoch after epoch.
"""

from __future__ import annotations

import abc
import hashlib
import json
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Self

import attrs
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from orchestrator.errors import UserError

__all__ = ["DataOrder", "Dataset", "DatasetError", "open_dataset", "require_columns"]

Row = dict[str, Any]
_Offsets = npt.NDArray[np.int64]

# `datasets`' file names (its config.py).
_STATE_JSON = "state.json"
_DATASET_DICT_JSON = "dataset_dict.json"
# The JSON-lines index scans the map this many bytes at a time, so beside the offsets its one
# temporary is a 4 MB byte mask, whatever the size of the file.
_SCAN_CHUNK = 1 << 22
_JSON_WHITESPACE = b" \t\r\n"
_UTF8_BOM = b"\xef\xbb\xbf"
_OPEN_BRACE = ord("{")
_NEWLINE = ord("\n")
# What pyarrow raises for a file it cannot read: its ArrowInvalid is a ValueError, not OSError.
_READ_ERRORS = (OSError, pa.ArrowException)
# Decoded parquet row groups kept: two, so reads that alternate between neighbours stay cheap.
_ROW_GROUPS_KEPT = 2


class DatasetError(UserError):
    """A dataset cannot be used as configured (one line that names the path)."""


class Dataset(abc.ABC):
    """Rows of a user's dataset, read on demand: `len(dataset)`, `columns`, `row(i)`.

    Rows are dicts of plain Python values (str, int, float, bool, None, lists, dicts; other
    Arrow types as pyarrow's `to_pylist` gives them, e.g. datetime or bytes). Reads block:
    call them from a worker thread. Use it as a context manager, or call `close`, to
    release its file handles and memory maps.
    """

    #: The form it was read from: "jsonl", "parquet" or "save_to_disk".
    form: str

    def __init__(self, path: Path, length: int, columns: tuple[str, ...]) -> None:
        self._path = path
        self._length = length
        self._columns = columns
        self._closed = False

    @property
    def path(self) -> Path:
        return self._path

    @property
    def columns(self) -> tuple[str, ...]:
        return self._columns

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        return f"<{self.form} dataset {self._path}: {self._length} rows>"

    def row(self, index: int) -> Row:
        """Row `index` (0 <= index < len). Blocks. Raises IndexError outside the range,
        ValueError once closed, and DatasetError when the row cannot be read (a bad JSON
        line, a damaged file)."""
        self._check_open()
        if not 0 <= index < self._length:
            raise IndexError(f"row {index} of a dataset of {self._length} rows")
        return self._row(int(index))

    def rows(self, indices: Iterable[int]) -> list[Row]:
        """The rows at `indices`, in that order (repeats allowed): like `[row(i) for i in
        indices]`, but a parquet row group is decoded once for all the rows it holds. Blocks;
        raises as `row` does."""
        self._check_open()
        wanted = np.fromiter(indices, dtype=np.int64)
        outside = wanted[(wanted < 0) | (wanted >= self._length)]
        if outside.size:
            raise IndexError(f"row {int(outside[0])} of a dataset of {self._length} rows")
        return self._rows(wanted)

    def close(self) -> None:
        """Release the file handles and maps; reads after it raise ValueError. Idempotent."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"dataset {self._path} is closed")

    @abc.abstractmethod
    def _row(self, index: int) -> Row: ...

    @abc.abstractmethod
    def _rows(self, indices: npt.NDArray[np.int64]) -> list[Row]: ...

    @abc.abstractmethod
    def _close(self) -> None: ...


def open_dataset(path: Path) -> Dataset:
    """Open the dataset at `path`: a `.jsonl` file, a `.parquet` file, or a folder written
    by `datasets`' `save_to_disk`. Blocks (it indexes or maps the files). Raises
    DatasetError for a missing or unreadable path, another kind of file, a JSON line that is
    not an object, a folder without `state.json` or with a missing data file, and an empty
    dataset."""
    if not path.exists():
        raise DatasetError(f"dataset {path}: no such file or folder")
    if path.is_dir():
        return _open_saved_folder(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _JsonLinesDataset.open(path)
    if suffix == ".parquet":
        return _ParquetDataset.open(path)
    raise DatasetError(
        f"dataset {path}: not a .jsonl file, a .parquet file, or a folder written by"
        " datasets' save_to_disk"
    )


def require_columns(dataset: Dataset, names: Mapping[str, str]) -> None:
    """Check that each configured column exists. `names` maps a config key to the column it
    names, e.g. `{"env.arith.prompt": "question"}`. Raises DatasetError naming the first
    missing column, its key and the columns the dataset has."""
    for key, column in names.items():
        if column not in dataset.columns:
            have = ", ".join(dataset.columns)
            raise DatasetError(
                f"{key} = {column!r}: dataset {dataset.path} has no such column"
                f" (its columns: {have})"
            )


# --- JSON lines -----------------------------------------------------------------------------


class _JsonLinesDataset(Dataset):
    """A `.jsonl` file: the byte offset where each row starts, and one more at the end."""

    form = "jsonl"

    def __init__(self, path: Path, fd: int, starts: _Offsets, columns: tuple[str, ...]) -> None:
        super().__init__(path, len(starts) - 1, columns)
        self._fd = fd
        self._starts = starts

    @classmethod
    def open(cls, path: Path) -> _JsonLinesDataset:
        fd = _open_file(path)
        try:
            starts = _index_json_lines(path, fd)
            first = _parse_json_line(path, fd, starts, 0)
            dataset = cls(path, fd, starts, tuple(first))
        except BaseException:
            os.close(fd)
            raise
        return dataset

    def _row(self, index: int) -> Row:
        row = _parse_json_line(self._path, self._fd, self._starts, index)
        for name in self._columns:
            row.setdefault(name, None)
        return row

    def _rows(self, indices: npt.NDArray[np.int64]) -> list[Row]:
        return [self._row(index) for index in indices.tolist()]

    def _close(self) -> None:
        os.close(self._fd)


def _open_file(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise DatasetError(f"dataset {path}: cannot read: {_reason(exc)}") from None


def _index_json_lines(path: Path, fd: int) -> _Offsets:
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise DatasetError(f"dataset {path}: empty (no rows)")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
            begin = len(_UTF8_BOM) if mapped[: len(_UTF8_BOM)] == _UTF8_BOM else 0
            data = np.frombuffer(mapped, dtype=np.uint8)
            # `data` borrows the map, which cannot close while it lives; the scan returns
            # only copies, and reports a bad line instead of raising (a traceback would
            # keep its frame's views alive).
            starts, bad_line = _scan_json_lines(data, begin)
            del data
    except OSError as exc:
        raise DatasetError(f"dataset {path}: cannot read: {_reason(exc)}") from None
    if bad_line is not None:
        raise DatasetError(f"dataset {path}: line {bad_line} is not a JSON object")
    if len(starts) < 2:
        raise DatasetError(f"dataset {path}: empty (no rows, only blank lines)")
    return starts


def _scan_json_lines(data: npt.NDArray[np.uint8], begin: int) -> tuple[_Offsets, int | None]:
    """Where the rows of JSON-lines bytes start, and the end of the data last; blank lines
    are left out (they become trailing whitespace of the row before). Also the number of the
    first line that is neither blank nor begins with `{`, or None."""
    size = len(data)
    parts = [np.array([begin], dtype=np.int64)]
    for at in range(begin, size, _SCAN_CHUNK):
        after_newline = np.flatnonzero(data[at : at + _SCAN_CHUNK] == _NEWLINE).astype(np.int64)
        after_newline += at + 1
        parts.append(after_newline)
    if parts[-1].size == 0 or parts[-1][-1] != size:
        parts.append(np.array([size], dtype=np.int64))
    # Line i spans bounds[i]:bounds[i + 1]; the last bound is the end of the data.
    bounds = np.concatenate(parts)
    del parts
    first_bytes = data[bounds[:-1]]
    odd = np.flatnonzero(first_bytes != _OPEN_BRACE)
    # The common blank line: nothing before its newline.
    empty = odd[first_bytes[odd] == _NEWLINE]
    blank = [empty]
    others: list[int] = []
    for line in odd[first_bytes[odd] != _NEWLINE].tolist():
        text = data[bounds[line] : bounds[line + 1]].tobytes().strip(_JSON_WHITESPACE)
        if not text:
            others.append(line)
        elif text[0] != _OPEN_BRACE:
            return bounds[:1], line + 1
    blank.append(np.array(others, dtype=np.int64))
    dropped = np.concatenate(blank)
    if dropped.size:
        bounds = np.delete(bounds, dropped)
    return bounds, None


def _parse_json_line(path: Path, fd: int, starts: _Offsets, index: int) -> Row:
    start, end = int(starts[index]), int(starts[index + 1])
    try:
        raw = os.pread(fd, end - start, start)
    except OSError as exc:
        raise DatasetError(f"dataset {path}: cannot read: {_reason(exc)}") from None
    try:
        value = json.loads(raw)
    except ValueError as exc:
        line = _line_number(fd, start)
        raise DatasetError(f"dataset {path}: line {line} is not a JSON object ({exc})") from None
    if not isinstance(value, dict):
        line = _line_number(fd, start)
        raise DatasetError(f"dataset {path}: line {line} is not a JSON object")
    return value


def _line_number(fd: int, offset: int) -> int:
    """The 1-based number of the line that starts at byte `offset` (counts the newlines
    before it: only for error messages)."""
    newlines = 0
    for at in range(0, offset, _SCAN_CHUNK):
        newlines += os.pread(fd, min(_SCAN_CHUNK, offset - at), at).count(b"\n")
    return newlines + 1


# --- Parquet --------------------------------------------------------------------------------


class _ParquetDataset(Dataset):
    """A `.parquet` file, decoded a row group at a time; the last two are kept."""

    form = "parquet"

    def __init__(self, path: Path, file: Any, group_starts: _Offsets) -> None:
        columns = tuple(str(name) for name in file.schema_arrow.names)
        super().__init__(path, int(group_starts[-1]), columns)
        self._file = file
        self._group_starts = group_starts
        self._decoded: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: Path) -> _ParquetDataset:
        try:
            file = pq.ParquetFile(path, memory_map=True)
        except _READ_ERRORS as exc:
            raise DatasetError(f"dataset {path}: cannot read as parquet: {_reason(exc)}") from None
        metadata = file.metadata
        sizes = [metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)]
        group_starts = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=group_starts[1:])
        if group_starts[-1] == 0:
            file.close()
            raise DatasetError(f"dataset {path}: empty (no rows)")
        return cls(path, file, group_starts)

    def _row(self, index: int) -> Row:
        group = _group_of(self._group_starts, index)
        table = self._row_group(group)
        rows: list[Row] = table.slice(index - int(self._group_starts[group]), 1).to_pylist()
        return rows[0]

    def _rows(self, indices: npt.NDArray[np.int64]) -> list[Row]:
        found: list[Row] = [{}] * len(indices)
        # Row groups already decoded first, so none is evicted and decoded again.
        for group, where, local in sorted(
            _by_group(self._group_starts, indices), key=lambda part: part[0] not in self._decoded
        ):
            rows: list[Row] = self._row_group(group).take(pa.array(local)).to_pylist()
            for position, row in zip(where.tolist(), rows, strict=True):
                found[position] = row
        return found

    def _row_group(self, group: int) -> Any:
        with self._lock:
            self._check_open()
            table = self._decoded.get(group)
            if table is not None:
                self._decoded.move_to_end(group)
                return table
            try:
                table = self._file.read_row_group(group)
            except _READ_ERRORS as exc:
                raise DatasetError(
                    f"dataset {self._path}: cannot read row group {group}: {_reason(exc)}"
                ) from None
            self._decoded[group] = table
            while len(self._decoded) > _ROW_GROUPS_KEPT:
                self._decoded.popitem(last=False)
            return table

    def _close(self) -> None:
        with self._lock:
            self._decoded.clear()
            self._file.close()


# --- save_to_disk folders -------------------------------------------------------------------


class _ArrowDataset(Dataset):
    """Arrow record batches over memory maps, in row order."""

    form = "save_to_disk"

    def __init__(self, path: Path, maps: list[Any], table: Any) -> None:
        columns = tuple(str(name) for name in table.schema.names)
        self._batches: list[Any] = [batch for batch in table.to_batches() if batch.num_rows]
        starts = np.zeros(len(self._batches) + 1, dtype=np.int64)
        np.cumsum([batch.num_rows for batch in self._batches], out=starts[1:])
        super().__init__(path, int(starts[-1]), columns)
        self._batch_starts = starts
        self._maps = maps

    def _row(self, index: int) -> Row:
        batch = _group_of(self._batch_starts, index)
        local = index - int(self._batch_starts[batch])
        rows: list[Row] = self._batches[batch].slice(local, 1).to_pylist()
        return rows[0]

    def _rows(self, indices: npt.NDArray[np.int64]) -> list[Row]:
        found: list[Row] = [{}] * len(indices)
        for batch, where, local in _by_group(self._batch_starts, indices):
            rows: list[Row] = self._batches[batch].take(pa.array(local)).to_pylist()
            for position, row in zip(where.tolist(), rows, strict=True):
                found[position] = row
        return found

    def _close(self) -> None:
        # The batches point into the maps: let them go before the maps close.
        self._batches = []
        for mapped in self._maps:
            mapped.close()


def _open_saved_folder(path: Path) -> Dataset:
    state_path = path / _STATE_JSON
    if not state_path.is_file():
        if (path / _DATASET_DICT_JSON).is_file():
            raise DatasetError(
                f"dataset {path}: a DatasetDict folder (dataset_dict.json); name one split's"
                " folder inside it, e.g. its train folder"
            )
        raise DatasetError(
            f"dataset {path}: a folder without {_STATE_JSON}, so not one written by"
            " datasets' save_to_disk"
        )
    filenames = _data_filenames(state_path)
    maps: list[Any] = []
    try:
        tables = [_map_stream(path / name, maps) for name in filenames]
        try:
            table = pa.concat_tables(tables)
        except pa.ArrowInvalid as exc:
            raise DatasetError(
                f"dataset {path}: its data files do not share one schema"
                f" ({str(exc).splitlines()[0]})"
            ) from None
        dataset = _ArrowDataset(path, maps, table)
        if len(dataset) == 0:
            raise DatasetError(f"dataset {path}: empty (no rows)")
    except BaseException:
        for mapped in maps:
            mapped.close()
        raise
    return dataset


def _data_filenames(state_path: Path) -> list[str]:
    """The data files that `state.json` lists, in row order."""
    try:
        state = json.loads(state_path.read_bytes())
    except OSError as exc:
        raise DatasetError(f"dataset {state_path}: cannot read: {_reason(exc)}") from None
    except ValueError as exc:
        raise DatasetError(f"dataset {state_path}: not valid JSON ({exc})") from None
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not all(
        isinstance(entry, dict) and isinstance(entry.get("filename"), str) for entry in files
    ):
        raise DatasetError(
            f'dataset {state_path}: no "_data_files" list of {{"filename": ...}} entries'
        )
    if not files:
        raise DatasetError(f"dataset {state_path.parent}: empty (no data files)")
    return [entry["filename"] for entry in files]


def _map_stream(file_path: Path, maps: list[Any]) -> Any:
    """The Arrow IPC stream at `file_path` as a table over a memory map (appended to
    `maps`, which the caller closes)."""
    if not file_path.is_file():
        raise DatasetError(f"dataset {file_path.parent}: missing data file {file_path.name}")
    try:
        mapped = pa.memory_map(str(file_path))
    except _READ_ERRORS as exc:
        raise DatasetError(f"dataset {file_path}: cannot read: {_reason(exc)}") from None
    maps.append(mapped)
    try:
        return pa.ipc.open_stream(mapped).read_all()
    except _READ_ERRORS as exc:
        raise DatasetError(
            f"dataset {file_path}: cannot read as an Arrow IPC stream: {_reason(exc)}"
        ) from None


def _reason(exc: BaseException) -> str:
    """The first line of what went wrong: an OSError's strerror, or pyarrow's message."""
    if isinstance(exc, OSError) and exc.strerror:
        return str(exc.strerror)
    lines = str(exc).splitlines()
    return lines[0] if lines else type(exc).__name__


# --- Locating rows in groups ----------------------------------------------------------------


def _group_of(starts: _Offsets, index: int) -> int:
    """Which group (row group, record batch) holds row `index`; `starts` are the groups'
    first rows, and the total last."""
    return int(np.searchsorted(starts, index, side="right")) - 1


def _by_group(
    starts: _Offsets, indices: npt.NDArray[np.int64]
) -> Iterator[tuple[int, npt.NDArray[np.intp], npt.NDArray[np.int64]]]:
    """For each group that holds some of `indices`: the group, where those indices are in
    `indices`, and the rows' indices within the group."""
    groups = np.searchsorted(starts, indices, side="right") - 1
    order = np.argsort(groups, kind="stable")
    sorted_groups = groups[order]
    cuts = np.flatnonzero(np.diff(sorted_groups)) + 1
    for where in np.split(order, cuts):
        if where.size:
            group = int(groups[where[0]])
            yield group, where, indices[where] - starts[group]


# --- The draw order -------------------------------------------------------------------------


def _at_least_one(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


@attrs.define(eq=False)
class DataOrder:
    """The order rows are drawn in: epoch after epoch, each a shuffle of `range(length)`.

    Draw `position` (0, 1, 2, ... across epochs) takes `row_at(position)`. Epoch `e` is a
    permutation from a numpy generator seeded by (`seed`, `key`, `e`), so the same position
    always gives the same row: a resumed run that knows how many rows it drew continues
    without replaying or skipping any. `key` (the environment's name) gives two environments
    over the same data different orders. The same order needs the same numpy: its
    generators keep their streams across versions only as a rule, not a promise.

    Only the current epoch's permutation is kept (int32 under 2**31 rows), made on its first
    draw: that one call shuffles `length` integers (about 50 ms a million rows), so make the
    first draw of an epoch from a worker thread for a large dataset. No I/O.
    """

    length: int = attrs.field(validator=_at_least_one)
    seed: int
    key: str
    _epoch: int = attrs.field(default=-1, init=False, repr=False)
    _permutation: npt.NDArray[np.signedinteger[Any]] | None = attrs.field(
        default=None, init=False, repr=False
    )

    def row_at(self, position: int) -> tuple[int, int]:
        """`(epoch, row_index)` of the `position`-th draw. Raises ValueError when negative."""
        if position < 0:
            raise ValueError(f"position must not be negative, got {position}")
        epoch, offset = divmod(position, self.length)
        return epoch, int(self._permutation_of(epoch)[offset])

    def _permutation_of(self, epoch: int) -> npt.NDArray[np.signedinteger[Any]]:
        if self._permutation is not None and self._epoch == epoch:
            return self._permutation
        # numpy's shuffle draws the same swaps whatever the dtype: int32 changes no order.
        permutation: npt.NDArray[np.signedinteger[Any]] = (
            np.arange(self.length, dtype=np.int32)
            if self.length < 2**31
            else np.arange(self.length, dtype=np.int64)
        )
        np.random.default_rng(self._seed_sequence(epoch)).shuffle(permutation)
        self._permutation, self._epoch = permutation, epoch
        return permutation

    def _seed_sequence(self, epoch: int) -> np.random.SeedSequence:
        # A stable digest (not hash(), which is salted per process) of the seed and the key;
        # the seed may be negative, which SeedSequence's entropy cannot be.
        digest = hashlib.blake2b(f"{self.seed}\0{self.key}".encode(), digest_size=16).digest()
        return np.random.SeedSequence([int.from_bytes(digest, "little"), epoch])

"""Lazy reading of dumps: a step file, or a directory of step files, and their index."""
from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Iterator, Mapping, NamedTuple, Optional, Union

import h5py
from h5py import h5d, h5g, h5s
import numpy as np
import pandas as pd

from . import format as fmt
from .decoding import decode, unscaled
from .errors import DumpError
from .validation import (check_dataset, check_index, check_index_type, check_run_attrs, damaged,
                         hard_link, linked_id, plain_attrs)

PathLike = Union[str, os.PathLike]

# Columns a loaded index adds in front of the on-disk ones.
STEP_COLUMNS = ("epoch", "step", "rank")


def open_h5(path: Path) -> h5py.File:
    """Open a step file read-only, turning every failure into a one-line :class:`DumpError`."""
    if fmt.is_temp_file_name(path.name):
        raise DumpError(f"{path}: is still being written (temporary file); wait for the step "
                        f"to finish or pass the published file")
    if not path.exists():
        raise DumpError(f"{path}: no such file or directory")
    if not os.access(path, os.R_OK):
        raise DumpError(f"{path}: permission denied; make the file readable")
    if not h5py.is_hdf5(path):
        raise DumpError(f"{path}: not an HDF5 file")
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as exc:
        raise DumpError(f"{path}: cannot be opened as HDF5 (truncated or damaged?): "
                        f"{str(exc).splitlines()[0]}") from exc


class StepFile:
    """One published step file. Its attributes and index are read, and checked against the
    format (:mod:`compare.validation`), when it is opened."""

    def __init__(self, path: PathLike):
        self.path = Path(path)
        with open_h5(self.path) as f:
            self.attrs = plain_attrs(self.path, f)
            self._check_format()
            check_run_attrs(self.path, self.attrs, self.attrs[fmt.ATTR_FORMAT_VERSION])
            self.epoch, self.step = int(self.attrs["epoch"]), int(self.attrs["step"])
            rank = int(self.attrs["rank"])
            self.rank: Optional[int] = None if rank < 0 else rank
            self.group_name = fmt.step_group_name(self.epoch, self.step)
            group = hard_link(self.path, f, self.group_name, "step group", h5py.Group)
            index = hard_link(self.path, group, fmt.INDEX_DATASET, "index table", h5py.Dataset)
            check_index_type(self.path, index.dtype)
            try:
                table = index[()]
            except (OSError, RuntimeError, TypeError, ValueError) as exc:
                raise damaged(self.path, f"the index table cannot be read ({exc})") from exc
            check_index(self.path, table, self.attrs[fmt.ATTR_FORMAT_VERSION],
                        self.attrs.get(fmt.ATTR_INDEX_CRC))
        self.index = _index_frame(self.path, table)

    def _check_format(self) -> None:
        name = self.attrs.get(fmt.ATTR_FORMAT_NAME)
        if not isinstance(name, str) or name != fmt.FORMAT_NAME:
            raise DumpError(f"{self.path}: HDF5 file is not an h5cmp dump (no "
                            f"{fmt.ATTR_FORMAT_NAME}={fmt.FORMAT_NAME!r} attribute)")
        version = self.attrs.get(fmt.ATTR_FORMAT_VERSION)
        if not isinstance(version, int) or version not in fmt.SUPPORTED_VERSIONS:
            advice = ("dump this step again" if isinstance(version, int)
                      and 0 < version < fmt.FORMAT_VERSION else "upgrade h5cmp")
            raise DumpError(f"{self.path}: dump format version {version!r} is not supported by "
                            f"this h5cmp (reads {sorted(fmt.SUPPORTED_VERSIONS)}); {advice}")

    @property
    def incomplete(self) -> str:
        """Why the dumper marked this step incomplete ("" for a complete step): it ended while
        an exception propagated, so records after the failure are missing."""
        return str(self.attrs.get(fmt.ATTR_INCOMPLETE, ""))

    @property
    def injected_from(self) -> str:
        """"" or, for a localizing re-run, the reference whose values it ran on and the kinds
        injected (``dumper.injection``; since format version 6)."""
        return str(self.attrs.get(fmt.ATTR_INJECTED_FROM, ""))

    @property
    def label(self) -> str:
        """``epoch:step`` (and the rank), as reports name steps."""
        return fmt.step_label(self.epoch, self.step, self.rank)

    def open(self) -> "StepReader":
        """Open the file for reading tensors: ``with step.open() as r: r.read(row)``."""
        return self.location.open()

    @property
    def location(self) -> "StepLocation":
        """Where its tensors are, without its index (to read them in another process)."""
        return StepLocation(self.path, self.group_name)

    def __repr__(self) -> str:
        return f"StepFile({str(self.path)!r}, epoch={self.epoch}, step={self.step})"


class StepLocation(NamedTuple):
    """Where a step file's tensors are (:attr:`StepFile.location`): all a reader needs, a
    few bytes to send to another process."""

    path: Path
    group_name: str

    def open(self) -> "StepReader":
        """Open the file for reading tensors, as :meth:`StepFile.open`."""
        return StepReader(self, open_h5(self.path))


class StepReader:
    """An open step file; reads tensors named by index rows (each checked against its row)."""

    def __init__(self, step: Union[StepFile, StepLocation], h5: h5py.File):
        self.step, self._h5 = step, h5
        self._group = hard_link(step.path, h5, step.group_name, "step group", h5py.Group)

    def dataset(self, row) -> h5py.Dataset:
        """The dataset of index row ``row`` (a namedtuple from ``itertuples``, a Series or a
        dict)."""
        fields = [row[k] if isinstance(row, (pd.Series, dict)) else getattr(row, k)
                  for k in ("group", "dataset", "dtype", "encoding", "shape")]
        return dataset_of(self.step.path, self._group, *fields)

    def read(self, row) -> np.ndarray:
        """Decoded values of the tensor of index row ``row`` (whole), without the loss scale
        they carry."""
        dtype, encoding, grad_scale = (
            (row["dtype"], row["encoding"], row["grad_scale"]) if isinstance(row, pd.Series)
            else (row.dtype, row.encoding, row.grad_scale))
        return unscaled(decode(self.read_raw(row), dtype, encoding), grad_scale)

    def read_raw(self, row) -> np.ndarray:
        """The stored array as it is on disk (bits for types numpy lacks), checked against its
        checksum."""
        checksum = row["checksum"] if isinstance(row, pd.Series) else row.checksum
        ds = self.dataset(row)
        array = _read_whole(ds, ds.id.shape)
        check_checksum(ds, checksum, fmt.data_checksum(array))
        return array

    def close(self) -> None:
        self._h5.close()

    def __enter__(self) -> "StepReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StepReaders:
    """Step files opened once each, by key (e.g. ``(epoch, step, rank)``), and closed together
    (a context manager)."""

    def __init__(self, files: dict):
        self._files, self._open = files, {}

    def __getitem__(self, key) -> StepReader:
        if key not in self._open:
            self._open[key] = self._files[key].open()
        return self._open[key]

    def __enter__(self) -> "StepReaders":
        return self

    def __exit__(self, *exc) -> None:
        for reader in self._open.values():
            reader.close()


def one_side(row: Mapping, side: str) -> dict:
    """The index fields of side ``side`` ("a" or "b") of a row of paired records, named as in
    an index row (for :meth:`StepReader.dataset`)."""
    return {k: row[f"{k}_{side}"] for k in ("group", "dataset", "dtype", "encoding", "shape")}


@contextlib.contextmanager
def reading(where: str) -> Iterator[None]:
    """What h5py raises reading a damaged file (``KeyError``, ``OSError``, ``RuntimeError``)
    as one :class:`DumpError` naming ``where`` (the file, or the files, being read)."""
    try:
        yield
    except (KeyError, OSError, RuntimeError) as exc:
        raise DumpError(f"{where}: cannot read a tensor ({exc}); the file is damaged") from exc


def dataset_of(path: Path, step_group: h5py.Group, group: str, name: str, dtype: str,
               encoding: str, shape: tuple) -> h5py.Dataset:
    """Dataset ``group/name`` of a step group, after checking it is what its index row says."""
    return h5py.Dataset(dataset_id_of(path, step_group.id, group, name, dtype, encoding, shape))


def dataset_id_of(path: Path, step_group: h5g.GroupID, group: str, name: str, dtype: str,
                  encoding: str, shape: tuple) -> h5d.DatasetID:
    """:func:`dataset_of` in h5py's low-level objects (a third cheaper per small tensor)."""
    call_group = linked_id(path, step_group, group, "call group", h5g.GroupID)
    ds = linked_id(path, call_group, name, f"in call group {group!r}, dataset", h5d.DatasetID)
    check_dataset(path, ds, group, name, dtype, encoding, shape)
    return ds


def read_chunks(ds: h5py.Dataset, dtype: str, encoding: str, max_elements: int,
                checksum: int = fmt.NO_CHECKSUM, grad_scale: float = fmt.NO_GRAD_SCALE
                ) -> Iterator[np.ndarray]:
    """Decoded values of ``ds`` as flat C-order pieces of whole leading-axis slices, each of at
    most ``max_elements`` elements (or one slice, if a slice is larger), without the loss scale
    ``grad_scale`` they carry (:func:`compare.decoding.unscaled`). Two datasets of the same
    shape give aligned pieces. Once the last piece is read, the stored bytes are checked
    against ``checksum`` (its index row's) unless it is ``fmt.NO_CHECKSUM``."""
    shape = ds.id.shape
    size = math.prod(shape)
    if not shape or size <= max_elements:
        pieces: Iterator[np.ndarray] = iter([_read_whole(ds, shape)])
    else:
        step = max(1, max_elements // max(1, size // shape[0]))
        pieces = (ds[start:start + step] for start in range(0, shape[0], step))
    computed = fmt.DataChecksum()
    for piece in pieces:
        if checksum != fmt.NO_CHECKSUM:
            computed.update(piece)
        yield unscaled(decode(piece, dtype, encoding), grad_scale).reshape(-1)
    check_checksum(ds, checksum, computed.value)


def _read_whole(ds: h5py.Dataset, shape: tuple) -> np.ndarray:
    """All of ``ds`` (checked by ``check_dataset``: a plain numeric type), through h5py's
    low-level read: its slicing machinery costs as much as the copy for small tensors."""
    array = np.empty(shape, ds.id.dtype)
    if array.size:
        ds.id.read(h5s.ALL, h5s.ALL, array)
    return array


def check_checksum(ds: Union[h5py.Dataset, h5d.DatasetID], checksum: int,
                   computed: int) -> None:
    """Refuse a dataset whose bytes are not those the dumper wrote (``checksum`` from its
    index row; ``fmt.NO_CHECKSUM``: a file older than version 4, nothing to check)."""
    if checksum != fmt.NO_CHECKSUM and computed != checksum:
        ds = ds if isinstance(ds, h5py.Dataset) else h5py.Dataset(ds)
        raise damaged(Path(ds.file.filename), f"dataset {ds.name.lstrip('/')} does not match "
                                              f"its checksum: its bytes were changed")


class Dump:
    """A dump: step files from one file or a directory, with a combined index DataFrame.

    Index columns: ``epoch, step, rank`` then the on-disk columns of ``compare.format``, with
    ``shape`` parsed to a tuple. Rows are in execution order (step, then ``seq``).
    """

    def __init__(self, path: PathLike, steps: list[StepFile]):
        if not steps:
            raise DumpError(f"{path}: no step files")
        self.path = Path(path)
        self.steps = sorted(steps, key=lambda s: (s.epoch, s.step, s.rank or 0))
        frames = [s.index.assign(epoch=s.epoch, step=s.step, rank=s.rank) for s in self.steps]
        index = pd.concat(frames, ignore_index=True)
        self.index = index[list(STEP_COLUMNS) + list(fmt.INDEX_COLUMN_NAMES)]

    def __repr__(self) -> str:
        return f"Dump({str(self.path)!r}, {len(self.steps)} steps, {len(self.index)} records)"


def load_dump(path: Union[PathLike, Dump]) -> Dump:
    """Open a dump file or a directory of step files, lazily (no tensor is read).

    Raises :class:`DumpError` with a one-line message for anything that is not a readable dump.
    """
    if isinstance(path, Dump):
        return path
    p = Path(path)
    try:
        if not p.is_dir():
            return Dump(p, [StepFile(p)])
        names = sorted(n for n in os.listdir(p) if fmt.parse_step_file_name(n))
    except PermissionError as exc:
        raise DumpError(f"{p}: permission denied; make the directory readable") from exc
    if not names:
        raise DumpError(f"{p}: directory holds no dump step files (*-epoch_*-step_dump.hdf5)")
    return Dump(p, _one_file_per_step(p, [StepFile(p / n) for n in names]))


def _one_file_per_step(directory: Path, steps: list[StepFile]) -> list[StepFile]:
    """Refuse a directory where two files hold one step (``0-epoch_1…`` and ``00-epoch_1…``),
    or a step both with and without a rank: pairing would have to guess."""
    seen: dict[tuple, StepFile] = {}
    for step in steps:
        for key in ((step.epoch, step.step, step.rank), (step.epoch, step.step, "any")):
            other = seen.get(key)
            if other is not None and (key[2] != "any" or (other.rank is None) != (step.rank is None)):
                raise DumpError(f"{directory}: {other.path.name} and {step.path.name} both hold "
                                f"step {step.epoch}:{step.step}; keep one of them")
            seen[key] = step
    return steps


def _strings(path: Path, name: str, column: np.ndarray) -> list[str]:
    """A string column as ``str``: fixed-length UTF-8 (what the dumper writes) or
    variable-length (also valid, see docs/format.md)."""
    try:
        if column.dtype.kind == "S":
            return np.char.decode(column, "utf-8").tolist()
        return [v.decode() if isinstance(v, bytes) else str(v) for v in column]
    except UnicodeDecodeError as exc:
        raise damaged(path, f"index column {name!r} holds text that is not UTF-8") from exc


def _absent(name: str, rows: int) -> np.ndarray:
    """A column an older format version lacks (see ``fmt.COLUMN_SINCE``)."""
    if dict(fmt.INDEX_COLUMNS)[name] == "str":  # not sharded, no addends
        return np.full(rows, "", dtype=object)
    fill = {"checksum": fmt.NO_CHECKSUM, "micro_batch": fmt.NO_MICRO_BATCH, "injected": 0,
            "digest": fmt.NO_DIGEST, "grad_scale": fmt.NO_GRAD_SCALE}.get(name, np.nan)
    return np.full(rows, fill)


def _index_frame(path: Path, table: np.ndarray) -> pd.DataFrame:
    names = fmt.INDEX_COLUMN_NAMES
    if len(table) == 0:  # a step in which no module ran
        return pd.DataFrame({n: pd.Series(dtype=object if k == "str" else k)
                             for n, k in fmt.INDEX_COLUMNS})
    present = set(table.dtype.names)
    cols = {name: _absent(name, len(table)) if name not in present else
            _strings(path, name, table[name]) if kind == "str" else table[name]
            for name, kind in fmt.INDEX_COLUMNS}
    frame = pd.DataFrame(cols, columns=list(names))
    for name in ("shape", "mesh_shape", "global_shape", "offsets"):
        frame[name] = frame[name].map(fmt.parse_shape)
    frame["requires_grad"] = frame["requires_grad"].astype(bool)
    return frame

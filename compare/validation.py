"""What a reader checks before it trusts a step file: its attributes, its index table row by
row against the format, and each dataset against its index row before reading it. Links are
never followed (the dumper writes none). Every failure is a one-line :class:`DumpError` that
names the file and the problem; the checks cost per row, not per element.
"""
from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Union

import h5py
import numpy as np
from h5py import h5d, h5g, h5l, h5o

from . import format as fmt
from .decoding import BITS_DTYPES, STORED_BITS
from .errors import DumpError

RAW_DTYPES = frozenset({"float16", "float32", "float64", "complex64", "complex128", "int8",
                        "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"})
STATUSES = frozenset({fmt.ST_OK, fmt.ST_DROPPED, fmt.ST_UNSUPPORTED})
_NUMERIC = {"int64", "int32", "int8", "float64"}


def damaged(path: Path, problem: str) -> DumpError:
    return DumpError(f"{path}: damaged dump: {problem}; dump this step again")


def plain_attrs(path: Path, f: h5py.File) -> dict:
    """The root attributes of ``f`` as Python values; text that is not UTF-8 is damage."""
    out = {}
    try:
        attrs = f.attrs
        names = list(attrs)
    except (OSError, RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise damaged(path, f"the root attributes cannot be listed ({exc})") from exc
    for name in names:
        try:
            value = attrs[name]
        except (OSError, TypeError, ValueError) as exc:
            raise damaged(path, f"root attribute {name!r} cannot be read ({exc})") from exc
        if isinstance(value, bytes):
            try:
                value = value.decode()
            except UnicodeDecodeError as exc:
                raise damaged(path, f"root attribute {name!r} is not UTF-8 text") from exc
        elif isinstance(value, np.generic):
            value = value.item()
        out[name] = value
    return out


def check_run_attrs(path: Path, attrs: dict, version: int) -> None:
    """Every root attribute a reader relies on has its type (``fmt.ATTR_TYPES``); those a
    ``version`` file must hold (``fmt.REQUIRED_ATTRS_SINCE``) are present."""
    for name, since in fmt.REQUIRED_ATTRS_SINCE.items():
        if since <= version and name not in attrs:
            raise damaged(path, f"root attribute {name!r} is missing")
    for name, kind in fmt.ATTR_TYPES.items():
        if name in attrs and not _is_a(attrs[name], kind):
            raise damaged(path, f"root attribute {name!r} is {attrs[name]!r}, not "
                                f"{_TYPE_WORDS[kind]}")
    for name in ("epoch", "step"):
        if attrs[name] < 0:
            raise damaged(path, f"root attribute {name!r} is negative ({attrs[name]})")


_TYPE_WORDS = {int: "an integer", bool: "a boolean", str: "text"}


def _is_a(value: object, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is bool:
        return isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))
    return isinstance(value, kind)


_LINK_KINDS = {h5l.TYPE_SOFT: "SoftLink", h5l.TYPE_EXTERNAL: "ExternalLink"}
_OBJECT_IDS = {h5py.Group: h5g.GroupID, h5py.Dataset: h5d.DatasetID}
_ID_KINDS = {ids: kind.__name__.lower() for kind, ids in _OBJECT_IDS.items()}


def hard_link(path: Path, group: h5py.Group, name: str, what: str, expected: type):
    """``group[name]``, an ``expected`` (``h5py.Group`` or ``h5py.Dataset``), refusing soft
    and external links (see :func:`linked_id`)."""
    return expected(linked_id(path, group.id, name, what, _OBJECT_IDS[expected]))


def linked_id(path: Path, group: h5g.GroupID, name: str, what: str,
              expected: type) -> Union[h5g.GroupID, h5d.DatasetID]:
    """The object linked as ``name`` in ``group``, an ``expected`` (``h5g.GroupID`` or
    ``h5d.DatasetID``), refusing soft and external links (loops, FIFOs, other files). ``what``
    names it in messages. (Through h5py's low-level calls: the high-level ones cost twice as
    much per tensor.)"""
    key = fmt.name_bytes(name)
    try:
        info = group.links.get_info(key)
    except (OSError, RuntimeError, KeyError, TypeError, ValueError) as exc:
        if not _exists(group, key):
            raise damaged(path, f"{what} {name!r} is missing") from exc
        raise damaged(path, f"{what} {name!r} cannot be read ({exc})") from exc
    if info.type != h5l.TYPE_HARD:
        kind = _LINK_KINDS.get(info.type, "user-defined link")
        raise damaged(path, f"{what} {name!r} is a {kind}, which an h5cmp dump never holds "
                            f"(not followed)")
    try:
        obj = h5o.open(group, key)
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        raise damaged(path, f"{what} {name!r} cannot be opened ({exc})") from exc
    if not isinstance(obj, expected):
        raise damaged(path, f"{what} {name!r} is not a {_ID_KINDS[expected]}")
    return obj


def _exists(group: h5g.GroupID, key: bytes) -> bool:
    try:
        return bool(group.links.exists(key))
    except (OSError, RuntimeError, KeyError, TypeError, ValueError):
        return True  # there, but unreadable


def check_index_type(path: Path, dtype: np.dtype) -> None:
    """Before the index table is read: a compound type whose columns overlap or overrun it, or
    whose numeric columns are not of their size (a damaged datatype message), would make HDF5
    convert into memory outside its buffers."""
    if dtype.names is None:
        raise damaged(path, "the index table is not a table of columns")
    end = 0
    for offset, size, name in sorted((dtype.fields[n][1], dtype.fields[n][0].itemsize, n)
                                     for n in dtype.names):
        if offset < end or offset + size > dtype.itemsize:
            raise damaged(path, f"the index table's type is damaged (column {name!r})")
        end = offset + size
    for name, kind in fmt.INDEX_COLUMNS:
        if kind in _NUMERIC and name in dtype.names and \
                dtype[name].itemsize != np.dtype(kind).itemsize:
            raise damaged(path, f"the index table's type is damaged (column {name!r} is "
                                f"{dtype[name]}, not {kind})")


def check_index(path: Path, table: np.ndarray, version: int, crc: object) -> None:
    """The index table's columns and every row's kind, encoding, status, dtype and shape."""
    names = set(table.dtype.names or ())
    wanted = {name for name, _ in fmt.INDEX_COLUMNS if fmt.COLUMN_SINCE.get(name, 1) <= version}
    missing = sorted(wanted - names)
    if missing:
        raise damaged(path, f"the index lacks column(s) {', '.join(missing)}")
    for name, kind in fmt.INDEX_COLUMNS:
        if name in names and kind in _NUMERIC and table.dtype[name].kind not in "iuf":
            raise damaged(path, f"index column {name!r} is not numeric")
    if crc is not None and _fixed_width(table) and zlib.crc32(table.tobytes()) != crc:
        raise damaged(path, "the index table does not match its checksum (index_crc32)")
    for row, (kind, encoding, status, dtype, shape, dataset) in enumerate(zip(
            *(_text(table[c]) for c in ("kind", "encoding", "status", "dtype", "shape",
                                         "dataset")))):
        where = f"index row {row}"
        if kind not in fmt.KINDS:
            raise damaged(path, f"{where}: unknown kind {kind!r}")
        if encoding not in fmt.ENCODINGS:
            raise damaged(path, f"{where}: unknown encoding {encoding!r}")
        if status not in STATUSES:
            raise damaged(path, f"{where}: unknown status {status!r}")
        parse_shape(path, where, shape)
        if dataset:
            stored_dtype(path, where, dtype, encoding)
    if "addends" in names:
        for row, text in enumerate(_text(table["addends"])):
            check_addends(path, f"index row {row}", text)
    if "grad_scale" in names:  # what values are divided by: a loss scale is finite, positive
        scales = table["grad_scale"].astype(np.float64)
        bad = np.flatnonzero(~(np.isfinite(scales) & (scales > 0)))
        if len(bad):
            raise damaged(path, f"index row {bad[0]}: grad_scale {float(scales[bad[0]])!r} is not a "
                                f"positive number")


def check_addends(path: Path, where: str, text: str) -> None:
    try:
        fmt.parse_addends(text)
    except ValueError as exc:
        raise damaged(path, f"{where}: addends {text!r} are not call:index pairs") from exc


def parse_shape(path: Path, where: str, text: str) -> tuple[int, ...]:
    try:
        shape = fmt.parse_shape(text)
    except ValueError as exc:
        raise damaged(path, f"{where}: shape {text!r} is not a list of sizes") from exc
    if any(s < 0 for s in shape):
        raise damaged(path, f"{where}: negative size in shape {text!r}")
    return shape


def stored_dtype(path: Path, where: str, dtype: str, encoding: str) -> np.dtype:
    """The numpy dtype a tensor of torch ``dtype`` is stored in under ``encoding``."""
    if encoding == fmt.ENC_RAW and dtype in RAW_DTYPES:
        return np.dtype(dtype)
    if encoding == fmt.ENC_BITS and dtype in BITS_DTYPES:
        return np.dtype(STORED_BITS[dtype])
    raise damaged(path, f"{where}: dtype {dtype!r} cannot be stored as {encoding!r}")


def check_dataset(path: Path, ds: h5d.DatasetID, group: str, name: str, dtype: str,
                  encoding: str, shape: tuple) -> None:
    """The dataset holds what its index row says: a dataset, of the stored dtype and the
    shape, with all its bytes (a file that claims 2**40 elements and holds none would make a
    reader wait forever)."""
    where = f"dataset {group}/{name}"
    expected = stored_dtype(path, where, dtype, encoding)
    try:
        stored, stored_shape, size = ds.dtype, ds.shape, ds.get_storage_size()
    except (OSError, RuntimeError, TypeError, ValueError) as exc:
        raise damaged(path, f"{where} has unreadable metadata ({exc})") from exc
    if stored != expected:
        raise damaged(path, f"{where} stores {stored}, its index row says {dtype} "
                            f"({expected} on disk)")
    if stored_shape != tuple(shape):
        raise damaged(path, f"{where} has shape {stored_shape}, its index row says "
                            f"{tuple(shape)}")
    needed = math.prod(shape) * expected.itemsize
    if needed and size < needed:
        raise damaged(path, f"{where} should hold {needed} bytes and holds {size}")


def _fixed_width(table: np.ndarray) -> bool:
    """Whether the table's bytes are its content (fixed-width strings, as the dumper writes):
    variable-length strings are pointers, which no checksum can cover."""
    return all(table.dtype[name].kind != "O" for name in table.dtype.names)


def _text(column: np.ndarray) -> list[str]:
    if column.dtype.kind == "S":
        return np.char.decode(column, "utf-8", errors="replace").tolist()
    return [v.decode(errors="replace") if isinstance(v, bytes) else str(v) for v in column]

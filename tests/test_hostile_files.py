"""Damaged or hostile files: h5cmp exits 2 with one line naming the file and the problem, never
a traceback, never a hang, never a verdict on data it could not trust."""
from __future__ import annotations

import os
import shutil
import stat
import zlib

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from compare import format as fmt
from compare.cli import main

from helpers import dump_run

STEP = fmt.step_file_name(0, 0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return dump_run(tmp_path_factory.mktemp("hostile") / "ref", steps=1)


@pytest.fixture
def copy(reference, tmp_path):
    """A fresh copy of the reference step file."""
    target = tmp_path / "b"
    target.mkdir()
    shutil.copy(reference / STEP, target / STEP)
    return target / STEP


def h5cmp(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def refused(result, says: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h5cmp: error: "), result.output
    assert "damaged dump" in lines[0] or says in lines[0], lines[0]
    assert says in lines[0], lines[0]


def _group(f: h5py.File) -> h5py.Group:
    return f[fmt.step_group_name(0, 0)]


def edit_index(path, edit, keep_checksum=True) -> None:
    """Apply ``edit(table)`` to the index table (a structured array) and store it back, with
    a matching checksum unless ``keep_checksum`` is False (then the old one stays)."""
    with h5py.File(path, "r+") as f:
        group = _group(f)
        table = edit(group[fmt.INDEX_DATASET][()])
        del group[fmt.INDEX_DATASET]
        group[fmt.INDEX_DATASET] = table
        if keep_checksum:
            f.attrs[fmt.ATTR_INDEX_CRC] = zlib.crc32(table.tobytes())


def set_cell(column, value, row=None):
    def edit(table):
        rows = np.flatnonzero(table["dataset"] != b"") if row is None else [row]
        if table.dtype[column].kind == "S":
            width = max(table.dtype[column].itemsize, len(value))
            new = table.astype([(n, (f"S{width}" if n == column else table.dtype[n]))
                                for n in table.dtype.names])
            new[column][rows[0]] = value
            return new
        table[column][rows[0]] = value
        return table
    return edit


@pytest.mark.parametrize("column, value, says", [
    ("dtype", b"float17", "dtype 'float17' cannot be stored as 'raw'"),
    ("encoding", b"zip", "unknown encoding 'zip'"),
    ("kind", b"gradient", "unknown kind 'gradient'"),
    ("shape", b"8,x", "is not a list of sizes"),
    ("shape", b"8,-16", "negative size"),
    ("status", b"fine", "unknown status 'fine'"),
    ("addends", b"3:0:1", "addends '3:0:1' are not call:index pairs"),
    ("addends", b"99999999999999999999:0", "are not call:index pairs"),
    ("addends", b"1: 2", "addends '1: 2' are not call:index pairs"),
    ("grad_scale", 0.0, "grad_scale 0.0 is not a positive number"),
    ("grad_scale", float("nan"), "grad_scale nan is not a positive number"),
    ("grad_scale", -1024.0, "grad_scale -1024.0 is not a positive number"),
])
def test_a_damaged_index_row_is_refused(reference, copy, column, value, says):
    edit_index(copy, set_cell(column, value))
    refused(h5cmp(reference, copy.parent), says)
    refused(h5cmp(copy.parent), says)  # the listing reads the index too


@pytest.mark.parametrize("column, value, says", [
    ("dtype", b"float64", "stores float32, its index row says float64"),
    ("shape", b"4,16", "its index row says (4, 16)"),
])
def test_an_index_row_that_disagrees_with_its_dataset_is_refused(reference, copy, column,
                                                                 value, says):
    edit_index(copy, set_cell(column, value))
    refused(h5cmp(reference, copy.parent), says)


def test_a_missing_index_column_is_refused(reference, copy):
    from numpy.lib import recfunctions
    edit_index(copy, lambda table: recfunctions.drop_fields(table, "path", usemask=False))
    refused(h5cmp(reference, copy.parent), "the index lacks column(s) path")


def test_an_index_column_of_the_wrong_width_is_refused_before_it_is_read(reference, copy):
    # HDF5 converts a table into the reader's buffers by its stored type: a damaged type must
    # be refused before the read (the fuzz test damages its bytes; here a column is narrowed)
    def narrow(table):
        dtype = [(name, "i2" if name == "checksum" else table.dtype[name])
                 for name in table.dtype.names]
        return table.astype(dtype)
    edit_index(copy, narrow)
    refused(h5cmp(reference, copy.parent), "column 'checksum' is int16, not int64")


def test_an_index_changed_behind_its_checksum_is_refused(reference, copy):
    edit_index(copy, set_cell("module", b"mid"), keep_checksum=False)
    refused(h5cmp(reference, copy.parent), "does not match its checksum")


def _replace_dataset(path, make) -> tuple[str, str]:
    """Replace the first stored tensor's dataset by ``make(group, name)``; returns the call
    group's and the dataset's names."""
    with h5py.File(path, "r+") as f:
        group = _group(f)
        call = sorted(k for k in group if k != fmt.INDEX_DATASET)[0]
        name = sorted(group[call])[0]
        del group[call][name]
        make(group[call], name)
    return call, name


def test_a_dataset_that_claims_more_than_it_holds_is_refused_quickly(reference, copy):
    """2**40 elements claimed by the dataset and its index row, none stored: refused from the
    metadata instead of read as a terabyte of fill values."""
    huge = 1 << 40
    call, name = _replace_dataset(copy, lambda g, n: g.create_dataset(n, (huge,), dtype="f4"))

    def claim(table):
        row = np.flatnonzero((table["group"] == call.encode()) & (table["dataset"] == name.encode()))
        return set_cell("shape", str(huge).encode(), row=row[0])(table)
    edit_index(copy, claim)
    refused(h5cmp(reference, copy.parent), f"should hold {huge * 4} bytes and holds 0")


@pytest.mark.parametrize("make, says", [
    (lambda g, n: g.__setitem__(n, h5py.SoftLink(f"{g.name}/{n}")), "is a SoftLink"),
    (lambda g, n: g.__setitem__(n, h5py.ExternalLink("/dev/zero", "/x")), "is a ExternalLink"),
    (lambda g, n: g.create_dataset(n, data=np.array([b"x"], dtype=h5py.string_dtype())),
     "its index row says"),
    (lambda g, n: g.create_dataset(n, data=np.void(b"abcd")), "its index row says"),
])
def test_a_damaged_dataset_is_refused_quickly(reference, copy, make, says):
    _replace_dataset(copy, make)
    refused(h5cmp(reference, copy.parent), says)


def test_changed_tensor_bytes_are_refused(reference, copy):
    """One bit of a stored tensor flipped (a damaged disk, a bad copy): refused by its
    checksum, not judged as a (possibly tiny) difference between the runs."""
    with h5py.File(copy, "r+") as f:
        group = _group(f)
        call = sorted(k for k in group if k != fmt.INDEX_DATASET)[-1]
        ds = group[call][sorted(group[call])[0]]
        raw = ds[()].view(np.uint8).copy()
        offset = ds.id.get_offset()
    with open(copy, "r+b") as f:  # below HDF5: only the data changes
        f.seek(offset)
        f.write(bytes([raw.reshape(-1)[0] ^ 1]))
    refused(h5cmp(reference, copy.parent), "does not match its checksum: its bytes were changed")


def test_an_external_link_to_a_fifo_is_never_opened(reference, copy, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _replace_dataset(copy, lambda g, n: g.__setitem__(n, h5py.ExternalLink(str(fifo), "/x")))
    refused(h5cmp(reference, copy.parent), "is a ExternalLink")


def test_text_that_is_not_utf8_is_refused(reference, copy):
    with h5py.File(copy, "r+") as f:
        f.attrs["device"] = np.bytes_(b"\xff\xfe")
    refused(h5cmp(reference, copy.parent), "root attribute 'device' is not UTF-8 text")
    refused(h5cmp(copy.parent), "root attribute 'device' is not UTF-8 text")


@pytest.mark.parametrize("name, value, says", [
    (fmt.ATTR_INDEX_CRC, None, "root attribute 'index_crc32' is missing"),
    (fmt.ATTR_INCOMPLETE, None, "root attribute 'incomplete' is missing"),
    ("step", None, "root attribute 'step' is missing"),
    ("step", -3, "root attribute 'step' is negative"),
    ("epoch", "0", "root attribute 'epoch' is '0', not an integer"),
    ("tf32_matmul", 7, "root attribute 'tf32_matmul' is 7, not a boolean"),
    (fmt.ATTR_FORMAT_VERSION, "4", "dump format version '4' is not supported"),
    (fmt.ATTR_FORMAT_VERSION, 3, "version 3 is not supported by this h5cmp "
                                 "(reads [1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12]); dump this step again"),
])
def test_a_missing_or_mistyped_root_attribute_is_refused(reference, copy, name, value, says):
    """A version-3 file without its checksum attribute cannot pass unchecked."""
    with h5py.File(copy, "r+") as f:
        if value is None:
            del f.attrs[name]
        else:
            f.attrs[name] = value
    result = h5cmp(reference, copy.parent)
    assert result.exit_code == 2 and says in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_an_unreadable_directory_is_an_error(reference, tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    shutil.copy(reference / STEP, locked / STEP)
    os.chmod(locked, 0)
    try:
        if os.geteuid() == 0:  # root reads anything: make listing it fail as it would
            real = os.listdir
            monkeypatch.setattr(os, "listdir", lambda p: (_ for _ in ()).throw(
                PermissionError(13, "Permission denied")) if str(p) == str(locked) else real(p))
        refused(h5cmp(reference, locked), "permission denied")
    finally:
        os.chmod(locked, stat.S_IRWXU)


@pytest.mark.parametrize("second", [fmt.step_file_name(0, 0, rank=0), "00-epoch_0-step_dump.hdf5"])
def test_two_files_for_one_step_are_refused(reference, copy, second):
    shutil.copy(copy, copy.parent / second)
    if "rank" in second:
        with h5py.File(copy.parent / second, "r+") as f:
            f.attrs["rank"] = 0
    refused(h5cmp(reference, copy.parent), "both hold step 0:0")


def test_integers_beyond_float64_are_compared_exactly(tmp_path):
    import torch
    from dumper import HookerAndDumper
    for name, value in (("a", 2 ** 62), ("b", 2 ** 62 + 1)):
        model = torch.nn.Identity()
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            model(torch.tensor([value, 7]))
    result = h5cmp(tmp_path / "a", tmp_path / "b")
    assert result.exit_code == 1 and "DIFF" in result.output, result.output

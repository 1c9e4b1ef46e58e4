"""Fuzzing ``h5cmp`` with damaged copies of a real dump: random bytes, truncations, root
attributes, index cells, dataset shapes and types, and links, from a fixed seed.

Every case must end within a time limit with exit 0, 1 or 2, never a traceback nor an internal
error; exit 2 with one line naming the file; and exit 0 only if the damaged file still reads as
the original (same index table, same bytes in every dataset): a changed file is never passed.
"""
from __future__ import annotations

import json
import os
import random
import selectors
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from compare import format as fmt

from helpers import dump_run

ROOT = Path(__file__).resolve().parents[1]
STEP = fmt.step_file_name(0, 0)
# H5CMP_FUZZ_SEED and H5CMP_FUZZ_SCALE (a multiplier of the case counts) fuzz further locally
SEED = int(os.environ.get("H5CMP_FUZZ_SEED", 20261123))
SCALE = float(os.environ.get("H5CMP_FUZZ_SCALE", 1))
CASES_PER_KIND = {kind: max(1, round(count * SCALE)) for kind, count in {
    "bytes": 45, "truncate": 6, "attribute": 12, "index cell": 18, "dataset": 15,
    "link": 15}.items()}
SECONDS_PER_CASE = 30  # generous for a loaded CI machine; a case takes ~0.1 s


def _datasets(f: h5py.File) -> dict[str, bytes]:
    """Every dataset's bytes by path (what 'reads as the original' compares)."""
    out: dict[str, bytes] = {}
    f.visititems(lambda name, obj: out.__setitem__(name, obj[()].tobytes())
                 if isinstance(obj, h5py.Dataset) else None)
    return out


def _reads_as(path: Path, original: dict[str, bytes]) -> bool:
    try:  # (not `name in f`: h5py's membership test reads metadata that reading itself skips)
        with h5py.File(path, "r") as f:
            return all(isinstance(f[name], h5py.Dataset) and f[name][()].tobytes() == data
                       for name, data in original.items())
    except Exception:  # noqa: BLE001 - any failure to read means it does not read the same
        return False


def _tensor_paths(f: h5py.File) -> list[str]:
    paths: list[str] = []
    f.visititems(lambda name, obj: paths.append(name) if isinstance(obj, h5py.Dataset)
                 and not name.endswith(fmt.INDEX_DATASET) else None)
    return sorted(paths)


def _mutate_bytes(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    offsets = [rng.randrange(len(data)) for _ in range(rng.randint(1, 4))]
    for offset in offsets:
        data[offset] = rng.randrange(256)
    path.write_bytes(bytes(data))
    return f"bytes at {offsets}"


def _truncate(path: Path, rng: random.Random) -> str:
    size = rng.randrange(path.stat().st_size)
    os.truncate(path, size)
    return f"truncated to {size}"


HOSTILE_VALUES = [b"\xff\xfe", -1, 2 ** 62, "text", np.arange(3), 1.5, True, np.void(b"ab")]


def _mutate_attribute(path: Path, rng: random.Random) -> str:
    with h5py.File(path, "r+") as f:
        name = rng.choice(sorted(f.attrs))
        if rng.random() < 0.25:
            del f.attrs[name]
            return f"attribute {name} deleted"
        value = rng.choice(HOSTILE_VALUES)
        f.attrs[name] = value
        return f"attribute {name} = {value!r}"


def _mutate_index_cell(path: Path, rng: random.Random) -> str:
    """A damaged cell; the checksum is left as it was (damage, not an edit)."""
    with h5py.File(path, "r+") as f:
        group = f[fmt.step_group_name(0, 0)]
        table = group[fmt.INDEX_DATASET][()]
        row, column = rng.randrange(len(table)), rng.choice(table.dtype.names)
        if table.dtype[column].kind == "S":
            value = bytes(rng.choice(b"ab,-0123456789\xff") for _ in range(rng.randint(0, 6)))
            value = value[:table.dtype[column].itemsize]
        else:
            value = rng.choice([-1, 0, 2 ** 31 - 1, float("nan"), 1e300])
            if table.dtype[column].kind in "iu" and not -2 ** 31 < value < 2 ** 31:
                value = -7  # NaN or too large for the column
            value = np.array(value).astype(table.dtype[column])
        table[column][row] = value
        del group[fmt.INDEX_DATASET]
        group[fmt.INDEX_DATASET] = table
        return f"index row {row} {column} = {value!r}"


def _mutate_dataset(path: Path, rng: random.Random) -> str:
    with h5py.File(path, "r+") as f:
        name = rng.choice(_tensor_paths(f))
        old = f[name]
        dtype = old.dtype if rng.random() < 0.5 else rng.choice(["f2", "f8", "i1", "u2"])
        shape = old.shape if dtype != old.dtype else tuple(
            rng.randint(0, 9) for _ in range(rng.randint(0, 3)))
        del f[name]
        f.create_dataset(name, data=np.ones(shape, dtype=dtype))
        return f"{name} replaced by {dtype} {shape}"


def _mutate_link(path: Path, rng: random.Random) -> str:
    with h5py.File(path, "r+") as f:
        paths = _tensor_paths(f)
        name = rng.choice(paths)
        if rng.random() < 0.3:  # a call group instead of a dataset
            name = name.rsplit("/", 1)[0]
        other = rng.choice(paths)
        link = rng.choice([h5py.SoftLink("/" + name), h5py.SoftLink("/" + other),
                           h5py.SoftLink("/nowhere"), h5py.ExternalLink(str(path), "/" + other),
                           "hard"])
        del f[name]
        if link == "hard":
            if other.startswith(name + "/") or other == name:
                other = fmt.step_group_name(0, 0) + "/" + fmt.INDEX_DATASET
            f[name] = f[other]
            return f"{name} hard-linked to {other}"
        f[name] = link
        return f"{name} -> {link}"


MUTATIONS = {"bytes": _mutate_bytes, "truncate": _truncate, "attribute": _mutate_attribute,
             "index cell": _mutate_index_cell, "dataset": _mutate_dataset, "link": _mutate_link}


def _run_cases(reference: Path, cases: list[str]) -> dict[str, dict]:
    """Each case's result; fails naming the case that outlives its time limit."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "fuzz_driver.py"), str(reference), json.dumps(cases)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    results: dict[str, dict] = {}
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    try:
        while len(results) < len(cases):
            pending = cases[len(results)]
            deadline = time.monotonic() + SECONDS_PER_CASE
            if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                pytest.fail(f"h5cmp took over {SECONDS_PER_CASE} s on {pending}")
            line = proc.stdout.readline()
            if not line:
                pytest.fail(f"the fuzz driver died at {pending}: {proc.stderr.read()[-2000:]}")
            result = json.loads(line)
            results[result["case"]] = result
        assert proc.wait(timeout=SECONDS_PER_CASE) == 0, proc.stderr.read()[-2000:]
    finally:
        proc.kill()
        proc.wait()
    return results


def test_h5cmp_survives_damaged_files(tmp_path):
    reference = dump_run(tmp_path / "a", steps=1)
    base = dump_run(tmp_path / "b", steps=1) / STEP
    with h5py.File(base, "r") as f:
        original = _datasets(f)
    rng = random.Random(SEED)
    cases, what = [], {}
    for kind, count in CASES_PER_KIND.items():
        for i in range(count):
            case = tmp_path / f"{kind.replace(' ', '_')}{i}"
            case.mkdir()
            shutil.copy(base, case / STEP)
            what[str(case)] = f"{kind}: {MUTATIONS[kind](case / STEP, rng)}"
            cases.append(str(case))
    results = _run_cases(reference, cases)
    codes: dict[int, int] = {}
    failures = []
    for case, r in results.items():
        codes[r["code"]] = codes.get(r["code"], 0) + 1
        problem = _problem(r, case, original)
        if problem:
            failures.append(f"{what[case]} -> exit {r['code']}, {problem}: {r['output'][-300:]}")
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)
    assert codes.get(2, 0) > len(cases) // 3, codes  # most damage is refused


def _problem(r: dict, case: str, original: dict[str, bytes]) -> str:
    """What is wrong with one case's result ("" if nothing)."""
    if r["code"] not in (0, 1, 2) or r["escaped"] is not None:
        return f"escaped: {r['escaped']}"
    if "Traceback" in r["output"] or "internal error" in r["output"]:
        return "a traceback or an internal error"
    lines = r["output"].strip().splitlines()
    if r["code"] == 2 and not (len(lines) == 1 and lines[0].startswith("h5cmp: error: ")
                               and case in lines[0]):
        return "not one error line naming the file"
    if r["code"] == 0 and not _reads_as(Path(case) / STEP, original):
        return "passed a changed file"
    return ""

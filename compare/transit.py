"""Values in transit: one tensor handed from a module call to the next, in B as in A.

A call's output is the input of the calls that consume it (the input row's ``producer``), and
the gradient a consumer sends back for that input is the gradient that arrives at the
producer's output, unchanged where nothing else uses the tensor. Where A holds the same bits in
both records of such a link (:func:`bits`; not all zeros), the code between them is the identity
in A, and B runs the same code: in any precision it hands the values on unchanged, or cast
to the later record's dtype. Where B's two records differ by more, B's code between them
(functional code between modules, a hook, a communication, an in-place change) changed the
values in B only, whatever error the values carried before. Per later record of a link:

``transit_rel_diff``
    ``||later_b - earlier_b|| / ||earlier_b||`` from B's values (the smallest over its links);
    0 where B's bits agree; where B holds statistics only, the difference of the two norms (a
    lower bound); where a digest stands for B's values and the bits differ, inf.
``transit_from``
    the earlier record (:func:`compare.format.record_label`).

The verdict (:mod:`compare.verdict`) allows what a cast may do. Records B ran on A's values
(a localizing re-run, ``injected``) and sharded records put together from parts have no link.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator, Optional

import h5py
import numpy as np
import pandas as pd

from . import format as fmt
from .dump import dataset_of, open_h5, read_chunks
from .validation import hard_link

TRANSIT_COLUMNS = ("transit_rel_diff", "transit_from")


def bits(row, side: str) -> Optional[tuple]:
    """What identifies a record's values on ``side`` ("a" or "b"), equal for equal bits: its
    digest or checksum (a digest is the checksum its dataset would have), else its statistics
    and sketch; None where nothing does, or its values are all zeros (which many tensors share)."""
    get = lambda name: getattr(row, f"{name}_{side}")  # noqa: E731
    shape = (get("dtype"), tuple(get("shape")))
    word = get("digest") if get("digest") != fmt.NO_DIGEST else get("checksum")
    if word != fmt.NO_CHECKSUM:
        return (*shape, "bits", int(word)) if word != 0 else None
    numbers = tuple(get(c) for c in (*fmt.STAT_COLUMNS, *fmt.SKETCH_COLUMNS))
    norm = get("stat_norm")
    if not norm > 0 or any(math.isnan(v) for v in numbers[:len(fmt.STAT_COLUMNS)]):
        return None
    return (*shape, "stats", tuple(-1.0 if math.isnan(v) else v for v in numbers))


def links(pairs: pd.DataFrame) -> list[tuple[int, int]]:
    """``(earlier, later)`` row labels of ``pairs`` whose records hold one tensor handed on, with
    the same bits in A: a call's output and a consumer's input, the consumer's grad_input for
    that input and the call's grad_output."""
    sharded = [pairs[f"parts_{side}"].map(lambda p: isinstance(p, tuple) and len(p) > 0)
               for side in ("a", "b")]
    both = pairs[(pairs["side"] == "both") & (pairs["injected_b"].fillna(0) == 0)
                 & (pairs["injected_a"].fillna(0) == 0) & ~sharded[0] & ~sharded[1]]
    rows: dict[tuple, list] = {}
    for row in both.itertuples():
        step = (row.epoch, row.step, row.rank)
        rows.setdefault((*step, int(row.call_a), row.kind), []).append(row)
    out = []
    for row in both[(both["kind"] == fmt.INPUT) & (both["producer_a"] >= 0)].itertuples():
        step = (row.epoch, row.step, row.rank)
        consumer, producer = int(row.call_a), int(row.producer_a)
        sent = [r for r in rows.get((*step, consumer, fmt.GRAD_INPUT), ())
                if r.index == row.index]
        for earlier, later_kind in [(row, None)] + [(s, fmt.GRAD_OUTPUT) for s in sent]:
            key = bits(earlier, "a")
            if key is None:
                continue
            if later_kind is None:  # forward: the producer's output the input is
                candidates = rows.get((*step, producer, fmt.OUTPUT), ())
                out += [(c.Index, row.Index) for c in candidates if bits(c, "a") == key]
            else:
                candidates = rows.get((*step, producer, later_kind), ())
                out += [(earlier.Index, c.Index) for c in candidates if bits(c, "a") == key]
    return list(dict.fromkeys(out))


def measure(pairs: pd.DataFrame, files_b: dict, chunk_elements: int) -> dict[int, dict]:
    """``TRANSIT_COLUMNS`` per later record of each link (:func:`links`), by row label;
    ``files_b``: B's step files by (epoch, step, rank)."""
    out: dict[int, dict] = {}
    opened: dict[tuple, tuple] = {}
    try:
        for earlier, later in links(pairs):
            e, l = pairs.loc[earlier], pairs.loc[later]
            diff = _difference(e, l, lambda key: _step_group(opened, files_b, key),
                               chunk_elements)
            if math.isnan(diff) or diff >= out.get(later, {}).get("transit_rel_diff", math.inf):
                continue
            out[later] = {"transit_rel_diff": diff, "transit_from": fmt.record_label(
                e["module"], e["cls_a"], e["call_idx"], e["kind"], e["index"], e["occurrence"])}
    finally:
        for f, _ in opened.values():
            f.close()
    return out


def _difference(earlier: pd.Series, later: pd.Series, group_of, chunk_elements: int) -> float:
    """``transit_rel_diff`` of one link (NaN where B's records cannot say)."""
    sent, got = (bits(r, "b") for r in (earlier, later))
    if sent is not None and sent == got:
        return 0.0
    if earlier["dataset_b"] and later["dataset_b"] and earlier["digest_b"] == fmt.NO_DIGEST \
            and later["digest_b"] == fmt.NO_DIGEST:
        if tuple(earlier["shape_b"]) != tuple(later["shape_b"]):
            return math.inf
        group = group_of((earlier["epoch"], earlier["step"], earlier["rank"]))
        squares = np.zeros(2)
        for x, y in zip(*(_values(group, r, chunk_elements) for r in (earlier, later))):
            x, y = x.astype(np.float64, copy=False), y.astype(np.float64, copy=False)
            squares += (np.dot(y - x, y - x), np.dot(x, x))
        return math.sqrt(squares[0] / squares[1]) if squares[1] > 0 else math.inf
    if sent is not None and got is not None and "bits" in (sent[2], got[2]):
        return math.inf  # a digest: the bits differ, by how much it does not say
    norms = earlier["stat_norm_b"], later["stat_norm_b"]
    return abs(norms[1] - norms[0]) / norms[0] if norms[0] > 0 else math.nan


def _values(group: tuple, row: pd.Series, chunk_elements: int) -> Iterator[np.ndarray]:
    path, step_group = group
    ds = dataset_of(path, step_group, row["group_b"], row["dataset_b"], row["dtype_b"],
                    row["encoding_b"], tuple(row["shape_b"]))
    return read_chunks(ds, row["dtype_b"], row["encoding_b"], chunk_elements,
                       int(row["checksum_b"]))


def _step_group(opened: dict, files: dict, key: tuple) -> tuple[Path, h5py.Group]:
    """B's step group of ``key``, its file opened once."""
    if key not in opened:
        step = files[key]
        f = open_h5(step.path)
        opened[key] = (f, (step.path, hard_link(step.path, f, step.group_name, "step group",
                                                h5py.Group)))
    return opened[key][1]

"""Sharded tensors put together: a distributed dump compared as the global tensors it holds.

Where a record's ranks hold shards (a ``DTensor``, or a tensor marked with ``mark_sharded``;
docs/format.md, "Sharded tensors"), :func:`assemble` makes one row of it, with the global
shape and its ``parts`` (each rank's shard: file, dataset, offsets); the chosen rank's other
rows stand as they are. :func:`compare_parts` then compares a pair region by region: for each
overlap of a part of A with a part of B, the two blocks are read and fed to the error
accumulator, so that memory is bounded by a shard, never by the whole tensor. Replicated
shards are read once, the lowest rank's (``h5cmp RUN --ranks`` checks that the copies agree);
partial ones (``P(sum)``) are added up, block by block, in float64. A record whose shards are
known by statistics only is given the statistics of the whole (without a sketch).
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Iterator, NamedTuple

import h5py
import numpy as np
import pandas as pd

from . import format as fmt
from .decoding import decode
from .dump import Dump, check_checksum, dataset_of, open_h5
from .metrics import ErrorAccumulator
from .pairing import KEY, tensor_rows
from .statistics import stats_from_sums
from .tolerance import Tolerance

_PLACEMENT = re.compile(r"S\(\d+\)|R|P\(sum\)")  # what can be put together
_RECORD = [k for k in KEY if k != "rank"]


class Part(NamedTuple):
    """One rank's shard of a global tensor: where its values are and where it sits."""

    path: str        # step file
    step_group: str
    group: str       # call group
    dataset: str
    dtype: str
    encoding: str
    shape: tuple
    offsets: tuple
    checksum: int
    rank: int
    partial: bool    # one of the parts that add up to the values of its region


def sharded_ranks(dump: Dump) -> bool:
    """Whether ``dump`` is distributed and some of its records are shards."""
    index = dump.index
    return index["rank"].notna().any() and (index["placements"] != "").any()


def assemble(dump: Dump, steps, rank: int) -> pd.DataFrame:
    """``tensor_rows`` of ``dump`` as those of one rank, ``rank``: its rows of tensors that are
    not sharded, and one row per sharded record (from every rank's shards), whose ``shape`` is
    the global shape and ``parts`` its :class:`Part` tuple (empty on every other row)."""
    rows = tensor_rows(dump, steps)
    files = {(s.epoch, s.step, s.rank): s for s in dump.steps}
    sharded = (rows["placements"] != "").to_numpy()
    plain = rows[~sharded & (rows["rank"] == rank).to_numpy()]
    made = [_assembled(group.sort_values("rank", kind="stable"), files, rank)
            for _, group in rows[sharded].groupby(_RECORD, sort=False, dropna=False)]
    out = pd.concat([plain, pd.DataFrame(made)], ignore_index=True) if made else plain
    return out.sort_values(["epoch", "step", "seq"], kind="stable", ignore_index=True)


def _assembled(shards: pd.DataFrame, files: dict, rank: int) -> dict:
    """The row of one sharded record, from its ranks' rows."""
    base = shards[shards["rank"] == rank]
    row = (base if len(base) else shards).iloc[0].to_dict()
    row.update(rank=rank, parts=(), checksum=fmt.NO_CHECKSUM, digest=fmt.NO_DIGEST,
               shape=tuple(row["global_shape"]))
    why = _why_not(shards)
    if why:
        row.update(status=fmt.ST_UNSUPPORTED, value=f"shards not put together: {why}",
                   dataset="", **dict.fromkeys(fmt.STAT_COLUMNS, math.nan))
        return row
    partial = any(p.startswith("P") for p in fmt.parse_placements(row["placements"]))
    kept = shards if partial else shards.drop_duplicates(["offsets", "shape"])
    if (kept["dataset"] != "").all():
        row["parts"] = tuple(
            Part(str(f.path), f.group_name, s.group, s.dataset, s.dtype, s.encoding,
                 tuple(s.shape), tuple(s.offsets), int(s.checksum), int(s.rank), partial)
            for s in kept.itertuples() for f in [files[(s.epoch, s.step, s.rank)]])
    else:  # statistics of each shard: those of the whole
        row.update(dataset="", **dict(zip(fmt.STAT_COLUMNS, _whole_stats(kept))),
                   **dict.fromkeys(fmt.SKETCH_COLUMNS, math.nan))
    return row


def _why_not(shards: pd.DataFrame) -> str:
    """Why the shards of one record cannot be put together ("" when they can)."""
    if len(set(zip(shards["placements"], shards["global_shape"]))) > 1:
        return "the ranks disagree on its sharding"
    if (shards["status"] != fmt.ST_OK).any():
        return "a shard was " + shards[shards["status"] != fmt.ST_OK]["status"].iloc[0]
    if (shards["digest"] != fmt.NO_DIGEST).any():
        return "digests of shards are not the digest of the whole"
    placements = fmt.parse_placements(shards["placements"].iloc[0])
    if not all(_PLACEMENT.fullmatch(p) for p in placements):
        return f"placements {';'.join(placements)} (only S(d), R and P(sum) are)"
    partial = any(p.startswith("P") for p in placements)
    if partial and ("R" in placements or (shards["dataset"] == "").any()):
        return "partial values replicated over a mesh dimension, or known by statistics only"
    regions = shards.groupby(["offsets", "shape"], sort=False).size()
    covered = sum(math.prod(shape) for _, shape in regions.index)
    if covered != math.prod(shards["global_shape"].iloc[0]) or (
            partial and regions.nunique() > 1):
        return f"shards are missing (ranks {', '.join(map(str, sorted(shards['rank'])))} held)"
    return ""


def _whole_stats(shards: pd.DataFrame) -> tuple:
    """The statistics of a tensor from those of its (disjoint) shards."""
    stats = shards[list(fmt.STAT_COLUMNS)].to_numpy(dtype=np.float64)
    n = np.array([math.prod(s) for s in shards["shape"]], dtype=np.float64)
    lo, hi, mean, _, norm, nan, inf, zero = stats.T
    return stats_from_sums(float(np.min(lo)), float(np.max(hi)), float(np.sum(mean * n)),
                           float(np.sum(norm ** 2)), int(n.sum()), float(nan.sum()),
                           float(inf.sum()), float(zero.sum()))


class PartReader:
    """Reads blocks of parts, keeping their files open while a task runs, and checks a part
    read whole, in consecutive slabs, against its checksum."""

    def __init__(self) -> None:
        self._files: dict[str, h5py.File] = {}
        self._sums: dict[Part, fmt.DataChecksum] = {}

    def read(self, part: Part, lo: tuple, hi: tuple) -> np.ndarray:
        """The block ``lo:hi`` (global coordinates) of ``part``, decoded."""
        f = self._files.get(part.path)
        if f is None:
            f = self._files[part.path] = open_h5(Path(part.path))
        ds = dataset_of(Path(part.path), f[part.step_group], part.group, part.dataset,
                        part.dtype, part.encoding, part.shape)
        box = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, part.offsets))
        raw = np.asarray(ds[box] if box else ds[()])
        self._check(part, ds, lo, hi, raw)
        return decode(raw, part.dtype, part.encoding)

    def _check(self, part: Part, ds: h5py.Dataset, lo: tuple, hi: tuple,
               raw: np.ndarray) -> None:
        """Slabs of whole rows of a part, read in order from its first row: their checksum,
        once the last is read, must be the part's."""
        if part.checksum == fmt.NO_CHECKSUM or any(
                a != o or b != o + s for a, b, o, s in list(zip(lo, hi, part.offsets,
                                                                part.shape))[1:]):
            return
        if lo[:1] == part.offsets[:1]:
            self._sums[part] = fmt.DataChecksum()
        running = self._sums.get(part)
        if running is None:
            return
        running.update(raw)
        if not hi or hi[0] == part.offsets[0] + part.shape[0]:
            check_checksum(ds, part.checksum, self._sums.pop(part).value)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._sums.clear()


def _regions(parts: tuple[Part, ...]) -> dict[tuple, list[Part]]:
    """Parts by the region they cover: one part, or the partial parts that add up there."""
    regions: dict[tuple, list[Part]] = {}
    for part in parts:
        regions.setdefault((part.offsets, part.shape), []).append(part)
    return regions


def _slabs(lo: tuple, hi: tuple, max_elements: int) -> Iterator[tuple[tuple, tuple]]:
    """The box ``lo:hi`` cut along its first dimension into slabs of at most ``max_elements``
    elements (at least one row each)."""
    if not lo:
        yield lo, hi
        return
    row = math.prod(b - a for a, b in zip(lo[1:], hi[1:]))
    step = max(1, max_elements // max(1, row))
    for start in range(lo[0], hi[0], step):
        yield (start, *lo[1:]), (min(start + step, hi[0]), *hi[1:])


def compare_parts(parts_a: tuple[Part, ...], parts_b: tuple[Part, ...], tol: Tolerance,
                  reader: PartReader, max_elements: int) -> dict:
    """Metrics of a pair of global tensors given as parts (a side stored whole is one part at
    offset 0, :func:`whole_part`), read in slabs of at most ``max_elements`` elements, and
    ``shard_rank``: the rank of the shard holding the largest absolute error."""
    acc, worst, worst_rank = ErrorAccumulator(tol), -1.0, math.nan
    for (offsets_a, shape_a), side_a in _regions(parts_a).items():
        for (offsets_b, shape_b), side_b in _regions(parts_b).items():
            lo = tuple(max(x, y) for x, y in zip(offsets_a, offsets_b))
            hi = tuple(min(x + s, y + t) for x, s, y, t in zip(offsets_a, shape_a, offsets_b,
                                                               shape_b))
            if any(b <= a for a, b in zip(lo, hi)):
                continue
            for slab_lo, slab_hi in _slabs(lo, hi, max_elements):
                a, b = (_block(side, slab_lo, slab_hi, reader) for side in (side_a, side_b))
                acc.update(a.reshape(-1), b.reshape(-1))
                with np.errstate(all="ignore"):
                    slab_worst = float(np.nanmax(np.abs(a.astype(np.float64) - b), initial=0))
                if slab_worst > worst:
                    sharded = side_a if side_a[0].rank >= 0 else side_b
                    worst, worst_rank = slab_worst, sharded[0].rank
    return {**acc.result(), "rtol": tol.rtol, "atol": tol.atol, "shard_rank": worst_rank}


def _block(parts: list[Part], lo: tuple, hi: tuple, reader: PartReader) -> np.ndarray:
    if len(parts) == 1 and not parts[0].partial:
        return reader.read(parts[0], lo, hi)
    total = None
    for part in parts:  # partial values: their sum
        values = reader.read(part, lo, hi).astype(np.float64)
        total = values if total is None else total + values
    return total


def whole_part(path: Path, step_group: str, group: str, dataset: str, dtype: str,
               encoding: str, shape: tuple, checksum: int) -> Part:
    """A tensor stored whole, as the one part of itself (rank -1: not a shard)."""
    return Part(str(path), step_group, group, dataset, dtype, encoding, tuple(shape),
                (0,) * len(shape), checksum, -1, False)

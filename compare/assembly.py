"""Sharded tensors put together: a distributed dump compared as the global tensors it holds.

Where a record's ranks hold shards (a ``DTensor``, or a tensor marked with ``mark_sharded``;
docs/format.md, "Sharded tensors"), :func:`assemble` makes one row of it, with the global
shape and its ``parts`` (each rank's shard: file, dataset, offsets); the chosen rank's other
rows stand as they are. :func:`compare_parts` then compares a pair region by region: for each
overlap of a part of A with a part of B, the two blocks are read and fed to the error
accumulator, so that memory is bounded by a shard, never by the whole tensor. Replicated
shards are read once, the base rank's (the chosen one, else the lowest); where another
rank's copy of a region has other bytes (checksums) or statistics, the row's
``replicas_differ`` says which (``h5cmp RUN --ranks`` lists every disagreement). Partial
shards (``P(sum)``) are added up, block by block, in float64. A record whose shards are known
by statistics only is given the statistics of the whole (without a sketch).
"""
from __future__ import annotations

import collections
import math
import re
from pathlib import Path
from typing import Iterator, NamedTuple

import h5py
from h5py import h5d, h5g, h5s
import numpy as np
import pandas as pd

from . import format as fmt
from .decoding import decode, unscaled
from .dump import Dump, check_checksum, dataset_id_of, open_h5
from .metrics import ErrorAccumulator, rows_measured
from .pairing import KEY, tensor_rows
from .prefetch import prefetched
from .statistics import described, stats_from_sums
from .tolerance import Tolerance
from .validation import linked_id

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
    grad_scale: float = fmt.NO_GRAD_SCALE  # the loss scale its values carry (fmt.INDEX_COLUMNS)


def sharded_ranks(dump: Dump) -> bool:
    """Whether ``dump`` is distributed and some of its records are shards."""
    index = dump.index
    return index["rank"].notna().any() and (index["placements"] != "").any()


def assemble(dump: Dump, steps, rank: int) -> pd.DataFrame:
    """``tensor_rows`` of ``dump`` as those of one rank, ``rank``: its rows of tensors that are
    not sharded, and one row per sharded record (from every rank's shards), whose ``shape`` is
    the global shape and ``parts`` its :class:`Part` tuple (empty on every other row)."""
    rows = tensor_rows(dump, steps)
    sharded = (rows["placements"] != "").to_numpy()
    plain = rows[~sharded & (rows["rank"] == rank).to_numpy()]
    shards = rows[sharded]
    if shards.empty:
        return plain
    files = {(s.epoch, s.step, s.rank): s for s in dump.steps}
    columns = [*_RECORD, "rank", "placements", "global_shape", "status", "digest", "dataset",
               "group", "dtype", "encoding", "shape", "offsets", "checksum", *fmt.STAT_COLUMNS]
    records: dict[tuple, list[tuple[int, _Shard]]] = {}
    first_stat = columns.index(fmt.STAT_COLUMNS[0])
    for position, values in enumerate(zip(*(shards[c].tolist() for c in columns))):
        shard = _Shard(*values[len(_RECORD):first_stat], values[first_stat:])
        records.setdefault(values[:len(_RECORD)], []).append((position, shard))
    positions, changes = [], []
    for (epoch, step, *_), record in records.items():
        record.sort(key=lambda item: (item[1].rank != rank, item[1].rank))  # base rank first
        positions.append(record[0][0])
        changes.append(_assembled([shard for _, shard in record],
                                  {shard.rank: files[(epoch, step, shard.rank)]
                                   for _, shard in record}))
    made = shards.iloc[positions].reset_index(drop=True)
    made["rank"] = rank
    made["shape"] = made["global_shape"]
    made["checksum"], made["digest"] = fmt.NO_CHECKSUM, fmt.NO_DIGEST
    for column in {name for change in changes for name in change}:
        values = made[column].tolist()
        for i, change in enumerate(changes):
            if column in change:
                values[i] = change[column]
        made[column] = pd.Series(values, dtype=made[column].dtype if column != "parts"
                                 else object)
    out = pd.concat([plain, made], ignore_index=True)
    return out.sort_values(["epoch", "step", "seq"], kind="stable", ignore_index=True)


class _Shard(NamedTuple):
    """What putting a record together needs of one rank's row."""

    rank: int
    placements: str
    global_shape: tuple
    status: str
    digest: int
    dataset: str
    group: str
    dtype: str
    encoding: str
    shape: tuple
    offsets: tuple
    checksum: int
    stats: tuple   # fmt.STAT_COLUMNS


def _assembled(shards: list[_Shard], files: dict) -> dict:
    """The columns that change on the row of one sharded record, its shards given with the
    base rank's first, ``files`` its step's file per rank."""
    why = _why_not(shards)
    if why:
        return {"status": fmt.ST_UNSUPPORTED, "value": f"shards not put together: {why}",
                "dataset": "", "parts": (), **dict.fromkeys(fmt.STAT_COLUMNS, math.nan)}
    partial = any(p.startswith("P") for p in fmt.parse_placements(shards[0].placements))
    replicas = {"replicas_differ": "" if partial else _replicas_differ(shards)}
    if not partial:  # replicated shards: the first of each region
        shards = list({(s.offsets, s.shape): s for s in reversed(shards)}.values())[::-1]
    if all(s.dataset for s in shards):
        return {**replicas, "parts": tuple(
            Part(str(f.path), f.group_name, s.group, s.dataset, s.dtype, s.encoding, s.shape,
                 s.offsets, int(s.checksum), int(s.rank), partial)
            for s in shards for f in [files[s.rank]])}
    # statistics of each shard: those of the whole
    return {**replicas, "parts": (), "dataset": "",
            **dict(zip(fmt.STAT_COLUMNS, _whole_stats(shards))),
            **dict.fromkeys(fmt.SKETCH_COLUMNS, math.nan)}


def _replicas_differ(shards: list[_Shard]) -> str:
    """Which rank's copy of a region differs from the copy that is read (``shards``: the base
    rank's first, then by rank), by the checksum of its bytes, or its statistics where only
    those are known: "rank 3's copy differs from rank 1's", the lowest such rank; "" where
    every copy agrees (or was dumped without checksum)."""
    read: dict[tuple, _Shard] = {}
    for shard in shards:
        kept = read.setdefault((shard.offsets, shard.shape), shard)
        if kept is not shard and _copies_differ(kept, shard):
            return f"rank {shard.rank}'s copy differs from rank {kept.rank}'s"
    return ""


def _copies_differ(a: _Shard, b: _Shard) -> bool:
    if a.dataset and b.dataset:
        return fmt.NO_CHECKSUM not in (a.checksum, b.checksum) and a.checksum != b.checksum
    if a.dataset or b.dataset:
        return False  # values against statistics: left to h5cmp --ranks
    return not all(x == y or (x != x and y != y) for x, y in zip(a.stats, b.stats))


def _why_not(shards: list[_Shard]) -> str:
    """Why the shards of one record cannot be put together ("" when they can)."""
    first = shards[0]
    if any((s.placements, s.global_shape) != (first.placements, first.global_shape)
           for s in shards):
        return "the ranks disagree on its sharding"
    failed = [s.status for s in shards if s.status != fmt.ST_OK]
    if failed:
        return f"a shard was {failed[0]}"
    if any(s.digest != fmt.NO_DIGEST and not s.dataset and not described(s.stats)
           for s in shards):
        return "digests of shards are not the digest of the whole"
    placements = fmt.parse_placements(first.placements)
    if not all(_PLACEMENT.fullmatch(p) for p in placements):
        return f"placements {';'.join(placements)} (only S(d), R and P(sum) are)"
    partial = any(p.startswith("P") for p in placements)
    if partial and ("R" in placements or not all(s.dataset for s in shards)):
        return "partial values replicated over a mesh dimension, or known by statistics only"
    regions: dict[tuple, int] = {}
    for s in shards:
        regions[(s.offsets, s.shape)] = regions.get((s.offsets, s.shape), 0) + 1
    covered = sum(math.prod(shape) for _, shape in regions)
    if covered != math.prod(first.global_shape) or (partial and len(set(regions.values())) > 1):
        return f"shards are missing (ranks {', '.join(str(s.rank) for s in shards)} held)"
    if not _tile(list(regions), first.global_shape):
        return ("shards overlap or do not form a grid (their offsets, or a mark_sharded "
                "dimension, are wrong)")
    return ""


def _tile(regions: list[tuple[tuple, tuple]], shape: tuple) -> bool:
    """Whether ``(offsets, shape)`` regions that hold as many elements as ``shape`` cover it
    without overlapping: they form a grid (a mesh's shards do) whose intervals along each
    dimension follow each other from 0."""
    regions = [r for r in regions if math.prod(r[1])]
    if not math.prod(shape):
        return True
    cells = 1
    for dim, size in enumerate(shape):
        intervals = sorted({(offsets[dim], extent[dim]) for offsets, extent in regions})
        ends = [start + length for start, length in intervals]
        if [start for start, _ in intervals] != [0, *ends[:-1]] or ends[-1:] != [size]:
            return False
        cells *= len(intervals)
    return cells == len(regions)


def _whole_stats(shards: list[_Shard]) -> tuple:
    """The statistics of a tensor from those of its (disjoint) shards."""
    stats = np.array([s.stats for s in shards], dtype=np.float64)
    n = np.array([math.prod(s.shape) for s in shards], dtype=np.float64)
    lo, hi, mean, _, norm, nan, inf, zero = stats.T
    return stats_from_sums(float(np.min(lo)), float(np.max(hi)), float(np.sum(mean * n)),
                           float(np.sum(norm ** 2)), int(n.sum()), float(nan.sum()),
                           float(inf.sum()), float(zero.sum()))


class PartReader:
    """Reads blocks of parts, keeping their files open while a task runs. A part of at most
    ``max_elements`` elements is read whole, once, checked against its checksum and kept
    while the last few parts are (a whole side that several shards overlap is read once);
    a larger one is read block by block, and checked once its slabs of whole rows have been
    read in order."""

    KEPT = 4  # small parts kept decoded: the ones a record's regions go back to

    def __init__(self, max_elements: int) -> None:
        self._max = max_elements
        self._files: dict[str, h5py.File] = {}
        self._groups: dict[tuple[str, str], tuple[Path, h5g.GroupID]] = {}  # open step groups
        self._sums: dict[Part, fmt.DataChecksum] = {}
        self._kept: collections.OrderedDict[Part, np.ndarray] = collections.OrderedDict()

    def read(self, part: Part, lo: tuple, hi: tuple) -> np.ndarray:
        """The block ``lo:hi`` (global coordinates) of ``part``, decoded."""
        box = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, part.offsets))
        if math.prod(part.shape) <= self._max:
            return self._whole(part)[box]
        ds = h5py.Dataset(self._dataset(part))
        raw = np.asarray(ds[box] if box else ds[()])
        self._check(part, ds, lo, hi, raw)
        return unscaled(decode(raw, part.dtype, part.encoding), part.grad_scale)

    def _whole(self, part: Part) -> np.ndarray:
        values = self._kept.get(part)
        if values is None:
            ds = self._dataset(part)
            raw = np.empty(part.shape, ds.dtype)
            if raw.size:
                ds.read(h5s.ALL, h5s.ALL, raw)
            if part.checksum != fmt.NO_CHECKSUM:
                check_checksum(ds, part.checksum, fmt.data_checksum(raw))
            values = self._kept[part] = unscaled(decode(raw, part.dtype, part.encoding),
                                                 part.grad_scale)
            while len(self._kept) > self.KEPT:
                self._kept.popitem(last=False)
        self._kept.move_to_end(part)
        return values

    def _dataset(self, part: Part) -> h5d.DatasetID:
        opened = self._groups.get((part.path, part.step_group))
        if opened is None:
            f = self._files.get(part.path)
            if f is None:
                f = self._files[part.path] = open_h5(Path(part.path))
            opened = self._groups[part.path, part.step_group] = (
                Path(part.path), linked_id(Path(part.path), f.id, part.step_group,
                                           "step group", h5g.GroupID))
        path, step_group = opened
        return dataset_id_of(path, step_group, part.group, part.dataset, part.dtype,
                             part.encoding, part.shape)

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
        self._groups.clear()
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._sums.clear()
        self._kept.clear()


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
    offset 0, :func:`whole_part`), and ``shard_rank``: the rank of the shard holding the
    largest absolute error (of A's shards where A is sharded). A tensor of at most
    ``max_elements`` elements is put together whole on each side and compared at once; a
    larger one is compared in slabs of at most ``max_elements`` elements, read ahead by a
    background thread."""
    sharded = parts_a if parts_a[0].rank >= 0 else parts_b
    shape = tuple(max(p.offsets[d] + p.shape[d] for p in sharded)
                  for d in range(len(sharded[0].shape)))
    if math.prod(shape) <= max_elements:
        a, b = (_whole_tensor(parts, shape, reader) for parts in (parts_a, parts_b))
        acc = ErrorAccumulator(tol, row=rows_measured(shape, max_elements))
        acc.update(a.reshape(-1), b.reshape(-1))
        return {**acc.result(), "rtol": tol.rtol, "atol": tol.atol,
                "shard_rank": _rank_of_largest_error(a, b, sharded)}
    acc, worst_rank = ErrorAccumulator(tol), math.nan
    for a, b, rank in prefetched(_slab_pairs(parts_a, parts_b, reader, max_elements)):
        worst = acc.max_abs
        acc.update(a.reshape(-1), b.reshape(-1))
        if acc.max_abs > worst or math.isnan(worst_rank):  # the largest error so far is here
            worst_rank = rank
    return {**acc.result(), "rtol": tol.rtol, "atol": tol.atol, "shard_rank": worst_rank}


def _whole_tensor(parts: tuple[Part, ...], shape: tuple, reader: PartReader) -> np.ndarray:
    """A small tensor's values, its parts put in their places."""
    regions = _regions(parts)
    if len(regions) == 1:
        return _block(next(iter(regions.values())), (0,) * len(shape), shape, reader)
    whole = None
    for (offsets, region), side in regions.items():
        hi = tuple(o + s for o, s in zip(offsets, region))
        block = _block(side, offsets, hi, reader)
        if whole is None:
            whole = np.empty(shape, block.dtype)
        whole[tuple(map(slice, offsets, hi))] = block
    return whole


def _rank_of_largest_error(a: np.ndarray, b: np.ndarray, sharded: tuple[Part, ...]) -> int:
    """The rank of the shard of ``sharded`` that holds the largest finite absolute difference
    of ``a`` and ``b`` (the first shard's where none differ)."""
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(np.subtract(b, a, dtype=np.result_type(a, b, np.float64)))
    diff[~np.isfinite(diff)] = 0
    if not diff.size:
        return sharded[0].rank
    at = np.unravel_index(int(np.argmax(diff)), diff.shape)
    if not diff[at]:
        integers = a.dtype.kind in "iu" and b.dtype.kind in "iu"  # beyond 2**53 a difference
        differ = np.flatnonzero(a != b) if integers else ()      # can round to 0 in float64
        if not len(differ):
            return sharded[0].rank
        at = np.unravel_index(int(differ[0]), a.shape)
    return next(p.rank for p in sharded
                if all(o <= i < o + s for i, o, s in zip(at, p.offsets, p.shape)))


def _slab_pairs(parts_a: tuple[Part, ...], parts_b: tuple[Part, ...], reader: PartReader,
                max_elements: int) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """``(a, b, rank)`` for each slab of each overlap of a region of A with one of B: the two
    sides' values there and the rank of the shard they belong to."""
    for (offsets_a, shape_a), side_a in _regions(parts_a).items():
        for (offsets_b, shape_b), side_b in _regions(parts_b).items():
            lo = tuple(max(x, y) for x, y in zip(offsets_a, offsets_b))
            hi = tuple(min(x + s, y + t) for x, s, y, t in zip(offsets_a, shape_a, offsets_b,
                                                               shape_b))
            if any(b <= a for a, b in zip(lo, hi)):
                continue
            rank = (side_a if side_a[0].rank >= 0 else side_b)[0].rank
            for slab_lo, slab_hi in _slabs(lo, hi, max_elements):
                yield (_block(side_a, slab_lo, slab_hi, reader),
                       _block(side_b, slab_lo, slab_hi, reader), rank)


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

"""``compare_dumps``: pair two dumps and measure every tensor pair's error."""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import itertools
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Optional, Union

import h5py
import numpy as np
import pandas as pd

from . import cluster
from .attributes import NO_ATTRIBUTES, Attributes
from .centering import Centering, normalized_sizes, per_channel
from .dump import Dump, PathLike, dataset_of, load_dump, open_h5, read_chunks, reading
from .errors import DumpError
from . import format as fmt
from .alignment import align_inputs, align_ops
from .arguments import argument_rows, differing_arguments
from .assembly import PartReader, assemble, compare_parts, sharded_ranks, whole_part
from .call_order import align_calls
from .mapping import NameMapping, find_prefix, load_mapping
from .metrics import METRIC_COLUMNS, ErrorAccumulator, rows_measured
from .prefetch import prefetched
from .pairing import (KEY, align_ranks, at_rank, outside_compiled_regions, pair_records,
                      recorded_on_both_sides, select, tensor_rows, unlike_forms)
from .statistics import (compare_stats, described, sketch_of_chunks, sketch_sums, stats_of_chunks,
                         unscaled_stats)
from .status import (CLOSE, DROPPED, EQUAL, HASH_MISMATCH, MISSING_IN_A, MISSING_IN_B,
                     OP_ONLY_IN_A, OP_ONLY_IN_B, REPLICA_MISMATCH, SHAPE_MISMATCH, UNSUPPORTED)
from .recompute import RECOMPUTE_COLUMNS, RECOMPUTE_FIGURES
from .recompute import measure as measure_recomputed
from .tolerance import pair_tolerance
from .transit import TRANSIT_COLUMNS
from .transit import measure as measure_transit
from .validation import hard_link
from .verdict import VERDICT_COLUMNS, judge

DEFAULT_CHUNK_ELEMENTS = 1 << 20  # elements read per dataset slice (4 MiB of float32)

PAIR_COLUMNS = [
    "epoch", "step", "rank", "seq", "call", "module", "cls", "call_idx", "micro_batch", "kind",
    "index", "occurrence", "path", "producer", "addends", "injected", "dtype_a", "dtype_b",
    "shape_a", "shape_b", "grad_scale_a", "grad_scale_b", "status", *METRIC_COLUMNS,
    *TRANSIT_COLUMNS, *RECOMPUTE_COLUMNS, "rtol", "atol", "shard_rank",
]
RESULT_COLUMNS = PAIR_COLUMNS + list(VERDICT_COLUMNS)
# result.attrs key: the compared steps a dumper marked incomplete, as "B's step 0:1 (why)"
INCOMPLETE_STEPS = "incomplete_steps"
# result.attrs key: how B's module names were renamed before pairing ("" when they were not)
NAME_MAPPING = "name_mapping"
# result.attrs key: what one side recorded that the other's dumper was not asked to record
NOT_COMPARED = "not_compared"
# result.attrs key: how a sharded side's tensors were put together ("" when none was)
ASSEMBLED = "assembled"
# result.attrs key: the arguments (non-tensor leaves) that differ between paired calls, as
# dicts of compare.arguments.COLUMNS, in execution order
ARGUMENTS = "arguments"


def compare_dumps(a: Union[PathLike, Dump], b: Union[PathLike, Dump], rtol: Optional[float] = None,
                  atol: Optional[float] = None, *, steps: Optional[Iterable[str]] = None,
                  modules: Optional[Iterable[str]] = None, kinds: Optional[Iterable[str]] = None,
                  rank: Optional[int] = None, jobs: int = 1,
                  chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
                  progress: Optional[Callable[[int], None]] = None,
                  mapping: Union[NameMapping, PathLike, None] = None,
                  client: Optional[Any] = None) -> pd.DataFrame:
    """One row per tensor record of either dump, in execution order, with its errors and its
    status (see :mod:`compare.status` and :mod:`compare.verdict`).

    ``a`` is the reference. Records are paired by (epoch, step, rank, module, call, kind, index),
    op records after aligning each module call's ops (:mod:`compare.alignment`); a record on
    one side only gets status ``missing_in_a``/``missing_in_b`` (``op_only_in_a``/``_b`` for
    an op record). Given ``rtol``/
    ``atol`` decide which records are close (every element ``|b - a| <= atol + rtol |b|``);
    by default the error model does. ``steps`` holds ``"S"`` or ``"E:S"`` strings and limits
    what is compared; ``modules`` (globs on module path or key) and ``kinds`` (record kinds)
    only select the rows returned: every record of the compared steps is judged, so the
    verdict does not depend on them. A
    non-distributed dump is compared with one rank of a distributed one: ``rank``, else the
    lowest (see :func:`compare.pairing.align_ranks`). ``jobs`` > 1 compares in that many
    processes; with ``client`` (a ``distributed.Client``) the work runs on that Dask cluster's
    workers instead, which read the step files from storage they share with this process
    (:mod:`compare.cluster`; the rows are the same). ``progress(n)`` is called as ``n`` more
    pairs are done.

    ``mapping`` (a :class:`~compare.mapping.NameMapping` or a rules file) renames B's module
    paths before pairing. Without one, when most of B's modules are not A's and a prefix
    explains them (a model wrapped one level deeper), B is renamed by that prefix. Either
    way ``result.attrs[NAME_MAPPING]`` says how ("" when B kept its names).
    """
    full_a, full_b = load_dump(a), load_dump(b)
    assembled = assembled_sides(full_a, full_b)
    if assembled == "A and B":  # two layouts: each side's other records are its lowest rank's
        base_a, base_b = (rank if rank is not None else min(s.rank for s in d.steps)
                          for d in (full_a, full_b))
        dump_a, dump_b = at_rank(full_a, base_a), at_rank(full_b, base_b, label=base_a)
    else:
        dump_a, dump_b, _ = align_ranks(full_a, full_b, rank)
        base_a = base_b = dump_a.steps[0].rank
    _check_distinct(dump_a, dump_b)
    rows_a, rows_b = tensor_rows(dump_a, steps), tensor_rows(dump_b, steps)
    if "A" in assembled:
        rows_a = assemble(full_a, steps, base_a)
    if "B" in assembled:
        rows_b = assemble(full_b, steps, base_b).assign(rank=base_a)
    if rows_a.empty and rows_b.empty:
        held = sorted({f"{s.epoch}:{s.step}" for s in dump_a.steps + dump_b.steps})
        raise DumpError(f"{dump_a.path} / {dump_b.path}: nothing to compare: no tensor record"
                        + (f" in step {', '.join(steps)} (the dumps hold steps "
                           f"{', '.join(held)})" if steps else " in either dump"))
    mapping = _name_mapping(mapping, rows_a, rows_b)
    if mapping is not None:
        rows_b = _one_to_one(mapping, rows_b, mapping.apply(rows_b))
    _check_same_model(dump_a, dump_b, rows_a, rows_b)
    rows_b = align_calls(rows_a, rows_b, argument_rows(dump_a.index),
                         argument_rows(dump_b.index))
    rows_b = align_inputs(rows_a, align_ops(rows_a, rows_b))
    pairs, not_compared = recorded_on_both_sides(pair_records(rows_a, rows_b))
    pairs, unlike = unlike_forms(pairs, dump_a.index, dump_b.index)
    not_compared += unlike
    if pairs.empty:
        raise DumpError(f"{dump_a.path} / {dump_b.path}: nothing to compare: the dumps share no "
                        f"step ({'; '.join(not_compared)}); dump the same steps of both runs")
    files_a = {(s.epoch, s.step, s.rank if s.rank is not None else -1): s for s in dump_a.steps}
    files_b = {(s.epoch, s.step, s.rank if s.rank is not None else -1): s for s in dump_b.steps}
    compiled_a, compiled_b = ({c for f in files.values() for c in fmt.compiled_modules(f.attrs)}
                              for files in (files_a, files_b))
    pairs, left_out = outside_compiled_regions(pairs, compiled_a, compiled_b)
    not_compared += left_out
    # (put-together sides pair other ranks' calls: their arguments are not paired)
    arguments = () if assembled else tuple(
        differing_arguments(dump_a, dump_b, pairs).to_dict("records"))
    if client is not None:
        jobs = max(jobs, cluster.worker_count(client))
    # each module's recorded attributes (B's where B kept its module names)
    attributes = {"a": Attributes.of(dump_a.index),
                  "b": Attributes.of(dump_b.index) if mapping is None else NO_ATTRIBUTES}
    eps = {**attributes["b"].eps, **attributes["a"].eps}  # A's, else B's
    tasks = _tasks(pairs, files_a, files_b, max(1, jobs), chunk_elements, rtol, atol, eps)
    metrics: dict[int, dict] = {}
    with contextlib.ExitStack() as stack:
        runner: Callable = map
        if client is not None:
            runner = functools.partial(cluster.run_on, client)
        elif jobs > 1 and len(tasks) > 1:
            runner = stack.enter_context(cf.ProcessPoolExecutor(max_workers=jobs)).map
        for result in runner(_run_task, tasks):
            metrics.update(result)
            if progress:
                progress(len(result))
        recomputed = measure_recomputed(pairs, files_a, files_b, metrics, attributes, runner,
                                        max(1, jobs))
    for row, figures in measure_transit(pairs, files_a, files_b, chunk_elements).items():
        metrics.setdefault(row, {}).update(figures)
    for row, figures in recomputed.items():
        metrics.setdefault(row, {}).update(figures)
    paired = files_a.keys() & files_b.keys()
    # compiled code (fused kernels) rounds otherwise than eager code, even in the same dtypes
    # and so do shards computed apart and put together (partial sums reduced in another order)
    # and code that runs other ops (a fused attention against its steps)
    kernels = not (compiled_a or compiled_b or assembled or _other_code(pairs)) and all(
        fmt.same_kernels(files_a[k].attrs, files_b[k].attrs) for k in paired)
    tf32 = tuple(tuple(any(fmt.tf32_allowed(files[k].attrs)[i] for k in paired) for i in (0, 1))
                 for files in (files_a, files_b))
    judged = judge(_result_frame(pairs, metrics, {"a": base_a, "b": base_b}), rtol, atol,
                   same_kernels=kernels, tf32=tf32)
    result = select(judged, modules, kinds)[RESULT_COLUMNS].reset_index(drop=True)
    result.attrs.update(judged.attrs)
    compared = {(e, s, -1 if r != r else r) for e, s, r in
                pairs[["epoch", "step", "rank"]].drop_duplicates().itertuples(index=False)}
    result.attrs[NAME_MAPPING] = mapping.describe() if mapping is not None else ""
    result.attrs[NOT_COMPARED] = not_compared
    result.attrs[ARGUMENTS] = arguments
    result.attrs[ASSEMBLED] = "" if not assembled else (
        f"{assembled}'s sharded tensors are put together from the ranks' shards; the other "
        f"records are rank {base_a}'s" + (f" (B's rank {base_b}'s)" if base_b != base_a else ""))
    result.attrs[INCOMPLETE_STEPS] = [
        f"{side}'s step {f.label} ({f.incomplete})" for side, files in (("A", files_a),
                                                                          ("B", files_b))
        for key, f in sorted(files.items()) if f.incomplete and key in compared]
    return result


def assembled_sides(a: Dump, b: Dump) -> str:
    """Which sides' sharded tensors are put together (:mod:`compare.assembly`): "A" or "B",
    the distributed side, if it holds shards and the other is not distributed; "A and B" when
    both are distributed in different layouts (other ranks, or the same records sharded
    otherwise); "" otherwise (the ranks pair one by one)."""
    distributed = [any(s.rank is not None for s in d.steps) for d in (a, b)]
    if distributed[0] != distributed[1]:
        side, dump = ("A", a) if distributed[0] else ("B", b)
        return side if sharded_ranks(dump) else ""
    if distributed[0] and (sharded_ranks(a) or sharded_ranks(b)) and _layouts(a) != _layouts(b):
        return "A and B"
    return ""


def _layouts(dump: Dump) -> tuple[frozenset, frozenset]:
    """A distributed dump's ranks, and how its lowest rank's records are sharded."""
    index = dump.index
    lowest = index[(index["rank"] == index["rank"].min()) & (index["placements"] != "")]
    return (frozenset(s.rank for s in dump.steps), frozenset(zip(
        lowest["module"], lowest["call_idx"], lowest["kind"], lowest["index"],
        lowest["mesh_shape"], lowest["placements"])))


def _check_same_model(a: Dump, b: Dump, rows_a: pd.DataFrame, rows_b: pd.DataFrame) -> None:
    """Raise :class:`DumpError` when fewer than half the modules of the side that recorded
    fewer have a namesake in the other: the dumps record different models, or B's modules
    were renamed (a side may record a subset: ``include=``)."""
    names = [sorted({m for m in rows["module"].unique() if m and fmt.split_op(m) is None})
             for rows in (rows_a, rows_b)]
    common = set(names[0]) & set(names[1])
    fewer = min(len(names[0]), len(names[1]))
    if not fewer or 2 * len(common) >= fewer:
        return
    only_a, only_b = ([m for m in side if m not in common][:2] for side in names)
    raise DumpError(f"{a.path} / {b.path}: the dumps record different models: {len(common)} of "
                    f"A's {len(names[0])} modules have a namesake among B's {len(names[1])} (A "
                    f"has {', '.join(only_a)}, B {', '.join(only_b)}); if B's modules were "
                    f"renamed, `h5cmp A B --suggest-map` prints rules for --map")


def _name_mapping(given: Union[NameMapping, PathLike, None], rows_a: pd.DataFrame,
                  rows_b: pd.DataFrame) -> Optional[NameMapping]:
    """The rules given, or a prefix that pairs most of B's modules when most do not pair."""
    if isinstance(given, NameMapping):
        return given
    if given is not None:
        return load_mapping(given)
    modules_a, modules_b = set(rows_a["module"]), set(rows_b["module"])
    if len(modules_a & modules_b) * 2 >= len(modules_b):
        return None
    return find_prefix(modules_a, modules_b)


def _one_to_one(mapping: NameMapping, before: pd.DataFrame, after: pd.DataFrame) -> pd.DataFrame:
    """``after`` (B's rows renamed), refused if the rules gave two of B's records one key."""
    clash = after.duplicated(KEY, keep=False).to_numpy()
    if clash.any():
        first, second = (before[clash].iloc[i] for i in (0, 1))
        raise DumpError(f"{mapping.origin}: two of B's records get one name: {first['module']!r} "
                        f"and {second['module']!r} both become "
                        f"{after[clash].iloc[0]['module']!r} ({first['kind']} "
                        f"{after[clash].iloc[0]['index']}); make the rules one-to-one")
    return after


class _PairRef(NamedTuple):
    """What a worker needs to compare one pair (picklable)."""

    row: int
    dataset_a: str
    dataset_b: str
    group_a: str
    group_b: str
    dtype_a: str
    dtype_b: str
    encoding_a: str
    encoding_b: str
    shape_a: tuple
    shape_b: tuple
    status_a: str
    status_b: str
    checksum_a: int
    checksum_b: int
    digest_a: int
    digest_b: int
    grad_scale_a: float  # the loss scale each side's values carry
    grad_scale_b: float
    parts_a: tuple   # a sharded tensor's parts (compare.assembly), () for a stored one
    parts_b: tuple
    normalized: int  # parameter length of the normalization it is the input of, else 0
    per_channel: bool  # that normalization is a BatchNorm
    eps: float  # its eps, NaN where the dumps do not say
    stats_a: tuple
    stats_b: tuple
    sketch_a: tuple
    sketch_b: tuple

    @property
    def both_values(self) -> bool:
        return bool(self.dataset_a) and bool(self.dataset_b)

    @property
    def hashed(self) -> bool:
        """Their bits are compared: a side holds a digest and nothing else to compare (a
        hash mode record), and the other a digest or values. Where both sides have values or
        statistics (a parameter's digest comes with them), those are compared: they say how
        much the values differ."""
        sides = ((self.digest_a, self.dataset_a, self.stats_a),
                 (self.digest_b, self.dataset_b, self.stats_b))
        return any(digest != fmt.NO_DIGEST and not dataset and not described(stats)
                   for digest, dataset, stats in sides) and all(
            digest != fmt.NO_DIGEST or dataset for digest, dataset, _ in sides)

    @property
    def assembled(self) -> bool:
        """A side is a sharded tensor put together from its parts (compare.assembly)."""
        return bool(self.parts_a) or bool(self.parts_b)

    @property
    def dropped(self) -> bool:
        return fmt.ST_DROPPED in (self.status_a, self.status_b)

    @property
    def unsupported(self) -> bool:
        return fmt.ST_UNSUPPORTED in (self.status_a, self.status_b)


def _check_distinct(a: Dump, b: Dump) -> None:
    files_a = {os.path.realpath(s.path) for s in a.steps}
    same = files_a & {os.path.realpath(s.path) for s in b.steps}
    if same:
        raise DumpError(f"{sorted(same)[0]}: the same file is on both sides; pass two different dumps")


def _tasks(pairs: pd.DataFrame, files_a: dict, files_b: dict, jobs: int, chunk_elements: int,
           rtol, atol, eps: dict[tuple, float]) -> list[tuple]:
    """Work units: (step file A, step file B, rows); a step's rows are split so every job has
    work. ``eps``: each normalization's, by (epoch, step, rank, module)."""
    keys = zip(pairs["epoch"], pairs["step"], pairs["rank"], pairs["module"])
    both = pairs.assign(normalized=normalized_sizes(pairs),
                        per_channel=per_channel(pairs["cls_a"]),
                        eps=[eps.get(k, math.nan) for k in keys])[pairs["side"] == "both"]
    groups = list(both.groupby(["epoch", "step", "rank"], sort=True))
    pieces = max(1, -(-jobs * 2 // max(1, len(groups)))) if jobs > 1 else 1
    tasks = []
    for key, rows in groups:
        numbers = [rows[[c + side for c in names]].itertuples(index=False, name=None)
                   for names in (fmt.STAT_COLUMNS, fmt.SKETCH_COLUMNS) for side in ("_a", "_b")]
        columns = list(_PairRef._fields[1:-4])
        records = [_PairRef(*t, *n) for t, *n in zip(rows[columns].itertuples(name=None),
                                                      *numbers)]
        for part in np.array_split(np.arange(len(records)), min(pieces, len(records))):
            tasks.append((files_a[key].path, files_b[key].path, files_a[key].group_name,
                          files_b[key].group_name, [records[i] for i in part], chunk_elements,
                          rtol, atol))
    return tasks


def _run_task(task: tuple) -> dict[int, dict]:
    path_a, path_b, group_a, group_b, records, chunk_elements, rtol, atol = task
    out: dict[int, dict] = {}
    acc: Optional[ErrorAccumulator] = None
    with open_h5(path_a) as fa, open_h5(path_b) as fb:
        values = [r for r in records if r.both_values and not r.dropped and not r.hashed
                  and not r.assembled]
        side_a, side_b = (_Side(path, hard_link(path, f, group, "step group", h5py.Group))
                          for path, f, group in ((path_a, fa, group_a), (path_b, fb, group_b)))
        pieces = _pair_pieces(side_a, side_b, values, chunk_elements)
        blocks = PartReader(chunk_elements)
        with reading(f"{path_a} / {path_b}"), contextlib.closing(blocks):
            for r in records:
                if r.assembled and not (r.dropped or r.unsupported):
                    out[r.row] = _compare_assembled(side_a, side_b, r, rtol, atol, blocks,
                                                    chunk_elements)
                elif r.hashed and not r.dropped:
                    out[r.row] = _compare_digests(r)
                elif r.dropped or not r.both_values:
                    out[r.row] = _compare_described(side_a, side_b, r, chunk_elements, rtol,
                                                    atol)
            for ref, a, b in prefetched(pieces):
                tol = pair_tolerance(ref.dtype_a, ref.dtype_b, rtol, atol)
                if tuple(ref.shape_a) != tuple(ref.shape_b):
                    out[ref.row] = {"status": SHAPE_MISMATCH, "rtol": tol.rtol, "atol": tol.atol}
                elif a is not None:
                    acc = acc or ErrorAccumulator(
                        tol, Centering(tuple(ref.shape_a), ref.normalized, ref.per_channel,
                                       ref.eps)
                        if ref.normalized else None,
                        row=rows_measured(tuple(ref.shape_a), chunk_elements))
                    acc.update(a, b)
                else:
                    out[ref.row] = {**(acc or ErrorAccumulator(tol)).result(),
                                    "rtol": tol.rtol, "atol": tol.atol}
                    acc = None
    return out


def _compare_assembled(side_a: "_Side", side_b: "_Side", r: _PairRef, rtol, atol,
                       blocks: PartReader, chunk_elements: int) -> dict:
    """A pair where a side is a sharded tensor put together from its parts: compared region
    by region (:func:`compare.assembly.compare_parts`); the other side, if stored whole, is
    one part of itself."""
    tol = pair_tolerance(r.dtype_a, r.dtype_b, rtol, atol)
    if tuple(r.shape_a) != tuple(r.shape_b):
        return {"status": SHAPE_MISMATCH, "rtol": tol.rtol, "atol": tol.atol}
    if not r.both_values:  # values put together against statistics: not supported
        return {"status": UNSUPPORTED, "rtol": tol.rtol, "atol": tol.atol}
    parts = [tuple(part._replace(grad_scale=scale) for part in parts or (whole_part(
                 side.path, side.group.name.lstrip("/"), group, dataset, dtype, encoding, shape,
                 checksum),))
             for parts, side, group, dataset, dtype, encoding, shape, checksum, scale in (
                 (r.parts_a, side_a, r.group_a, r.dataset_a, r.dtype_a, r.encoding_a, r.shape_a,
                  r.checksum_a, r.grad_scale_a),
                 (r.parts_b, side_b, r.group_b, r.dataset_b, r.dtype_b, r.encoding_b, r.shape_b,
                  r.checksum_b, r.grad_scale_b))]
    return compare_parts(parts[0], parts[1], tol, blocks, chunk_elements)


class _Side(NamedTuple):
    """One side's open step file: its path (for messages) and its step group."""

    path: Path
    group: h5py.Group

    def dataset(self, group: str, name: str, dtype: str, encoding: str, shape: tuple):
        return dataset_of(self.path, self.group, group, name, dtype, encoding, shape)


def _compare_digests(r: _PairRef) -> dict:
    """A pair where a side holds a digest (hash mode): its bits against the other side's digest,
    or the checksum of its dataset (the same number for the same bytes)."""
    bits = [digest if digest != fmt.NO_DIGEST else checksum
            for digest, checksum in ((r.digest_a, r.checksum_a), (r.digest_b, r.checksum_b))]
    numel = int(np.prod(r.shape_a)) if tuple(r.shape_a) == tuple(r.shape_b) else np.nan
    same = bits[0] == bits[1] and r.dtype_a == r.dtype_b and tuple(r.shape_a) == tuple(r.shape_b)
    return {"status": EQUAL if same else HASH_MISMATCH, "numel": numel}


def _compare_described(side_a: _Side, side_b: _Side, r: _PairRef, chunk_elements: int, rtol,
                       atol) -> dict:
    """A pair where a side was dropped, is unsupported or holds statistics only: compare what
    is known (a side holding only a digest, against statistics: unsupported); where both sides'
    bits are known too (parameters: a digest besides their statistics), ``equal`` only for
    equal bits."""
    tol = pair_tolerance(r.dtype_a, r.dtype_b, rtol, atol)
    known = all(dataset or described(stats) for dataset, stats in (
        (r.dataset_a, r.stats_a), (r.dataset_b, r.stats_b)))  # a digest against statistics: not
    if r.dropped or r.unsupported or not known:
        status = DROPPED if r.dropped else UNSUPPORTED
        return {"status": status, "rtol": tol.rtol, "atol": tol.atol}
    datasets = [side.dataset(group, dataset, dtype, encoding, shape) if dataset else None
                for side, dataset, group, dtype, encoding, shape in (
                    (side_a, r.dataset_a, r.group_a, r.dtype_a, r.encoding_a, r.shape_a),
                    (side_b, r.dataset_b, r.group_b, r.dtype_b, r.encoding_b, r.shape_b))]
    if tuple(r.shape_a) != tuple(r.shape_b):
        return {"status": SHAPE_MISMATCH, "rtol": tol.rtol, "atol": tol.atol}
    sides, sketches = [], []
    # the sides known by statistics all have a sketch: sketch the sides with values as well
    sketched = all(sketch_sums(sketch) for dataset, sketch in (
        (r.dataset_a, r.sketch_a), (r.dataset_b, r.sketch_b)) if not dataset)
    for ds, dtype, encoding, checksum, scale, stats, sketch in (
            (datasets[0], r.dtype_a, r.encoding_a, r.checksum_a, r.grad_scale_a, r.stats_a,
             r.sketch_a),
            (datasets[1], r.dtype_b, r.encoding_b, r.checksum_b, r.grad_scale_b, r.stats_b,
             r.sketch_b)):
        stats, sketch = unscaled_stats(stats, sketch, scale)
        if ds is not None:
            def chunks():
                return read_chunks(ds, dtype, encoding, chunk_elements, int(checksum), scale)
            stats = stats_of_chunks(chunks())
            if sketched:
                sketch = sketch_of_chunks(chunks())
        sides.append(stats)
        sketches.append(sketch)
    result = compare_stats(sides[0], sides[1], tol, *sketches)
    result["numel"] = int(np.prod(r.shape_a))
    bits = _bits(r)
    if bits is not None and result["status"] in (EQUAL, CLOSE):  # the bits say more
        result["status"] = EQUAL if bits[0] == bits[1] else CLOSE
    return {**result, "rtol": tol.rtol, "atol": tol.atol}


def _bits(r: _PairRef) -> Optional[tuple[int, int]]:
    """Both sides' digests (or their datasets' checksums), where both have one and their
    dtypes are one: equal for equal bits (statistics equal for +0.0 and -0.0, or elements in
    another order)."""
    bits = [digest if digest != fmt.NO_DIGEST else checksum if dataset else fmt.NO_DIGEST
            for digest, checksum, dataset in ((r.digest_a, r.checksum_a, r.dataset_a),
                                              (r.digest_b, r.checksum_b, r.dataset_b))]
    if fmt.NO_DIGEST in bits or fmt.NO_CHECKSUM in bits or r.dtype_a != r.dtype_b:
        return None
    return bits[0], bits[1]


def _pair_pieces(side_a: _Side, side_b: _Side, records: list[_PairRef], chunk_elements: int):
    """``(ref, a, b)`` for each aligned chunk pair of each record, then ``(ref, None, None)``."""
    for r in records:
        # opened (and so checked against the index) even when the shapes differ: a shape
        # mismatch is reported only between datasets that hold what their index rows say
        ds_a = side_a.dataset(r.group_a, r.dataset_a, r.dtype_a, r.encoding_a, r.shape_a)
        ds_b = side_b.dataset(r.group_b, r.dataset_b, r.dtype_b, r.encoding_b, r.shape_b)
        if tuple(r.shape_a) == tuple(r.shape_b):
            # zip_longest, not zip: both sides' readers must end, which checks their checksums
            for a, b in itertools.zip_longest(
                    read_chunks(ds_a, r.dtype_a, r.encoding_a, chunk_elements, int(r.checksum_a),
                                r.grad_scale_a),
                    read_chunks(ds_b, r.dtype_b, r.encoding_b, chunk_elements, int(r.checksum_b),
                                r.grad_scale_b)):
                yield r, a, b
        yield r, None, None


def _other_code(pairs: pd.DataFrame) -> bool:
    """Whether the runs ran other ops in a module whose ops both recorded (ops one side only
    recorded, dumped with ``ops=`` in one run, are no difference in the code)."""
    owners = pairs["module"].map(lambda m: (fmt.split_op(m) or (None,))[0])
    is_op = owners.notna()
    both = set(owners[is_op & pairs["side"].eq("both")])
    return bool((is_op & pairs["side"].ne("both") & owners.isin(both)).any())


def _result_frame(pairs: pd.DataFrame, metrics: dict[int, dict], base: dict[str, int]
                  ) -> pd.DataFrame:
    """Pairs plus their metrics; identity columns from side A, or B where A has no record;
    the ``reason`` of each pair whose side put together holds replicas that differ (``base``:
    each side's base rank)."""
    frame = pairs.copy()
    for col in ("seq", "call", "producer", "addends", "cls", "path"):
        frame[col] = frame[f"{col}_a"].fillna(frame[f"{col}_b"])
    # a parameter handed on, whichever side says so (files before 2026-11-29 cannot)
    handed = (frame["producer_a"] == fmt.PRODUCER_PARAMETER) | (
        frame["producer_b"] == fmt.PRODUCER_PARAMETER)
    frame.loc[handed, "producer"] = fmt.PRODUCER_PARAMETER
    known = frame["micro_batch_a"].notna() & (frame["micro_batch_a"] != fmt.NO_MICRO_BATCH)
    frame["micro_batch"] = frame["micro_batch_a"].where(known, frame["micro_batch_b"]).fillna(
        fmt.NO_MICRO_BATCH)
    frame["injected"] = frame["injected_b"].fillna(0)  # B ran on A's value here (B injected)
    frame[["seq", "call", "producer", "micro_batch", "injected"]] = frame[
        ["seq", "call", "producer", "micro_batch", "injected"]].astype("int64")
    computed = pd.DataFrame.from_dict(metrics, orient="index")
    frame = frame.join(computed)
    op = np.array([fmt.split_op(m) is not None for m in frame["module"]], dtype=bool)
    for side, missing, op_only in (("a_only", MISSING_IN_B, OP_ONLY_IN_A),
                                   ("b_only", MISSING_IN_A, OP_ONLY_IN_B)):
        lone = (frame["side"] == side).to_numpy()
        frame.loc[lone & ~op, "status"] = missing
        frame.loc[lone & op, "status"] = op_only
    for col in [*METRIC_COLUMNS, "transit_rel_diff", *RECOMPUTE_FIGURES, "recomputed_stride",
                "rtol", "atol",
                "shard_rank"]:
        if col not in frame:
            frame[col] = np.nan
    for col in ("transit_from", "recomputed_dtype"):
        frame[col] = frame.get(col, pd.Series("", index=frame.index)).fillna("")
    frame["reason"] = ""
    for side in ("b", "a"):  # A's, where both sides' replicas differ
        note = frame[f"replicas_differ_{side}"].fillna("")
        mismatch = ((frame["side"] == "both") & (note != "")).to_numpy()
        frame.loc[mismatch, "status"] = REPLICA_MISMATCH
        frame.loc[mismatch, "reason"] = (
            f"{side.upper()}'s ranks hold different copies of this replicated tensor: "
            + note[mismatch] + f"; rank {base[side]}'s is compared (h5cmp {side.upper()} "
            f"--ranks lists every disagreement)")
    frame["rank"] = frame["rank"].where(frame["rank"] >= 0, None)
    return frame[[*PAIR_COLUMNS, "reason"]].reset_index(drop=True)

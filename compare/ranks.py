"""Rank consistency: the ranks of one distributed run compared where they must agree.

Data-parallel replicas hold the same weights at every step (DDP broadcasts them once, then
every rank applies the same all-reduced gradient), FSDP's ranks gather the same unsharded
parameters for each module call, and a replicated ``DTensor`` is the same on every rank of its
mesh. A rank that holds another value there is a finding in itself: a broken all-reduce, a
rank that skipped a step, an unsynchronized random generator. Everything else differs across
ranks by design (each rank's batch, its shard) and is left out.
"""
from __future__ import annotations

import copy
from os import PathLike
from typing import Iterable, Optional, Union

import pandas as pd

from . import format as fmt
from .comparison import compare_dumps
from .dump import Dump, StepFile, load_dump
from .errors import DumpError
from .status import CARRYING

# what must agree across ranks, as reports say it
REPLICAS = "parameters and their gradients that are not sharded, and replicated DTensors"
BASE_RANK = "base_rank"  # result column: the rank each row's rank is compared against


def must_agree(index: pd.DataFrame) -> pd.Series:
    """Rows of a step's index that every rank must hold alike: parameters that are not
    sharded and their gradients (data-parallel replicas; the gradients the optimizer steps with,
    after the all-reduce), and any record of a DTensor replicated over its whole mesh
    (placements all R)."""
    replicated = index["placements"].map(
        lambda text: bool(text) and set(fmt.parse_placements(text)) == {"R"})
    return (index["kind"].isin([fmt.PARAM, fmt.PARAM_GRAD]) & (index["placements"] == "")
            & (index["index"] >= 0)) | replicated  # (not a normalization's eps row)


def compare_ranks(run: Union[PathLike, str, Dump], *, steps: Optional[Iterable[str]] = None,
                  modules: Optional[Iterable[str]] = None,
                  kinds: Optional[Iterable[str]] = None, jobs: int = 1) -> pd.DataFrame:
    """Each rank of the distributed dump ``run`` against its lowest rank, over the records
    that must agree (:func:`must_agree`), step by step.

    One row per record and compared rank, with ``compare_dumps``' columns (``rank``: the
    compared rank; :data:`BASE_RANK`: the rank it is compared against) and statuses judged
    exactly (``rtol = atol = 0``): a replica is its base's, bit for bit, or it differs.
    ``steps``, ``modules`` and ``kinds`` select as for ``compare_dumps``. Raises
    :class:`DumpError` for a dump of fewer than two ranks or with nothing that must agree.
    """
    dump = load_dump(run)
    ranks = sorted({s.rank for s in dump.steps if s.rank is not None})
    if len(ranks) < 2:
        held = f"rank {ranks[0]} only" if ranks else "no distributed step"
        raise DumpError(f"{dump.path}: comparing ranks needs a dump of two or more ranks "
                        f"(it holds {held}); pass the directory of every rank's step files")
    base = ranks[0]
    frames = []
    for rank in ranks[1:]:
        replicas_a, replicas_b = _replicas(dump, base, base), _replicas(dump, rank, base)
        if not (replicas_a and replicas_b):
            continue
        frame = compare_dumps(Dump(dump.path, replicas_a), Dump(dump.path, replicas_b), 0.0,
                              0.0, steps=steps, modules=modules, kinds=kinds, jobs=jobs)
        frames.append(frame.assign(rank=rank, **{BASE_RANK: base}))
    if not frames:
        raise DumpError(f"{dump.path}: no record that every rank must hold alike ({REPLICAS}); "
                        f"dump parameters (the default kinds) to compare ranks")
    result = pd.concat(frames, ignore_index=True)
    return result.sort_values(["epoch", "step", "seq", "rank"], kind="stable",
                              ignore_index=True)


def _replicas(dump: Dump, rank: int, label: int) -> list[StepFile]:
    """The steps of ``rank`` with only the rows that must agree, relabelled as rank ``label``
    (so that they pair with the base rank's)."""
    steps = []
    for step in dump.steps:
        if step.rank == rank:
            kept = copy.copy(step)
            kept.index = step.index[must_agree(step.index)]
            kept.rank = label
            if len(kept.index):
                steps.append(kept)
    return steps


def first_disagreement(result: pd.DataFrame) -> Optional[pd.Series]:
    """The first failing row in execution order (step, then the run's order; the lowest rank
    first), or None when every rank agrees."""
    failing = result[result["status"].isin(CARRYING)]
    return None if failing.empty else failing.iloc[0]


def describe(result: pd.DataFrame) -> str:
    """The text ``h5cmp RUN --ranks`` prints: what was compared and the first disagreement."""
    ranks = sorted(set(result["rank"]))
    base = int(result[BASE_RANK].iloc[0])
    steps = result[["epoch", "step"]].drop_duplicates()
    compared = (f"{len(result)} records of {len(steps)} step(s) that every rank must hold alike "
                f"({REPLICAS}), ranks {', '.join(map(str, ranks))} against rank {base}")
    first = first_disagreement(result)
    if first is None:
        return f"every rank agrees with rank {base} bit for bit: {compared}"
    label = fmt.record_label(first["module"], first["cls"], int(first["call_idx"]),
                             first["kind"], int(first["index"]), int(first["occurrence"]))
    how = first["status"] if pd.isna(first.get("max_abs_err")) else \
        f"{first['status']}, max abs err {first['max_abs_err']:.3g}"
    failing = int(result["status"].isin(CARRYING).sum())
    return (f"first disagreement: step {first['epoch']}:{first['step']}, rank {first['rank']} "
            f"differs from rank {base} in {label} {first['path']} ({how}); {failing} "
            f"disagreeing record(s) in all. Compared: {compared}")

"""Human-readable listing of one dump: steps, module calls, tensors, dtypes and shapes (and
statistics, without the loss scale a gradient was held at)."""
from __future__ import annotations

from typing import Union

from . import format as fmt
from .dump import Dump, PathLike, load_dump


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError


def format_tree(dump: Union[PathLike, Dump]) -> str:
    """The structure of ``dump`` as text: one block per step, one line per call and per record."""
    dump = load_dump(dump)
    lines = []
    for step in dump.steps:
        idx = step.index
        a = step.attrs
        lines.append(f"{step.path.name}  epoch {step.epoch} step {step.step}"
                     f"{'' if step.rank is None else f' rank {step.rank}'}: "
                     f"{idx['call'].nunique()} module calls, {(idx['dataset'] != '').sum()} tensors, "
                     f"{_size(step.path.stat().st_size)}; torch {a.get('torch_version')}, "
                     f"{a.get('device')}, format v{a.get('format_version')}")
        if step.incomplete:
            lines.append(f"  INCOMPLETE: {step.incomplete}; records after the failure are missing")
        lines.append(f"  /{step.group_name}")
        for group, rows in idx.sort_values(["call", "seq"]).groupby("call", sort=True):
            lines.append(f"    {rows['group'].iloc[0]}")
            for r in rows.itertuples():
                if r.dataset:
                    name = r.dataset
                else:  # statistics, dropped or non-tensor: no dataset to name
                    name = f"({r.kind}_{r.index})" if r.index >= 0 else f"({r.kind})"
                shape = "[" + ", ".join(map(str, r.shape)) + "]"
                detail = r.value if not r.dataset else ""
                scale = r.grad_scale  # a GradScaler's: the values held are that many times theirs
                if r.stat_nan == r.stat_nan:  # statistics row (NaN = not computed)
                    detail = (f"min={r.stat_min / scale:.4g} max={r.stat_max / scale:.4g} "
                              f"mean={r.stat_mean / scale:.4g} std={r.stat_std / scale:.4g} "
                              f"nan={r.stat_nan:.0f} inf={r.stat_inf:.0f}")
                if scale != fmt.NO_GRAD_SCALE:
                    detail += (f"{'  ' if detail else ''}(held at loss scale {scale:g}"
                               f"{', divided out' if r.stat_nan == r.stat_nan else ''})")
                status = "" if r.status == "ok" else f"  [{r.status}]"
                lines.append(f"      {name:<16} {r.dtype:<14} {shape:<18} {r.path}"
                             f"{'  ' + detail if detail else ''}{status}")
    return "\n".join(lines)


def print_tree(dump: Union[PathLike, Dump]) -> None:
    print(format_tree(dump))

"""Localizing an error: accumulated vs local error per record, from three dumps.

``reference`` is the trusted run A, ``free`` the suspect run B left alone, ``injected`` the
suspect run re-run on A's values (``HookerAndDumper(..., inject=A)``, see
``dumper.injection``): every module call computed from A's inputs, weights and incoming
gradients, so a module can only be wrong there by itself. Comparing A with the injected run
gives each record's *local* error, judged by the same error model as any comparison (against
what comparable records of the injected run add, e.g. every bfloat16 Linear adds about the
same rounding; a module adding thirty times that is an origin). What arrived at a module
before it was replaced (an input or an incoming gradient, flagged ``injected``) is judged
too: its local error is that of the code between modules (a residual add, rotary embedding,
the attention around a projection, the loss).

Which records are judged: those of the directions that were injected (forward records when
inputs were, backward records when incoming gradients were), read from the ``injected`` flags
of the injected dump. A dump made with a standalone ``Injector`` (no flags: the dumper saw the
injected values only) is read by values instead: a call counts as injected where its inputs
(or incoming gradients) are A's, up to the rounding of B's dtype.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping, Optional

import numpy as np
import pandas as pd

from . import format as fmt
from . import status as st
from .comparison import compare_dumps
from .dump import Dump, PathLike, load_dump
from .errors import DumpError
from .precision import cast_rounding, rounding_of
from .sources import STEP_KEY, enclosing_modules

ORIGINS_SHOWN = 10  # origins listed by describe_origins
OPS_SUSPECTS = 3  # modules whose own code ops_suspects names at most
# What a module makes, and what must have been injected for its error to be local.
PRODUCED = {fmt.OUTPUT: fmt.INPUT, fmt.GRAD_INPUT: fmt.GRAD_OUTPUT}
DIRECTION_KINDS = {"forward": fmt.FORWARD_KINDS, "backward": fmt.BACKWARD_KINDS}
KEY = ["epoch", "step", "rank", "module", "cls", "call_idx", "kind", "index", "occurrence"]
CALL = ["epoch", "step", "rank", "module", "call_idx"]
JUDGED = ["status", "rel_error", "added_ratio", "reason", "same_as"]


def localize(reference: PathLike | Dump, free: PathLike | Dump, injected: PathLike | Dump,
             rtol: Optional[float] = None, atol: Optional[float] = None, *,
             steps: Optional[Iterable[str]] = None, modules: Optional[Iterable[str]] = None,
             free_result: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """One row per record of the injected run that carries local error only (see the module
    docstring), in execution order, with ``local_*`` (injected vs reference) and
    ``accumulated_*`` (free vs reference) status, rel_error, added_ratio, reason and same_as
    (the record of the same tensor judged first, where this is a later one), the
    ``injected`` flag (1: what arrived, replaced by A's value before the module ran), the
    ``call`` number and a ``verdict``: ``origin`` (wrong even from the reference's values),
    ``inherited`` (wrong only in the free run), ``fine``. Records the injected run has and the
    reference has not, or the other way round (an in-place module fed a copy makes a gradient
    the original run merges), are no origin. ``free_result``: ``compare_dumps(reference, free,
    ...)`` if already done. Where none is an origin, :func:`ops_suspects` says which modules'
    own code to dump op by op.

    Raises :class:`~compare.errors.DumpError` where ``injected`` cannot give local errors: it
    was injected from another dump, none of its calls ran on the reference's values, or its
    modules ran on weights that differ from the reference's, which it did not inject (the
    reference holds no values of them: dumped without ``params=True``)."""
    ref, rerun = load_dump(reference), load_dump(injected)
    _check_source(ref, rerun)
    acc = free_result if free_result is not None else compare_dumps(
        ref, free, rtol, atol, steps=steps)
    loc = compare_dumps(ref, rerun, rtol, atol, steps=steps)
    judged_locally = _judged_locally(loc)
    if not (loc["injected"] == 1).any():
        _check_replaced(ref, rerun, loc, acc)
    local = loc[judged_locally]
    _check_weights(ref, rerun, loc, local)
    judged = local[KEY + ["seq", "call", "injected"] + JUDGED].merge(
        acc[KEY + JUDGED], on=KEY, how="left", suffixes=("_local", "_accumulated"))
    judged = judged.rename(columns={f"{c}_local": f"local_{c}" for c in JUDGED}
                           | {f"{c}_accumulated": f"accumulated_{c}" for c in JUDGED})
    judged["verdict"] = np.where(  # a record only one run has is no local error
        judged["local_status"].isin(st.VALUE_FAILURES), st.ORIGIN,
        np.where(judged["accumulated_status"].isin(st.CARRYING), st.INHERITED, st.FINE))
    if modules:
        patterns = list(modules)
        judged = judged[[fmt.module_matches(m, c, patterns)
                         for m, c in zip(judged["module"], judged["cls"])]]
    return judged.reset_index(drop=True)


def _injected_from(rerun: Dump) -> set[tuple[str, tuple[str, ...]]]:
    """The (reference, kinds) the re-run's steps say they were injected from (none: no
    ``injected_from``, e.g. a standalone :class:`~dumper.injection.Injector`)."""
    return {fmt.parse_injected_from(str(s.attrs.get(fmt.ATTR_INJECTED_FROM, "")))
            for s in rerun.steps} - {("", ())}


def _check_source(ref: Dump, rerun: Dump) -> None:
    """The re-run must have been injected from the reference: by name, as dumps get moved (a
    directory, or a step file in it, on either side; given as it was, or resolved: ``.``, a
    link)."""
    names = _dump_names(ref.path) | _dump_names(ref.path.resolve())
    for source, _ in _injected_from(rerun):
        if not names & (_dump_names(Path(source)) | _dump_names(Path(source).resolve())):
            raise DumpError(f"{rerun.path}: a re-run on the values of {source}, not of A "
                            f"({ref.path}); compare it with the dump it was injected from")


def _dump_names(path: Path) -> set[str]:
    """The names a dump goes by: its own, and its directory's for a step file."""
    return {path.name} | ({path.parent.name} if fmt.parse_step_file_name(path.name) else set())


def _check_replaced(ref: Dump, rerun: Dump, loc: pd.DataFrame, acc: pd.DataFrame) -> None:
    """Without ``injected`` flags: some call must have had its inputs (or incoming gradients)
    replaced by the reference's, i.e. within rounding of them in the re-run where the free run
    is not (where the free run never strays, there is nothing to tell)."""
    rerun_within, free_within = _upstream_within(loc), _upstream_within(acc)
    strayed = free_within[~free_within]
    if strayed.empty or rerun_within.reindex(strayed.index, fill_value=False).any():
        return
    raise DumpError(f"{rerun.path}: no module call in it ran on A's ({ref.path}) values, so it "
                    f"is not a re-run of B on them; make one with HookerAndDumper(..., "
                    f"inject=A) in B's training loop (A dumped with params=True)")


def _check_weights(ref: Dump, rerun: Dump, loc: pd.DataFrame, local: pd.DataFrame) -> None:
    """The judged modules' weights must be the reference's: equal in both runs, or no further
    off than the cast to B's dtype moves them (compared on both sides), or injected (the
    reference holds their values and the re-run injected ``param``)."""
    kinds = {k for _, ks in _injected_from(rerun) for k in ks}
    params = loc[fmt.holds_weights(loc["kind"], loc["producer"])
                 & loc["status"].isin(st.COMPARED | {st.INHERITED})]
    # a parameter handed on as an input is A's where B ran on A's value of that input
    params = params[(params["kind"] == fmt.PARAM) | (params["injected"] != 1)]
    # A's weights in B's dtype: bit-identical, or no further off than the cast to it moves them
    cast = [cast_rounding(a, b) for a, b in zip(params["dtype_a"], params["dtype_b"])]
    params = params[(params["status"] != st.EQUAL)
                    & ~(params["rel_error"] <= np.array(cast) * (1 + 1e-9))]
    judged = set(zip(local["epoch"], local["step"], local["module"]))
    params = params[[k in judged for k in zip(params["epoch"], params["step"], params["module"])]]
    if params.empty:
        return
    index = ref.index
    held = set(zip(*(index.loc[(index["kind"] == fmt.PARAM) & (index["dataset"] != ""), c]
                     for c in ("epoch", "step", "module", "index"))))
    injected = fmt.PARAM in kinds or not kinds  # a standalone injector: by what A holds
    for r in params.itertuples():
        if r.kind == fmt.PARAM and injected and (r.epoch, r.step, r.module, r.index) in held:
            continue
        if r.kind == fmt.INPUT:  # a parameter handed on
            why = "the re-run did not inject that input (inject 'input' into that call)"
        elif injected:
            why = f"A ({ref.path}) holds no values of them there (dump A with params=True)"
        else:
            why = "the re-run did not inject 'param'"
        raise DumpError(
            f"{rerun.path}: its modules ran on their own weights, which differ from A's at "
            f"step {fmt.step_label(r.epoch, r.step, r.rank)} (first: "
            f"{fmt.record_label(r.module, r.cls, r.call_idx, r.kind, r.index)}, rel error "
            f"{r.rel_error:.3g}), and {why}: its errors are not local; re-run B with "
            f"inject=A (A dumped with params=True)")


def _judged_locally(loc: pd.DataFrame) -> pd.Series:
    """Rows of the comparison with the injected run that carry local error only."""
    flagged = loc[loc["injected"] == 1]
    if len(flagged):
        out = pd.Series(False, index=loc.index)
        for kinds in DIRECTION_KINDS.values():
            if flagged["kind"].isin(list(kinds)).any():
                out |= loc["kind"].isin(list(kinds))
        return out
    return _upstream_injected(loc)


def _upstream_within(frame: pd.DataFrame) -> pd.Series:
    """Per (call, produced kind): whether every upstream record of the call (inputs for an
    output, incoming gradients for a grad_input) is present in both runs and no element is
    further from the reference than rounding it to B's dtype moves it (one unit roundoff)."""
    unit = frame["dtype_b"].map(lambda d: rounding_of(d).unit).fillna(0.0)
    within = (frame["status"] == st.EQUAL) | (frame["max_rel_err"] <= unit * (1 + 1e-9))
    calls = frame.assign(rank=frame["rank"].fillna(-1), within=within)
    parts = [calls[calls["kind"] == upstream].groupby(CALL)["within"].all().to_frame()
             .assign(produced=produced).set_index("produced", append=True)["within"]
             for produced, upstream in PRODUCED.items()]
    return pd.concat(parts) if parts else pd.Series(dtype=bool)


def _upstream_injected(loc: pd.DataFrame) -> pd.Series:
    """For an injected run without flags: the produced rows (outputs, grad_inputs) whose call
    had its upstream (inputs, incoming gradients) replaced (:func:`_upstream_within`)."""
    up = _upstream_within(loc)
    calls = loc.assign(rank=loc["rank"].fillna(-1))
    injected = pd.Series(False, index=loc.index)
    for produced in PRODUCED:
        rows = calls[calls["kind"] == produced]
        keys = [(*k, produced) for k in zip(*(rows[c] for c in CALL))]
        injected[rows.index] = [bool(up.get(k, False)) for k in keys]
    return injected


def ops_suspects(frame: pd.DataFrame, shown: int = OPS_SUSPECTS) -> list[str]:
    """Where :func:`localize`'s ``frame`` names no origin: ``ops=`` globs of the modules whose
    own code (the functional code around their children: attention, rotary embedding, residual
    adds) added the most to what arrived at a child, relative to what comparable code adds in
    the re-run, at most ``shown``, the most first. That code has no record of its own, so it
    is judged against the loose allowance of all such code together; dumped again with
    ``ops=`` these and ``skip_ops=()`` (the views between ops recorded too, which links them),
    it is judged op by op. A module whose ops both runs recorded already is none; [] where an
    origin is named, or nothing that arrived carries added error."""
    if (frame["verdict"] == st.ORIGIN).any():
        return []
    ratio = frame["local_added_ratio"].to_numpy(float)
    arrived = frame[(frame["injected"] == 1) & (frame["local_status"] == st.CLOSE)
                    & np.isfinite(ratio) & (ratio > 0)]
    both = frame[~frame["local_status"].isin(st.ONE_SIDED)]  # the re-run's ops, A's too
    recorded = {op[0] for op in map(fmt.split_op, both["module"]) if op is not None}
    steps = dict(list(frame.assign(rank=frame["rank"].fillna(-1)).groupby(STEP_KEY)))
    globs: list[tuple[float, str]] = []  # (added ratio, the enclosing module's ops= glob)
    for key, rows in arrived.assign(rank=arrived["rank"].fillna(-1)).groupby(STEP_KEY):
        # (of the calls in the table, not those filtered out)
        enclosing = enclosing_modules(steps[key])
        for call, ratio_of in zip(rows["call"], rows["local_added_ratio"]):
            path, cls = enclosing.get(int(call), (None, None))
            if path is not None and path not in recorded:
                globs.append((ratio_of, path or cls))  # the root by its class
    ordered = [glob for _, glob in sorted(globs, key=lambda g: -g[0])]
    return list(dict.fromkeys(ordered))[:shown]


def origin_aliases(frame: pd.DataFrame, origin: Mapping | pd.Series) -> pd.DataFrame:
    """The rows of :func:`localize`'s ``frame`` that are later records of ``origin``'s tensor
    in the re-run (a model's logits, which are its head's output: the gradient arriving at
    them is the head's grad_output too)."""
    return fmt.later_records(frame, origin, "local_same_as")


def describe_origins(frame: pd.DataFrame, shown: int = ORIGINS_SHOWN,
                     unexplained: bool = False) -> str:
    """Text: how many records are origins, inherit or are fine; the origins in execution order
    (at most ``shown``), each with why (the local reason) and the later records of its tensor
    (:func:`origin_aliases`). ``unexplained``: the free run differs from A more than two dumps
    can explain (it fails, or they cannot tell); where no origin is named then, which modules'
    own code to dump op by op (:func:`ops_suspects`)."""
    origins = frame[frame["verdict"] == st.ORIGIN]
    lines = [f"{len(frame)} records judged with the reference's values injected: "
             f"{len(origins)} origin, {int((frame['verdict'] == st.INHERITED).sum())} "
             f"inherited, {int((frame['verdict'] == st.FINE).sum())} fine"]
    for r in origins.head(shown).itertuples():
        ratio = ("" if not np.isfinite(r.local_added_ratio)
                 else f", {r.local_added_ratio:.0f}x the typical local error")
        arrived = ("" if not r.injected else
                   " (as it arrived: sent back by the code after this module)"
                   if r.kind in fmt.BACKWARD_KINDS else
                   " (as it arrived: made by the code before this module)")
        aliases = origin_aliases(frame, r._asdict())
        also = "" if aliases.empty else " (the same values as " + ", ".join(
            fmt.record_label(a.module, a.cls, a.call_idx, a.kind, a.index)
            for a in aliases.itertuples()) + ")"
        nonfinite = (f": {r.local_reason}" if not np.isfinite(r.local_rel_error)
                     and isinstance(r.local_reason, str) and r.local_reason else "")
        lines.append(f"  origin: step {fmt.step_label(r.epoch, r.step, r.rank)} "
                     f"{fmt.direction_of(r.kind)} "
                     f"{fmt.record_label(r.module, r.cls, r.call_idx, r.kind, r.index)}{arrived}"
                     f"{also} local rel error {r.local_rel_error:.3g}{ratio} "
                     f"(accumulated {r.accumulated_rel_error:.3g}){nonfinite}")
    if len(origins) > shown:
        lines.append(f"  ... {len(origins) - shown} more (compare.localize gives them all)")
    suspects = ops_suspects(frame) if unexplained else []
    if suspects:
        lines.append(f"  no recorded call is an origin; the code around them is judged only "
                     f"as a whole, loosely, and added the most in the own code of "
                     f"{', '.join(suspects)}: to judge it op by op, dump A, B and the re-run "
                     f"again with HookerAndDumper(..., ops={suspects!r}, skip_ops=())")
    return "\n".join(lines)

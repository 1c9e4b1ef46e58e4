"""Which recorded tensors each recorded tensor is computed from, as far as a dump can tell.

A dump records module calls, not every op, so the sources of a record are the recorded tensors
its values depend on, at module granularity (same step and rank; backward kinds of the same
backward pass):

=============  ==========================================================================
record         sources
=============  ==========================================================================
output         the call's inputs, its module's parameters, and the outputs of its direct child
               calls
input          the outputs of the call that produced it (``producer``); if unknown, what the
               parent call had by then: its inputs and parameters, and the outputs of the
               children that ran before this call; none for a parameter of the model the
               parent's code hands on (``PRODUCER_PARAMETER``: weights, as below)
grad_output    the call's outputs (what the loss was computed from), the grad_inputs of the
               calls that consumed them (the outermost: a consumer nested in another whose
               grad_input for them was compared sends back part of what the outer one does,
               as a residual block's first layer its branch's share), the parent's
               grad_output, and the grad_inputs of the children of the parent that ran after
               the call and may have used its outputs (not those fed only what calls before
               it made, or the values it was given: attention's value projection sends back
               nothing of the key projection's gradient); where no recorded call
               consumed the outputs (the parent's own code did: attention, a gated
               product) and the parent is not the outermost call, also what that code's
               backward uses: the parent's inputs and parameters and the outputs of its
               children that no recorded call consumed
grad_input     the call's grad_output, inputs, outputs and parameters, and the grad_inputs of
               its direct child calls
param_grad     grad_output (of every backward pass), inputs and outputs of every call of the
               module
param          none: the weights come from before the step
=============  ==========================================================================

An input of the root call has none either (the data); the root's grad_output comes from its
outputs (through the loss), and so does that of a child of the root whose outputs no recorded
call consumed and no later child may have used (the root's own code computed the loss from them:
:func:`loss_values`).
The parent of a call is the latest earlier call whose module path contains it
(``blocks.0`` contains ``blocks.0.attn``; the root, path ``""``, contains every module).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional

import numpy as np
import pandas as pd

from . import format as fmt
from . import status as st

STEP_KEY = ["epoch", "step", "rank"]


def parent_calls(calls: pd.DataFrame) -> dict[int, Optional[int]]:
    """``call -> parent call`` (None for outermost calls) of one step's calls (columns
    ``call, module``), by module path and call order."""
    parents: dict[int, Optional[int]] = {}
    stack: list[tuple[int, str]] = []
    for call, module in calls.sort_values("call")[["call", "module"]].itertuples(index=False):
        while stack and not fmt.contains(stack[-1][1], module):
            stack.pop()
        parents[int(call)] = stack[-1][0] if stack else None
        stack.append((int(call), module))
    return parents


def enclosing_modules(step: pd.DataFrame) -> dict[int, tuple[str, str]]:
    """``call -> (module, class)`` of the module call that ran each module call of one
    step's records (the enclosing call that ran, not the path's prefix: a ``ModuleList``
    never runs); the model's own call has none."""
    modules = step[step["module"].map(fmt.split_op).isna()].drop_duplicates("call")
    named = dict(zip(modules["call"], zip(modules["module"], modules["cls"])))
    return {call: named[parent] for call, parent in parent_calls(modules).items()
            if parent is not None}


CallKey = tuple  # (epoch, step, rank, call), rank -1 when not distributed


def call_links(frame: pd.DataFrame) -> tuple[dict[CallKey, Optional[CallKey]],
                                              dict[CallKey, list[CallKey]]]:
    """``(parents, consumers)`` of the calls of ``frame``: each call's parent call (None for
    outermost ones), and the calls whose inputs each call output (by ``producer``)."""
    frame = frame.assign(rank=frame["rank"].fillna(-1))
    parents: dict[CallKey, Optional[CallKey]] = {}
    for (epoch, step, rank), calls in frame.groupby(STEP_KEY):
        for call, parent in parent_calls(calls.drop_duplicates("call")).items():
            parents[(epoch, step, rank, call)] = (
                None if parent is None else (epoch, step, rank, parent))
    consumers: dict[CallKey, list[CallKey]] = {}
    inputs = frame[(frame["kind"] == fmt.INPUT) & (frame["producer"] >= 0)]
    for epoch, step, rank, call, producer in inputs[[*STEP_KEY, "call", "producer"]].itertuples(
            index=False):
        consumers.setdefault((epoch, step, rank, producer), []).append((epoch, step, rank, call))
    return parents, consumers


def makers(frame: pd.DataFrame) -> pd.Series:
    """Per row, the code that computed the record, as a calibration group says it: a module's
    outputs, its parameters and the gradients it sends back, its class (``Linear``); an input,
    the class of the call that output it, else its parent's own code (``LlamaAttention code``)
    or, for the model's inputs, ``the data``; a gradient arriving at an output, the classes of
    the calls that consumed the output, else the parent's own code, or, for the model's
    outputs, ``the loss``."""
    parents, consumers = call_links(frame)
    keys = list(zip(frame["epoch"], frame["step"], frame["rank"].fillna(-1), frame["call"]))
    cls = dict(zip(keys, frame["cls"].fillna("")))

    def code_of(key, outermost: str) -> str:
        parent = parents.get(key)
        return outermost if parent is None else f"{cls[parent]} code"

    out = []
    for key, kind, producer in zip(keys, frame["kind"], frame["producer"]):
        if kind == fmt.INPUT:
            made_by = key[:3] + (int(producer),)
            out.append(cls[made_by] if producer >= 0 and made_by in cls
                       else code_of(key, "the data"))
        elif kind == fmt.GRAD_OUTPUT:
            users = sorted({cls[c] for c in consumers.get(key, ())})
            out.append("+".join(users) if users else code_of(key, "the loss"))
        else:
            out.append(cls[key])
    return pd.Series(out, index=frame.index, dtype=object)


class _Step:
    """Row positions of one step's records, looked up by call, or module, and kind."""

    def __init__(self, rows: pd.DataFrame):
        self.by_call_kind: dict[tuple, list[int]] = defaultdict(list)
        self.by_module_kind: dict[tuple, list[int]] = defaultdict(list)
        self.consumers: dict[int, set[int]] = defaultdict(set)
        # per (consumer, producer), the indices of the consumer's inputs the producer made
        self.fed: dict[tuple[int, int], set[int]] = defaultdict(set)
        # per call, its inputs' producers (fmt.NO_PRODUCER where unknown) and values, and the
        # values it was given and returned: (numel, rms_a) where a comparison measured them
        self.inputs: dict[int, list[tuple[int, Optional[tuple]]]] = defaultdict(list)
        self.values: dict[tuple[int, str], set[tuple]] = defaultdict(set)
        measured = "rms_a" in rows and "numel" in rows  # (an index alone: no values known)
        scales = rows["rms_a"] if measured else pd.Series(np.nan, index=rows.index)
        numels = rows["numel"] if measured else pd.Series(0, index=rows.index)
        # rows whose values were compared (all, for a frame without statuses)
        compared = (rows["status"].isin(list(st.COMPARED)) if "status" in rows
                    else pd.Series(True, index=rows.index))
        self.compared: dict[tuple, set[int]] = defaultdict(set)  # (call, kind, pass) -> indices
        for pos, call, module, kind, index, occurrence, producer, known, numel, scale in zip(
                rows["pos"], rows["call"], rows["module"], rows["kind"], rows["index"],
                rows["occurrence"], rows["producer"], compared, numels, scales):
            pass_ = occurrence if kind in fmt.BACKWARD_KINDS else None
            self.by_call_kind[(call, kind, pass_)].append(pos)
            self.by_module_kind[(module, kind)].append(pos)
            if known:
                self.compared[(call, kind, pass_)].add(int(index))
            values = (int(numel), float(scale)) if np.isfinite(scale) and scale > 0 else None
            if values is not None and kind in (fmt.INPUT, fmt.OUTPUT):
                self.values[(int(call), kind)].add(values)
            if kind == fmt.INPUT:
                self.inputs[int(call)].append((int(producer), values))
            if kind == fmt.INPUT and producer >= 0:
                self.consumers[int(producer)].add(int(call))
                self.fed[(int(call), int(producer))].add(int(index))
        calls = rows.drop_duplicates("call")
        self.module_of = dict(zip(calls["call"], calls["module"]))
        self.parent = parent_calls(calls)
        self.children: dict[int, list[int]] = defaultdict(list)
        for call, parent in sorted(self.parent.items()):
            if parent is not None:
                self.children[parent].append(call)

    def of(self, calls, kind: str, pass_=None) -> list[int]:
        out: list[int] = []
        for c in calls:
            out += self.by_call_kind.get((c, kind, pass_), ())
        return out

    def weights(self, call: int) -> list[int]:
        """The ``param`` rows of the call's module, whichever call recorded them (statistics
        are recorded at the first call only)."""
        return list(self.by_module_kind.get((self.module_of[call], fmt.PARAM), ()))

    def outermost(self, producer: int, pass_: int) -> set[int]:
        """The calls that consumed ``producer``'s outputs, less those nested in another of
        them whose grad_input of pass ``pass_`` for those outputs was compared (it holds
        theirs: what a residual block sends back to its input holds what its branch's first
        layer does)."""
        calls = self.consumers.get(producer, set())
        holding = {c for c in calls if self.fed.get((c, producer), set())
                   & self.compared.get((c, fmt.GRAD_INPUT, pass_), set())}
        out = set()
        for call in calls:
            parent = self.parent.get(call)
            while parent is not None and parent not in holding:
                parent = self.parent.get(parent)
            if parent is None:
                out.add(call)
        return out

    def siblings(self, call: int) -> list[int]:
        parent = self.parent[call]
        return [] if parent is None else self.children[parent]

    def may_use(self, sibling: int, call: int) -> bool:
        """Whether a sibling that ran after ``call`` may have computed from its outputs: not
        where each input of the sibling is a parameter, or was output by a call that ran
        before ``call``, or holds the values ``call`` was given and did not return (attention's
        value projection, fed the hidden states its key projection was, sends back nothing of
        the key's gradient); else it may (an input the parent's code made from what, a dump
        cannot tell, or a later call made, or no recorded input at all)."""
        inputs = self.inputs.get(sibling)
        given = self.values.get((call, fmt.INPUT), set())
        returned = self.values.get((call, fmt.OUTPUT), set())

        def independent(producer: int, values: Optional[tuple]) -> bool:
            return (producer == fmt.PRODUCER_PARAMETER or 0 <= producer < call
                    or (producer == fmt.NO_PRODUCER and values in given
                        and values not in returned))
        return not inputs or not all(independent(*each) for each in inputs)

    def code_values(self, call: int) -> list[int]:
        """Where no recorded call consumed the call's outputs and its parent is not the
        outermost call, the gradient arriving at them comes back through the parent's own code,
        whose backward uses the values its forward did: the parent's inputs and weights, and
        its children's outputs that no recorded call consumed either (the root's own code, with
        the loss beyond it, is left out). Else none."""
        parent = self.parent[call]
        if parent is None or self.consumers.get(call) or self.parent[parent] is None:
            return []
        used = [c for c in self.siblings(call) if not self.consumers.get(c)]
        return (self.of((parent,), fmt.INPUT) + self.weights(parent)
                + self.of(used, fmt.OUTPUT))

    def loss_values(self, call: int) -> list[int]:
        """The call's outputs where the loss is computed from them by code no dump records:
        the root call's (the user's loss), and those of a child of the root that no recorded
        call consumed and no later child may have used (the root's own code: a model given
        labels computes its loss from its head's logits; not its body's hidden states, which
        its head took as a slice). Else none."""
        parent = self.parent[call]
        given = parent is None or (
            self.parent[parent] is None and not self.consumers.get(call)
            and not any(c > call and self.may_use(c, call) for c in self.siblings(call)))
        return self.of((call,), fmt.OUTPUT) if given else []

    def loss_inputs(self, call: int) -> list[int]:
        """For the root call, the outputs of its children that its own code gets (a model
        given labels computes its loss from its head's logits: :meth:`loss_values`); else
        none."""
        if self.parent[call] is not None:
            return []
        return [row for child in self.children[call] for row in self.loss_values(child)]

    def sources(self, call: int, module: str, kind: str, occurrence: int, producer: int
                ) -> list[int]:
        fwd = (call,)
        parent = self.parent[call]
        if kind == fmt.OUTPUT:
            return (self.of(fwd, fmt.INPUT) + self.weights(call)
                    + self.of(self.children[call], fmt.OUTPUT))
        if kind == fmt.INPUT:
            if producer == fmt.PRODUCER_PARAMETER:  # weights, like a call's own
                return []
            if producer >= 0:
                return self.of((producer,), fmt.OUTPUT)
            if parent is None:
                return []
            before = [c for c in self.siblings(call) if c < call]
            return (self.of((parent,), fmt.INPUT) + self.weights(parent)
                    + self.of(before, fmt.OUTPUT))
        if kind == fmt.GRAD_OUTPUT:
            if parent is None:
                return self.of(fwd, fmt.OUTPUT)
            after = [c for c in self.siblings(call) if c > call and self.may_use(c, call)]
            consumers = self.outermost(call, occurrence)
            sources = (self.of(fwd, fmt.OUTPUT)
                       + self.of(sorted(set(after) | set(consumers)), fmt.GRAD_INPUT, occurrence)
                       + self.of((parent,), fmt.GRAD_OUTPUT, occurrence))
            return sources + self.code_values(call)
        if kind == fmt.GRAD_INPUT:
            return (self.of(fwd, fmt.GRAD_OUTPUT, occurrence) + self.of(fwd, fmt.INPUT)
                    + self.of(fwd, fmt.OUTPUT) + self.weights(call)
                    + self.of(self.children[call], fmt.GRAD_INPUT, occurrence))
        if kind == fmt.PARAM_GRAD:  # accumulated over every call and backward pass
            return (self.by_module_kind.get((module, fmt.GRAD_OUTPUT), [])
                    + self.by_module_kind.get((module, fmt.INPUT), [])
                    + self.by_module_kind.get((module, fmt.OUTPUT), []))
        return []


def _per_row(frame: pd.DataFrame, pick: Callable[..., list[int]]) -> list[np.ndarray]:
    """``pick(step, call, module, kind, occurrence, producer)`` for each row of ``frame``, as
    sorted integer arrays of row positions (the row itself left out)."""
    out: list[np.ndarray] = [np.empty(0, np.int64)] * len(frame)
    rows = frame.assign(pos=np.arange(len(frame)), rank=frame["rank"].fillna(-1))
    for _, step_rows in rows.groupby(STEP_KEY, sort=False):
        step = _Step(step_rows)
        for pos, call, module, kind, occurrence, producer in zip(
                step_rows["pos"], step_rows["call"], step_rows["module"], step_rows["kind"],
                step_rows["occurrence"], step_rows["producer"]):
            found = pick(step, int(call), module, kind, int(occurrence), int(producer))
            out[pos] = np.array(sorted(set(found) - {pos}), dtype=np.int64)
    return out


def record_sources(frame: pd.DataFrame) -> list[np.ndarray]:
    """For each row of ``frame`` (a comparison result, or any frame with the index columns
    ``epoch, step, rank, call, module, kind, occurrence, producer``), the positions of the
    rows it is computed from (see the module docstring), as integer arrays."""
    return _per_row(frame, lambda step, *row: step.sources(*row))


def code_values(frame: pd.DataFrame) -> list[np.ndarray]:
    """For each grad_output row that comes back through its parent's own code (attention, a
    gate: no recorded call consumed the outputs), the forward values that code's backward
    uses (a subset of its sources, see the module docstring); empty for every other row."""
    return _per_row(frame, lambda step, call, module, kind, *_: (
        step.code_values(call) if kind == fmt.GRAD_OUTPUT else []))


def loss_values(frame: pd.DataFrame) -> list[np.ndarray]:
    """For each grad_output row that the loss gives (:meth:`_Step.loss_values`), the rows of
    the outputs it is computed from (a subset of its sources); empty for every other row."""
    return _per_row(frame, lambda step, call, module, kind, *_: (
        step.loss_values(call) if kind == fmt.GRAD_OUTPUT else []))


def loss_inputs(frame: pd.DataFrame) -> list[np.ndarray]:
    """For each output row of the root call (the user's loss, beside its logits), the rows of
    its children's outputs that the root's own code computes from (:meth:`_Step.loss_inputs`,
    a subset of its sources); empty for every other row."""
    return _per_row(frame, lambda step, call, module, kind, *_: (
        step.loss_inputs(call) if kind == fmt.OUTPUT else []))


def earlier_sources(frame: pd.DataFrame) -> list[np.ndarray]:
    """:func:`record_sources` restricted to rows earlier in execution order (``seq``): what a
    record can have received. Later "sources" appear where several modules see one tensor
    (a container's output is its last child's)."""
    seq = frame["seq"].to_numpy(np.int64)
    return [s[seq[s] < seq[i]] for i, s in enumerate(record_sources(frame))]

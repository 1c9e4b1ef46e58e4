"""Reference injection (teacher forcing): run a step on a reference dump's values.

An :class:`Injector` names a reference dump, the kinds of record to inject and the modules to
inject into. For one step, :class:`StepReference` reads the reference's values on demand and
the replacement helpers put them in place:

- ``input``: a module call's tensor arguments are replaced before the module runs (exactly the
  reference's values after the cast to the run's dtype; the gradient passes through to the
  tensor that arrived, unchanged);
- ``param``: the module's own parameters are the reference's values for the call (the
  reference must have been dumped with ``params=True``), restored when the call returns; their
  gradients still accumulate into the run's parameters;
- ``grad_output``: the gradient arriving at a module call's output is replaced before the
  module's backward runs;
- ``output``: a module call's result is replaced (repairs everything downstream).

Each call takes the values of the reference's call it pairs with: the call of the same module
and number, but where the reference's calls of a module carry distinct names, integers or
flags and got the same tensors (:mod:`compare.call_order`; a rotary embedding called
once per attention type, in an order that changes with the hash seed), the one given the same
ones (none where none was), and the calls inside it the ones at their place inside that call.

An op record's input that the op writes into (an in-place method's own tensor, an indexed
assignment's, an ``out=``: :func:`dumper.ops.written`) is left in place, not injected: the
code goes on with that very tensor (a mixture of experts sums its experts' rows into one with
``index_add_``, RWKV writes its recurrence's output row by row), which a copy of the
reference's value would leave behind.

A value that arrived as the reference's rows in another order (code that orders rows
otherwise, e.g. tokens grouped by expert with an unstable sort) is left as it is, in every
kind but ``param``: the reference's would land in the wrong places
(``StepReference.reordered``).

In every kind, the extremes of the reference's dtype (``±finfo.max``) become the run's, not
infinities: an attention mask filled with float64's minimum becomes one filled with
float32's, as the run fills its own (other values beyond the run's range overflow as they
would in the run).

With all of ``input``, ``param`` and ``grad_output`` (:data:`LOCALIZING`), every module computes
from the reference's values in both directions, so what differs in its results is its own
computation's error alone: give the injector to :class:`~dumper.HookerAndDumper` (``inject=``)
and it records what *arrived* at each module before replacing it (flagged ``injected`` in the
index), then what the module made of the reference's values. ``compare.localize`` reads it.
Used alone (:meth:`Injector.register`), the injector installs its own hooks and changes the
run without recording anything (and, counting no micro-batches, pairs calls by their
arguments with those of the reference's first).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from compare import format as fmt
from compare.arguments import argument_rows
from compare.call_order import (CALL_KINDS, Inside, calls_inside, module_calls, runs_inside,
                                signature, told_apart)
from compare.dump import Dump, StepFile, load_dump
from compare.metrics import (NORMS_WITHIN, REORDERED_FROM, REORDERED_MARGIN,
                             reordered_rel_err, rows_measured)

from .calls import CallHooks, hooked_model, module_class
from .encoding import decode_to_tensor
from .flatten import call_leaves, leaf_text, map_tensors
from .op_pairing import OpPairing

INJECTABLE = (fmt.INPUT, fmt.OUTPUT, fmt.GRAD_OUTPUT, fmt.PARAM)
# what a localizing re-run injects: every module computes from the reference's values
LOCALIZING = (fmt.INPUT, fmt.PARAM, fmt.GRAD_OUTPUT)
Key = tuple  # (module path, call_idx, kind, index)
NO_CALL = -1  # the number of the reference's call a run's call pairs with where none does


class _StraightThrough(torch.autograd.Function):
    """Forward: the replacement values, exactly. Backward: the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x, replacement):
        return replacement.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _within_range_of(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``ref`` with the extremes of its dtype (``±finfo.max``: what masks are filled with)
    made ``dtype``'s where ``dtype`` is a floating dtype of narrower range; other values
    beyond that range still overflow, as they would in the run."""
    if not (ref.is_floating_point() and dtype.is_floating_point) or \
            torch.finfo(dtype).max >= torch.finfo(ref.dtype).max:
        return ref
    high, limit = torch.finfo(ref.dtype).max, torch.finfo(dtype).max
    return torch.where(ref == high, limit, torch.where(ref == -high, -limit, ref))


def _reordered(ref: torch.Tensor, arrived: torch.Tensor) -> bool:
    """Whether ``arrived`` holds ``ref``'s rows in another order, by the rule of
    :mod:`compare.metrics`' ``reordered_rel_err`` (far off element by element, the same norm,
    ``REORDERED_MARGIN`` times closer with the rows paired by content), e.g. tokens grouped by
    expert with an unstable sort: injecting ``ref`` would put its rows in the wrong places.
    Reads three numbers back from the device, and both tensors where they fit the rule."""
    row = rows_measured(tuple(ref.shape))
    if not row or not ref.is_floating_point():
        return False
    a, b = (x.detach().reshape(-1).double() for x in (ref, arrived))
    norm_a, norm_b, norm_d = torch.stack([a.norm(), b.norm(), (b - a).norm()]).tolist()
    if not (norm_a > 0 and norm_d >= REORDERED_FROM * norm_a
            and abs(norm_b - norm_a) <= NORMS_WITHIN * norm_a):  # NaN and inf fail one
        return False
    paired = reordered_rel_err(a.cpu().numpy(), b.cpu().numpy(), row)
    return REORDERED_MARGIN * paired * norm_a < norm_d


def replaced(t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` in place of ``t`` in the graph: the gradient of the result flows to ``t``."""
    if t.requires_grad and torch.is_grad_enabled():
        return _StraightThrough.apply(t, values)
    return values


class StepReference:
    """The reference's values of one step, read when first asked for (by whichever thread runs
    the hook: backward hooks may run on autograd's threads; reads are serialised).

    :meth:`tensor` gives the value of a record key cast to the run's tensor's dtype and
    device, or None where the reference holds none (another call structure, a record it did
    not store); a gradient at the run's loss scale (:attr:`grad_scale`, the dumper's), whatever
    the reference's was."""

    def __init__(self, injector: "Injector", step_file: StepFile):
        self.injector = injector
        self.label = step_file.label
        index = step_file.index.assign(epoch=step_file.epoch, step=step_file.step, rank=-1)
        rows = index[index["dataset"] != ""]
        self._rows = {(r.module, r.call_idx, r.kind, r.index): r for r in rows.itertuples()
                      if r.kind in injector.kinds and r.occurrence == 0}
        self._calls = module_calls(rows, argument_rows(index))
        self._ops = OpPairing(index)  # which reference op each op of the run takes values of
        # per (module, micro-batch) whose calls the reference's arguments tell apart: the
        # call_idx of each signature (compare.call_order)
        repeated = self._calls[self._calls["repeated"]]
        self._told_apart = {key: found for key, calls in
                            repeated.groupby(["module", "micro_batch"], sort=False)
                            if (found := told_apart(calls))}
        self._inside: dict[str, Inside] = {}  # per module paired otherwise: calls inside it
        self._paired: dict[tuple[str, int], int] = {}  # (module, call_idx): the reference's
        self._open: list[_PairedCall] = []  # calls paired otherwise, open now
        self._reader = step_file.open()
        self._lock = threading.Lock()
        self.injected = 0
        self.grad_scale = fmt.NO_GRAD_SCALE  # the loss scale the run's gradients carry
        self.reordered: list[str] = []  # reference values not injected: the run's, reordered
        self._ready: dict[Key, tuple[torch.Tensor, Optional[torch.Tensor]]] = {}  # injects()
        if fmt.PARAM in injector.kinds and not any(k[2] == fmt.PARAM for k in self._rows):
            warnings.warn(f"h5cmp: the reference {injector.reference.path} holds no parameter "
                          f"values in step {self.label} (dump it with params=True): weights are "
                          f"not injected, so a module's error there includes what weights that "
                          f"differ explain", RuntimeWarning, stacklevel=4)

    @property
    def kinds(self) -> frozenset:
        return self.injector.kinds

    def close(self) -> None:
        self._reader.close()
        self.forget_ready()
        if self.reordered:
            warnings.warn(f"h5cmp: {len(self.reordered)} value(s) of "
                          f"{self.injector.reference.path} step {self.label} were not injected "
                          f"(first: {self.reordered[0]}): the run holds the same values in "
                          f"another order there (its code orders them otherwise), and the "
                          f"reference's would land in the wrong places", RuntimeWarning,
                          stacklevel=3)
        if self.injected == 0:
            warnings.warn(f"h5cmp: nothing of {self.injector.reference.path} step {self.label} "
                          f"was injected: it holds no values of these modules' calls (dumped "
                          f"in statistics mode, or another model?)", RuntimeWarning,
                          stacklevel=3)

    def wants(self, path: str, module: nn.Module) -> bool:
        """Whether ``module`` (at ``path``) is one the injector injects into."""
        patterns = self.injector.include
        return not patterns or fmt.module_matches(path, module_class(module).__name__, patterns)

    def enter_call(self, path: str, call_idx: int, micro_batch: int, args: tuple,
                   kwargs: dict) -> None:
        """A call of the module at ``path`` starts: note which of the reference's calls it
        takes values from (the module docstring), before any is asked for."""
        paired = self._inside_open(path, call_idx)
        signatures = self._told_apart.get((path, micro_batch))
        if paired is None and signatures:  # none of the reference's has these: no values
            paired = signatures.get(signature(
                (p, *leaf_text(x)) for p, x in call_leaves(args, kwargs)
                if not isinstance(x, torch.Tensor)), NO_CALL)
        if paired is None or (paired == call_idx and not self._open):
            return
        self._paired[(path, call_idx)] = paired
        if path not in self._inside:
            self._inside[path] = calls_inside(self._calls, self._calls[
                self._calls["module"] == path])
        self._open.append(_PairedCall(path, call_idx, {
            module: by_owner.get(paired, []) for module, by_owner in self._inside[path].items()}))

    def leave_call(self, path: str, call_idx: int) -> None:
        """The call :meth:`enter_call` saw start returned (or raised)."""
        for at in range(len(self._open) - 1, -1, -1):
            if (self._open[at].path, self._open[at].call_idx) == (path, call_idx):
                del self._open[at:]
                return

    def _inside_open(self, module: str, call_idx: int) -> Optional[int]:
        """The reference's number of a call made inside an open call paired otherwise (a
        submodule's, an op's): the call at its place in the reference's, else ``NO_CALL``;
        None where no such call is open."""
        for call in reversed(self._open):
            if runs_inside(module, call.path):
                return call.take(module, call_idx)
        return None

    def pair_op(self, module: str, call_idx: int, shapes: tuple) -> None:
        """An op of the run starts, given tensors of ``shapes``: pair it with one of the
        reference's (:mod:`dumper.op_pairing`) before any of its values is asked for."""
        _, paired, _, _ = self._paired_key((module, call_idx, fmt.INPUT, 0))
        self._ops.pair(module, paired, shapes)

    def unpair_op(self, module: str, call_idx: int) -> None:
        """The op :meth:`pair_op` paired recorded nothing (it returned its input)."""
        _, paired, _, _ = self._paired_key((module, call_idx, fmt.INPUT, 0))
        self._ops.forget(module, paired)

    def _reference_key(self, key: Key) -> Optional[Key]:
        """``key`` (the run's module, call_idx, kind, index) as the reference's record key:
        a call's own records at the call it pairs with, an op's at the op it pairs with (None
        where none: :meth:`pair_op`); weights, the same at every call, at the run's number."""
        module, paired, kind, index = self._paired_key(key)
        if fmt.split_op(module) is None:
            return module, paired, kind, index
        op = self._ops.paired(module, paired)
        return None if op is None else (op, paired, kind, index)

    def _paired_key(self, key: Key) -> Key:
        """``key`` at the reference's number of its call (:meth:`_reference_key`)."""
        module, call_idx, kind, index = key
        if kind not in CALL_KINDS:
            return key
        paired = self._paired.get((module, call_idx))
        if paired is None and self._open:  # an op of a paired call, asked for the first time
            paired = self._inside_open(module, call_idx)
            if paired is not None:
                self._paired[(module, call_idx)] = paired
        return key if paired is None else (module, paired, kind, index)

    def has(self, key: Key) -> bool:
        return self._reference_key(key) in self._rows

    def injects(self, key: Key, like: torch.Tensor) -> bool:
        """Whether the reference's value of ``key`` will be put in place of ``like``: it has
        one, and ``like`` is not that value in another order. The value is read now and kept
        for the :meth:`tensor` call that puts it in."""
        value = self.tensor(key, like)
        self._ready[key] = (like, value)
        return value is not None

    def forget_ready(self) -> None:
        """Drop values :meth:`injects` read that no :meth:`tensor` call took (a tensor passed
        twice is replaced once)."""
        self._ready.clear()

    def tensor(self, key: Key, like: torch.Tensor) -> Optional[torch.Tensor]:
        ready = self._ready.pop(key, None)
        if ready is not None and ready[0] is like:
            return ready[1]
        row = self._rows.get(self._reference_key(key))
        if row is None:
            return None
        with self._lock:
            ref = decode_to_tensor(self._reader.read_raw(row), row.dtype)
            self.injected += 1
        if key[2] in fmt.BACKWARD_KINDS and row.grad_scale != self.grad_scale:
            wide = torch.complex128 if ref.is_complex() else torch.float64  # (exact: powers
            ref = ref.to(wide) * (self.grad_scale / row.grad_scale)  # of two, no underflow)
        if tuple(ref.shape) != tuple(like.shape):
            raise ValueError(f"h5cmp: cannot inject {row.group}/{row.dataset} of "
                             f"{self.injector.reference.path} step {self.label}: reference shape "
                             f"{tuple(ref.shape)} != run shape {tuple(like.shape)}; the runs must "
                             f"have the same model and batch")
        made = torch.empty_like(like).copy_(_within_range_of(ref, like.dtype))
        # (like's dtype, device and strides)
        if key[2] != fmt.PARAM and _reordered(made, like):
            with self._lock:
                self.injected -= 1
                self.reordered.append(f"{row.group}/{row.dataset}")
            return None
        # and its class: hooks run with torch-function handling off (dumper.ops.quietly),
        # where a subclass's own __torch_function__ does not make one of its kind
        return made if type(made) is type(like) else made.as_subclass(type(like))

    def leaf_replacer(self, path: str, call_idx: int, kind: str,
                      made: Optional[dict] = None, kept: frozenset[int] = frozenset()
                      ) -> Callable:
        """``fn(leaf)`` for :func:`~dumper.flatten.map_tensors`: the n-th tensor leaf replaced by
        the reference's ``kind`` n of that call, where it has one (``made[n]``: the leaf and
        what was put in its place), but for the tensors whose ids are ``kept``."""
        counter = itertools.count()
        once: dict[int, torch.Tensor] = {}  # one tensor passed several times stays one

        def replace(leaf):
            if not isinstance(leaf, torch.Tensor):
                return leaf
            index = next(counter)
            if id(leaf) in kept:
                return leaf
            if id(leaf) in once:
                return once[id(leaf)]
            ref = self.tensor((path, call_idx, kind, index), leaf)
            if ref is None:
                return leaf
            put = once[id(leaf)] = replaced(leaf, ref)
            if made is not None:
                made[index] = (leaf, put)
            return put
        return replace

    def swap_parameters(self, path: str, call_idx: int, module: nn.Module) -> list[tuple]:
        """Put the reference's values of ``module``'s own parameters in their place for this
        call; returns what :func:`restore_parameters` needs to put the originals back."""
        put = []  # every value read (and checked) before any is put in
        for index, (name, p) in enumerate(list(module.named_parameters(recurse=False))):
            ref = self.tensor((path, call_idx, fmt.PARAM, index), p)
            if ref is not None:
                put.append((name, p, replaced(p, ref)))
        for name, _, value in put:
            module._parameters[name] = value  # no __setattr__: not a Parameter
        return put


class _PairedCall:
    """An open call of the run paired with another of the reference's calls than its number
    says (or with none), and the calls made inside that one (``inside``: module -> their
    call_idxs, in order)."""

    def __init__(self, path: str, call_idx: int, inside: dict[str, list[int]]):
        self.path, self.call_idx, self.inside = path, call_idx, inside
        self.taken: dict[str, dict[int, int]] = {}  # module -> the run's call_idx -> reference's

    def take(self, module: str, call_idx: int) -> int:
        """The reference's number of the run's ``call_idx`` of ``module`` made inside this
        call: the n-th of the reference's there for the n-th of the run's; ``NO_CALL`` past
        its end."""
        taken = self.taken.setdefault(module, {})
        if call_idx not in taken:
            theirs = self.inside.get(module, [])
            taken[call_idx] = theirs[len(taken)] if len(taken) < len(theirs) else NO_CALL
        return taken[call_idx]


def restore_parameters(module: nn.Module, swapped: list[tuple]) -> None:
    """Undo :meth:`StepReference.swap_parameters`, where the value put in is still there
    (another hook may have replaced it since, e.g. FSDP resharding: that stays)."""
    for name, p, value in swapped:
        if module._parameters.get(name) is value:
            module._parameters[name] = p


class Injector:
    """Which reference values to inject: ``reference`` (a dump directory or
    :class:`~compare.dump.Dump`), ``kinds`` ⊆ ``INJECTABLE`` and ``include`` globs on module
    paths or keys (all modules by default). For step ``(epoch, step)`` the values of the same
    module, call and index in the reference's step are used, cast to the run's dtype and device.

    ``HookerAndDumper(..., inject=injector)`` records what arrives before replacing it (the
    localizing re-run, see the module docstring); :meth:`register` / :meth:`injecting` install
    hooks of its own instead.
    """

    def __init__(self, reference: Union[str, os.PathLike, Dump],
                 kinds: Union[str, Iterable[str]] = (fmt.INPUT,),
                 include: Union[str, Iterable[str], None] = None):
        self.include = (include,) if isinstance(include, str) else tuple(include or ())
        if include is not None and not self.include:
            raise ValueError("include=[] chooses no module to inject into; leave include out "
                             "to inject into every module")
        self.reference = load_dump(reference)
        self.kinds = frozenset((kinds,) if isinstance(kinds, str) else kinds)
        bad = self.kinds - set(INJECTABLE)
        if bad or not self.kinds:
            raise ValueError(f"kinds must be a non-empty subset of {list(INJECTABLE)}, "
                             f"got {sorted(bad) or 'none'}")
        self._step: Optional[StepReference] = None
        self._hooks: Optional[CallHooks] = None
        self._grad_handles: list[RemovableHandle] = []
        self.injected = 0  # values injected so far, all steps

    def step(self, epoch: int, step: int, rank: Optional[int] = None) -> StepReference:
        """The reference's values of step ``(epoch, step)`` of ``rank`` (a non-distributed
        reference serves every rank); ``close()`` it after the step."""
        files = [s for s in self.reference.steps if (s.epoch, s.step) == (epoch, step)]
        step_file = next((s for s in files if s.rank == rank), None) or next(
            (s for s in files if s.rank is None), None)
        if step_file is None:
            of_rank = "" if rank is None else f" of rank {rank}"
            raise KeyError(f"h5cmp: reference dump {self.reference.path} has no step "
                           f"{epoch}:{step}{of_rank}; dump that step of the reference run too")
        return StepReference(self, step_file)

    def describe(self) -> str:
        """What the index's ``injected_from`` attribute says: the reference (as an absolute
        path, so that a comparison run elsewhere can find it by name) and the kinds."""
        return fmt.injected_from(str(self.reference.path.absolute()),
                                 [k for k in INJECTABLE if k in self.kinds])

    # -- used alone: hooks of its own ------------------------------------------------------
    def register(self, model: nn.Module, epoch: int, step: int) -> None:
        """Install hooks injecting into step ``(epoch, step)``; :meth:`remove` takes them away.
        Register it *before* a dumper's hooks for the dump to record what was used."""
        self._step = self.step(epoch, step)
        self._hooks = CallHooks(self._enter, self._leave, always_call=True, enter_first=True)
        hooked = hooked_model(model)
        for path, module in hooked.modules:
            if self._step.wants(path, module):
                self._hooks.install(path, module, hooked)

    def remove(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        for handle in self._grad_handles:
            handle.remove()
        self._grad_handles.clear()
        if self._step is not None:
            self.injected += self._step.injected
            self._step.close()
            self._step = None

    @contextlib.contextmanager
    def injecting(self, model: nn.Module, epoch: int, step: int) -> Iterator["Injector"]:
        self.register(model, epoch, step)
        try:
            yield self
        finally:
            self.remove()

    def _enter(self, module: nn.Module, path: str, call_idx: int, args: tuple, kwargs: dict
               ) -> tuple[tuple, Optional[tuple[tuple, dict]]]:
        self._step.enter_call(path, call_idx, 0, args, kwargs)  # (it counts no micro-batches)
        swapped = (self._step.swap_parameters(path, call_idx, module)
                   if fmt.PARAM in self.kinds else [])
        state = (path, call_idx, swapped)
        if fmt.INPUT not in self.kinds:
            return state, None
        replace = self._step.leaf_replacer(path, call_idx, fmt.INPUT)
        return state, (map_tensors(args, replace), map_tensors(kwargs, replace))

    def _leave(self, module: nn.Module, state: tuple, output: Any) -> Any:
        path, call_idx, swapped = state
        restore_parameters(module, swapped)
        self._step.leave_call(path, call_idx)
        if output is None:  # the forward raised (the hooks are always called)
            return None
        if fmt.OUTPUT in self.kinds:
            output = map_tensors(output, self._step.leaf_replacer(path, call_idx, fmt.OUTPUT))
        if fmt.GRAD_OUTPUT in self.kinds:
            counter = itertools.count()

            def hook_grad(leaf):
                if isinstance(leaf, torch.Tensor):
                    key = (path, call_idx, fmt.GRAD_OUTPUT, next(counter))
                    if leaf.requires_grad and self._step.has(key):
                        step = self._step
                        self._grad_handles.append(leaf.register_hook(
                            lambda g, key=key: step.tensor(key, g)))
                return leaf
            map_tensors(output, hook_grad)
        return output

"""The NaN/Inf sentinel: find the first module call, forward or backward, that made a
non-finite value, on every step, cheaply (``HookerAndDumper(..., on_nonfinite=...)``).

Forward: each hooked call's output tensors are checked when the call returns (children return
before their parents, so the first non-finite output is the innermost call that has one); the
report says whether the call's inputs were finite (then the call made the NaN/Inf) or not
(it arose before the call, in code outside the hooked modules). Backward: the gradient of every
module input and output is checked as autograd delivers it; the first non-finite one was sent
back by the backward of the module(s) that took that tensor as input (their own output
gradients, checked earlier, were finite), or comes from the loss when no module took it.

A CPU tensor's check is one sum (only a non-finite sum is confirmed element by element), read
at once, so a ``"raise"`` stops the step in the failing hook. On other devices (CUDA) reading a
result waits for the device, so a check is the tensor's minimum and maximum (one reduction,
which cannot overflow), left there and read in one transfer when the outermost hooked call
returns, at the end of each backward pass, after :data:`READ_EVERY` checks and at
:meth:`NonFiniteSentinel.remove`: the report still names the first failing call, but a
``"raise"`` comes at that read, later in the step. Hooks only read: the model's numerics do
not change.
"""
from __future__ import annotations

import collections
import math
import threading
import warnings
import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import ops
from .calls import hooked_model, in_backward, module_class
from .capture import hook_gradient
from .flatten import call_leaves, leaves
from .grads import gradient_edge

ACTIONS = ("raise", "warn")
READ_EVERY = 1024  # device-side checks read at once at most (bounds what waits)


def check_action(action: str) -> None:
    """Refuse an ``on_nonfinite`` that is not one of :data:`ACTIONS`."""
    if action not in ACTIONS:
        raise ValueError(f"on_nonfinite must be one of {ACTIONS} or None, got {action!r}")


class NonFiniteError(RuntimeError):
    """A module call made NaN or Inf (raised by the sentinel with ``on_nonfinite="raise"``)."""


def checks_on_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s check stays on its device until the next read (else it is read at once)."""
    return t.device.type != "cpu"


def is_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite (integers and booleans always are)."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    if t.is_complex():
        return bool(torch.isfinite(t).all())
    total = float(t.detach().sum())
    return math.isfinite(total) or bool(torch.isfinite(t).all())  # a sum may overflow


def extremes(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``t``'s minimum and maximum as 0-d tensors on its device (no host read; none for a tensor
    that is always finite). Both are finite iff every element is: ``aminmax`` propagates NaN, and
    unlike a sum it cannot overflow."""
    t = t.detach()
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return ()
    return tuple(torch.aminmax(torch.view_as_real(t) if t.is_complex() else t))


def signature(t: torch.Tensor) -> str:
    """``shape dtype``."""
    return _signature(tuple(t.shape), t.dtype)


def _signature(shape: tuple, dtype: torch.dtype) -> str:
    return f"{shape} {str(dtype).replace('torch.', '')}"


def describe(t: torch.Tensor) -> str:
    """:func:`signature`, and its NaN/Inf counts when it has any."""
    text = signature(t)
    if not is_finite(t):
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        text += f" with {nan} NaN, {inf} Inf of {t.numel()}"
    return text


class _Watched:
    """A tensor whose gradient is checked: what it is, and the modules that took it as input."""

    __slots__ = ("what", "users")

    def __init__(self, what: str):
        self.what, self.users = what, []

    def origin(self) -> str:
        """Where a non-finite gradient of this tensor came from."""
        if not self.users:
            return "no hooked module took this tensor as input: it comes from the loss"
        depth = max(p.count(".") + bool(p) for p in self.users)
        innermost = " or ".join(dict.fromkeys(p or "<root>" for p in self.users
                                              if p.count(".") + bool(p) == depth))
        return f"the backward of {innermost} made it (grad_input; its grad_output was finite)"


class _Kept:
    """A tensor as it was when checked: read again only if unchanged (same object, same
    version; an inference tensor has no version: if it is still there, it is taken as
    unchanged); else only its signature is known."""

    __slots__ = ("ref", "version", "shape", "dtype")

    def __init__(self, t: torch.Tensor):
        self.ref = weakref.ref(t)
        self.version = None if t.is_inference() else t._version
        self.shape, self.dtype = tuple(t.shape), t.dtype

    def get(self) -> Optional[torch.Tensor]:
        t = self.ref()
        if t is None or (self.version is not None and t._version != self.version):
            return None
        return t

    @property
    def signature(self) -> str:
        return _signature(self.shape, self.dtype)


class _Pending:
    """A check whose result is still on the device: the event it stands for, the tensor's
    :func:`extremes`, and the tensor (and, forward, the call's inputs) kept to describe it."""

    __slots__ = ("event", "extremes", "tensor", "inputs", "watched")

    def __init__(self, event: tuple, t: torch.Tensor, inputs: Optional[list], watched):
        self.event, self.extremes, self.tensor = event, extremes(t), _Kept(t)
        self.inputs, self.watched = inputs, watched


class NonFiniteSentinel:
    """Hooks ``model`` (as :func:`~dumper.calls.hooked_model` does) for one step; reports the
    first non-finite value by ``action`` (``"raise"``: :class:`NonFiniteError`, stopping the
    step; ``"warn"``: a warning, once per step). ``history`` earlier events are quoted in the
    report. :meth:`remove` reads what is left to read and removes every hook."""

    def __init__(self, model: nn.Module, action: str, history: int = 8):
        check_action(action)
        self.action = action
        self.report: Optional[str] = None  # the first report of this step
        self._history: collections.deque = collections.deque(maxlen=history)  # of events
        self._calls = 0
        self._depth = 0  # hooked calls open
        self._pending: list[_Pending] = []  # device-side checks not read yet, in order
        self._read_task: Optional[int] = None  # the backward pass whose end reads them
        self._lock = threading.Lock()  # depth and pending (forwards may run on threads)
        # per gradient edge (node, slot) of a watched tensor: what it is and the modules that
        # took it as input; the nodes are kept so that their ids stay unique
        self._watched: dict[tuple[int, int], _Watched] = {}
        self._nodes: list = []
        self._checked: dict[int, tuple[weakref.ref, int]] = {}  # outputs checked
        self.handles: list[RemovableHandle] = []
        hooked = hooked_model(model)
        for path, module in hooked.modules:
            cls = module_class(module).__name__
            self.handles.append(hooked.hook(path, module, ops.quietly(
                lambda m, args, kwargs, path=path: self._pre_hook(path, args, kwargs)),
                pre=True, with_kwargs=True))
            self.handles.append(hooked.hook(path, module, ops.quietly(  # also when it raises
                lambda m, args, kwargs, out, path=path, cls=cls:
                self._post_hook(path, cls, args, kwargs, out)), with_kwargs=True,
                always_call=True))

    def remove(self) -> None:
        """Remove every hook, then read the checks still on the device: a failure found now
        is reported as a warning, whatever the action (the step is over); a read that fails
        (a device error) is warned about."""
        with self._lock:
            pending, self._pending = self._pending, []
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self._watched.clear()
        self._nodes.clear()
        self._checked.clear()
        if pending and self.report is None:
            try:
                self._read(pending, action="warn")
            except RuntimeError as exc:
                warnings.warn(f"h5cmp: the NaN/Inf sentinel could not read its last "
                              f"{len(pending)} checks ({exc})", RuntimeWarning, stacklevel=2)

    # forward

    def _pre_hook(self, path: str, args: tuple, kwargs: dict) -> None:
        if in_backward() or self.report is not None:
            return
        with self._lock:
            self._depth += 1
        if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
            inputs: Any = (("args[0]", args[0]),)  # the common case, without the generator
        else:
            inputs = call_leaves(args, kwargs)
        for _, leaf in inputs:
            if isinstance(leaf, torch.Tensor):
                watched = self._watch(leaf, ("the input of", path))
                if watched is not None:
                    watched.users.append(path)

    def _post_hook(self, path: str, cls: str, args: tuple, kwargs: dict, output: Any) -> None:
        if in_backward() or self.report is not None:
            return
        with self._lock:
            self._depth -= 1
            outermost = self._depth <= 0
        self._calls += 1
        call = (path, cls, self._calls)
        outputs = (("output", output),) if isinstance(output, torch.Tensor) else \
            leaves(output, "output")
        for leaf_path, leaf in outputs:
            if not isinstance(leaf, torch.Tensor) or self._seen(leaf):
                continue
            self._check(leaf, ("forward", call, leaf_path), (args, kwargs), None)
            if self.report is not None:
                return
            self._watch(leaf, (leaf_path + " of", path))
            if not leaf.is_inference():
                self._checked[id(leaf)] = (weakref.ref(leaf), leaf._version)
        if outermost and output is not None and self._pending:  # None: also when it raised
            self._read_pending()

    def _seen(self, t: torch.Tensor) -> bool:
        """Whether ``t`` was checked at its current version (a container returns its last
        child's output: checked once)."""
        known = self._checked.get(id(t))
        return (known is not None and known[0]() is t and not t.is_inference()
                and known[1] == t._version)

    # backward

    def _watch(self, t: torch.Tensor, what: tuple) -> Optional[_Watched]:
        """Check ``t``'s gradient when autograd delivers it (once per gradient edge)."""
        if not t.requires_grad or not torch.is_grad_enabled():
            return None
        node, slot = gradient_edge(t)
        key = (id(node), slot)
        watched = self._watched.get(key)
        if watched is None:
            watched = self._watched[key] = _Watched(f"{what[0]} {what[1] or '<root>'}")
            self._nodes.append(node)
            self.handles.append(hook_gradient(t, lambda grad: self._on_grad(watched, grad)))
        return watched

    def _on_grad(self, watched: _Watched, grad: torch.Tensor) -> None:
        if self.report is None:
            self._check(grad, ("backward", watched.what), None, watched)
        task = torch._C._current_graph_task_id()
        if self._pending and self._read_task != task:  # read at the end of this backward pass
            self._read_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._read_pending)

    # checking and reporting

    def _check(self, t: torch.Tensor, event: tuple, call: Optional[tuple],
               watched: Optional[_Watched]) -> None:
        """Check ``t`` for ``event`` (``call``: the forward call's ``(args, kwargs)``)."""
        if checks_on_device(t):
            inputs = None if call is None else [(p, _Kept(x)) for p, x in _tensor_inputs(call)]
            check = _Pending(event, t, inputs, watched)
            with self._lock:
                self._pending.append(check)
                full = len(self._pending) >= READ_EVERY
            if full:
                self._read_pending()
            return
        if self._pending:  # earlier checks come first
            self._read_pending()
            if self.report is not None:
                return
        if is_finite(t):
            self._history.append(event)
        else:
            self._found(event, t, None if call is None else _tensor_inputs(call), watched,
                        self.action)

    def _read_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._read_task = None
        if pending and self.report is None:
            self._read(pending, self.action)

    def _read(self, pending: list[_Pending], action: str) -> None:
        """Read ``pending``'s extremes (one transfer per device) and report the first failure."""
        by_device: dict[torch.device, list[int]] = {}
        for i, check in enumerate(pending):
            if check.extremes:
                by_device.setdefault(check.extremes[0].device, []).append(i)
        finite = [True] * len(pending)
        for indices in by_device.values():
            values = torch.stack([x for i in indices for x in pending[i].extremes])
            for i, ok in zip(indices, torch.isfinite(values).view(-1, 2).all(1).tolist()):
                finite[i] = ok
        for check, ok in zip(pending, finite):
            if ok:
                self._history.append(check.event)
                continue
            tensor = check.tensor.get()
            inputs = None if check.inputs is None else [
                (p, _or(kept.get(), kept.signature)) for p, kept in check.inputs]
            self._found(check.event, _or(tensor, check.tensor.signature), inputs,
                        check.watched, action)
            return

    def _found(self, event: tuple, t, inputs: Optional[list], watched: Optional[_Watched],
               action: str) -> None:
        """Report ``event``'s tensor ``t`` (or, if no longer there, its signature) as the first
        non-finite value; ``inputs``: the forward call's ``(path, tensor or signature)``."""
        if event[0] == "forward":
            state = "; ".join(f"{p}: {_state(x, 'no longer there to check')}"
                              for p, x in inputs) or "none"
            what = f"forward: {_event_subject(event)} is {_state(t, GONE)}; {_where(inputs)}. " \
                   f"Inputs: {state}"
        else:
            what = f"backward: the gradient of {event[1]} is {_state(t, GONE)}; " \
                   f"{watched.origin()}"
        last = "\n".join(f"  {_event_text(e)}" for e in self._history) or "  (none)"
        self.report = (f"h5cmp: first non-finite value: {what}\nthe last {len(self._history)} "
                       f"events before it:\n{last}")
        if action == "raise":
            self.remove()  # the step stops here: leave no hook behind whoever catches it
            raise NonFiniteError(self.report)
        warnings.warn(self.report, RuntimeWarning, stacklevel=2)


GONE = "non-finite: freed or changed in place before its check was read"


def _or(t: Optional[torch.Tensor], signature_: str):
    """``t``, or the signature of what is no longer there."""
    return signature_ if t is None else t


def _state(t, gone: str) -> str:
    """A tensor described, or the signature of one no longer there and why (``gone``)."""
    return describe(t) if isinstance(t, torch.Tensor) else f"{t} ({gone})"


def _tensor_inputs(call: tuple) -> list[tuple[str, torch.Tensor]]:
    """The tensors among a call's ``(args, kwargs)``, with their paths."""
    return [(p, x) for p, x in call_leaves(*call) if isinstance(x, torch.Tensor)]


def _where(inputs: list) -> str:
    """Who made a forward call's non-finite output, from its inputs' state."""
    states = [is_finite(x) if isinstance(x, torch.Tensor) else None for _, x in inputs]
    if False in states:
        return ("its inputs were already non-finite: it arose before this call, in code outside "
                "the hooked modules")
    if None in states:
        return ("this call made it, unless an input that is no longer there to check was "
                "non-finite")
    return "this call made it (its inputs are finite)"


def _event_subject(event: tuple) -> str:
    """``output of path (Class), call n`` for a forward event."""
    (path, cls, n), leaf_path = event[1], event[2]
    return f"{leaf_path} of {path or '<root>'} ({cls}), call {n}"


def _event_text(event: tuple) -> str:
    """A line of the report's history: an event found finite."""
    if event[0] == "forward":
        return f"forward {_event_subject(event)}: finite"
    return f"backward: gradient of {event[1]}: finite"

"""Parameter gradients (``param_grad`` records): the gradients the optimizer steps with.

A parameter's gradient is taken after each accumulation into ``.grad`` (a post-accumulate-grad
hook; each replaces the one before), and taken again when an optimizer step begins that
updates the parameter (a global optimizer step pre-hook, registered for the hooked step only):
by then a data-parallel wrapper has all-reduced and averaged it, the user may have clipped
it, and a GradScaler has unscaled it (``GradScaler.step`` unscales before it steps, but for
an optimizer that unscales inside its fused step: such a record carries no loss scale, one
taken as accumulated the step's, and one taken again at the step's end after
``GradScaler.unscale_``, none). Where the step ends (``remove_hooks``) before any optimizer
step, the gradient stays as accumulated, unless it was changed in place since (DDP all-reduces at the end of backward):
then it is taken again. One that is ``None`` by then stays as accumulated. Each is recorded
under its module's first call, numbered at its last accumulation.
"""
from __future__ import annotations

import weakref
from typing import Callable, NamedTuple, Optional

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from compare import format as fmt

from .record import CallInfo, Record, RecordMaker


class _Taken(NamedTuple):
    """A parameter's gradient as last taken, and what tells whether it changed since."""

    record: Record
    param: torch.Tensor
    grad: weakref.ref  # not kept alive: DDP replaces it by a view of its bucket
    version: int
    final: bool        # taken as an optimizer step began: what it stepped with


class ParamGrads:
    """The ``param_grad`` records of one hooked step. :meth:`watch` each module's parameters,
    :meth:`finish` when the step ends, :meth:`release` what was not handed on."""

    def __init__(self, maker: RecordMaker, next_seq: Callable[[], int],
                 first_call: Callable[[int], Optional[CallInfo]]):
        self._maker = maker
        self._next_seq = next_seq
        self._first_call = first_call  # id of a module -> its first call in the step
        self._taken: dict[tuple[int, int], _Taken] = {}
        self.handles: list[RemovableHandle] = [
            register_optimizer_step_pre_hook(self._optimizer_steps)]

    def watch(self, module: nn.Module) -> None:
        """Take the gradients of ``module``'s own parameters."""
        for index, (name, p) in enumerate(module.named_parameters(recurse=False)):
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(
                    self._accumulated(id(module), index, name)))

    def finish(self) -> list[Record]:
        """The step's records, in the order of their last accumulation; the hooks are
        removed."""
        self.remove_hooks()
        records = [self._taken_again(t, self._maker.param_grad_scale())
                   if not t.final and _changed(t) else t.record for t in self._taken.values()]
        self._taken.clear()
        return sorted(records, key=lambda r: r.seq)

    def release(self) -> None:
        """Give back the buffers of the records not handed on (a step discarded)."""
        self.remove_hooks()
        for taken in self._taken.values():
            self._maker.release(taken.record)
        self._taken.clear()

    def remove_hooks(self) -> None:
        """Remove the accumulation hooks and the optimizer step pre-hook (idempotent)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _accumulated(self, module_id: int, index: int, name: str):
        def hook(p: torch.Tensor) -> None:
            call = self._first_call(module_id)
            if p.grad is None or call is None:
                return
            before = self._taken.get((module_id, index))
            record = self._maker.tensor(self._next_seq(), call, fmt.PARAM_GRAD, index, name,
                                        p.grad)
            self._taken[(module_id, index)] = _Taken(record, p, weakref.ref(p.grad),
                                                     p.grad._version, False)
            if before is not None:
                self._maker.release(before.record)
        return hook

    def _optimizer_steps(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for key, taken in list(self._taken.items()):
            if not taken.final and id(taken.param) in stepped and taken.param.grad is not None:
                # GradScaler.step unscales first, but for an optimizer that unscales in its
                # own step (a fused one: GradScaler hands it the scale as ``grad_scale``)
                scaled = getattr(optimizer, "grad_scale", None) is not None
                record = self._taken_again(taken, self._maker.grad_scale if scaled
                                           else fmt.NO_GRAD_SCALE)
                self._taken[key] = taken._replace(record=record, final=True)

    def _taken_again(self, taken: _Taken, grad_scale: float) -> Record:
        """``taken``'s gradient taken again, carrying the loss scale ``grad_scale``."""
        old = taken.record
        record = self._maker.tensor(old.seq, old.call, fmt.PARAM_GRAD, old.index, old.path,
                                    taken.param.grad)
        record.grad_scale = grad_scale
        self._maker.release(old)
        return record


def _changed(taken: _Taken) -> bool:
    """Whether the parameter's gradient is another tensor, or was changed in place, since it
    was taken (a gradient now ``None`` has not: nothing to take)."""
    grad = taken.param.grad
    return grad is not None and (grad is not taken.grad() or grad._version != taken.version)

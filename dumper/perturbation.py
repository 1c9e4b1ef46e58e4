"""Perturbations: plant a known error in chosen modules, for sensitivity checks and tests.

The hooks run before every other forward hook of the module (``prepend=True``), so a dumper
records the perturbed values as the module's own. Every hook registered here is kept in a
handle list and removed by ``remove()``. (Reference injection is :mod:`dumper.injection`.)
"""
from __future__ import annotations

from typing import Iterable, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from compare import format as fmt

from .calls import hook_target, hookable_modules
from .flatten import map_tensors


class Perturbation:
    """Scale, noise or offset on chosen modules' outputs (``where="output"``) or on the gradient
    arriving at them (``where="grad_output"``): ``x * scale + noise * N(0, 1) + offset``.
    For sensitivity checks, and to plant a known error in tests. ``remove()`` undoes it."""

    def __init__(self, model: nn.Module, include: Union[str, Iterable[str]],
                 where: str = fmt.OUTPUT, scale: float = 1.0, noise: float = 0.0,
                 offset: float = 0.0, seed: int = 0):
        if where not in (fmt.OUTPUT, fmt.GRAD_OUTPUT):
            raise ValueError(f"where must be 'output' or 'grad_output', got {where!r}")
        self._handles: list[RemovableHandle] = []
        self._gen = torch.Generator().manual_seed(seed)
        self.scale, self.noise, self.offset, self.where = scale, noise, offset, where
        patterns = (include,) if isinstance(include, str) else tuple(include)
        matched = [m for p, m in hookable_modules(hook_target(model))
                   if not patterns or fmt.module_matches(p, type(m).__name__, patterns)]
        if not matched:
            raise ValueError(f"no module matches {list(patterns)}; see dumper.module_keys(model)")
        for module in matched:
            self._handles.append(module.register_forward_hook(self._hook, prepend=True))

    def _apply(self, t: torch.Tensor) -> torch.Tensor:
        out = t * self.scale if self.scale != 1.0 else t
        if self.noise:
            noise = torch.randn(t.shape, generator=self._gen).to(dtype=t.dtype, device=t.device)
            out = out + self.noise * noise
        return out + self.offset if self.offset else out

    def _hook(self, module, args, output):
        def each(leaf):
            if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
                return leaf
            if self.where == fmt.OUTPUT:
                return self._apply(leaf)
            if leaf.requires_grad:  # autograd may deliver no gradient (None): leave it so
                self._handles.append(leaf.register_hook(
                    lambda grad: None if grad is None else self._apply(grad)))
            return leaf
        return map_tensors(output, each)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def perturb(model: nn.Module, include: Union[str, Iterable[str]], **kwargs) -> Perturbation:
    """Install a :class:`Perturbation`; call ``.remove()`` on the result to undo it."""
    return Perturbation(model, include, **kwargs)

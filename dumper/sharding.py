"""Sharded tensors: what part of a global tensor a rank's tensor is.

A ``DTensor`` (FSDP2's ``fully_shard``, tensor parallel ``parallelize_module``, any device
mesh) is recorded as its local shard with its :class:`Sharding`; so is a plain tensor the user
marks as a shard (:class:`ShardMarks`, for hand-written Megatron-style layers). The index
columns it fills are in ``docs/format.md`` ("Sharded tensors").
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Optional

import torch

from compare import format as fmt


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Where a rank's local tensor sits in the global tensor: the device mesh's shape, one
    placement per mesh dimension (DTensor's notation: ``S(d)`` sharded along dimension ``d``,
    ``R`` replicated, ``P(sum)`` a partial sum to be reduced), the global shape, and the
    offsets of this rank's shard in it."""

    mesh_shape: tuple[int, ...]
    placements: tuple[str, ...]
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def columns(self) -> dict[str, str]:
        """Its index columns (``fmt.SHARDING_COLUMNS``)."""
        return {"mesh_shape": fmt.format_shape(self.mesh_shape),
                "placements": fmt.format_placements(self.placements),
                "global_shape": fmt.format_shape(self.global_shape),
                "offsets": fmt.format_shape(self.offsets)}


def _dtensor_type() -> Optional[type]:
    """``DTensor``, if torch.distributed.tensor is loaded (otherwise no tensor is one)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def local_part(t: torch.Tensor) -> tuple[torch.Tensor, Optional[Sharding]]:
    """``t``'s local shard (detached) and its :class:`Sharding` for a ``DTensor``; ``t`` itself
    and None for any other tensor."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        return t, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    mesh, placements = t.device_mesh, tuple(t.placements)
    _, offsets = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    return t.detach().to_local(), Sharding(tuple(mesh.shape), tuple(map(str, placements)),
                                          tuple(t.shape), tuple(offsets))


@dataclasses.dataclass(frozen=True)
class _Mark:
    patterns: tuple[str, ...]
    kind: str
    dim: int
    index: Optional[int]
    group: object


class ShardMarks:
    """Plain tensors the user declares to be shards: for modules matching a glob, the tensors
    of one kind are this rank's equal shard along ``dim`` of a tensor split over the ranks of
    ``group`` in rank order (the default group when None; one rank when torch.distributed is
    not initialized)."""

    def __init__(self) -> None:
        self._marks: list[_Mark] = []

    def add(self, patterns: tuple[str, ...], kind: str, dim: int, index: Optional[int],
            group: object) -> None:
        if kind not in fmt.KINDS:
            raise ValueError(f"kind must be one of {list(fmt.KINDS)}, got {kind!r}")
        self._marks.append(_Mark(patterns, kind, dim, index, group))

    def __bool__(self) -> bool:
        return bool(self._marks)

    def sharding(self, module: str, cls: str, kind: str, index: int,
                 t: torch.Tensor) -> Optional[Sharding]:
        """The :class:`Sharding` of tensor ``index`` of ``kind`` of a call of ``module``, if a
        mark covers it."""
        for mark in self._marks:
            if mark.kind == kind and mark.index in (None, index) and fmt.module_matches(
                    module, cls, mark.patterns):
                return _even_shard(t, mark.dim, mark.group)
        return None


def _even_shard(t: torch.Tensor, dim: int, group: object) -> Sharding:
    ranks, rank = 1, 0
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ranks = torch.distributed.get_world_size(group)
        rank = torch.distributed.get_rank(group)
    dim = dim % max(t.dim(), 1)
    shape = list(t.shape)
    offsets = [0] * len(shape)
    offsets[dim] = rank * shape[dim]
    shape[dim] *= ranks
    return Sharding((ranks,), (f"S({dim})",), tuple(shape), tuple(offsets))

"""One row of a step's index table, as produced by the hooks and consumed by the writer."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from compare import format as fmt

from .encoding import dtype_name
from .flatten import short_repr


@dataclasses.dataclass
class CallInfo:
    """Identity of one module call within a step."""

    number: int
    module: str
    cls: str
    call_idx: int

    @property
    def group(self) -> str:
        return fmt.call_group_name(self.number, fmt.module_key(self.module, self.cls))


@dataclasses.dataclass
class Record:
    """A leaf seen by a hook: an index row, and the tensor snapshot to store (if any)."""

    seq: int
    call: CallInfo
    kind: str
    index: int
    path: str
    dtype: str
    shape: str
    device: str
    requires_grad: bool
    status: str
    value: str = ""
    snapshot: Optional[torch.Tensor] = None
    occurrence: int = 0

    @property
    def dataset(self) -> str:
        if self.snapshot is None:
            return ""
        return fmt.dataset_name(self.kind, self.index, self.occurrence)

    @property
    def nbytes(self) -> int:
        s = self.snapshot
        return 0 if s is None else s.numel() * s.element_size()


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """A private dense CPU copy of ``t``'s current values (later in-place ops cannot touch it)."""
    detached = t.detach()
    if detached.device.type == "cpu":
        return detached.clone(memory_format=torch.contiguous_format)
    return detached.to("cpu", copy=True)


def _unsupported_reason(t: torch.Tensor) -> str:
    if t.layout != torch.strided:
        return f"layout {t.layout} is not stored"
    if t.is_quantized:
        return "quantized tensors are not stored"
    if t.device.type == "meta":
        return "meta tensors have no data"
    return ""


def tensor_record(seq: int, call: CallInfo, kind: str, index: int, path: str,
                  t: torch.Tensor) -> Record:
    """Record for tensor leaf ``t``, with a snapshot of its values taken now."""
    reason = _unsupported_reason(t)
    shape = "" if reason and t.layout != torch.strided else fmt.format_shape(tuple(t.shape))
    rec = Record(seq, call, kind, index, path, dtype_name(t.dtype), shape, str(t.device),
                 bool(t.requires_grad), fmt.ST_UNSUPPORTED if reason else fmt.ST_OK, reason)
    if not reason:
        rec.snapshot = snapshot(t)
    return rec


def leaf_record(seq: int, call: CallInfo, kind: str, path: str, leaf: Any) -> Record:
    """Record for a non-tensor leaf: its type and a short repr, no data."""
    return Record(seq, call, kind, -1, path, type(leaf).__name__, "", "", False, fmt.ST_OK,
                  short_repr(leaf))

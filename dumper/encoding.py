"""Lossless conversion of a tensor snapshot to a numpy array for HDF5 (see docs/format.md)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from compare import format as fmt

# dtypes numpy cannot hold: stored as their bits in an integer type of the same width.
_BITS_VIEW: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16, torch.complex32: torch.int32}
for _name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
              "float8_e8m0fnu", "float4_e2m1fn_x2"):
    if hasattr(torch, _name):
        _BITS_VIEW[getattr(torch, _name)] = torch.uint8
_NUMPY_BITS = {torch.int16: np.uint16, torch.int32: np.uint32, torch.uint8: np.uint8}


class Encoded(NamedTuple):
    array: np.ndarray
    encoding: str


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the name recorded in the index."""
    return str(dtype).removeprefix("torch.")


def encode(snapshot: torch.Tensor) -> Encoded:
    """Array whose bytes are exactly ``snapshot``'s values, and the encoding to read it back.

    ``snapshot`` must be a dense CPU tensor owned by the dumper (it may be viewed, not copied).
    """
    t = snapshot.resolve_conj().resolve_neg().contiguous()
    view = _BITS_VIEW.get(t.dtype)
    if view is None:
        return Encoded(t.numpy(), fmt.ENC_RAW)
    return Encoded(t.view(view).numpy().view(_NUMPY_BITS[view]), fmt.ENC_BITS)


def decode_to_tensor(array: np.ndarray, dtype: str) -> torch.Tensor:
    """Inverse of :func:`encode`: the exact tensor (used by tests and by reference injection)."""
    torch_dtype = getattr(torch, dtype)
    view = _BITS_VIEW.get(torch_dtype)
    t = torch.from_numpy(array if array.flags.c_contiguous else array.copy())
    return t if view is None else t.view(view).view(torch_dtype)

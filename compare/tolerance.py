"""Default tolerances per dtype (those of ``torch.testing.assert_close``), and pair rules."""
from __future__ import annotations

from typing import NamedTuple, Optional


class Tolerance(NamedTuple):
    """Elements a, b agree when ``|a - b| <= atol + rtol * |b|``."""

    rtol: float
    atol: float


EXACT = Tolerance(0.0, 0.0)
_FLOAT = {
    "float16": Tolerance(1e-3, 1e-5),
    "bfloat16": Tolerance(1.6e-2, 1e-5),
    "float32": Tolerance(1.3e-6, 1e-5),
    "float64": Tolerance(1e-7, 1e-7),
    "complex32": Tolerance(1e-3, 1e-5),
    "complex64": Tolerance(1.3e-6, 1e-5),
    "complex128": Tolerance(1e-7, 1e-7),
}


def dtype_tolerance(dtype: str) -> Tolerance:
    """Tolerance of one dtype: the table above; integers, bool and float8/float4 are exact."""
    return _FLOAT.get(dtype, EXACT)


def pair_tolerance(dtype_a: str, dtype_b: str, rtol: Optional[float] = None,
                   atol: Optional[float] = None) -> Tolerance:
    """Tolerance for comparing a ``dtype_a`` tensor with a ``dtype_b`` one.

    A mixed pair takes the looser of the two (a dtype difference alone is never a failure);
    ``rtol``/``atol`` given by the user override the defaults.
    """
    a, b = dtype_tolerance(dtype_a), dtype_tolerance(dtype_b)
    default = Tolerance(max(a.rtol, b.rtol), max(a.atol, b.atol))
    return Tolerance(default.rtol if rtol is None else rtol, default.atol if atol is None else atol)

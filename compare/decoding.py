"""Decode stored arrays to numpy values for comparison (torch-free; see docs/format.md).

Types numpy lacks are widened exactly: bfloat16, float8 and float4 to float32, complex32 to
complex64. The bits themselves are what is stored; these decoders only serve the metrics.
"""
from __future__ import annotations

import functools

import numpy as np

from . import format as fmt


def _minifloat_table(exp_bits: int, man_bits: int, bias: int, *, ieee_specials: bool,
                     fn_nan_all_ones: bool = False, nan_at_neg_zero: bool = False,
                     signed: bool = True) -> np.ndarray:
    """float32 value of every bit pattern of a small float format."""
    total = (1 if signed else 0) + exp_bits + man_bits
    values = np.empty(1 << total, dtype=np.float32)
    for bits in range(1 << total):
        sign = -1.0 if signed and bits >> (exp_bits + man_bits) & 1 else 1.0
        exp = bits >> man_bits & ((1 << exp_bits) - 1)
        man = bits & ((1 << man_bits) - 1)
        if nan_at_neg_zero and bits == 1 << (total - 1):
            values[bits] = np.nan
            continue
        if ieee_specials and exp == (1 << exp_bits) - 1:
            values[bits] = sign * np.inf if man == 0 else np.nan
            continue
        if fn_nan_all_ones and exp == (1 << exp_bits) - 1 and man == (1 << man_bits) - 1:
            values[bits] = np.nan
            continue
        if exp == 0 and man_bits > 0:
            value = man / (1 << man_bits) * 2.0 ** (1 - bias)
        else:
            value = (1 + man / (1 << man_bits)) * 2.0 ** (exp - bias)
        values[bits] = sign * value
    return values


@functools.cache
def _table(dtype: str) -> np.ndarray:
    if dtype == "float8_e4m3fn":
        return _minifloat_table(4, 3, 7, ieee_specials=False, fn_nan_all_ones=True)
    if dtype == "float8_e5m2":
        return _minifloat_table(5, 2, 15, ieee_specials=True)
    if dtype == "float8_e4m3fnuz":
        return _minifloat_table(4, 3, 8, ieee_specials=False, nan_at_neg_zero=True)
    if dtype == "float8_e5m2fnuz":
        return _minifloat_table(5, 2, 16, ieee_specials=False, nan_at_neg_zero=True)
    if dtype == "float8_e8m0fnu":
        powers = 2.0 ** (np.arange(255, dtype=np.float64) - 127)  # bit pattern 255 is NaN
        return np.append(powers, np.nan).astype(np.float32)
    if dtype == "float4_e2m1fn_x2":
        return _minifloat_table(2, 1, 1, ieee_specials=False)
    raise KeyError(dtype)


# dtypes numpy lacks, and the unsigned type of the same width their bits are stored in
STORED_BITS = {"bfloat16": "uint16", "complex32": "uint32", "float8_e4m3fn": "uint8",
               "float8_e5m2": "uint8", "float8_e4m3fnuz": "uint8", "float8_e5m2fnuz": "uint8",
               "float8_e8m0fnu": "uint8", "float4_e2m1fn_x2": "uint8"}
BITS_DTYPES = frozenset(STORED_BITS)


def decode(array: np.ndarray, dtype: str, encoding: str) -> np.ndarray:
    """Values of a stored array as a numpy array (exact; widened where numpy lacks the type)."""
    if encoding == fmt.ENC_RAW:
        return array
    if encoding != fmt.ENC_BITS or dtype not in BITS_DTYPES:
        raise ValueError(f"cannot decode encoding {encoding!r} of dtype {dtype!r}")
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    if dtype == "complex32":
        halves = array.astype(np.uint32)
        real = (halves & 0xFFFF).astype(np.uint16).view(np.float16)
        imag = (halves >> 16).astype(np.uint16).view(np.float16)
        out = np.empty(array.shape, dtype=np.complex64)
        out.real, out.imag = real, imag
        return out
    if dtype == "float4_e2m1fn_x2":  # two values per byte, low nibble first
        table = _table(dtype)
        pairs = np.stack([table[array & 0xF], table[array >> 4]], axis=-1)
        return pairs.reshape(array.shape[:-1] + (-1,)) if array.ndim else pairs
    return _table(dtype)[array]


def unscaled(values: np.ndarray, grad_scale: float) -> np.ndarray:
    """The values a record stands for without the loss scale it carries (its index row's
    ``grad_scale``): divided by it in float64 (exactly, for a GradScaler's power of two; the
    16-bit values would underflow), or as they are where it is ``fmt.NO_GRAD_SCALE``."""
    if grad_scale == fmt.NO_GRAD_SCALE:
        return values
    wide = np.complex128 if np.iscomplexobj(values) else np.float64
    return values.astype(wide) / grad_scale


def value_dtype(dtype: str) -> str:
    """numpy dtype name of :func:`decode`'s result for a recorded torch dtype name."""
    if dtype == "complex32":
        return "complex64"
    if dtype in BITS_DTYPES:
        return "float32"
    return dtype

"""Statistics mode: a few numbers per tensor instead of its values (see docs/format.md)."""
from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Optional

import numpy as np
import torch

from compare.statistics import (SKETCH_COLUMNS_P, SKETCH_ROWS_Q, SKETCH_SIZE, sketch_signs,
                                stats_from_sums)

from .host_memory import tensor_bytes

SMALL = 1 << 16  # CPU tensors up to this many elements are reduced with numpy: far fewer
#                  dispatcher round trips than torch for the same eight numbers

# The raw sums a device computes per tensor (dumper.arena), turned into the statistics on the
# host by :func:`stats_of_sums`
RAW_SUMS = ("min", "max", "sum", "sumsq", "nan", "inf", "zero")


def tensor_stats(t: torch.Tensor) -> tuple:
    """``(min, max, mean, std, norm, nan, inf, zero)`` of ``t`` in float64, order of
    ``compare.format.STAT_COLUMNS``. For a tensor on an accelerator this reads the result
    (a host sync); the dumper batches those instead (:mod:`dumper.arena`).

    Complex tensors are described by their magnitudes; integers and bool as float64;
    float16/bfloat16/float8 reduced in float32; sums accumulate in float64. NaNs propagate into
    min/max/mean/std/norm; the counts say how many there are. The numbers are combined by
    :func:`compare.statistics.stats_from_sums`, the definition the reader uses too.
    """
    x = t.detach()
    n = x.numel()
    if n == 0:
        return stats_from_sums(math.nan, math.nan, 0.0, 0.0, 0, 0, 0, 0)
    if x.dtype in _NUMPY_FLOATS and x.is_cpu and n <= SMALL:
        return _small_cpu_stats(_float64_copy(x), x.dtype)  # the common case, kept short
    x = reduced(x)
    if x.device.type == "cpu":
        return _cpu_stats(x.reshape(-1))
    row = torch.empty(len(RAW_SUMS), dtype=torch.float64, device=x.device)
    tensor_sums(x.reshape(-1), row)
    return stats_of_sums(row.tolist(), n)


def reduced(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the statistics see it: complex by magnitude, integers and bool as float64,
    16- and 8-bit floats as float32 (docs/format.md)."""
    if x.is_complex():
        x = x.abs()
    if not x.is_floating_point():
        return x.to(torch.float64)
    return x.float() if x.element_size() < 4 else x


DOT_LIMIT = 2 ** 31 - 1  # elements cuBLAS's dot takes


def tensor_sums(x: torch.Tensor, row: torch.Tensor) -> None:
    """Write the raw sums (``RAW_SUMS``) of ``x`` (flat, :func:`reduced`, not empty) into
    ``row`` (float64, on ``x``'s device) with no host sync and about ten kernels (a float64
    copy, its min and max, its sum, its dot product with itself, the three counts in one sum
    over a stack of their masks), where stacking and copying results took thirteen."""
    wide = x if x.dtype == torch.float64 else x.to(torch.float64)
    torch.aminmax(wide, out=(row[0], row[1]))
    torch.sum(wide, 0, out=row[2])
    if wide.numel() <= DOT_LIMIT and wide.stride(0) != 0:
        torch.dot(wide, wide, out=row[3])
    else:  # cuBLAS's dot takes at most 2**31 - 1 elements, and no stride 0
        torch.sum(torch.square(wide), 0, out=row[3])
    torch.sum(torch.stack((torch.isnan(x), torch.isinf(x), x == 0)), 1, dtype=torch.float64,
              out=row[4:len(RAW_SUMS)])


def stats_of_sums(raw: list[float], n: int) -> tuple:
    """The statistics of a tensor of ``n`` elements from its ``RAW_SUMS``."""
    lo, hi, total, sumsq, nan, inf, zero = raw[:len(RAW_SUMS)]
    if nan:  # NaN propagates into min and max, whatever a reduction made of it
        lo = hi = math.nan
    return stats_from_sums(lo, hi, total, sumsq, n, nan, inf, zero)


_NUMPY_FLOATS = {torch.float32: np.float32, torch.float64: np.float64}  # numpy reads these
_MIN, _MAX, _SUM = np.minimum.reduce, np.maximum.reduce, np.add.reduce
_scratch = threading.local()  # per-thread buffers: hooks may run on several threads
CHUNK = 1 << 18  # elements per pass over a chunk: scratch buffers stay small and in cache


def _scratch_buffer(dtype: torch.dtype, n: int) -> torch.Tensor:
    """This thread's reusable ``CHUNK``-element buffer of ``dtype``, cut to ``n`` elements."""
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    if dtype not in buffers:
        buffers[dtype] = torch.empty(CHUNK, dtype=dtype)
    return buffers[dtype][:n]


HEAP_COPY = 1 << 14  # float64 copies below 128 KiB come from malloc's heap, reused at once


def _float64_copy(x: torch.Tensor) -> np.ndarray:
    """A float64 copy of ``x`` (a CPU float tensor of at most ``SMALL`` elements), flat, as a
    numpy array: a fresh one when small (numpy's cast of the tensor's memory read in place,
    :func:`_host_view`; else one torch call), else this thread's scratch buffer (a fresh one
    that large would be mapped and page-faulted anew each time). Never ``x.numpy()``
    (:mod:`dumper.host_memory`)."""
    if x.numel() <= HEAP_COPY:
        view = _host_view(x)
        if view is not None:
            return view.astype(np.float64)
        return x.to(torch.float64, copy=True).numpy().reshape(-1)
    wide = _scratch_buffer(torch.float64, x.numel())
    wide.view(x.shape).copy_(x)
    return wide.numpy()


def _host_view(x: torch.Tensor) -> Optional[np.ndarray]:
    """The elements of ``x`` as a flat numpy array over its memory (:mod:`dumper.host_memory`)
    where ``x`` is one of ``_NUMPY_FLOATS`` and can be read so; else None."""
    memory = tensor_bytes(x) if x.dtype in _NUMPY_FLOATS else None
    return None if memory is None else memory.view(_NUMPY_FLOATS[x.dtype])


def _small_cpu_stats(a: np.ndarray, source: torch.dtype) -> tuple:
    """Statistics of a small float64 array (``a`` is scratch: squared in place) holding the
    values of a ``source`` tensor. Ufunc reductions are called directly: for 2048 elements
    numpy's Python wrappers (``a.min()``, ``np.einsum``) took a third of the time. No BLAS:
    numpy's OpenBLAS threads spin after a call, taking a core from training."""
    lo, hi = float(_MIN(a)), float(_MAX(a))
    finite = math.isfinite(lo) and math.isfinite(hi)
    nan = inf = 0.0
    if not finite:
        nan, inf = float(np.count_nonzero(np.isnan(a))), float(np.count_nonzero(np.isinf(a)))
    zero = float(a.size - np.count_nonzero(a))
    # inf - inf is the NaN the counts explain, overflow gives inf and underflow 0: numpy must
    # neither warn nor raise, whatever np.seterr the user chose. Finite float32 values widened
    # to float64 can do none of these (their squares lie within 1e-90 and 2e77), so they need
    # no error state (1.4 us)
    quiet = contextlib.nullcontext() if finite and source == torch.float32 else \
        np.errstate(all="ignore")
    with quiet:
        total = float(_SUM(a))
        sumsq = float(_SUM(np.multiply(a, a, out=a)))
    return stats_from_sums(lo, hi, total, sumsq, a.size, nan, inf, zero)


def _cpu_stats(x: torch.Tensor) -> tuple:
    """One aminmax pass over ``x`` (float32 or float64), then chunk by chunk: a float64 copy
    for the sum and the dot product, and sign(x)·sign(x) for the non-zeros (a quarter of
    count_nonzero's time on floats, a fifth less than summing |sign|). No tensor-sized
    temporaries. Passes whose answer min and max already give are skipped: no NaN/Inf when
    both are finite, no zero outside [min, max]."""
    n = x.numel()
    if n <= SMALL:
        return _small_cpu_stats(_float64_copy(x), x.dtype)
    low, high = torch.aminmax(x)
    lo, hi = low.item(), high.item()
    finite = math.isfinite(lo) and math.isfinite(hi)
    count_zeros = finite and lo <= 0 <= hi
    total = sumsq = 0.0
    nonzero = float(n)
    for start in range(0, n, CHUNK):
        part = x[start:start + CHUNK]
        wide = part if part.dtype == torch.float64 else \
            _scratch_buffer(torch.float64, part.numel()).copy_(part)
        total += wide.sum().item()
        sumsq += torch.dot(wide, wide).item()
        if count_zeros:
            signs = torch.sign(part, out=_scratch_buffer(part.dtype, part.numel()))
            nonzero -= part.numel() - torch.dot(signs, signs).item()  # exact: CHUNK < 2**24
    nan = inf = 0.0
    if not finite:
        nan, inf = float(torch.isnan(x).sum()), float(torch.isinf(x).sum())
        nonzero = float(torch.count_nonzero(x))
    return stats_from_sums(lo, hi, total, sumsq, n, nan, inf, n - nonzero)


_sign_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
SKETCH_ROWS = 1 << 10  # rows of P elements sketched at a time: float64 scratch of 8 MiB


def _signs_on(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tables = _sign_tables.get(device)
    if tables is None:
        tables = _sign_tables[device] = tuple(torch.from_numpy(s).to(device)
                                              for s in sketch_signs())
    return tables


# CPU tensors up to this many elements are sketched with numpy (no dispatcher, no BLAS);
# beyond, torch's matrix product is faster (2-core CPU: level at 16384, 2.75x at 65536)
SKETCH_SMALL = 1 << 14


def tensor_sketch(t: torch.Tensor) -> tuple:
    """The sketch of ``t`` (``compare.statistics.sketch_of_chunks``, the definition the reader
    shares), in float64. For a tensor on an accelerator this reads the result (a host sync);
    the dumper batches those instead (:func:`sketch_on_device`, :mod:`dumper.arena`)."""
    x = t.detach().reshape(-1)
    if x.is_complex():
        x = x.abs()
    if x.device.type == "cpu" and x.dtype in _NUMPY_FLOATS and x.numel() <= SKETCH_SMALL:
        return tuple(sketch_of_small(_float64_copy(x)).tolist())
    return tuple(sketch_on_device(x).tolist())


def sketch_of_small(x: np.ndarray) -> np.ndarray:
    """The sketch of a flat float64 array of at most ``SKETCH_SMALL`` elements: one product
    with each element's sign, precomputed (a few us for small ones)."""
    return np.einsum("kn,n->k", _element_signs()[:, :x.size], x)


@functools.cache
def _element_signs() -> np.ndarray:
    """Each of the first SKETCH_SMALL elements' sign in each sum of the sketch (SKETCH_SIZE x
    SKETCH_SMALL)."""
    col_signs, row_signs = sketch_signs()
    i = np.arange(SKETCH_SMALL)
    return col_signs[:, i % SKETCH_COLUMNS_P] * row_signs[:, (i // SKETCH_COLUMNS_P)
                                                          % SKETCH_ROWS_Q]


def sketch_on_device(t: torch.Tensor) -> torch.Tensor:
    """The sketch of ``t`` as a float64 tensor on its device (no host sync). Rows of P
    elements are multiplied by their row signs a block at a time (one small matrix product),
    then by the column signs; the last partial row apart."""
    x = t.detach().reshape(-1)
    if x.is_complex():
        x = x.abs()
    col_signs, row_signs = _signs_on(x.device)
    p, q = SKETCH_COLUMNS_P, SKETCH_ROWS_Q
    rows = x.shape[0] // p
    total = torch.zeros(SKETCH_SIZE, p, dtype=torch.float64, device=x.device)
    for start in range(0, rows, SKETCH_ROWS):
        stop = min(rows, start + SKETCH_ROWS)
        block = x[start * p:stop * p].view(stop - start, p).to(torch.float64)
        total.addmm_(row_signs[:, torch.arange(start, stop, device=x.device) % q], block)
    sketch = (total * col_signs).sum(1)
    tail = x[rows * p:].to(torch.float64)
    if tail.numel():
        sketch += (row_signs[:, rows % q, None] * col_signs[:, :tail.numel()]) @ tail
    return sketch

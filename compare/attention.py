"""What torch's scaled dot-product attention computes, in float64 (:mod:`compare.formulas`), and
how far rounding may move it: ``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p,
is_causal, scale=, enable_gqa=)`` without dropout (a random mask is nothing to recompute).

Over the last two axes of each batch and head (``L`` queries, ``S`` keys), the others
broadcast: ``s = scale q kᵀ + m`` (``scale`` by default ``1 / sqrt(E)`` of the queries' ``E``
features; ``m`` the mask added: a boolean one's False and a causal one's keys after the query,
torch's lower triangle from the top left, at ``-inf``), ``p = softmax(s)`` over the keys (0
where a query sees no key, as torch's), ``o = p v``. Backward, from ``g``: ``gv = pᵀ g``, ``gs
= p (g vᵀ - rowsum(g o))``, ``gq = scale gs k``, ``gk = scale gsᵀ q``, and the mask's gradient
``gs``, each summed over the axes its operand was broadcast along; with ``enable_gqa`` each key
and value head serves ``H / H_kv`` neighbouring query heads, and its gradients sum theirs.

Terms (:class:`compare.operands.Figures`), in root sum of squares per element: the products
each result sums (``p v``; ``gs k``, ``gs q``; ``p g``), and what the scores' rounding moves: a
kernel holds ``s`` at a unit of ``|s|`` or of the terms of its product, ``t = scale² q² k²ᵀ``,
which moves each probability relatively by ``sqrt(s² + t)`` (forward, ``o`` by ``p (v - o)``
times that; none where the mask holds a fill, ``finfo(dtype).min``, which the score rounds to
on both sides: a query whose keys are all hidden so sees each alike). Backward, ``gs`` is a
difference that may cancel: its terms are ``gs`` times ``sqrt(1 + s² + t)`` and ``p`` times the
roundings of ``g vᵀ`` (``sqrt(g² v²ᵀ)``) and of ``rowsum(g o)`` (``sqrt(rowsum(g² o²))``), and
each gradient of it carries them through its product (``scale² gs_terms² k²``). ``K``: the
lengths of the two sums an element goes through, times the elements an operand's gradient sums
over its broadcast axes and query heads. The scores' rounding is one rounding, counted as the
products' (also in the accumulator's random walk, :func:`compare.formulas.allowed`): an upper
bound, several times torch's CPU kernels' error.
"""
from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Optional

import numpy as np

from . import format as fmt
from .metrics import FILLS
from .operands import Figures, Operands, unbroadcast

ATTENTION = "scaled_dot_product_attention"
# its tensor operands by position (the mask may be none), and its numbers by parameter name,
# at their positions (None: keyword only)
ATTENTION_OPERANDS = ("query", "key", "value", "attn_mask")
ATTENTION_OPTIONS = {"dropout_p": 4, "is_causal": 5, "scale": None, "enable_gqa": None}


class _Scores(NamedTuple):
    """One attention call's forward in float64: its operands (keys and values repeated for
    the query heads they serve), the scores as a kernel holds them (0 at a mask's fill, which
    absorbs them), the squared terms of their product, the probabilities and the result."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    scale: float
    held: np.ndarray
    t: np.ndarray
    p: np.ndarray
    o: np.ndarray

    def moved(self) -> np.ndarray:
        """``s² + t`` where a key counts (``p > 0``: a hidden key's score may be ``-inf``)."""
        counts = self.p > 0
        return np.where(counts, np.square(np.where(counts, self.held, 0.0)) + self.t, 0.0)


def attention(kind: str, ops: Operands) -> Optional[Figures]:
    """The figures of an attention call's ``kind`` record (``grad_input`` of operand
    ``ops.operand``: query, key, value, mask), or None where its operands do not fit."""
    q, (k, v, mask) = ops.tensors.get(fmt.INPUT), (*ops.others, None, None, None)[:3]
    options = ops.options
    if q is None or k is None or v is None or options.get("dropout_p", 0.0) != 0.0 or (
            options.get("is_causal", 0.0) and mask is not None) or min(
            q.ndim, k.ndim, v.ndim) < 2:
        return None
    groups = _groups(q, k, v, bool(options.get("enable_gqa", 0.0)))
    if groups is None:
        return None
    with np.errstate(all="ignore"):
        forward = _forward(q, k, v, mask, groups, options)
        if forward is None:
            return None
        if kind == fmt.OUTPUT:
            return _output(forward, ops.tensors[fmt.OUTPUT])
        g = ops.tensors[fmt.GRAD_OUTPUT]
        if g.shape != forward.o.shape:
            return None
        operand = (q, k, v, mask)[ops.operand] if ops.operand < 4 else None
        if operand is None:
            return None
        return _gradient(forward, g, ops.operand, operand.shape, groups,
                         ops.tensors[fmt.GRAD_INPUT])


def _groups(q: np.ndarray, k: np.ndarray, v: np.ndarray, gqa: bool) -> Optional[int]:
    """How many query heads each key and value head serves (1 without ``enable_gqa``), None
    where the shapes do not fit an attention."""
    if k.shape[-2] != v.shape[-2] or q.shape[-1] != k.shape[-1] or k.shape[:-2] != v.shape[:-2]:
        return None
    if not gqa:
        return 1
    if min(q.ndim, k.ndim) < 3 or k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]:
        return None
    return q.shape[-3] // k.shape[-3]


def _forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Optional[np.ndarray],
             groups: int, options: Mapping[str, float]) -> Optional[_Scores]:
    """The call's forward (None where its shapes do not broadcast)."""
    if groups > 1:
        k, v = np.repeat(k, groups, axis=-3), np.repeat(v, groups, axis=-3)
    scale = options.get("scale", 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else math.nan)
    try:
        s = scale * np.matmul(q, np.swapaxes(k, -1, -2))
        if options.get("is_causal", 0.0):
            s = np.where(np.tri(*s.shape[-2:], dtype=bool), s, -np.inf)
        held = s
        if mask is not None:
            s = s + mask
            held = np.where(np.isin(mask, FILLS), 0.0, s)
        t = scale ** 2 * np.matmul(np.square(q), np.swapaxes(np.square(k), -1, -2))
        np.broadcast_shapes(s.shape[:-2], v.shape[:-2])
    except ValueError:
        return None
    if s.shape[-1] == 0:
        return None
    top = s.max(axis=-1, keepdims=True)
    exp = np.exp(s - np.where(np.isfinite(top), top, 0.0))
    total = exp.sum(axis=-1, keepdims=True)
    p = np.divide(exp, total, out=np.zeros(exp.shape), where=total > 0)
    return _Scores(q, k, v, scale, np.broadcast_to(held, s.shape), np.broadcast_to(t, s.shape),
                   p, np.matmul(p, v))


def _output(f: _Scores, got: np.ndarray) -> Optional[Figures]:
    """``o = p v``: terms ``p v`` and ``p (v - o) sqrt(s² + t)``."""
    if got.shape != f.o.shape:
        return None
    p2 = np.square(f.p)
    w = p2 * f.moved()
    # sum_j w_ij (v_jd - o_id)², expanded into products
    moved = np.matmul(w, np.square(f.v)) - 2.0 * f.o * np.matmul(w, f.v) + np.square(
        f.o) * w.sum(axis=-1, keepdims=True)
    terms = np.matmul(p2, np.square(f.v)) + np.maximum(moved, 0.0)
    return Figures(got, f.o, terms, f.p.shape[-1] + f.q.shape[-1])


def _gradient(f: _Scores, g: np.ndarray, operand: int, shape: tuple, groups: int,
              got: np.ndarray) -> Optional[Figures]:
    """The gradient of ``operand`` (of ``shape``) from ``g``, with its terms."""
    dp = np.matmul(g, np.swapaxes(f.v, -1, -2))
    row = (g * f.o).sum(axis=-1, keepdims=True)
    ds = f.p * (dp - row)
    p2, moved = np.square(f.p), f.moved()
    # the squared terms of each element of gs
    ds_terms = np.square(ds) * (1.0 + moved) + p2 * (
        np.matmul(np.square(g), np.swapaxes(np.square(f.v), -1, -2))
        + np.square(g * f.o).sum(axis=-1, keepdims=True))
    if operand == 0:
        want = f.scale * np.matmul(ds, f.k)
        terms = f.scale ** 2 * np.matmul(ds_terms, np.square(f.k))
        count = f.p.shape[-1] + g.shape[-1]
    elif operand == 1:
        want = f.scale * np.matmul(np.swapaxes(ds, -1, -2), f.q)
        terms = f.scale ** 2 * np.matmul(np.swapaxes(ds_terms, -1, -2), np.square(f.q))
        count = f.p.shape[-2] + g.shape[-1]
    elif operand == 2:
        want = np.matmul(np.swapaxes(f.p, -1, -2), g)
        terms = np.matmul(np.swapaxes(p2 * (1.0 + moved), -1, -2), np.square(g))
        count = f.p.shape[-2] + f.q.shape[-1]
    else:
        want, terms, count = ds, ds_terms, g.shape[-1]
    count *= want.size // max(math.prod(shape), 1)  # summed over broadcast axes and heads
    if operand in (1, 2) and groups > 1:  # a key or value head's gradient sums its queries'
        want, terms = (_heads_summed(a, groups) for a in (want, terms))
    try:
        want, terms = unbroadcast(want, shape), unbroadcast(terms, shape)
    except ValueError:
        return None
    if got.shape != want.shape:
        return None
    return Figures(got, want, terms, count)


def _heads_summed(values: np.ndarray, groups: int) -> np.ndarray:
    """``values`` of the query heads summed over each group of ``groups`` neighbours."""
    heads = values.shape[-3]
    return values.reshape(*values.shape[:-3], heads // groups, groups,
                          *values.shape[-2:]).sum(axis=-3)

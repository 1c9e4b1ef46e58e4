"""Metrics against independent numpy references; tolerances; chunking."""
from __future__ import annotations

import math

import numpy as np
import pytest

from compare.metrics import (REORDERED_MARGIN, ErrorAccumulator, compare_chunks, reordered_rel_err,
                             row_probe, rows_measured)
from compare.tolerance import Tolerance, pair_tolerance

TOL = Tolerance(1e-3, 1e-5)


def reference(a: np.ndarray, b: np.ndarray, tol: Tolerance) -> dict:
    """Plain one-shot numpy definitions (see compare/metrics.py's docstring)."""
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    fin = np.isfinite(a64) & np.isfinite(b64)
    fa, fb = a64[fin], b64[fin]
    d = np.abs(fb - fa)
    same_nonfinite = (np.isnan(a64) & np.isnan(b64)) | (a64 == b64)
    bad_nonfinite = np.sum(~fin & ~same_nonfinite)
    denom = np.maximum(np.abs(fa), tol.atol)
    rel = [x / y if y > 0 else (math.inf if x > 0 else 0.0) for x, y in zip(d, denom)]
    na, nb = np.linalg.norm(fa), np.linalg.norm(fb)
    return dict(
        numel=a64.size,
        max_abs_err=d.max() if d.size else 0.0,
        mean_abs_err=d.mean() if d.size else 0.0,
        max_rel_err=max(rel) if rel else 0.0,
        rel_l2_err=(np.linalg.norm(fb - fa) / na) if na else (0.0 if not d.any() else math.inf),
        cosine=(fa @ fb / (na * nb)) if na and nb else (1.0 if na == nb else 0.0),
        rmse=math.sqrt(np.mean(d ** 2)) if d.size else 0.0,
        mismatches=int(np.sum(d > tol.atol + tol.rtol * np.abs(fb)) + bad_nonfinite),
        max_tol_ratio=math.inf if bad_nonfinite else max(
            [0.0] + [x / y if y > 0 else (math.inf if x > 0 else 0.0)
                     for x, y in zip(d, tol.atol + tol.rtol * np.abs(fb))]),
        nan_a=int(np.isnan(a64).sum()), nan_b=int(np.isnan(b64).sum()),
        inf_a=int(np.isinf(a64).sum()), inf_b=int(np.isinf(b64).sum()),
    )


def _check(a, b, tol=TOL):
    got = compare_chunks([(a.ravel(), b.ravel())], tol)
    ref = reference(a, b, tol)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-300), key
    return got


def test_random_data_with_zeros():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(5000).astype(np.float32)
    a[::7] = 0
    b = a + rng.standard_normal(5000).astype(np.float32) * 1e-4
    got = _check(a, b)
    assert got["status"] == "DIFF"


def test_nan_and_inf_positions():
    a = np.array([1.0, np.nan, np.inf, -np.inf, 2.0, 0.0], dtype=np.float32)
    same = _check(a, a.copy())
    assert same["status"] == "equal" and same["nan_a"] == 1 and same["inf_a"] == 2
    b = a.copy()
    b[1], b[4] = 3.0, np.nan
    moved = _check(a, b)
    assert moved["status"] == "nan_mismatch" and moved["mismatches"] == 2


def test_empty_and_scalar():
    empty = _check(np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32))
    assert empty["status"] == "equal" and empty["numel"] == 0
    scalar = _check(np.array(2.0), np.array(2.0 + 1e-9))
    assert scalar["status"] == "close"


def test_all_zero_sides():
    zeros = np.zeros(4)
    assert _check(zeros, zeros)["cosine"] == 1.0
    one_side = _check(zeros, np.ones(4))
    assert one_side["rel_l2_err"] == math.inf and one_side["cosine"] == 0.0


def test_chunked_equals_one_shot():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(100_003)
    b = a * (1 + rng.standard_normal(a.size) * 1e-6)
    b[17] = np.nan
    one = compare_chunks([(a, b)], TOL)
    acc = ErrorAccumulator(TOL)
    for start in range(0, a.size, 4096):
        acc.update(a[start:start + 4096], b[start:start + 4096])
    chunked = acc.result()
    for key in one:
        if isinstance(one[key], float):
            assert chunked[key] == pytest.approx(one[key], rel=1e-12, nan_ok=True), key
        else:
            assert chunked[key] == one[key], key


def test_float64_accumulation_does_not_stall():
    a = np.full(20_000_000, 0.5, dtype=np.float32)
    got = compare_chunks([(a, a + np.float32(0.25))], Tolerance(0, 0))
    assert got["mean_abs_err"] == 0.25 and got["rmse"] == 0.25


def test_bf16_vs_fp32_pair_uses_looser_tolerance_and_wide_compare():
    tol = pair_tolerance("bfloat16", "float32")
    assert tol == Tolerance(1.6e-2, 1e-5)
    rng = np.random.default_rng(2)
    fp32 = rng.standard_normal(1000).astype(np.float32)
    bf16 = (fp32.view(np.uint32) & 0xFFFF0000).view(np.float32)  # truncated to bfloat16 values
    got = _check(bf16, fp32, tol)
    assert got["status"] == "close"


@pytest.mark.parametrize("dtype, expected", [
    ("float16", (1e-3, 1e-5)), ("float32", (1.3e-6, 1e-5)), ("float64", (1e-7, 1e-7)),
    ("int64", (0, 0)), ("bool", (0, 0)), ("float8_e4m3fn", (0, 0)), ("complex64", (1.3e-6, 1e-5)),
])
def test_default_tolerances(dtype, expected):
    assert tuple(pair_tolerance(dtype, dtype)) == expected
    assert tuple(pair_tolerance(dtype, dtype, rtol=0.5)) == (0.5, expected[1])


@pytest.mark.parametrize("shape, size", [((4, 10, 48), 48), ((3, 8, 5, 5), 8), ((6, 8), 8),
                                         ((2, 8, 1, 1), 8)])
def test_centered_error_is_the_error_a_normalization_sees(shape, size):
    """Each grouping's mean removed, the error relative to the input's spread: a stream of mean
    30 and spread 1 amplifies a relative error 30 times; one group of little spread (a
    BatchNorm over a batch of two) weighs as much as any, as the normalization divides each
    by its own (the reader streams the tensor in chunks)."""
    from compare.centering import CHANNEL, LAST, POSITION, Centering, groupings
    rng = np.random.default_rng(0)
    a = rng.normal(30, 1, size=shape)
    a[:, 0] = 30 + 0.01 * rng.normal(size=a[:, 0].shape)  # a group of little spread
    b = a + rng.normal(0, 0.03, size=shape)
    acc = ErrorAccumulator(Tolerance(0.0, 0.0), Centering(shape, size))
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    for start in range(0, flat_a.size, 77):
        acc.update(flat_a[start:start + 77], flat_b[start:start + 77])
    result = acc.result()
    d = b - a
    axes = {LAST: (-1,), CHANNEL: tuple(i for i in range(len(shape)) if i != 1),
            POSITION: (1,)}

    def centered(x, ax):
        return x - x.mean(axis=ax, keepdims=True)

    def squares(x, ax):
        return (centered(x, ax) ** 2).sum(axis=ax)

    expected = max(max(np.linalg.norm(centered(d, ax)) / np.linalg.norm(centered(a, ax)),
                       np.sqrt(np.mean(squares(d, ax) / squares(a, ax))))
                   for ax in (axes[kind] for kind in groupings(shape, size)))
    # streamed sums of squares lose ~1e-16 (mean / spread)² of their digits to the mean
    assert result["centered_rel_err"] == pytest.approx(expected, rel=1e-6)
    assert result["centered_rel_err"] > 10 * result["rel_l2_err"]
    assert math.isnan(ErrorAccumulator(Tolerance(0.0, 0.0)).result()["centered_rel_err"])


@pytest.mark.parametrize("shape, size, channels, eps", [
    ((2, 16, 1, 1), 16, True, 1e-3),    # a BatchNorm over a batch of two at one position
    ((4, 8, 3, 3), 8, True, 1e-5),
    ((3, 5, 24), 24, False, 1e-6),       # a LayerNorm (and an RMSNorm) over the last dimension
    ((3, 5, 24), 24, False, math.nan),   # eps not recorded: the worst of the common ones
])
def test_normalized_error_is_what_the_normalization_computes(shape, size, channels, eps):
    """``normalized_rel_err``: the error of ``x_c / sqrt(mean(x_c²) + eps)`` per group, computed
    here by normalizing both sides; the error along a group's own values is divided out (in
    a group of two, all of it), groups of little spread beside eps weigh less, and large
    errors (B's pair in the other order) count in full."""
    from compare.centering import CHANNEL, LAST, NORMALIZATION_EPS, Centering
    rng = np.random.default_rng(1)
    a = rng.normal(0.5, 1, size=shape)
    a.reshape(-1)[:3] *= 1e-3  # a few small values: groups of little spread
    b = a * (1 + 3e-3 * rng.normal(size=shape))  # a rounding, relative to each element
    b.reshape(-1)[-1] = -b.reshape(-1)[-1] * 5  # and one large error
    acc = ErrorAccumulator(Tolerance(0.0, 0.0), Centering(shape, size, channels, eps))
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    for start in range(0, flat_a.size, 50):
        acc.update(flat_a[start:start + 50], flat_b[start:start + 50])
    axes = {LAST: (-1,), CHANNEL: (0, 2, 3)}[CHANNEL if channels else LAST]

    def error(e: float, center: bool) -> float:
        def normalized(x):
            x = x - x.mean(axis=axes, keepdims=True) if center else x
            return x / np.sqrt((x ** 2).mean(axis=axes, keepdims=True) + e)
        return float(np.linalg.norm(normalized(b) - normalized(a))
                     / np.linalg.norm(normalized(a)))
    expected = max(error(e, center) for e in (NORMALIZATION_EPS if math.isnan(eps) else (eps,))
                   for center in ((True,) if channels else (True, False)))
    assert acc.result()["normalized_rel_err"] == pytest.approx(expected, rel=1e-6)
    if channels:  # a BatchNorm without its eps may have used its running statistics
        unknown = ErrorAccumulator(Tolerance(0.0, 0.0), Centering(shape, size, True))
        unknown.update(flat_a, flat_b)
        assert math.isnan(unknown.result()["normalized_rel_err"])
    if channels and shape[0] == 2:  # two per group: only the flipped pair's error is left
        rounded = ErrorAccumulator(Tolerance(0.0, 0.0), Centering(shape, size, True, eps))
        rounded.update(flat_a, (a * (1 + 3e-3 * rng.normal(size=shape))).reshape(-1))
        assert rounded.result()["normalized_rel_err"] < 0.1 * rounded.result()["centered_rel_err"]


def test_normalized_error_is_unknown_where_a_group_constant_in_a_varies_in_b():
    """A padding row that A holds at zero and B does not: nothing in A's values tells what
    its normalization makes of B's, so the figure is NaN (judged by the centered rule)."""
    from compare.centering import Centering
    a = np.random.default_rng(2).normal(size=(4, 16))
    a[3] = 0.0
    b = a + 1e-3 * np.random.default_rng(3).normal(size=a.shape)
    acc = ErrorAccumulator(Tolerance(0.0, 0.0), Centering(a.shape, 16, eps=1e-5))
    acc.update(a.reshape(-1), b.reshape(-1))
    assert math.isnan(acc.result()["normalized_rel_err"])
    b[3] = 0.0  # constant in both: adds nothing
    acc = ErrorAccumulator(Tolerance(0.0, 0.0), Centering(a.shape, 16, eps=1e-5))
    acc.update(a.reshape(-1), b.reshape(-1))
    assert 0 < acc.result()["normalized_rel_err"] < 1e-2


def test_rows_in_another_order_are_paired_by_content_and_nothing_else_is():
    """``reordered_rel_err``: B's rows in another order leave the rounding once paired; rows
    that are not A's (another draw of the same distribution, other dropout masks, a
    transpose) do not pair, however many there are; a 1-D tensor, or one read in several
    chunks, is not measured."""
    rng = np.random.default_rng(0)
    shape = (2048, 64)
    a = rng.standard_normal(shape).astype(np.float32)
    tol = pair_tolerance("float32", "float32")
    row = rows_measured(shape)

    def paired(b, row=row):
        acc = ErrorAccumulator(tol, row=row)
        acc.update(a.reshape(-1), b.reshape(-1))
        return acc.result()["reordered_rel_err"]

    shuffled = a[rng.permutation(shape[0])] * np.float32(1 + 1e-6)
    assert paired(shuffled) == pytest.approx(1e-6, rel=0.1)
    another_draw = rng.standard_normal(shape).astype(np.float32)
    within_rows = np.ascontiguousarray(a[:, ::-1])
    assert paired(another_draw) > 0.5 and paired(within_rows) > 0.5
    dropped = [((rng.random(shape) < 0.5) * a * 2).astype(np.float32) for _ in range(2)]
    acc = ErrorAccumulator(tol, row=row)
    acc.update(dropped[0].reshape(-1), dropped[1].reshape(-1))
    assert acc.result()["reordered_rel_err"] > 0.5
    assert np.isnan(paired(a * np.float32(1.1)))        # not far off: not measured
    assert rows_measured((4096,)) == 0 and rows_measured((1 << 20, 4)) == 0
    acc = ErrorAccumulator(tol, row=row)                 # several chunks: not measured
    for half in np.split(np.arange(a.size), 2):
        acc.update(a.reshape(-1)[half], shuffled.reshape(-1)[half])
    assert np.isnan(acc.result()["reordered_rel_err"])


def test_rows_reordered_with_rounding_pair_although_their_projections_swap():
    """Rows whose projections differ by less than their rounding land in either order: each
    row pairs with its nearest neighbour in content order, so 48 rows of grouped experts,
    reordered and carrying bfloat16-sized noise, leave the noise; rows of one side repeated
    in place of others do not pass as a reordering."""
    rng = np.random.default_rng(3)
    shape = (48, 32)
    a = rng.standard_normal(shape)
    noise = rng.standard_normal(shape) * 4e-3 * np.abs(a)
    b = (a + noise)[rng.permutation(shape[0])]
    order = [np.argsort(x @ row_probe(shape[1])) for x in (a, b)]
    plain = np.linalg.norm(b[order[1]] - a[order[0]]) / np.linalg.norm(a)
    assert plain > 0.05  # the projection order alone mis-pairs some of these rows
    row = rows_measured(shape)
    rounding = np.linalg.norm(noise) / np.linalg.norm(a)
    assert reordered_rel_err(a.reshape(-1), b.reshape(-1), row) < 1.5 * rounding
    acc = ErrorAccumulator(pair_tolerance("float32", "float32"), row=row)
    acc.update(a.reshape(-1).astype(np.float32), b.reshape(-1).astype(np.float32))
    assert acc.result()["reordered_rel_err"] < 0.01 < acc.result()["rel_l2_err"] / REORDERED_MARGIN
    doubled = np.repeat(a[::2], 2, axis=0)[rng.permutation(shape[0])]  # half of A's rows, twice
    assert reordered_rel_err(a.reshape(-1), doubled.reshape(-1), row) > 0.5
    # rows of a few kinds (embeddings of 4 tokens), 6 of 256 swapped for another kind: each
    # row pairs once, so the kinds B holds more of do not all find a partner of their kind
    vocab = rng.standard_normal((4, 32))
    tokens = rng.integers(0, 4, 256)
    other = tokens.copy()
    other[:6] = (other[:6] + 1) % 4
    a, b = vocab[tokens], vocab[other][rng.permutation(256)]
    assert reordered_rel_err(a.reshape(-1), b.reshape(-1), 32) > 0.1
    # rows that repeat (position embeddings of 16 places over a batch of 128), shuffled
    tiled = np.tile(rng.standard_normal((16, 32)), (128, 1))
    shuffled = tiled[rng.permutation(len(tiled))]
    assert reordered_rel_err(tiled.reshape(-1), shuffled.reshape(-1), 32) == 0.0


@pytest.mark.parametrize("dtype_a, dtype_b", [(np.float32, np.float32), (np.float64, np.float64),
                                              (np.float32, np.float64)])
def test_a_masks_fill_values_are_no_data(dtype_a, dtype_b):
    """An additive attention mask (finfo(dtype).min where masked, each run in its own dtype)
    added to scores: an error in the unmasked scores is measured against them (it read as
    1e-41 of the fills); a fill one side lacks is a difference."""
    rng = np.random.default_rng(0)
    scores = rng.standard_normal(50_000)
    masked = rng.random(scores.size) < 0.5
    a = np.where(masked, np.finfo(dtype_a).min, scores).astype(dtype_a)
    b = np.where(masked, np.finfo(dtype_b).min, scores * 1.01).astype(dtype_b)
    got = compare_chunks([(a, b)], TOL)
    kept_a, kept_b = a[~masked].astype(np.float64), b[~masked].astype(np.float64)
    assert got["rel_l2_err"] == pytest.approx(
        np.linalg.norm(kept_b - kept_a) / np.linalg.norm(kept_a), rel=1e-9)
    assert got["rms_a"] == pytest.approx(np.sqrt(np.mean(kept_a ** 2)), rel=1e-9)
    assert compare_chunks([(a, a.copy())], TOL)["status"] == "equal"
    unmasked = b.copy()
    unmasked[np.flatnonzero(masked)[0]] = 0.0
    assert compare_chunks([(a, unmasked)], TOL)["status"] == "DIFF"


def test_index_count_is_the_most_times_one_value_occurs_in_a_streamed():
    """Of A's integers, however they are chunked (and whatever B holds); NaN for floating
    tensors and for values outside [0, MAX_COUNTED)."""
    from compare.metrics import MAX_COUNTED
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 300, 100_000)
    b = ids + (rng.random(ids.size) < 0.01)
    cuts = [0, 7, 40_000, 40_001, 100_000]
    got = compare_chunks([(ids[i:j], b[i:j]) for i, j in zip(cuts, cuts[1:])], TOL)
    assert got["index_count"] == np.unique(ids, return_counts=True)[1].max()
    assert math.isnan(compare_chunks([(ids.astype(np.float32), b.astype(np.float32))],
                                     TOL)["index_count"])
    for outside in (np.array([3, MAX_COUNTED]), np.array([-100, 3, 3])):
        assert math.isnan(compare_chunks([(outside, outside)], TOL)["index_count"])
    assert math.isnan(compare_chunks([(ids[:0], b[:0])], TOL)["index_count"])

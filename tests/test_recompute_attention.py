"""Scaled dot-product attention recomputed from its op records (compare.attention): the
formula follows torch's autograd with masks, causality, a scale and grouped key heads;
torch's own kernels round within what it allows; in real models a wrong attention kernel is
found exactly, and healthy pairs stay quiet where its softmax backward cancels."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from compare import compare_dumps, formulas, localize, summarize
from compare import format as fmt
from compare import status as st
from compare.cli import main
from compare.precision import ROUNDING
from compare.status import ORIGIN
from compare.verdict import MISCOMPUTED
from dumper import HookerAndDumper

from architectures import run_step
from test_recompute_ops import _dumped, _WrongOp

ATTENTION = "scaled_dot_product_attention"
# (query, key, value shapes, mask shape or None, options); "bool" masks where it may look
CASES = {
    "plain": ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6), None, {}),
    "float mask broadcast": ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6), (1, 3, 5, 7), {}),
    "bool mask": ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6), "bool", {"scale": 0.7}),
    "causal, grouped heads": ((2, 4, 6, 4), (2, 2, 6, 4), (2, 2, 6, 4), None,
                              {"is_causal": True, "enable_gqa": True, "scale": 0.3}),
    "matrices": ((5, 4), (7, 4), (7, 3), (5, 7), {}),
    "keys broadcast over the batch": ((2, 3, 5, 4), (1, 3, 7, 4), (1, 3, 7, 6), None, {}),
}


def _attention(shapes: tuple, dtype: torch.dtype, seed: int = 0) -> tuple:
    """An attention call of ``shapes`` (CASES) in ``dtype`` and its gradients: the inputs
    given (the mask too; a float one requiring grad), options, output, incoming gradient."""
    q_shape, k_shape, v_shape, mask_shape, options = shapes
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(s, generator=gen).to(dtype).requires_grad_()
               for s in (q_shape, k_shape, v_shape)]
    mask = None
    if mask_shape == "bool":
        mask = torch.rand(q_shape[0], 1, 1, k_shape[-2], generator=gen) > 0.3
        mask[..., 0] = True  # every query sees a key
    elif mask_shape is not None:
        mask = torch.randn(mask_shape, generator=gen).to(dtype).requires_grad_()
    y = nn.functional.scaled_dot_product_attention(*tensors, attn_mask=mask, **options)
    g = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(g)
    return tensors, mask, options, y, g


def _figures(tensors, mask, options, y, g) -> list[tuple[str, int, dict]]:
    """``(kind, operand, columns)`` of the formula for the output and each gradient."""
    def values(t):
        return t.detach().double().numpy()

    added = None if mask is None else (np.where(mask.numpy(), 0.0, -np.inf)
                                       if mask.dtype == torch.bool else values(mask))
    grads = [t.grad for t in tensors] + ([mask.grad] if mask is not None and
                                         mask.requires_grad else [])
    [formula] = formulas.candidates(ATTENTION)
    out = []
    for kind, operand, got in [(fmt.OUTPUT, 0, y), *((fmt.GRAD_INPUT, i, grad)
                                                     for i, grad in enumerate(grads))]:
        records = {fmt.INPUT: values(tensors[0]), fmt.OUTPUT: values(y),
                   fmt.GRAD_OUTPUT: values(g), fmt.GRAD_INPUT: values(got)}
        ops = formulas.Operands(records, None, None, math.nan,
                                others=(values(tensors[1]), values(tensors[2]), added),
                                operand=operand,
                                options={k: float(v) for k, v in options.items()})
        out.append((kind, operand, formula(kind, ops).columns()))
    return out


@pytest.mark.parametrize("case", CASES)
def test_attention_follows_autograd(case):
    """In float64 the formula gives torch's output and the gradients of query, key, value
    and a float mask, to float64 rounding."""
    figures = _figures(*_attention(CASES[case], torch.float64))
    has_mask_grad = CASES[case][3] not in (None, "bool")
    assert [(kind, operand) for kind, operand, _ in figures] == [
        (fmt.OUTPUT, 0), *((fmt.GRAD_INPUT, i) for i in range(3 + has_mask_grad))]
    for kind, operand, columns in figures:
        assert columns["recomputed_rel_err"] < 1e-14, (kind, operand, columns)
        assert columns["recomputed_spread"] >= 0.5


@pytest.mark.parametrize("backend", [SDPBackend.MATH, None], ids=["math", "default"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("case", ["float mask broadcast", "causal, grouped heads"])
def test_torchs_kernels_round_within_what_the_formula_allows(case, dtype, backend):
    """torch's CPU kernels (its math backend, rounding the scores to the dtype, and the
    default fused one) recomputed in float64 from their own rounded operands: every record
    within what rounding allows, over several seeds."""
    for seed in range(3):
        with sdpa_kernel(backend) if backend else contextlib.nullcontext():
            figures = _figures(*_attention(CASES[case], getattr(torch, dtype), seed))
        for kind, operand, c in figures:
            allowed = formulas.allowed(ROUNDING[dtype].unit, c["recomputed_spread"],
                                       c["recomputed_terms"])
            assert 0 < c["recomputed_rel_err"] <= allowed, (seed, kind, operand, c, allowed)


def _llama(directory, precision: str, wrong: dict = None):
    """One step of the tiny Llama (its attention by torch's sdpa), its first layer's
    attention op by op; ``wrong``: a :class:`_WrongOp` in B's kernels."""
    with _WrongOp(**wrong) if wrong else contextlib.nullcontext():
        run_step("llama", precision, directory,
                 dumper_options={"ops": ["model.layers.0.self_attn"]})
    return directory


def test_a_wrong_attention_kernel_is_found_in_llama_and_healthy_pairs_pass(tmp_path):
    """Llama's sdpa call (causal, grouped key heads) recomputed in a float32 A against a
    bfloat16 B: every record within rounding, the pair passes; a kernel whose query gradient
    is 1e-3 off in a float32 B is the first divergence, named by the CLI, by 1e-3
    recomputed."""
    a = _llama(tmp_path / "a", "float32")
    result = compare_dumps(a, _llama(tmp_path / "b", "bfloat16"))
    rows = result[(result["cls"] == ATTENTION) & result["kind"].isin(["output", "grad_input"])]
    assert len(rows) == 4 and rows["recomputed_rel_err"].notna().all(), rows
    assert (rows["status"] != st.DIFF).all() and summarize(result).ok, summarize(result).verdict()
    wrong = _llama(tmp_path / "wrong", "float32", {"where": "grad_input", "scale": 1.001,
                                                    "op": ATTENTION, "operand": 0})
    first = summarize(compare_dumps(a, wrong)).first
    op = f"model.layers.0.self_attn/{ATTENTION}#0"
    assert (first.row["module"], first.row["kind"], first.row["index"]) == (
        op, "grad_input", 0), first.row
    assert first.row["recomputed_rel_err"] == pytest.approx(1e-3, rel=0.05)
    assert MISCOMPUTED in first.row["reason"]
    shell = CliRunner().invoke(main, [str(a), str(wrong)])
    assert shell.exit_code == 1 and f"{op} (grad_input[0])" in shell.output, shell.output


def test_t5_in_float64_against_float32_after_four_steps_has_no_false_origin(tmp_path):
    """T5 (its position bias is the mask, which gets a gradient) at step 4, float64 A
    against float32 B, its cross-attention op by op and B re-run on A's values: no origin.
    Before its attention was recomputed, the query's gradient, where softmax's backward
    cancels, was one (9x the typical local error)."""
    common = dict(seed=20, steps=4, optimizer="adamw", plant_last_only=True)
    options = {"ops": ["decoder.block.1.layer.1.EncDecAttention"], "skip_ops": ()}
    a = tmp_path / "a"
    run_step("t5", "float64", a, dumper_options={"params": True, **options}, **common)
    free, rerun = tmp_path / "free", tmp_path / "rerun"
    run_step("t5", "float32", free, dumper_options=options, **common)
    run_step("t5", "float32", rerun, dumper_options={**options, "inject": a}, **common)
    found = localize(a, free, rerun)
    attention = found[found["cls"] == ATTENTION]
    assert attention["local_rel_error"].notna().any(), found
    assert not (found["verdict"] == ORIGIN).any(), found[found["verdict"] == ORIGIN]


class _Projected(nn.Module):
    """Attention's query, key and value projection, split into ``heads`` heads."""

    def __init__(self, heads: int = 2, width: int = 16):
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(width, 3 * width)

    def split(self, x: torch.Tensor) -> tuple:
        """Query, key and value of ``x`` (batch, length, width), heads on axis 1."""
        return tuple(t.unflatten(-1, (self.heads, -1)).transpose(1, 2)
                     for t in self.qkv(x).chunk(3, dim=-1))

    @staticmethod
    def merged(out: torch.Tensor) -> torch.Tensor:
        """The heads of ``out`` side by side again."""
        return out.transpose(1, 2).flatten(-2)


class _MaskedAttention(_Projected):
    """Attention over a padded batch as model code writes it: a float mask filled with
    ``finfo.min`` (the first sample's last query sees no key: it averages them all), a
    boolean one, one at ``-inf`` (the first sample's first query sees none: torch gives
    zeros), causal self-attention of one tensor given as query, key and value, and its square
    ``v * v``: one tensor at two places, whose gradient is recorded once."""

    def forward(self, x):
        batch, length, _ = x.shape
        q, k, v = self.split(x)
        keep = torch.ones(batch, 1, length, length, dtype=torch.bool)
        keep[1, ..., -2:] = False  # the second sample's last two positions are padding
        zeros = torch.zeros(keep.shape, dtype=q.dtype)
        filled = zeros.masked_fill(~keep, torch.finfo(q.dtype).min)
        filled[0, :, -1] = torch.finfo(q.dtype).min
        hidden = zeros.masked_fill(~keep, -math.inf)
        hidden[0, :, 0] = -math.inf
        attend = nn.functional.scaled_dot_product_attention
        out = (attend(q, k, v, attn_mask=filled) + attend(q, k, v, attn_mask=keep)
               + attend(q, k, v, hidden) + attend(v, v, v, is_causal=True) + v * v)
        return self.merged(out)


def test_masks_fills_and_a_tensor_given_twice_are_recomputed_as_torch_computes_them(tmp_path):
    """Through the dumper and h5cmp: the attention records of a healthy float32 A against
    bfloat16 B recomputed within rounding (masks of fills, booleans and ``-inf``, rows that
        see no key, a recorded ``is_causal``), but the gradient of a tensor given twice (the sum
    of both places', which A's records do not follow either), and the pair passes; an output
    10 % off in a bfloat16 B, where a query sees only fills, is the first divergence, found by
    its recomputation (the fills do not widen what rounding allows)."""
    a = _dumped(tmp_path / "a", _MaskedAttention, "float32")
    result = compare_dumps(a, _dumped(tmp_path / "b", _MaskedAttention, "bfloat16"))
    rows = result[result["cls"].isin([ATTENTION, "mul"])
                  & result["kind"].isin(["output", "grad_input"])].set_index(["module", "kind",
                                                                               "index"])
    shared = [(f"/{ATTENTION}#3", "grad_input", 0), ("/mul#0", "grad_input", 0)]
    assert rows.loc[shared, "recomputed_rel_err"].isna().all()
    # (torch's float32 backward of a query that sees only fills is not its float64 one, nor
    # the same in its two CPU kernels: A's records need not follow the formula there)
    filled = [(f"/{ATTENTION}#0", "grad_input", i) for i in range(3)]
    recomputed = rows.drop(shared + filled)
    assert len(recomputed) == 3 * 3 + 2, recomputed
    assert recomputed["recomputed_rel_err"].notna().all(), recomputed["recomputed_rel_err"]
    assert (rows["status"] != st.DIFF).all() and summarize(result).ok, summarize(result).verdict()
    wrong = _dumped(tmp_path / "wrong", _MaskedAttention, "bfloat16",
                    wrong={"where": "output", "scale": 1.1, "op": ATTENTION})
    first = summarize(compare_dumps(a, wrong)).first
    assert (first.row["module"], first.row["kind"]) == (f"/{ATTENTION}#0", "output"), first.row
    assert first.row["recomputed_rel_err"] == pytest.approx(0.1, rel=0.05)
    assert MISCOMPUTED in first.row["reason"]
    assert CliRunner().invoke(main, [str(a), str(wrong)]).exit_code == 1


class _LongAttention(_Projected):
    """Attention whose scores (8 samples, 4 heads, 192 queries against 192 keys) are more
    than a recomputation takes whole, with a padding mask per sample."""

    def __init__(self):
        super().__init__(heads=4)

    def forward(self, x):
        keep = torch.ones(x.shape[0], 1, 1, x.shape[1], dtype=torch.bool)
        keep[::2, ..., -7:] = False
        return self.merged(nn.functional.scaled_dot_product_attention(*self.split(x),
                                                                      attn_mask=keep))


def test_a_long_attention_is_recomputed_on_every_kth_sample(tmp_path):
    """Scores beyond ``SAMPLE_ELEMENTS``: recomputed on every second sample of the batch (its
    mask's too), within rounding in a healthy float32 A against bfloat16 B; a query gradient
    10 % off in a bfloat16 B is found by the recomputation."""
    def dumped(name: str, precision: str, wrong: dict = None):
        torch.manual_seed(0)
        model = _LongAttention()
        batch = torch.randn(8, 192, 16, generator=torch.Generator().manual_seed(1))
        with _WrongOp(**wrong) if wrong else contextlib.nullcontext(), \
                HookerAndDumper(tmp_path / name, ops="*").hooks(model, 0, 0):
            with torch.autocast("cpu", dtype=getattr(torch, precision),
                                enabled=precision != "float32"):
                loss = model(batch).float().pow(2).mean()
            loss.backward()
        return tmp_path / name

    a = dumped("a", "float32")
    result = compare_dumps(a, dumped("b", "bfloat16"))
    rows = result[(result["cls"] == ATTENTION) & result["kind"].isin(["output", "grad_input"])]
    assert len(rows) == 4 and (rows["recomputed_stride"] == 2).all(), rows["recomputed_stride"]
    assert summarize(result).ok, summarize(result).verdict()
    wrong = dumped("wrong", "bfloat16", {"where": "grad_input", "scale": 1.1, "op": ATTENTION,
                                         "operand": 0})
    first = summarize(compare_dumps(a, wrong)).first
    assert (first.row["module"], first.row["kind"], first.row["index"]) == (
        f"/{ATTENTION}#0", "grad_input", 0), first.row
    assert first.row["recomputed_rel_err"] == pytest.approx(0.1, rel=0.1)


class _Padded(_Projected):
    """Attention given a padding mask, or (``masked=False``: the classic bug of code that
    drops it) none."""

    def __init__(self, masked: bool = True):
        super().__init__()
        self.masked = masked

    def forward(self, x):
        keep = torch.ones(x.shape[0], 1, 1, x.shape[1], dtype=torch.bool)
        keep[0, ..., -3:] = False
        return self.merged(nn.functional.scaled_dot_product_attention(
            *self.split(x), attn_mask=keep if self.masked else None))


def test_an_attention_given_a_mask_in_one_run_only_is_named(tmp_path):
    """A gives a mask and B none: B's call is not recomputed as if it had A's operands (A's
    records do not follow the formula without one), and it is the first divergence; B gives
    one A did not: B's call, recomputed from its records as A's code computes it, is not."""
    masked = _dumped(tmp_path / "masked", _Padded, "float32")
    unmasked = _dumped(tmp_path / "unmasked", lambda: _Padded(masked=False), "float32")
    for a, b in ((masked, unmasked), (unmasked, masked)):
        result = compare_dumps(a, b)
        recomputed = result.loc[result["cls"] == ATTENTION, "recomputed_rel_err"]
        first = summarize(result).first
        assert (first.row["module"], first.row["kind"]) == (f"/{ATTENTION}#0", "output")
        if a == masked:
            assert recomputed.isna().all(), recomputed
        else:
            assert first.row["recomputed_rel_err"] > 0.1 and MISCOMPUTED in first.row["reason"]

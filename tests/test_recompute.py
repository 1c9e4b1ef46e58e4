"""A call recomputed from its own records (compare.recompute): a module's own forward or
backward error found exactly where the gradient already carries as much, no false alarm from
the rounding of low precisions, and no figures where the formula or the weights are not
known to hold."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import dumper.capture
from compare import compare_dumps, formulas, summarize
from compare import format as fmt
from compare import status as st
from compare.dump import load_dump
from compare.cli import main
from compare.formulas import allowed
from compare.verdict import MISCOMPUTED
from dumper import HookerAndDumper, perturb

from architectures import cannot_run, run_step
from helpers import dump_embedded, read_tensors

COLUMNS = ["recomputed_rel_err", "recomputed_spread", "recomputed_terms"]


def _unit(dtype: str) -> float:
    return {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}[dtype]


@pytest.fixture(scope="module")
def healthy_pairs(tmp_path_factory):
    """``(arch, dtype) -> (A, healthy comparison)``: A a float32 step of ``arch`` with its
    weights, compared with the same step at ``dtype``; each made once per module, for the
    plants in one architecture to share."""
    references: dict[str, Path] = {}
    made: dict[tuple[str, str], tuple] = {}

    def pair(arch: str, dtype: str) -> tuple:
        if arch not in references:
            references[arch] = tmp_path_factory.mktemp(arch) / "a"
            run_step(arch, "float32", references[arch], dumper_options={"params": True})
        if (arch, dtype) not in made:
            b = tmp_path_factory.mktemp(f"{arch}-{dtype}") / "b"
            run_step(arch, dtype, b)
            made[arch, dtype] = (references[arch], compare_dumps(references[arch], b))
        return made[arch, dtype]
    return pair


@pytest.mark.parametrize("arch, module, dtype, scale", [
    ("llama", "model.layers.0.mlp.up_proj", "bfloat16", 1.1),   # a Linear
    ("llama", "model.layers.1.mlp.act_fn", "float16", 1.03),    # SiLU
    ("mobilenet_v2", "mobilenet_v2.layer.1.expand_1x1.convolution", "bfloat16", 1.1),  # 1x1
    ("mobilenet_v2", "mobilenet_v2.layer.2.conv_3x3.activation", "float16", 1.03),  # ReLU6
    ("mobilenet_v2", "mobilenet_v2.layer.3.expand_1x1.normalization", "bfloat16", 1.1),  # BN
    ("gpt2", "transformer.h.1.ln_2", "float16", 1.03),           # LayerNorm
    ("qwen3", "model.layers.0.self_attn.k_norm", "bfloat16", 1.1),  # RMSNorm of bfloat16
    ("resnet", "layer1.0.conv2", "bfloat16", 1.1),                # 3x3 convolution, padded
    ("convnext", "convnext.encoder.stages.0.layers.0.dwconv", "bfloat16", 1.1),  # 7x7, groups
    ("mobilenet_v2", "mobilenet_v2.layer.0.conv_3x3.convolution", "bfloat16", 1.1),  # stride 2
    ("gpt2", "transformer.h.0.mlp.c_fc", "bfloat16", 1.1),       # Hugging Face's Conv1D
])
def test_a_calls_own_backward_error_is_found_exactly(tmp_path, healthy_pairs, arch, module,
                                                     dtype, scale):
    """A module whose own backward is off by ``scale`` (the gradient it sends back, scaled
    inside its call) in a low-precision B whose gradients carry as much error already: its
    grad_input is the first divergence, by ``scale - 1`` recomputed; the healthy pair's every
    recomputed call lies within what rounding in B's dtype explains (no false alarm)."""
    why = cannot_run(arch, dtype)
    if why:
        pytest.skip(f"torch cannot run {arch} under {dtype} here: {why}")
    a, healthy = healthy_pairs(arch, dtype)
    run_step(arch, dtype, tmp_path / "p",
             plant={"include": [module], "where": "grad_input", "scale": scale})
    checked = healthy[healthy["recomputed_rel_err"].notna()]
    assert len(checked) >= 10 and not (checked["status"] == st.DIFF).any()
    # within what the verdict allows (recomputed_allowance), and that, where B's dtype
    # rounds operands, at least the operand-rounding allowance in B's dtype with, near zero
    # (float16 gradients of 5e-6 are subnormal), the spacing there, twice
    assert (checked["recomputed_rel_err"] <= checked["recomputed_allowance"]).all()
    underflow = float(torch.finfo(getattr(torch, dtype)).smallest_normal) * _unit(dtype)
    floor = allowed(_unit(dtype), checked["recomputed_spread"].to_numpy(),
                    checked["recomputed_terms"].to_numpy()) + 2 * underflow / checked[
        "rms_a"].to_numpy()
    assert (checked["recomputed_rel_err"].to_numpy() <= floor).all()
    assert summarize(healthy).ok, summarize(healthy).verdict()
    planted = compare_dumps(a, tmp_path / "p")
    first = summarize(planted).first
    assert (first.row["module"], first.row["kind"]) == (module, "grad_input")
    assert first.row["recomputed_rel_err"] == pytest.approx(scale - 1, rel=0.1)
    assert first.row["reason"].startswith(f"{MISCOMPUTED} {first.row['recomputed_rel_err']:.3g}")


def test_a_forward_error_and_the_cli_text(tmp_path):
    """A Linear's output scaled by 1.1 in bfloat16: found at its output by recomputation, and
    the CLI says so, naming what rounding explains."""
    module = "model.layers.1.self_attn.o_proj"
    run_step("llama", "float32", tmp_path / "a", dumper_options={"params": True})
    run_step("llama", "bfloat16", tmp_path / "p",
             plant={"include": [module], "where": "output", "scale": 1.1})
    result = compare_dumps(tmp_path / "a", tmp_path / "p")
    first = summarize(result).first
    assert (first.row["module"], first.row["kind"]) == (module, "output")
    assert first.row["recomputed_rel_err"] == pytest.approx(0.1, rel=0.1)
    out = CliRunner().invoke(main, [str(tmp_path / "a"), str(tmp_path / "p")])
    assert out.exit_code == 1
    assert f"{MISCOMPUTED} {first.row['recomputed_rel_err']:.3g} (rel) from what its own " \
           f"records give (Linear: recomputed from its input and weights)" in out.output


class _Scaled(nn.Linear):
    """A class named ``Linear`` that computes something else: ``2 (x Wᵀ + b)``."""

    def forward(self, x):
        return 2 * super().forward(x)


_Scaled.__name__ = "Linear"


def _run(directory, model: nn.Module, batch: torch.Tensor, **options):
    with HookerAndDumper(directory, **options).hooks(model, 0, 0):
        model(batch).pow(2).mean().backward()
    return directory


def test_no_figures_where_the_formula_does_not_hold_in_a(tmp_path):
    """A's own records show the class computes something else: no recomputation, and no
    false alarm in a healthy pair."""
    batch = torch.randn(8, 16)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), _Scaled(16, 16))

    result = compare_dumps(_run(tmp_path / "a", model(), batch, params=True),
                           _run(tmp_path / "b", model(), batch))
    assert list(result.loc[result["recomputed_rel_err"].notna(), "module"].unique()) == ["0"]
    assert summarize(result).ok


def test_weights_used_only_where_known_to_be_the_same(tmp_path):
    """B's weights differ from A's (a wrong checkpoint: one Linear's weight x 1.01): A's cannot
    stand for them, so that Linear has no figures from A's weights, and the divergence is
    the weight's; with B's own values (``params=True``) B's computation is recomputed and
    holds, so the output is no origin."""
    batch = torch.randn(8, 16)

    def model(factor: float):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        with torch.no_grad():
            m[2].weight.mul_(factor)
        return m

    a = _run(tmp_path / "a", model(1.0), batch, params=True)
    without = compare_dumps(a, _run(tmp_path / "b", model(1.01), batch))
    out = without[(without["module"] == "2") & (without["kind"] == "output")].iloc[0]
    assert math.isnan(out["recomputed_rel_err"])
    first = summarize(without).first
    assert (first.row["module"], first.row["kind"]) == ("2", "param")
    with_values = compare_dumps(a, _run(tmp_path / "bp", model(1.01), batch, params=True))
    out = with_values[(with_values["module"] == "2") & (with_values["kind"] == "output")].iloc[0]
    assert out["recomputed_rel_err"] < 1e-6 and out["status"] == st.INHERITED
    assert summarize(with_values).first.row["kind"] == "param"


def test_figures_match_a_hand_computation(tmp_path):
    """``recomputed_rel_err`` of a float16 Linear's grad_input against the float64 product of
    its recorded incoming gradient and weights, computed here by torch."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 8)
    x = torch.randn(4, 32)
    seen = {}

    def run(directory, dtype):
        model = nn.Sequential(layer).to(dtype)
        inp = x.to(dtype, copy=True).requires_grad_()
        with HookerAndDumper(directory, params=True).hooks(model, 0, 0):
            out = model(inp)
            out.register_hook(lambda g: seen.update({(dtype, "g"): g.double()}))
            out.float().pow(2).sum().backward()
        seen[dtype] = (seen[(dtype, "g")], model[0].weight.detach().double(), inp.grad.double())
        return directory

    a = run(tmp_path / "a", torch.float32)
    b = run(tmp_path / "b", torch.float16)
    g, w, gx = seen[torch.float16]
    want = g @ w
    expected = float((gx - want).norm() / want.norm())
    spread = float(((g ** 2) @ (w ** 2)).sum().sqrt() / want.norm())
    result = compare_dumps(a, b)
    row = result[(result["module"] == "0") & (result["kind"] == "grad_input")].iloc[0]
    assert row["recomputed_rel_err"] == pytest.approx(expected, rel=1e-9)
    assert row["recomputed_spread"] == pytest.approx(spread, rel=1e-9)
    assert row["recomputed_terms"] == 8
    assert np.isfinite(row["recomputed_rel_err"]) and row["status"] != st.DIFF


class _NudgedLinear(nn.Linear):
    """A ``Linear`` whose results are 2**-21 (8 float32 units) larger: a kernel change within
    what float32 rounding of its 32-term products explains, beyond the last bits."""

    def forward(self, x):
        return super().forward(x) * (1 + 2.0 ** -21)


_NudgedLinear.__name__ = "Linear"


def test_a_kernel_change_within_rounding_is_still_news_where_bits_are_expected_equal(tmp_path):
    """Both runs float32 on the same kernels, B's middle Linear computed otherwise: its own
    computation is right within rounding (recomputed), but where records are expected to be
    bit-identical any change is the finding, and it is still reported there."""
    batch = torch.randn(64, 32)

    def model(middle: type) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), middle(32, 32), nn.ReLU(),
                             nn.Linear(32, 4))

    result = compare_dumps(_run(tmp_path / "a", model(nn.Linear), batch, params=True),
                           _run(tmp_path / "b", model(_NudgedLinear), batch))
    middle = result[(result["module"] == "2") & (result["kind"] == "output")].iloc[0]
    assert 0 < middle["rel_error"] < 1e-6
    assert middle["recomputed_rel_err"] <= allowed(2.0 ** -24, middle["recomputed_spread"],
                                                   middle["recomputed_terms"])
    first = summarize(result).first
    assert (first.row["module"], first.row["kind"], first.row["status"]) == (
        "2", "output", st.DIFF)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_rounding_an_injected_operand_matches_torch(dtype):
    """What a re-run casts A's values to (compare.precision.rounded, torch-free) is torch's
    cast, bit for bit: ties, subnormals and large values included."""
    from compare.precision import rounded
    values = torch.cat([torch.randn(10000, dtype=torch.float64) * 10.0 ** torch.randint(
        -9, 4, (10000,), dtype=torch.float64), torch.tensor([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8,
                                                             2.0 ** -130, -0.0])])
    want = values.to(torch.float32).to(getattr(torch, dtype)).double().numpy()
    got = rounded(values.to(torch.float32).double().numpy(), dtype)
    assert np.array_equal(got, want)


def _rows(out: torch.Tensor) -> torch.Tensor:
    """Every third row of ``out``'s leading axes (flattened) marked 1."""
    rows = (torch.arange(out.numel() // out.shape[-1]) % 3 == 0).float()
    return rows.reshape(*out.shape[:-1], 1)


def _channels(out: torch.Tensor) -> torch.Tensor:
    """Every even channel (axis 1) of ``out`` marked 1."""
    return (torch.arange(out.shape[1]) % 2 == 0).float().reshape(1, -1, 1, 1)


@pytest.mark.parametrize("make, shape, elements, sampled", [
    # 2-D: 32 features a row, 6 rows fit: every 11th of 64 rows
    (lambda: nn.Linear(32, 16), (64, 32), 32 * 6, lambda t: t.reshape(-1, t.shape[-1])[::11]),
    # 3-D: one slice of the first axis (16 rows) is already more: rows of both leading axes
    (lambda: nn.Linear(32, 16), (4, 16, 32), 32 * 6,
     lambda t: t.reshape(-1, t.shape[-1])[::11]),
    # more rows apart than a slice of the first axis holds: every 6th row, some slices none
    (lambda: nn.Linear(8, 4), (4, 3, 8), 16, lambda t: t.reshape(-1, t.shape[-1])[::6]),
    # an activation: down to single elements where no row fits, every 39th of 192
    (lambda: nn.ReLU(), (4, 6, 8), 5, lambda t: t.reshape(-1)[::39]),
    # a BatchNorm normalizes across the batch: every 3rd of its 8 channels (4 x 36 each)
    (lambda: nn.BatchNorm2d(8), (4, 8, 6, 6), 144 * 3, lambda t: t[:, ::3]),
])
def test_a_large_call_is_recomputed_on_every_kth_sample(tmp_path, monkeypatch, make, shape,
                                                        elements, sampled):
    """Beyond ``SAMPLE_ELEMENTS`` a call is recomputed on every k-th of the samples its formula
    treats apart (slices of the first axis, a Linear's rows of all leading axes, an
    activation's elements, a BatchNorm's channels), the same in every record and on both
    sides: the figure is the hand-computed error of those samples, not the whole tensor's."""
    import compare.recompute as recompute
    monkeypatch.setattr(recompute, "SAMPLE_ELEMENTS", elements)
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)  # (a ReLU alone has no weights to train)
    mark = _channels if isinstance(make(), nn.BatchNorm2d) else _rows

    def run(directory, planted: bool):
        torch.manual_seed(1)
        layer = make()
        if planted:  # B's error: 1 % in the marked rows or channels
            layer.register_forward_hook(lambda m, args, out: out * (1 + 0.01 * mark(out)))
        _run(directory, nn.Sequential(layer), x, params=True)
        with torch.no_grad():  # what the layer computes (not layer(x): its hook would scale it)
            want = (nn.functional.linear(x, layer.weight, layer.bias)
                    if isinstance(layer, nn.Linear) else torch.relu(x)
                    if isinstance(layer, nn.ReLU) else nn.functional.batch_norm(
                        x, None, None, layer.weight, layer.bias, training=True, eps=layer.eps))
        return want.double(), (want * (1 + 0.01 * mark(want))).double()

    run(tmp_path / "a", False)
    want, got = run(tmp_path / "b", True)
    expected = float((sampled(got) - sampled(want)).norm() / sampled(want).norm())
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    row = result[(result["module"] == "0") & (result["kind"] == "output")].iloc[0]
    assert row["recomputed_rel_err"] == pytest.approx(expected, rel=1e-3)
    stride = row["recomputed_stride"]
    assert stride > 1
    if expected > 0:  # (the activation's samples miss every marked row: 0, and no DIFF)
        assert row["reason"].startswith(f"{MISCOMPUTED} {expected:.3g}")
        assert f"on one sample in {stride:.0f})" in row["reason"]
    assert expected != pytest.approx(float((got - want).norm() / want.norm()), rel=1e-2)
    backward = result[(result["module"] == "0") & (result["kind"] == "grad_input")]
    assert backward["recomputed_rel_err"].notna().all() and len(backward) == 1


def test_empty_records_have_no_figures(tmp_path):
    """Calls on tensors with no elements (a Linear to 0 features, a ReLU of its output) have
    nothing to recompute: no figures, and the comparison goes on."""
    batch = torch.randn(8, 16)

    def run(directory):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 0), nn.ReLU())
        with HookerAndDumper(directory, params=True).hooks(model, 0, 0):
            model(batch)  # forward only: an empty output has no gradient to send back
        return directory

    result = compare_dumps(run(tmp_path / "a"), run(tmp_path / "b"))
    assert set(result["module"]) >= {"0", "1"}
    assert result["recomputed_rel_err"].isna().all()
    assert summarize(result).ok


class _Geometries(nn.Module):
    """Convolutions of every geometry torch takes: stride, padding by size and by name (an
    even kernel's ``same``: the odd pad after), dilation, groups, the padding modes, one and
    three dimensions."""

    def __init__(self):
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.Tanh(),
            nn.Conv2d(6, 6, 4, padding="same"), nn.Tanh(),
            nn.Conv2d(6, 8, 3, padding="same", dilation=2, groups=2), nn.Tanh(),
            nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8, bias=False), nn.Tanh(),
            nn.Conv2d(8, 6, 3, padding=1, padding_mode="reflect"), nn.Tanh(),
            nn.Conv2d(6, 6, 3, padding=1, padding_mode="circular"), nn.Tanh(),
            nn.Conv2d(6, 4, 3, padding=1, padding_mode="replicate"), nn.Tanh(),
            nn.Conv2d(4, 4, 3, padding="valid"))
        self.line = nn.Conv1d(4, 6, 5, stride=3, padding=2)
        self.volume = nn.Conv3d(1, 2, (2, 3, 1), stride=(1, 2, 1), padding=(1, 0, 0))

    def forward(self, x):
        x = self.convs(x)
        y = self.line(x.flatten(2))
        return self.volume(y[:, None, :, :, None])


CONVS = [f"convs.{i}" for i in range(0, 15, 2)]  # between them: Tanh
ZERO_PADDED = {"convs.0", "convs.2", "convs.4", "convs.6", "convs.14", "line", "volume"}


def _dumped_step(directory, model: nn.Module, batch: torch.Tensor, plant: dict = None,
                 **options):
    """One step of ``model`` on ``batch`` dumped into ``directory`` (``plant``: passed to
    ``dumper.perturb`` for that step; ``options``: to the dumper)."""
    planted = perturb(model, **plant) if plant else None
    with HookerAndDumper(directory, **options).hooks(model, 0, 0):
        model(batch).pow(2).mean().backward()
    if planted:
        planted.remove()
    return directory


def _planted_first(a, run, directory, module: str, where: str):
    """The first divergence against ``a`` of float32 ``run`` with a 1e-3 error planted in
    ``module``'s ``where``: that record, by 1e-3 recomputed."""
    planted = run(directory, torch.float32,
                  plant={"include": [module], "where": where, "scale": 1.001})
    first = summarize(compare_dumps(a, planted)).first
    assert (first.row["module"], first.row["kind"]) == (module, where)
    assert first.row["recomputed_rel_err"] == pytest.approx(1e-3, rel=0.05)
    return first


def _geometries(directory, dtype: torch.dtype, plant: dict = None, **options):
    torch.manual_seed(0)
    model = _Geometries().to(dtype)
    batch = torch.randn(2, 4, 12, 12, generator=torch.Generator().manual_seed(1)).to(dtype)
    return _dumped_step(directory, model, batch, plant, **options)


def test_every_convolution_geometry_is_recomputed_within_rounding(tmp_path):
    """Float64 A, float32 B: each convolution's output is recomputed at its recorded
    geometry, and the gradient it sends back where it pads with zeros (its input needs one:
    not the first), each within float32 rounding, and the pair agrees."""
    a = _geometries(tmp_path / "a", torch.float64, params=True)
    result = compare_dumps(a, _geometries(tmp_path / "b", torch.float32))
    convs = {*CONVS, "line", "volume"}
    recomputed = result[result["recomputed_rel_err"].notna()]
    by_kind = {kind: set(recomputed.loc[recomputed["kind"] == kind, "module"]) & convs
               for kind in ("output", "grad_input")}
    assert by_kind == {"output": convs, "grad_input": ZERO_PADDED - {"convs.0"}}
    assert (recomputed["recomputed_stride"] == 1).all()
    rows = recomputed[recomputed["module"].isin(convs)]
    floor = allowed(2.0 ** -24, rows["recomputed_spread"].to_numpy(),
                    rows["recomputed_terms"].to_numpy())
    assert (rows["recomputed_rel_err"].to_numpy() <= floor).all()
    assert summarize(result).ok, summarize(result).verdict()


@pytest.mark.parametrize("module, where", [("convs.4", "output"), ("convs.8", "output"),
                                           ("convs.6", "grad_input"), ("volume", "grad_input")])
def test_a_convolutions_own_error_is_found_exactly(tmp_path, module, where):
    """A 1e-3 error in one convolution's forward or backward (grouped, dilated, reflecting,
    three-dimensional) in a float32 B against float64 A: the first divergence, by 1e-3
    recomputed."""
    a = _geometries(tmp_path / "a", torch.float64, params=True)
    _planted_first(a, _geometries, tmp_path / "p", module, where)


def test_the_geometry_is_recorded_and_older_files_recompute_what_they_can(tmp_path,
                                                                         monkeypatch):
    """Each convolution's geometry is a ``conv`` row at its first call; dumps without those
    rows (written before 2026-11-27) recompute only the convolutions that need none (stride
    1, no padding, one group: here the ``valid`` one) and leave the others alone, without a
    false alarm."""
    a = _geometries(tmp_path / "a", torch.float64, params=True)
    index = load_dump(a).index
    rows = index[(index["kind"] == fmt.PARAM) & (index["path"] == fmt.CONV_PATH)]
    assert len(rows) == len(CONVS) + 2 and set(rows["dtype"]) == {"str"}
    geometry = dict(zip(rows["module"], rows["value"].map(fmt.parse_conv)))
    assert geometry["convs.6"] == fmt.ConvGeometry((1, 1), (2, 2), (2, 2), 8, "zeros")
    assert geometry["convs.2"].padding == "same" and geometry["volume"].stride == (1, 2, 1)
    assert geometry["convs.8"].padding_mode == "reflect"
    monkeypatch.setattr(dumper.capture, "CONVOLUTIONS", ())  # as written before
    old = _geometries(tmp_path / "old-a", torch.float64, params=True)
    assert not (load_dump(old).index["path"] == fmt.CONV_PATH).any()
    result = compare_dumps(old, _geometries(tmp_path / "old-b", torch.float32))
    recomputed = result[result["recomputed_rel_err"].notna() & result["cls"].str.startswith(
        "Conv")]
    assert set(recomputed["module"]) == {"convs.14"}
    assert summarize(result).ok, summarize(result).verdict()


def test_a_geometry_that_does_not_parse_is_not_recomputed():
    """``compare.format.parse_conv`` takes what ``conv_text`` writes and nothing else: no
    missing field, sizes of one length, strides, dilations and groups of at least 1, no
    negative padding."""
    geometry = fmt.ConvGeometry((2, 1), "same", (1, 3), 4, "circular")
    assert fmt.parse_conv(fmt.conv_text(geometry)) == geometry
    for text in ("", "stride=1", "stride=1,1 padding=1 dilation=1,1 groups=1 padding_mode=zeros",
                 "stride=1,1 padding=x,1 dilation=1,1 groups=1 padding_mode=zeros",
                 "stride=1,1 padding=1,1 dilation=1,1 groups=0 padding_mode=zeros",
                 "stride=0,1 padding=1,1 dilation=1,1 groups=1 padding_mode=zeros",
                 "stride=1,1 padding=-1,1 dilation=1,1 groups=1 padding_mode=zeros"):
        assert fmt.parse_conv(text) is None, text


class _IntConv(nn.Conv2d):
    """A subclass that keeps its sizes as plain ints, as some libraries' do."""

    def __init__(self):
        super().__init__(3, 4, 3, padding=1)
        self.stride, self.padding, self.dilation = 1, 1, 1


class _OddConv(nn.Conv2d):
    """A subclass whose sizes are not torch's kind at all."""

    def __init__(self):
        super().__init__(4, 4, 3, padding=1)
        self.stride = "learned"

    def forward(self, x):
        return nn.functional.conv2d(x, self.weight, self.bias, 1, 1)


def test_a_convolution_subclass_records_what_it_can_and_the_step_runs(tmp_path):
    """Sizes kept as ints are recorded per dimension; sizes of no known kind record no
    geometry, and the user's step runs and is dumped all the same."""
    torch.manual_seed(0)
    model = nn.Sequential(_IntConv(), _OddConv())
    with HookerAndDumper(tmp_path, params=True).hooks(model, 0, 0):
        model(torch.randn(2, 3, 6, 6)).sum().backward()
    index = load_dump(tmp_path).index
    rows = index[index["path"] == fmt.CONV_PATH]
    assert dict(zip(rows["module"], rows["value"])) == {
        "0": "stride=1,1 padding=1,1 dilation=1,1 groups=1 padding_mode=zeros"}
    assert {"0", "1"} <= set(index["module"])


def test_b_recomputed_at_as_geometry_where_it_slides_otherwise(tmp_path):
    """B's convolution pads by reflection where A's pads with zeros (same shapes, other
    borders): B is recomputed at A's geometry, so what it computes is not A's: a DIFF at its
    output, not a false agreement."""
    def run(directory, mode: str, dtype: torch.dtype, **options):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode=mode), nn.Tanh()).to(
            dtype)
        batch = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
        with HookerAndDumper(directory, **options).hooks(model, 0, 0):
            model(batch).pow(2).mean().backward()
        return directory

    a = run(tmp_path / "a", "zeros", torch.float64, params=True)
    result = compare_dumps(a, run(tmp_path / "b", "reflect", torch.float32))
    first = summarize(result).first
    assert (first.row["module"], first.row["kind"]) == ("0", "output")
    assert first.row["recomputed_rel_err"] > 0.01


def test_calls_are_recomputed_in_processes_as_in_one(tmp_path):
    """``jobs=2`` recomputes the calls in two processes: the same figures, row for row."""
    a = _geometries(tmp_path / "a", torch.float64, params=True)
    b = _geometries(tmp_path / "b", torch.float32)
    one, two = (compare_dumps(a, b, jobs=jobs) for jobs in (1, 2))
    columns = ["recomputed_rel_err", "recomputed_spread", "recomputed_terms", "recomputed_dtype"]
    assert one[columns].notna().any(axis=None)
    pd.testing.assert_frame_equal(one[columns], two[columns])


def _transposed(directory, dtype: torch.dtype, plant: dict = None, **options):
    """Transposed convolutions (a decoder's upsampling): stride with output padding,
    dilation with groups."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1), nn.Tanh(),
        nn.ConvTranspose2d(6, 4, 3, stride=3, padding=2, dilation=2, groups=2,
                           output_padding=2)).to(dtype)
    batch = torch.randn(2, 4, 5, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    return _dumped_step(directory, model, batch.requires_grad_(), plant, **options)


def test_transposed_convolutions_are_recomputed_and_their_errors_found(tmp_path):
    """Float64 A, float32 B: each transposed convolution's output and the gradient it sends
    back are recomputed within float32 rounding at the recorded geometry, the pair agrees,
    and a 1e-3 error in one's forward or backward is the first divergence, by 1e-3."""
    a = _transposed(tmp_path / "a", torch.float64, params=True)
    index = load_dump(a).index
    assert set(index.loc[index["path"] == fmt.CONV_PATH, "module"]) == {"0", "2"}
    result = compare_dumps(a, _transposed(tmp_path / "b", torch.float32))
    rows = result[result["recomputed_rel_err"].notna() & result["cls"].str.startswith("Conv")]
    assert sorted(zip(rows["module"], rows["kind"])) == [
        ("0", "grad_input"), ("0", "output"), ("2", "grad_input"), ("2", "output")]
    floor = allowed(2.0 ** -24, rows["recomputed_spread"].to_numpy(),
                    rows["recomputed_terms"].to_numpy())
    assert (rows["recomputed_rel_err"].to_numpy() <= floor).all()
    assert summarize(result).ok, summarize(result).verdict()
    for module, where in (("2", "output"), ("0", "grad_input")):
        _planted_first(a, _transposed, tmp_path / f"{module}{where}", module, where)


def test_an_embedding_is_recomputed_from_the_rows_its_ids_name(tmp_path, monkeypatch):
    """An Embedding's output is the rows of its weight its ids name: recomputed exactly from
    B's records (0 in a healthy pair, however far the weights drifted), its planted error
    measured (the torch-computed figure), found as the origin at a later step where drifted
    weights hide it from the error figures; only the rows named are read (a weight larger
    than ``MAX_ELEMENTS`` whose named rows fit is still recomputed); and on integers B ran on
    as A's (``inject=A``) too."""
    monkeypatch.setattr("compare.recompute.MAX_ELEMENTS", 64 * 16 // 2)  # 12 rows fit
    a = dump_embedded(tmp_path / "a", torch.float64, params=True)
    healthy = compare_dumps(a, dump_embedded(tmp_path / "b", torch.float32, drift=1e-3,
                                             params=True))
    out = healthy[(healthy["module"] == "emb") & (healthy["kind"] == "output")].iloc[0]
    assert out["recomputed_rel_err"] == 0.0 and out["recomputed_terms"] == 1
    assert summarize(healthy).ok, summarize(healthy).verdict()
    planted = compare_dumps(a, dump_embedded(tmp_path / "p", torch.float32, drift=1e-3,
                                             plant=1.1, params=True))
    first = summarize(planted).first
    assert (first.row["module"], first.row["kind"]) == ("emb", "output")
    assert first.row["reason"].startswith(MISCOMPUTED)
    # by hand: B's output against B's weight rows at B's ids, relatively
    tensors = read_tensors(tmp_path / "p")
    ids, weight, output = (tensors[("emb", 0, kind, 0)] for kind in ("input", "param", "output"))
    want = weight.double()[ids]
    expected = float((output.double() - want).norm() / want.norm())
    assert first.row["recomputed_rel_err"] == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.1, rel=1e-3)
    injected = compare_dumps(a, dump_embedded(tmp_path / "i", torch.float32, plant=1.1,
                                              inject=a))
    row = injected[(injected["module"] == "emb") & (injected["kind"] == "output")].iloc[0]
    assert row["recomputed_rel_err"] == pytest.approx(0.1, rel=1e-3)


class _Pooled(nn.Module):
    """Adaptive average pools: to bins of unequal sizes (7 rows to 3), and global."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bins = nn.AdaptiveAvgPool2d((3, 2))
        self.mix = nn.Conv2d(8, 8, 1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.mix(torch.tanh(self.bins(torch.tanh(self.conv(x)))))
        return self.head(self.pool(torch.tanh(x)).flatten(1))


def _pooled(directory, dtype: torch.dtype, plant: dict = None):
    torch.manual_seed(0)
    model = _Pooled().to(dtype)
    batch = torch.randn(2, 3, 7, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    return _dumped_step(directory, model, batch, plant, params=True)


def test_adaptive_average_pools_are_recomputed_and_their_errors_found(tmp_path):
    """Float64 A, float32 B: each pool's output and the gradient it sends back (the first
    needs none: its input is the conv's) are recomputed within float32 rounding, the pair
    agrees, and a 1e-3 error in a pool's forward or backward is the first divergence, by
    1e-3. (MobileNetV2's and a ResNet's pooled features carry tens of percent from bfloat16:
    a 10 % error in the pool itself hid there from the error figures.)"""
    a = _pooled(tmp_path / "a", torch.float64)
    result = compare_dumps(a, _pooled(tmp_path / "b", torch.float32))
    rows = result[result["recomputed_rel_err"].notna() & result["cls"].str.startswith("Adaptive")]
    # terms per element: 7 rows to 3 bins of 3 and 5 columns to 2 of 3 (rows 2 and 4 and
    # column 2 in two bins each); the global pool over 3 x 2
    assert sorted(zip(rows["module"], rows["kind"], rows["recomputed_terms"])) == [
        ("bins", "grad_input", 4), ("bins", "output", 9), ("pool", "grad_input", 1),
        ("pool", "output", 6)]
    floor = allowed(2.0 ** -24, rows["recomputed_spread"].to_numpy(),
                    rows["recomputed_terms"].to_numpy())
    assert (rows["recomputed_rel_err"].to_numpy() <= floor).all()
    assert summarize(result).ok, summarize(result).verdict()
    for module, where in (("bins", "output"), ("pool", "grad_input")):
        first = _planted_first(a, _pooled, tmp_path / f"{module}{where}", module, where)
        source = "input" if where == "output" else "incoming gradient"
        assert f"(AdaptiveAvgPool2d: recomputed from its {source})" in first.row["reason"]


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.Linear(6, 5), (3, 7, 6)), (lambda: nn.Conv2d(3, 4, 3), (2, 3, 6, 6)),
    (lambda: nn.BatchNorm2d(3), (4, 3, 5, 5)), (lambda: nn.LayerNorm(6), (3, 7, 6))])
def test_a_bias_gradient_is_recomputed_as_autograd_sums_it(make, shape):
    """A bias's gradient is its incoming gradient summed over every position: one of the two
    alignments (channels last, channels on axis 1) gives autograd's to float64 rounding."""
    torch.manual_seed(0)
    module = make().double()
    y = module(torch.randn(shape, dtype=torch.float64))
    g = torch.randn(y.shape, dtype=torch.float64)
    y.backward(g)
    ops = formulas.Operands({fmt.GRAD_OUTPUT: g.numpy(), fmt.PARAM_GRAD: module.bias.grad.numpy()},
                            None, None, math.nan)
    figures = [f(fmt.PARAM_GRAD, ops) for f in formulas.BIAS_GRADIENTS]
    errors = [f.columns()["recomputed_rel_err"] for f in figures if f is not None]
    assert min(errors) < 1e-14, errors
    terms = [f.columns()["recomputed_terms"] for f in figures if f is not None]
    assert math.prod(y.shape[:-1] if isinstance(module, (nn.Linear, nn.LayerNorm)) else
                     (y.shape[0], *y.shape[2:])) in terms


@pytest.mark.parametrize("runs", [1, 2, 8, 318])
def test_a_serial_sum_of_equal_terms_rounds_within_its_accumulated_figure(runs):
    """318 positions in ``runs`` runs of equal terms (a mean pooled over each run's positions
    gives each of them its gradient), summed in float32 in memory order, one thread's
    LayerNorm backward: its error is within twice the accumulated figure's units, where
    terms that round alike (few runs) put it far beyond the random walk of the terms."""
    rng = np.random.default_rng(runs)
    values = rng.uniform(0.5, 1.0, size=(runs, 32))
    terms = values[np.arange(318) * runs // 318].astype(np.float32).astype(np.float64)
    grad = np.cumsum(terms.astype(np.float32), axis=0, dtype=np.float32)[-1]
    ops = formulas.Operands({fmt.GRAD_OUTPUT: terms.reshape(2, 159, 32),
                             fmt.PARAM_GRAD: grad.astype(np.float64)}, None, None, math.nan)
    figures = formulas.bias_gradient(False, fmt.PARAM_GRAD, ops).columns()
    unit = 2.0 ** -24
    assert figures["recomputed_rel_err"] <= 2 * unit * figures["recomputed_accumulation"]
    walk = 2 * unit * math.sqrt(figures["recomputed_terms"]) * figures["recomputed_spread"]
    if runs <= 2:
        assert figures["recomputed_rel_err"] > 5 * walk, figures

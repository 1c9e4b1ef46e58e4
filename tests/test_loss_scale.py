"""Float16 mixed precision with a GradScaler: B's gradients carry the loss scale, recorded per
row (``grad_scale``, ``HookerAndDumper(..., scaler=)``) and compared without it."""
from __future__ import annotations

import zlib

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from compare import compare_dumps, load_dump, summarize
from compare import format as fmt
from compare.cli import main as h5cmp
from dumper import HookerAndDumper, perturb

from architectures import ARCHITECTURES, build, precision_context

SCALE = 2.0 ** 12  # a GradScaler's initial scale, low enough that no float16 gradient overflows


def _train(directory, precision: str, *, scaler: bool, record_scaler: bool = True,
           around_step: bool = False, plant: dict = None, mode: str = "tensors",
           dumped: int = 1, inject=None, scale: float = SCALE, fused: bool = False,
           clip: bool = False) -> None:
    """Two AdamW steps of a tiny GPT-2 (step ``dumped`` dumped, params=True), its loss scaled by a
    GradScaler where ``scaler``, which the dumper is told of where ``record_scaler``; the
    hooks around forward and backward, or (``around_step``) around the optimizer step too, so
    that parameter gradients are taken as ``GradScaler.step`` unscaled them; ``inject``: a
    localizing re-run on that dump's values; ``fused``: a fused AdamW (it unscales in its own
    step); ``clip``: ``scaler.unscale_`` and a gradient clip inside the hooks (its step
    outside), which changes the gradients in place after they were taken."""
    model, batch = build("gpt2", precision, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaling = torch.amp.GradScaler("cpu", init_scale=scale, enabled=scaler)
    dumper = HookerAndDumper(directory, steps=[dumped], params=True, mode=mode, inject=inject,
                             scaler=scaling if record_scaler else None)
    for step in range(2):
        planted = perturb(model, **plant) if plant and step == dumped else None
        with dumper.hooks(model, 0, step):
            with precision_context(precision):
                loss = ARCHITECTURES["gpt2"].loss(model, batch)
            scaling.scale(loss).backward()
            if clip:
                scaling.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            if around_step:
                scaling.step(opt)
                scaling.update()
        if not around_step:
            scaling.step(opt)
            scaling.update()
        opt.zero_grad()
        if planted is not None:
            planted.remove()


@pytest.mark.parametrize("around_step", [False, True], ids=["backward", "optimizer-step"])
def test_a_scaled_float16_run_is_compared_without_its_loss_scale(tmp_path, around_step):
    """Every backward record of B holds SCALE times its gradient; a parameter's gradient as
    accumulated too, and none once GradScaler.step unscaled it. Compared without the scale,
    nothing fails in a healthy float16 B against float32 A (exit 0); told nothing of the
    scaler, the first divergence is the loss's gradient, 4095 times off, and the report says
    what a factor of 2^12 is likely to be."""
    _train(tmp_path / "a", "float32", scaler=False)
    _train(tmp_path / "b", "float16", scaler=True, around_step=around_step)
    index = load_dump(tmp_path / "b").index
    backward = index["kind"].isin([fmt.GRAD_INPUT, fmt.GRAD_OUTPUT])
    assert (index.loc[backward, "grad_scale"] == SCALE).all()
    assert (index.loc[index["kind"].isin(list(fmt.FORWARD_KINDS)), "grad_scale"] == 1.0).all()
    param_grads = index.loc[index["kind"] == fmt.PARAM_GRAD, "grad_scale"]
    assert len(param_grads) and (param_grads == (1.0 if around_step else SCALE)).all()
    run = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert run.exit_code == 0 and "B diverges" not in run.output, run.output
    with h5py.File(next((tmp_path / "b").glob("*.hdf5"))) as f:  # the values are as they were
        assert f.attrs[fmt.ATTR_FORMAT_VERSION] == fmt.FORMAT_VERSION
    _train(tmp_path / "untold", "float16", scaler=True, record_scaler=False,
           around_step=around_step)
    untold = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "untold")])
    assert untold.exit_code == 1, untold.output
    first = summarize(compare_dumps(tmp_path / "a", tmp_path / "untold")).first
    assert first is not None and first.row["kind"] == fmt.GRAD_OUTPUT
    assert first.row["rel_error"] == pytest.approx(SCALE - 1, rel=1e-3)
    assert "B's values are 4096 (2^12) times A's, as a loss scale makes them" in untold.output
    assert "HookerAndDumper(..., scaler=scaler)" in untold.output


def test_statistics_of_scaled_gradients_are_compared_without_the_scale(tmp_path):
    """The first step in statistics mode: B's statistics, of scaled gradients, are unscaled."""
    _train(tmp_path / "a", "float32", scaler=False, mode="stats", dumped=0)
    _train(tmp_path / "b", "float16", scaler=True, mode="stats", dumped=0)
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert summarize(result).ok, summarize(result).verdict()
    grads = result[result["kind"] == fmt.GRAD_OUTPUT]
    assert grads["rel_l2_err"].isna().all() and (grads["rel_err_from_stats"] < 0.1).all()


def test_a_listing_of_a_scaled_dump_says_the_scale_and_divides_it_out(tmp_path):
    """`h5cmp B` lists a scaled gradient's statistics as the model's (the scale divided out,
    as the comparison does) and says which scale a stored tensor is held at."""
    _train(tmp_path / "a", "float32", scaler=False, dumped=0)
    _train(tmp_path / "b", "float16", scaler=True, mode="stats", dumped=0)
    _train(tmp_path / "c", "float16", scaler=True, dumped=0)
    index = load_dump(tmp_path / "b").index
    row = index[(index["kind"] == fmt.GRAD_OUTPUT) & (index["stat_std"] > 0)].iloc[0]
    unscaled = (f"min={row['stat_min'] / SCALE:.4g} max={row['stat_max'] / SCALE:.4g} "
                f"mean={row['stat_mean'] / SCALE:.4g} std={row['stat_std'] / SCALE:.4g}")
    listing = CliRunner().invoke(h5cmp, [str(tmp_path / "b")])
    assert listing.exit_code == 0, listing.output
    line = next(line for line in listing.output.splitlines() if unscaled in line)
    assert line.endswith(f"(held at loss scale {SCALE:g}, divided out)"), line
    assert f"(held at loss scale {SCALE:g})" in CliRunner().invoke(
        h5cmp, [str(tmp_path / "c")]).output
    assert "loss scale" not in CliRunner().invoke(h5cmp, [str(tmp_path / "a")]).output


def test_digests_at_two_loss_scales_are_reported_as_such(tmp_path):
    """Hash mode checks bits; gradients held at two loss scales never agree bitwise: the first
    divergence (the loss's gradient) says so, with both scales."""
    _train(tmp_path / "a", "float16", scaler=True, mode="hash", dumped=0)
    _train(tmp_path / "b", "float16", scaler=True, mode="hash", dumped=0, scale=SCALE / 2)
    run = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert run.exit_code == 1, run.output
    assert (f"held this gradient at loss scales {SCALE:g} and {SCALE / 2:g}, whose bits cannot "
            f"agree") in run.output, run.output
    _train(tmp_path / "again", "float16", scaler=True, mode="hash", dumped=0)
    again = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "again")])
    assert again.exit_code == 0 and "loss scales" not in again.output, again.output


def test_an_error_in_a_scaled_backward_is_found_where_it_is(tmp_path):
    """A 3 % error planted in one Linear-like module's backward of the scaled float16 run is
    the first divergence."""
    _train(tmp_path / "a", "float32", scaler=False)
    planted = "transformer.h.0.mlp.c_fc"
    _train(tmp_path / "b", "float16", scaler=True,
           plant={"include": planted, "where": "grad_input", "scale": 1.03})
    first = summarize(compare_dumps(tmp_path / "a", tmp_path / "b")).first
    assert first is not None and first.row["module"] == planted, first
    assert first.row["kind"] == fmt.GRAD_INPUT


def test_older_files_carry_no_loss_scale(tmp_path):
    """A row of a file written before version 11 reads ``grad_scale`` 1: no loss scale."""
    _train(tmp_path / "a", "float32", scaler=False)
    path = next((tmp_path / "a").glob("*.hdf5"))
    with h5py.File(path, "r+") as f:
        group = f[fmt.step_group_name(0, 1)]
        table = group[fmt.INDEX_DATASET][()]
        names = [n for n in table.dtype.names if n != "grad_scale"]
        older = np.empty(len(table), dtype=[(n, table.dtype[n]) for n in names])
        for n in names:
            older[n] = table[n]
        del group[fmt.INDEX_DATASET]
        group.create_dataset(fmt.INDEX_DATASET, data=older)
        f.attrs[fmt.ATTR_FORMAT_VERSION] = 10
        f.attrs[fmt.ATTR_INDEX_CRC] = zlib.crc32(older.tobytes())
    index = load_dump(tmp_path / "a").index
    assert (index["grad_scale"] == 1.0).all()


def test_a_localizing_rerun_at_another_loss_scale_names_the_planted_module(tmp_path):
    """A (float32, no scaler) injected into B (float16, scaled): A's gradients are put in at
    B's scale, so the re-run finds the planted backward error, and nothing in healthy B."""
    from compare import localize
    from compare.status import ORIGIN
    _train(tmp_path / "a", "float32", scaler=False)
    planted = {"include": "transformer.h.0.mlp.c_fc", "where": "grad_input", "scale": 1.03}
    for name, plant in (("healthy", None), ("planted", planted)):
        _train(tmp_path / name, "float16", scaler=True, plant=plant)
        _train(tmp_path / f"{name}-inj", "float16", scaler=True, plant=plant,
               inject=tmp_path / "a")
        table = localize(tmp_path / "a", tmp_path / name, tmp_path / f"{name}-inj")
        origins = list(table.loc[table["verdict"] == ORIGIN, "module"])
        assert origins == ([] if plant is None else [planted["include"]]), (name, origins)


def test_a_reference_value_is_rounded_as_the_scaled_run_holds_it():
    """A's float32 gradient put into a float16 run at a loss scale of 1024 is rounded there,
    where 2e-7 is a normal float16 number: within one rounding of it, where rounding it
    unscaled loses 8 % (float16's subnormals). ConvNeXt's re-run named two LayerNorms whose
    injected incoming gradient was rounded unscaled "miscomputed" (8 % off)."""
    from compare.precision import rounded
    values = np.full(4, 2e-7) * np.array([1.0, 1.1, 1.3, 1.7])
    scaled = rounded(values, "float16", 1024.0)
    assert np.array_equal(scaled, (values * 1024.0).astype(np.float16).astype(np.float64)
                          / 1024.0)
    assert np.abs(scaled / values - 1).max() <= 2.0 ** -11
    assert np.abs(rounded(values, "float16") / values - 1).max() > 0.05


def test_gradients_that_overflow_at_their_loss_scale_are_reported_so(tmp_path):
    """At a loss scale of 2^30 float16 gradients overflow: the first record with Inf is the
    first divergence, and the report says the loss scale made it overflow."""
    _train(tmp_path / "a", "float32", scaler=False, dumped=0)
    _train(tmp_path / "b", "float16", scaler=True, dumped=0, scale=2.0 ** 30)
    run = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert run.exit_code == 1, run.output
    assert "status nan_mismatch" in run.output
    assert ("B's gradients carry a loss scale of 1.07374e+09: they overflow float16 here"
            in run.output), run.output


def test_a_rerun_that_overflows_at_its_loss_scale_says_so_at_its_origin(tmp_path):
    """A localizing re-run puts A's gradients in at B's loss scale, where they may overflow
    float16 (MobileNetV2 at a fourth step, a loss scale of 128 and A's BatchNorm gradient of
    rms 112): its origin says the loss scale made it overflow, not only "NaN/Inf"."""
    _train(tmp_path / "a", "float32", scaler=False, dumped=0)
    for name, inject in (("b", None), ("c", tmp_path / "a")):
        _train(tmp_path / name, "float16", scaler=True, dumped=0, scale=2.0 ** 30,
               inject=inject)
    run = CliRunner().invoke(h5cmp, [str(tmp_path / name) for name in ("a", "b")]
                             + ["--injected", str(tmp_path / "c")])
    assert run.exit_code == 1, run.output
    origins = [line for line in run.output.splitlines() if line.startswith("  origin: ")]
    assert origins and ("B ran on A's gradients, put in at its loss scale of 1.07374e+09: "
                        "they overflow float16 here (this re-run cannot localize the step: "
                        "re-run it at a lower loss scale)") in origins[0], run.output


@pytest.mark.parametrize("case", ["fused", "clipped"])
def test_parameter_gradients_carry_the_scale_they_were_taken_at(tmp_path, case):
    """A fused AdamW unscales inside its step: its gradients, taken as the step begins, still
    carry the scale. ``scaler.unscale_`` then a clip, inside the hooks: the clip changes the
    gradients in place, they are taken again as the step ends, unscaled. Both compare with
    float32 A (clipped alike) without a divergence."""
    options = dict(fused=True, around_step=True) if case == "fused" else dict(clip=True)
    _train(tmp_path / "a", "float32", scaler=False, dumped=0, **options)
    _train(tmp_path / "b", "float16", scaler=True, dumped=0, **options)
    index = load_dump(tmp_path / "b").index
    param_grads = index.loc[index["kind"] == fmt.PARAM_GRAD, "grad_scale"]
    assert len(param_grads) and (param_grads == (SCALE if case == "fused" else 1.0)).all()
    run = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert run.exit_code == 0 and "B diverges" not in run.output, run.output

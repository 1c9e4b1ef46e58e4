"""The verdict on real architectures: healthy pairs across precisions pass, planted errors are
found where they were planted, their consequences are inherited, not failed."""
from __future__ import annotations

import contextlib
import copy
import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from click.testing import CliRunner

from compare import compare_dumps, localize, summarize
from compare import format as fmt
from compare import status as st
from compare.cli import main as h5cmp
from compare.status import FAILING, INHERITED, ORIGIN
from compare.verdict import IN_TRANSIT
from dumper import HookerAndDumper, Injector, perturb
from dumper.injection import LOCALIZING

from architectures import run_step
from helpers import require_runnable

pytest.importorskip("transformers")
warnings.filterwarnings("ignore", module="transformers")

# precision pairs (A, B) and the relative size of the error planted in B
VARIANTS = {
    "same": ("float32", "float32", 1e-3),
    "fp64": ("float64", "float32", 3e-2),
    "bf16": ("float32", "bfloat16", 0.1),
    "fp16": ("float32", "float16", 3e-2),
}
# per architecture: a module to plant in forward (its output) and one in backward (the
# gradient arriving at its output), chosen among the model's own layers
PLANTS = {
    "gpt2": ("transformer.h.1.mlp.c_fc", "transformer.h.0.attn.c_proj"),
    "llama": ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.up_proj"),
    "resnet": ("layer1.1.conv2", "fc"),
    "lstm": ("lstm", "head"),
}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """``dumps(arch, precision, plant=None, run="a")``: the directory of that run, made once
    (``run`` tells apart two runs of the same code)."""
    root = tmp_path_factory.mktemp("verdict")
    made = {}

    def get(arch, precision, plant=None, run="a"):
        key = (arch, precision, None if plant is None else str(sorted(plant.items())), run)
        if key not in made:
            made[key] = root / f"run{len(made)}"
            run_step(arch, precision, made[key], plant=plant)
        return made[key]
    return get


def _named(first, module: str) -> bool:
    """The first divergence, or a record of the same tensor, is ``module`` or inside it."""
    names = [first.row["module"], *first.aliases.get("module", [])]
    return any(n == module or n.startswith(module + ".") for n in names)


def _index(dump):
    """The index rows of a dump's steps."""
    from compare.dump import load_dump
    return load_dump(dump).index


@pytest.mark.slow
@pytest.mark.parametrize("arch, variant", [(a, v) for a in PLANTS for v in VARIANTS])
def test_healthy_pair_passes_and_plants_are_found(dumps, arch, variant):
    prec_a, prec_b, size = VARIANTS[variant]
    require_runnable(arch, prec_a, prec_b)
    a = dumps(arch, prec_a)
    healthy = summarize(compare_dumps(a, dumps(arch, prec_b, run="b")))
    assert healthy.ok and healthy.first is None, healthy
    # nothing fails; where an outlier could pass for amplified input error, it says so
    assert healthy.verdict().startswith(("B agrees with A", "B may diverge from A; two dumps "
                                                            "cannot tell"))
    for module, where in zip(PLANTS[arch], ("output", "grad_output")):
        planted = dumps(arch, prec_b, {"include": [module], "where": where, "scale": 1 + size})
        result = compare_dumps(a, planted)
        summary = summarize(result)
        assert summary.first is not None and _named(summary.first, module), (where, summary)
        assert summary.first.direction == ("forward" if where == "output" else "backward")
        # quiet: the origin fails, what carries it is inherited
        assert (result["status"].isin(FAILING)).sum() <= 3, result[result["status"].isin(FAILING)]
        assert (result["status"] == INHERITED).any()


def test_identical_rerun_is_all_equal(dumps, tmp_path):
    run_step("gpt2", "float32", tmp_path / "again")
    result = compare_dumps(dumps("gpt2", "float32"), tmp_path / "again")
    assert (result["status"] == "equal").all()
    assert summarize(result).verdict() == "B agrees with A exactly"


class TinyGrads(torch.nn.Module):
    """Gradients of ~1e-6 (the loss is scaled down), as with small losses or loss scaling."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("dtype_a, size, scale", [
    (torch.float32, 1e-3, 1e-6),   # same precision: a 1e-3 error in gradients of ~1e-9
    (torch.float64, 3e-2, 1e-4),   # float64 reference: a 3e-2 error in gradients of ~3e-7
])
def test_small_magnitude_gradient_errors_are_found(tmp_path, dtype_a, size, scale):
    batch = torch.randn(8, 16)

    def run(name, dtype, plant):
        torch.manual_seed(0)
        model = TinyGrads().to(dtype)
        if plant:
            perturb(model, "b", where="grad_output", scale=1 + size)
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            (model(batch.to(dtype)).pow(2).mean() * scale).backward()
        return tmp_path / name

    a = run("a", dtype_a, False)
    result = compare_dumps(a, run("planted", torch.float32, True))
    grads = result[result["kind"] == "grad_output"]
    assert grads["max_abs_err"].max() < 1e-5  # what a fixed atol=1e-5 would have let through
    first = summarize(result).first
    assert first is not None and first.row["module"] == "b" and first.direction == "backward"
    assert summarize(compare_dumps(a, run("healthy", torch.float32, False))).ok


def test_statistics_dumps_get_the_same_judgement(tmp_path):
    stats = {"mode": "stats"}
    run_step("gpt2", "float32", tmp_path / "a", dumper_options=stats)
    run_step("gpt2", "bfloat16", tmp_path / "b", dumper_options=stats)
    healthy = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert summarize(healthy).ok
    assert healthy["rel_l2_err"].isna().all() and healthy["norm_rel_diff"].notna().any()
    plant = {"include": ["transformer.h.0.mlp.c_fc"], "where": "output", "scale": 1.1}
    run_step("gpt2", "bfloat16", tmp_path / "p", dumper_options=stats, plant=plant)
    first = summarize(compare_dumps(tmp_path / "a", tmp_path / "p")).first
    assert first.row["module"] == "transformer.h.0.mlp.c_fc" and first.row["kind"] == "output"
    assert "estimated from statistics" in first.row["reason"]


def _gemma_step(directory, bfloat16: bool, scale_act: float = 1.0) -> None:
    """One AdamW step of a tiny Gemma (an architecture nothing else here uses: its RMSNorm
    computes in float32 under autocast) dumped in statistics mode, optionally with its first
    MLP activation's output scaled."""
    import transformers
    torch.manual_seed(0)
    config = transformers.GemmaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    model = transformers.GemmaForCausalLM(config)
    if scale_act != 1.0:
        model.model.layers[0].mlp.act_fn.register_forward_hook(lambda m, i, o: o * scale_act)
    ids = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(1))
    with HookerAndDumper(directory, mode="stats").hooks(model, 0, 0):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()


def _wav2vec2_steps(directory, dtype, steps: int = 4, plant=None) -> None:
    """AdamW steps of a tiny Wav2Vec2 (an architecture the benchmark does not use: a
    convolutional feature extractor with group norm, then attention over 159 positions),
    each dumped with params=True; ``plant`` is given to ``dumper.perturb`` in the last."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    model = transformers.Wav2Vec2ForSequenceClassification(transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, feat_extract_norm="group",
        mask_time_prob=0.0, layerdrop=0.0, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, num_labels=3,
        classifier_proj_size=16)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dumper = HookerAndDumper(directory, params=True)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        batch = dict(input_values=torch.randn(2, 1600, generator=g).to(dtype),
                     labels=torch.randint(0, 3, (2,), generator=g))
        planted = perturb(model, **plant) if plant and step == steps - 1 else None
        with dumper.hooks(model, 0, step):
            model(**batch).loss.backward()
        if planted:
            planted.remove()
        opt.step()
        opt.zero_grad()


def test_a_float64_reference_of_a_long_sequence_model_raises_no_false_alarm(tmp_path,
                                                                           one_thread):
    """Float64 against float32, a trial's false alarms: a LayerNorm bias's gradient, a sum
    over 318 positions, is ~sqrt(318 / 3) float32 roundings off (12x the other parameter
    gradients' typical error); on one thread, 69 roundings (7x that floor), where the
    classifier's mean over time gives each position of a sample the same gradient, whose
    roundings in a serial sum add up: recomputed from its incoming gradient, that is within
    what its partial sums' rounding explains. An attention key projection's incoming
    gradient moves along its values by a hair more than independent errors would
    (attention's backward sums its sources' errors with the probabilities). A 1 % error
    planted in a backward pass of the feature extractor is still found where it is."""
    _wav2vec2_steps(tmp_path / "a", torch.float64)
    _wav2vec2_steps(tmp_path / "b", torch.float32)
    healthy = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert healthy.exit_code == 0, healthy.output
    _wav2vec2_steps(tmp_path / "c", torch.float32, plant={
        "include": "wav2vec2.feature_extractor.conv_layers.1.activation",
        "where": "grad_input", "scale": 1.01})
    planted = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "c")])
    assert planted.exit_code == 1, planted.output
    assert planted.stdout.startswith("B diverges from A: first at step 0:3 backward in "
                                     "wav2vec2.feature_extractor.conv_layers.1.activation"), \
        planted.output


def test_the_gradient_of_a_loss_carries_its_logits_absolute_error(tmp_path, one_thread):
    """Float64 against float32 after 3 AdamW steps (a trial at a fresh seed): Funnel's logits,
    of rms 7.4, carry 4e-7 and their cross-entropy's gradient 1.5e-6, 24x float32 rounding, a
    false alarm that took the first divergence from every plant further on. Through the
    exponential, their absolute error is the probabilities' relative error; counted so, the
    healthy pair passes, and a 3 % error planted in a LayerNorm's incoming gradient is found
    where it is."""
    module = "funnel.encoder.blocks.0.0.ffn.layer_norm"
    common = dict(seed=9, steps=4, optimizer="adamw", plant_last_only=True)
    run_step("funnel", "float64", tmp_path / "a", dumper_options={"params": True}, **common)
    run_step("funnel", "float32", tmp_path / "b", **common)
    run_step("funnel", "float32", tmp_path / "planted", **common,
             plant={"include": [module], "where": "grad_output", "scale": 1.03})
    healthy = compare_dumps(tmp_path / "a", tmp_path / "b")
    loss_gradient = healthy[(healthy["module"] == "lm_head") & (healthy["kind"] == "grad_output")]
    assert len(loss_gradient) and (loss_gradient["rel_error"] > 10 * 2.0 ** -24).all(), \
        "no longer amplified"
    assert summarize(healthy).first is None, summarize(healthy).verdict()
    first = summarize(compare_dumps(tmp_path / "a", tmp_path / "planted")).first
    assert first is not None, "nothing named"
    assert (first.row["module"], first.row["kind"]) == (module, "grad_output"), first.row


def test_a_gradient_through_attention_code_carries_its_factors_errors_added(tmp_path,
                                                                           one_thread):
    """Float64 against float32 (a trial at a fresh seed): SegFormer's key projection gets its
    gradient from the attention code, whose backward multiplies the incoming gradient by the
    queries, keys and values, which all carry the error of the input they were computed
    from: their errors add, 5.5e-7 in the key's gradient, 9 float32 units where the largest
    of them is 2.6e-7. Counted with the largest alone, that was a false alarm; with the
    gradient's and the values' errors added, the healthy pair passes, and an error of 1e-3
    planted there is still found."""
    module = "segformer.stages.1.blocks.0.attention.k_proj"
    common = dict(seed=9, steps=1)
    run_step("segformer", "float64", tmp_path / "a", dumper_options={"params": True}, **common)
    run_step("segformer", "float32", tmp_path / "b", **common)
    run_step("segformer", "float32", tmp_path / "planted", **common,
             plant={"include": [module], "where": "grad_output", "scale": 1 + 1e-3})
    healthy = compare_dumps(tmp_path / "a", tmp_path / "b")
    arriving = healthy[(healthy["module"] == module) & (healthy["kind"] == "grad_output")]
    assert len(arriving) and (arriving["rel_error"] > 8 * 2.0 ** -24).all(), "no longer amplified"
    # judged against the factors' errors added: more than the largest of them
    projections = [module.replace("k_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
    factors = healthy[healthy["module"].isin(projections) & (healthy["kind"] == "output")]
    assert len(factors) == 3, factors
    factors = factors["rel_error"]
    assert (arriving["input_rel_error"] > 1.2 * factors.max()).all(), "the largest alone"
    assert summarize(healthy).first is None, summarize(healthy).verdict()
    first = summarize(compare_dumps(tmp_path / "a", tmp_path / "planted")).first
    assert first is not None, "nothing named"
    assert (first.row["module"], first.row["kind"]) == (module, "grad_output"), first.row


def test_a_scale_error_in_an_underflowing_float16_gradient_is_found(tmp_path, one_thread):
    """Swin under float16 autocast (a trial at a fresh seed): the gradient arriving at the
    first LayerNorm has rms 8e-7, where float16 rounds to subnormals 4 % apart relatively, so
    the rounding level hides a 3 % error in it. But rounding to nearest moves a tensor's
    scale only by noise (and flushing to zero by underflow², 0.15 %): the scale test finds a
    gradient scaled by 1.03 there, from two dumps and in the localizing re-run; the healthy
    pair and its re-run still pass."""
    require_runnable("swin", "float16")
    module = "swin.encoder.layers.0.blocks.0.layernorm_before"
    common = dict(seed=10, steps=1)
    a = tmp_path / "a"
    run_step("swin", "float32", a, dumper_options={"params": True}, **common)
    plant = {"include": [module], "where": "grad_output", "scale": 1.03}
    runs = {}
    for name, options in [("b", {}), ("planted", {"plant": plant})]:
        runs[name] = tmp_path / name
        run_step("swin", "float16", runs[name], **common, **options)
        runs[f"{name}-rerun"] = tmp_path / f"{name}-rerun"
        run_step("swin", "float16", runs[f"{name}-rerun"], **common, **options,
                 dumper_options={"inject": a})
    healthy = compare_dumps(a, runs["b"])
    arriving = healthy[(healthy["module"] == module) & (healthy["kind"] == "grad_output")]
    assert len(arriving) and (arriving["expected_rel_error"] > 0.03).all(), "no underflow"
    assert summarize(healthy).first is None, summarize(healthy).verdict()
    assert not (localize(a, runs["b"], runs["b-rerun"])["verdict"] == ORIGIN).any()
    first = summarize(compare_dumps(a, runs["planted"])).first
    assert first is not None, "nothing named"
    assert (first.row["module"], first.row["kind"]) == (module, "grad_output"), first.row
    assert "along A's values" in first.row["reason"], first.row["reason"]  # the scale test
    table = localize(a, runs["planted"], runs["planted-rerun"])
    origins = table[table["verdict"] == ORIGIN]
    assert len(origins) and (origins.iloc[0]["module"], origins.iloc[0]["kind"]) == (
        module, "grad_output"), origins


def test_a_gradient_taken_apart_by_code_between_modules_keeps_no_scale_of_its_own(
        tmp_path, one_thread):
    """ViT under float16 autocast at the 4th AdamW step (a trial at a fresh seed): the
    patch embeddings' gradient is the embeddings' without the class token, which its
    classifier reads alone, so drifted weights move that token's gradient otherwise than
    the patches': the part's scale moves apart from the whole's (+0.0038 against -0.0064).
    A 3 % error in layers.1.attention.o_proj's output, hidden in what its inputs carry, was
    blamed on the patch embeddings' gradient by the scale test; now the verdict says two
    dumps cannot tell, as for the healthy pair."""
    require_runnable("vit", "float16")
    common = dict(seed=13, steps=4, optimizer="adamw", plant_last_only=True)
    a, b, planted = tmp_path / "a", tmp_path / "b", tmp_path / "planted"
    run_step("vit", "float32", a, dumper_options={"params": True}, **common)
    run_step("vit", "float16", b, loss_scale=2.0 ** 10, **common)
    plant = {"include": ["vit.layers.1.attention.o_proj"], "where": "output", "scale": 1.03}
    run_step("vit", "float16", planted, loss_scale=2.0 ** 10, plant=plant, **common)
    for dump in (b, planted):
        summary = summarize(compare_dumps(a, dump))
        assert summary.first is None and summary.cannot_tell, summary.verdict()


def test_an_error_in_a_shared_layer_is_not_calibrated_by_its_own_calls(tmp_path, one_thread):
    """ALBERT runs one layer's modules at every depth (a held-out trial, fourth AdamW step,
    float64 against float32): a 0.1 % error in its feed-forward Linear, 410x the bound
    there, added in each of its three calls, and those three were half the Linear outputs
    adding any error, so they set the level each of them was judged by (0.018 %): "cannot
    tell". Judged against other modules' records it is named."""
    _healthy_agrees_and_plant_is_named(
        tmp_path, "albert", "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn")


def test_amplified_errors_do_not_set_the_level_they_are_judged_by(tmp_path, one_thread):
    """ALBERT again (seed 19): the same 0.1 % error, 235x its bound, and then the only
    forward outputs adding any error beside it were its GELU's, which passed it on 1.026
    times and so "added" 0.02 %: as the level of every output, they let it pass for
    typical ("cannot tell"). An added error that amplification by ``GAIN`` explains does
    not calibrate."""
    _healthy_agrees_and_plant_is_named(
        tmp_path, "albert", "albert.encoder.albert_layer_groups.0.albert_layers.0.ffn", seed=19)


def test_a_product_of_two_functions_of_its_input_does_not_set_the_level(tmp_path, one_thread):
    """Mixtral (seed 22): its fused experts multiply ``silu(x W_g)`` by ``x W_u``, so a 0.1 %
    error planted in the norm before them comes out twice as large, which ``GAIN`` does not
    explain. As the only forward output adding error beyond amplification, it set the level
    every float32 output was judged by (2e-4) and the plant, 233x its bound, passed for
    typical. A record whose error its sources' errors summed explain does not calibrate."""
    _healthy_agrees_and_plant_is_named(
        tmp_path, "mixtral", "model.layers.1.post_attention_layernorm", seed=22)


def test_a_gradient_summed_over_a_broadcast_products_positions_may_cancel(tmp_path, one_thread):
    """RegNet (a held-out trial, seed 23, fourth AdamW step, bfloat16 autocast against float32,
    weights up to 52 % apart): its SE layer's own ``x * attention`` sends back to the
    Sigmoid's output its incoming gradient (30 % off) times ``x``, summed over every position,
    and that sum cancels: 64 % off, a false alarm at "144x bfloat16 rounding". An error random
    over the terms gives ``||g|| rms(x) / ||sum||`` (2.2 there) times its size; a 0.1 % error
    planted in that gradient, float64 against float32, is still named."""
    se = "regnet.encoder.stages.0.layers.0.layer.2"
    a, b = tmp_path / "a", tmp_path / "b"
    run_step("regnet", "float32", a, dumper_options={"params": True}, seed=23, **_LATER_STEP)
    run_step("regnet", "bfloat16", b, seed=23, **_LATER_STEP)
    healthy = summarize(compare_dumps(a, b))
    assert healthy.first is None, healthy.verdict()
    first_a, planted = tmp_path / "first_a", tmp_path / "planted"
    run_step("regnet", "float64", first_a, dumper_options={"params": True}, seed=23)
    run_step("regnet", "float32", planted, seed=23, plant={
        "include": [f"{se}.attention.3"], "where": "grad_output", "scale": 1.001})
    first = summarize(compare_dumps(first_a, planted)).first
    assert first is not None, "nothing named"
    assert (first.row["module"], first.row["kind"]) == (f"{se}.attention.3", "grad_output")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_broadcast_products_sum_passes_on_a_random_error_as_modelled(seed):
    """``sum_p g x`` over 25 positions, where x is made to cancel 80 % of each sum (F about
    5): a 1 % error random over g's elements moves it by what ``F e_g`` says, within a
    quarter (128 sums: the norm spreads by 6 %). Terms of one sign (F < 1): a random error
    averages out, one proportional to g gives its own size, the least modelled."""
    from compare.evidence import _summed_over_broadcast
    rng = np.random.default_rng(seed)
    g, r = rng.standard_normal((2, 8, 16, 5, 5))
    along = (g * r).sum(axis=(2, 3), keepdims=True) / (g * g).sum(axis=(2, 3), keepdims=True)
    for g, x, least in ((g, r - 0.8 * along * g, False),
                        (1 + rng.random(g.shape), 1 + rng.random(g.shape), True)):
        s = (g * x).sum(axis=(2, 3), keepdims=True)
        rms = np.array([np.sqrt(np.mean(t ** 2)) for t in (s, g, x)])
        shapes = np.empty(3, object)
        shapes[:] = [s.shape, g.shape, x.shape]
        modelled = _summed_over_broadcast(0, np.array([1]), np.array([2]),
                                          np.array([0.0, 0.01, 0.0]), shapes, rms)
        error = 0.01 * rms[1] * rng.standard_normal(g.shape)
        measured = np.linalg.norm((error * x).sum(axis=(2, 3))) / np.linalg.norm(s)
        if least:
            assert modelled == 0.01 and measured < 0.01
        else:
            assert modelled > 0.03 and 0.75 < measured / modelled < 1.25, (measured, modelled)


def test_an_average_pool_that_cancels_passes_on_its_inputs_error_grown(tmp_path, one_thread):
    """Swin (a held-out trial, seed 21, fourth AdamW step, float64 against float32): its
    pooler averages a normalized sequence of rms 1.0 into 0.44 and so passes on its input's
    drift error 2.2x grown, beyond the gain of 1.1 a class of one member gets: a false alarm
    that took the first divergence from four plants. A mean's error grows by ``rms(x) /
    rms(y)`` at most (:func:`compare.gains.linear_gains`)."""
    _healthy_agrees_and_plant_is_named(
        tmp_path, "swin", "swin.encoder.layers.0.downsample.reduction", seed=21)


_LATER_STEP = dict(steps=4, optimizer="adamw", plant_last_only=True)


def _healthy_agrees_and_plant_is_named(tmp_path, arch: str, module: str, seed: int = 17
                                       ) -> None:
    """At the fourth AdamW step of ``seed``, float64 against float32: the healthy pair has no
    failing record, and a 0.1 % error in ``module``'s output is named there."""
    a, b, planted = tmp_path / "a", tmp_path / "b", tmp_path / "planted"
    run_step(arch, "float64", a, dumper_options={"params": True}, seed=seed, **_LATER_STEP)
    run_step(arch, "float32", b, seed=seed, **_LATER_STEP)
    run_step(arch, "float32", planted, seed=seed, **_LATER_STEP,
             plant={"include": [module], "where": "output", "scale": 1.001})
    healthy = summarize(compare_dumps(a, b))
    assert healthy.first is None, healthy.verdict()
    first = summarize(compare_dumps(a, planted)).first
    assert first is not None, "nothing named"
    assert (first.row["module"], first.row["kind"]) == (module, "output"), first.row


def test_attention_code_hands_on_its_sources_absolute_error(tmp_path, one_thread):
    """Bloom (a held-out trial, fourth AdamW step, float64 against float32): its attention's
    own code averages the values' third of the fused query-key-value output (1.3e-6 off, rms
    0.145) into a context of rms 0.083 that carries 2.8e-6, within the output's absolute
    error at the context's scale; judged by relative errors alone it was a false alarm that
    also took the first divergence from a 0.1 % plant downstream. An error of the attention's
    code itself (its probabilities 0.1 % off where no hooked module computes them) is named
    at the context."""
    _healthy_agrees_and_plant_is_named(tmp_path, "bloom", "transformer.h.0.mlp.dense_4h_to_h")
    # the probabilities' module not hooked: what it returns is the attention code's
    attention = "transformer.h.0.self_attention"
    unhooked = {"exclude": [f"{attention}.attention_dropout"]}
    code_a, code_b = tmp_path / "code_a", tmp_path / "code_b"
    run_step("bloom", "float64", code_a, dumper_options={"params": True, **unhooked},
             seed=17, **_LATER_STEP)
    run_step("bloom", "float32", code_b, dumper_options=unhooked, seed=17, **_LATER_STEP,
             plant={"include": [f"{attention}.attention_dropout"], "where": "output",
                    "scale": 1.001})
    first = summarize(compare_dumps(code_a, code_b)).first
    assert first is not None, "nothing named"
    assert (first.row["module"], first.row["kind"]) == (f"{attention}.dense", "input"), first.row


def test_a_cast_to_float16_rounds_to_its_subnormals_near_zero():
    """What casting A's value to B's dtype moves it by: the lower precision's unit, and, near
    zero, B's dtype's underflow (half float16's smallest subnormal, 2^-25) at the scale B
    holds it, B's loss scale included; at most all of it (flushed to zero); nothing between
    equal or unknown dtypes."""
    from compare.precision import cast_rounding_at_scale
    frame = pd.DataFrame({
        "dtype_a": ["float32", "bfloat16", "float32", "float32", "float16", None],
        "dtype_b": ["float16", "float16", "float16", "float16", "float16", "float16"],
        "rms_a": [2e-7, 1e-7, 2e-7, 1e-12, 2e-7, 2e-7],
        "grad_scale_b": [np.nan, np.nan, 1024.0, np.nan, np.nan, np.nan]})
    expected = [math.hypot(2.0 ** -11, 2.0 ** -25 / 2e-7), math.hypot(2.0 ** -8, 2.0 ** -25 / 1e-7),
                math.hypot(2.0 ** -11, 2.0 ** -25 / (2e-7 * 1024)), 1.0, 0.0, 0.0]
    np.testing.assert_allclose(cast_rounding_at_scale(frame), expected, rtol=1e-12)


@pytest.mark.parametrize("share_bounded", [0.0, 0.5, 1.0])
def test_each_record_is_calibrated_by_the_lower_quartile_of_other_modules_records(
        share_bounded):
    """A record's typical is the lower quartile of the added errors of the members that are no
    call of its module, as pandas computes it without them, and their count (rows of no
    member's module get all members'); of the bounded members (amplification explains their
    error), only those at most the lower quartile of the others' unbounded ones count, and
    none where no other is unbounded."""
    from compare.calibration import _typical_of_others
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 3, 5, 8, 31):
        members = pd.Series(rng.lognormal(size=n), index=rng.permutation(100)[:n])
        bounded = rng.random(1001) < share_bounded
        module = np.array([f"m{rng.integers(3)}" if k % 2 else f"p{k}" for k in range(1001)],
                          dtype=object)  # odd rows: calls of three shared modules
        rows = np.array([*members.index, 1000, 999, 997, 995], dtype=int)
        told = []
        for r in rows:
            others = members[module[members.index] != module[r]]
            free = others[~bounded[others.index]]
            told.append(others[~bounded[others.index] | (others <= free.quantile(0.25))]
                        if len(free) else free)
        level, count = _typical_of_others(members, bounded, rows, module)
        np.testing.assert_allclose(level, [t.quantile(0.25) if len(t) else 0.0 for t in told],
                                   rtol=1e-12)
        assert list(count) == [len(t) for t in told]


@pytest.mark.parametrize("arch, seed, module, loss_scale", [
    # k_proj's and q_proj's gradients took v_proj's grad_input (fed the same hidden states)
    # for a source, so the plant made them add nothing, and its own added error entered the
    # lower quartile it was judged by: 38x its bound, "agrees"
    ("whisper", 6, "model.decoder.layers.1.self_attn.v_proj", None),
    # the query's and key's gradients underflow float16 (rms 5e-8: 60 % of themselves), the
    # value's (2e-5) does not: counted in their own absolute terms, they set v_proj's typical
    ("swin", 8, "swin.encoder.layers.0.blocks.0.attention.v_proj", None),
    # at a loss scale of 2^10, a float16 gradient underflows 1024 times less than its
    # unscaled values (A's) say: the floors were 30x too high
    ("segformer", 8, "segformer.stages.1.blocks.0.attention.k_proj", 2.0 ** 10),
])
def test_a_float16_error_between_attention_projections_is_found_at_the_first_step(
        tmp_path, one_thread, arch, seed, module, loss_scale):
    """bench_localize's first-step float16 misses of a 3 % error in the gradient arriving at
    an attention projection (after attention's own code sent it back), each 28-38x the
    bound the healthy pair leaves there: named now, where the healthy pair still passes."""
    require_runnable(arch, "float16")
    common = dict(seed=seed, steps=1, optimizer="adamw", plant_last_only=True)
    run_step(arch, "float32", tmp_path / "a", dumper_options={"params": True}, **common)
    run_step(arch, "float16", tmp_path / "b", loss_scale=loss_scale, **common)
    run_step(arch, "float16", tmp_path / "planted", loss_scale=loss_scale, **common,
             plant={"include": [module], "where": "grad_output", "scale": 1.03})
    healthy = summarize(compare_dumps(tmp_path / "a", tmp_path / "b"))
    assert healthy.ok and healthy.first is None, healthy.verdict()
    first = summarize(compare_dumps(tmp_path / "a", tmp_path / "planted")).first
    assert first is not None, "nothing named"
    assert (first.row["module"], first.row["kind"]) == (module, "grad_output"), first.row


def test_a_wrong_loss_gradient_is_named_where_the_model_receives_it(tmp_path, one_thread):
    """DINOv2 (a held-out trial, seed 20, first step, float32 against bfloat16 autocast): the
    gradient arriving at its loss output (1.0, the seed of ``backward()``) 10 % too large
    was judged by the typical bfloat16 error of gradients arriving at outputs (0.021):
    within 6x of it, "cannot tell". A scalar output's gradient is one number the code after
    the model computes: a float32 rounding of it is all that is expected."""
    require_runnable("dinov2", "bfloat16")
    common = dict(seed=20, steps=1, optimizer="adamw", plant_last_only=True)
    run_step("dinov2", "float32", tmp_path / "a", dumper_options={"params": True}, **common)
    run_step("dinov2", "bfloat16", tmp_path / "b", **common)
    run_step("dinov2", "bfloat16", tmp_path / "planted", **common,
             plant={"include": [""], "where": "grad_output", "scale": 1.1})
    healthy = summarize(compare_dumps(tmp_path / "a", tmp_path / "b"))
    assert healthy.ok and healthy.first is None, healthy.verdict()
    result = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "planted")])
    assert result.exit_code == 1, result.output
    assert ("first divergence: step 0:0, backward, module <root> (Dinov2ForImageClassification)"
            " call 0, grad_output[0]") in result.output, result.output
    assert "float32 rounding of the gradient a scalar output receives" in result.output


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_lookup_tables_gradient_is_judged_by_the_sum_it_is(tmp_path, one_thread, monkeypatch,
                                                             precision):
    """Swin's relative position bias, a module given no input, looks its table up: the
    table's gradient sums what arrives at the positions each entry went to, 1.3x its
    incoming gradient's error in a healthy pair (every op recorded, eager attention, B's
    weights too: ``scripts/sweep_ops.py``), beyond the gain of 1.1 a class of one member
    gets: a false alarm. With the gain of that sum (``compare.gains``) it is none."""
    import architectures
    build = architectures.build

    def eager(*args, **kwargs):
        model, batch = build(*args, **kwargs)
        model.config._attn_implementation = "eager"
        return model, batch
    monkeypatch.setattr(architectures, "build", eager)
    common = dict(seed=3, steps=1, optimizer="adamw")
    options = {"ops": "*", "params": True}
    run_step("swin", "float32", tmp_path / "a", dumper_options=options, **common)
    run_step("swin", precision, tmp_path / "b", dumper_options=options, **common)
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    failing = result[result["status"].isin(list(FAILING))]
    assert failing.empty, failing[["module", "kind", "reason"]].to_string()


def test_statistics_do_not_pass_rounding_off_as_a_divergence(tmp_path):
    """Five statistics barely see an error random in sign: a float32 gradient carrying what
    bfloat16 code upstream rounded (0.6 %) looked 0.06 % off, so its RMSNorm's grad_input
    (0.4 %) was named a divergence in a healthy pair. As a source, such a record now counts at
    least one rounding to the lowest precision the runs compute in; a 5 % error is found."""
    _gemma_step(tmp_path / "a", bfloat16=False)
    _gemma_step(tmp_path / "b", bfloat16=True)
    _gemma_step(tmp_path / "planted", bfloat16=True, scale_act=1.05)
    healthy = summarize(compare_dumps(tmp_path / "a", tmp_path / "b"))
    assert healthy.ok and healthy.first is None, healthy
    first = summarize(compare_dumps(tmp_path / "a", tmp_path / "planted")).first
    assert first is not None and first.row["module"] == "model.layers.0.mlp.act_fn"


class _WithSideRecord(nn.Module):
    """Three Linears and, on the side, a module returning a float8 copy of a hidden state."""

    def __init__(self, plant: float):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.side = _Float8()
        self.plant = plant

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        self.side(h)
        return self.l3(self.l2(h) * self.plant)


class _Float8(nn.Module):
    def forward(self, x):
        return x.detach().to(torch.float8_e4m3fn)


def test_a_low_precision_record_elsewhere_does_not_hide_an_error_from_statistics(tmp_path):
    """The rounding a statistics-estimated source is granted is its own computation's: a
    float8 record on the side of a float64-against-float32 pair does not make a planted 5 %
    error pass for float8 rounding."""
    for name, dtype, plant in (("a", torch.float64, 1.0), ("b", torch.float32, 1.05)):
        torch.manual_seed(0)
        model = _WithSideRecord(plant).to(dtype)
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        with HookerAndDumper(tmp_path / name, mode="stats").hooks(model, 0, 0):
            model(x).pow(2).mean().backward()
    summary = summarize(compare_dumps(tmp_path / "a", tmp_path / "b"))
    assert not summary.ok and summary.first.row["module"] == "l3", summary


def test_drifted_weights_explain_later_steps(tmp_path):
    """After a few steps, fp32 and bf16 runs have different weights: the report says so and
    blames no module whose error the weights explain."""
    run_step("gpt2", "float32", tmp_path / "a", steps=4)
    run_step("gpt2", "bfloat16", tmp_path / "b", steps=4)
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    summary = summarize(result)
    assert summary.ok, summary
    weights = result[result["kind"] == "param"]
    assert (weights["status"] == INHERITED).any()
    assert "weights differ" in summary.verdict()
    # a parameter that differs by more than its own size (a bias no gradient reaches, moved
    # by AdamW alone) is noise, not the measure of how far the weights drifted
    noise = result.copy()
    noise.loc[weights.index[0], ["status", "rel_error"]] = INHERITED, 1.85e4
    others = weights.drop(weights.index[0])
    drift = others[others["status"] == INHERITED]["rel_error"].max()
    assert f"weights differ (up to {drift:.3g} in " in summarize(noise).verdict()


def test_kind_filter_does_not_change_the_verdict(dumps):
    a = dumps("gpt2", "float32")
    planted = dumps("gpt2", "bfloat16", {"include": ["transformer.h.1.mlp.c_fc"],
                                         "where": "output", "scale": 1.1})
    full = CliRunner().invoke(h5cmp, [str(a), str(planted)]).output
    only = CliRunner().invoke(h5cmp, [str(a), str(planted), "--kind", "grad_input"]).output
    verdict = "B diverges from A: first at step 0:0 forward in transformer.h.1.mlp.c_fc"
    assert full.startswith(verdict) and only.startswith(verdict)
    assert "it has no recorded inputs" not in only
    table = only.split("\n\nfailing rows", 1)[1] if "\n\nfailing rows" in only else ""
    assert " output[" not in table


def test_injected_local_errors_get_the_same_judgement(tmp_path):
    """bf16 modules each add a little rounding error locally: with reference inputs injected,
    only the planted module is an origin, and no backward record is reported for a forward
    injection."""
    plant = {"include": ["transformer.h.0.mlp.c_fc"], "where": "output", "scale": 1.1}
    run_step("gpt2", "float32", tmp_path / "a")
    run_step("gpt2", "bfloat16", tmp_path / "b", plant=plant)
    injector = Injector(tmp_path / "a", kinds=["input"])
    from architectures import build, precision_context, ARCHITECTURES
    model, batch = build("gpt2", "bfloat16")
    planted = perturb(model, **plant)
    injector.register(model, 0, 0)
    with HookerAndDumper(tmp_path / "i").hooks(model, 0, 0):
        with precision_context("bfloat16"):
            ARCHITECTURES["gpt2"].loss(model, batch).backward()
    injector.remove()
    planted.remove()
    table = localize(tmp_path / "a", tmp_path / "b", tmp_path / "i")
    assert set(table["kind"]) == {"output"}
    origins = table[table["verdict"] == ORIGIN]
    assert origins["module"].tolist() == ["transformer.h.0.mlp.c_fc"]
    assert np.isfinite(origins["local_added_ratio"]).all() and (origins["local_added_ratio"] > 10).all()
    out = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b"), "--injected",
                                     str(tmp_path / "i")]).output
    assert "1 origin" in out and "origin: step 0:0 forward transformer.h.0.mlp.c_fc" in out


def test_records_of_one_tensor_share_a_passing_judgement(dumps):
    """Where several records are one tensor (an output that is the next module's input), the
    later ones repeat the first's judgement: close stays close, only a carried error is
    inherited."""
    result = compare_dumps(dumps("gpt2", "float32"), dumps("gpt2", "bfloat16", run="b"))
    first = result.set_index(result.apply(lambda r: fmt.record_label(
        r["module"], r["cls"], r["call_idx"], r["kind"], r["index"], r["occurrence"]), axis=1))
    repeats = result[result["same_as"] != ""]
    assert len(repeats) > 10
    for _, row in repeats.iterrows():
        assert row["status"] == first.loc[row["same_as"], "status"], row


def test_user_tolerance_on_statistics_records(tmp_path):
    stats = {"mode": "stats"}
    run_step("mlp", "float32", tmp_path / "a", dumper_options=stats)
    run_step("mlp", "bfloat16", tmp_path / "b", dumper_options=stats)
    loose = compare_dumps(tmp_path / "a", tmp_path / "b", rtol=0.5, atol=0.5)
    assert set(loose["status"]) <= {"equal", "close"}
    assert summarize(loose).verdict().startswith("B agrees with A within the given tolerance")


@pytest.mark.slow
def test_a_low_precision_backward_error_is_found_by_its_scale(tmp_path):
    """A 10 % error in the gradient a module sends back (its own backward), where gradients
    already carry ~20 % (bfloat16, deep in a ResNet's backward), passes the relative-error
    test as amplification; its scale, which backpropagation passes on unchanged, moves by the
    10 % at once."""
    run_step("resnet", "float32", tmp_path / "a", seed=1)
    run_step("resnet", "bfloat16", tmp_path / "b", seed=1,
             plant={"include": ["layer1"], "where": "grad_input", "scale": 1.1})
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    first = summarize(result).first
    assert _named(first, "layer1") and first.row["kind"] == "grad_input"
    assert first.row["reason"].startswith("its error along A's values (scale) moves by 0.07")
    assert first.row["rel_error"] <= first.row["hidden_rel_error"]  # hidden from rel error
    # handed on unchanged, but from layer1's first block's gradient to what layer1 sent back
    # (its own code changed it: the same tensor as the first divergence)
    changed = result[result["transit_rel_diff"].fillna(0) > 0]
    assert set(changed["same_as"]) == {"layer1.Sequential#0 grad_input[0]"}, changed


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tensors", "stats"])
def test_a_gradient_changed_between_modules_is_found_exactly(tmp_path, mode):
    """A 10 % error in the gradient arriving at a module (after its consumer sent it back)
    hides in bfloat16's ~20 % from two dumps' error figures; but A hands the consumer's
    grad_input on unchanged, so B's two records of that gradient must hold the same values
    too: they differ by the 10 %, measured from B's values (tensors) or norms (statistics)."""
    run_step("resnet", "float32", tmp_path / "a", seed=1, dumper_options={"mode": mode})
    run_step("resnet", "bfloat16", tmp_path / "healthy", seed=1, dumper_options={"mode": mode})
    run_step("resnet", "bfloat16", tmp_path / "b", seed=1, dumper_options={"mode": mode},
             plant={"include": ["layer1"], "where": "grad_output", "scale": 1.1})
    healthy = compare_dumps(tmp_path / "a", tmp_path / "healthy")
    linked = healthy["transit_rel_diff"].notna()
    assert linked.sum() > 20 and (healthy.loc[linked, "transit_rel_diff"] == 0).all()
    assert summarize(healthy).ok
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    first = summarize(result).first
    assert _named(first, "layer1") and first.row["kind"] == "grad_output"
    sender = first.row["transit_from"]  # layer2, or its first block: one tensor
    assert sender in ("layer2.Sequential#0 grad_input[0]", "layer2.0.BasicBlock#0 grad_input[0]")
    assert first.row["transit_rel_diff"] == pytest.approx(0.1, rel=1e-3)
    assert first.row["reason"].startswith(
        f"B changed its values by {first.row['transit_rel_diff']:.3g} (rel) since layer2")
    if mode == "tensors":  # hidden from its error figures
        assert first.row["rel_error"] <= first.row["hidden_rel_error"]
    out = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert out.exit_code == 1, out.output
    assert f"the difference arose between {sender} and this grad_output" in out.output


def test_a_gradient_changed_on_its_way_into_a_residual_sum_is_found_exactly(tmp_path):
    """A ResNet block's shortcut output is added in place into ``bn2``'s output (``out +=
    identity``) by code between modules, so no hooked call consumes it; the dump names the
    outputs each sum adds unchanged (``addends``), and the gradient of the sum, which the
    block's last ReLU sends back, is what arrives at each of them. A 10 % error in the gradient
    arriving at the shortcut, hidden in bfloat16's error figures, is that link broken."""
    run_step("resnet", "float32", tmp_path / "a", seed=1)
    index = _index(tmp_path / "a")
    calls = dict(zip(index["call"], index["module"]))
    summed = index[(index["module"] == "layer2.0.relu") & (index["kind"] == "input")]
    addends = [(kind, calls[c], i) for text in summed["addends"]
               for kind, c, i in fmt.parse_addends(text)]
    assert addends == [("output", "layer2.0.downsample.1", 0), ("output", "layer2.0.bn2", 0)]
    run_step("resnet", "bfloat16", tmp_path / "healthy", seed=1)
    healthy = compare_dumps(tmp_path / "a", tmp_path / "healthy")
    links = healthy[healthy["transit_from"] == "layer2.0.relu.ReLU#1 grad_input[0]"]
    assert set(links["module"]) == {"layer2.0.downsample.1", "layer2.0.bn2"}
    assert (links["transit_rel_diff"] <= torch.finfo(torch.bfloat16).eps / 2).all()
    assert summarize(healthy).ok
    run_step("resnet", "bfloat16", tmp_path / "b", seed=1,
             plant={"include": ["layer2.0.downsample"], "where": "grad_output", "scale": 1.1})
    first = summarize(compare_dumps(tmp_path / "a", tmp_path / "b")).first
    assert (first.row["module"], first.row["kind"]) == ("layer2.0.downsample.1", "grad_output")
    assert first.row["transit_rel_diff"] == pytest.approx(0.1, rel=1e-3)
    assert first.row["rel_error"] <= first.row["hidden_rel_error"]  # hidden from its error


@pytest.mark.parametrize("mode", ["tensors", "stats"])
def test_a_gradient_changed_on_its_way_into_a_pre_norm_residual_is_found_exactly(tmp_path, mode):
    """In a pre-norm decoder layer the attention output is added to the residual into a sum
    that the next norm consumes and the layer's last add sums on: the gradient arriving at
    ``o_proj`` is the norm's grad_input plus the layer's grad_output, which A's values show.
    A 10 % error in it, hidden in bfloat16's error figures, breaks that sum in B's values (a
    statistics dump cannot check a sum: no link there, and no false alarm)."""
    options = {"mode": mode}
    run_step("llama", "float32", tmp_path / "a", seed=1, dumper_options=options)
    run_step("llama", "bfloat16", tmp_path / "healthy", seed=1, dumper_options=options)
    healthy = compare_dumps(tmp_path / "a", tmp_path / "healthy")
    summed = healthy[healthy["transit_from"].fillna("").str.contains(" + ", regex=False)]
    assert summarize(healthy).ok
    o_proj = "model.layers.0.self_attn.o_proj"
    if mode == "stats":
        assert summed.empty
        return
    # o_proj's output is self_attn's too: its records hold one gradient
    assert set(summed["module"]) == {f"model.layers.{n}.self_attn{o}" for n in (0, 1)
                                     for o in ("", ".o_proj")}
    assert (summed["transit_rel_diff"] <= torch.finfo(torch.bfloat16).eps / 2).all()
    run_step("llama", "bfloat16", tmp_path / "b", seed=1, dumper_options=options,
             plant={"include": [o_proj], "where": "grad_output", "scale": 1.1})
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    first = summarize(result).first
    assert (first.row["module"], first.row["kind"]) == (o_proj, "grad_output")
    assert first.row["transit_from"] == (
        "model.layers.0.post_attention_layernorm.LlamaRMSNorm#0 grad_input[0] + "
        "model.layers.0.LlamaDecoderLayer#0 grad_output[0]")
    # 10 % of the sum, relative to its terms' magnitude (they cancel a little)
    assert 0.08 < first.row["transit_rel_diff"] <= 0.1
    assert "which A adds unchanged" in first.row["reason"]


class _AddsItsInput(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h):
        return self.lin(h) + h


class _PartialSum(nn.Module):
    """``h = x + attn(x)`` is consumed by ``p`` and summed on into both outputs: ``attn``'s
    gradient is p's grad_input plus the two outputs' gradients. ``own``: ``p`` itself adds its
    input to its result (that share is in its grad_input already)."""

    def __init__(self, d: int, own: bool):
        super().__init__()
        self.attn, self.m1, self.m2 = (nn.Linear(d, d) for _ in range(3))
        self.p = _AddsItsInput(d) if own else nn.Linear(d, d)
        self.lin = self.p.lin if own else self.p

    def forward(self, x):
        h = x + self.attn(x)
        q = self.p(h)
        return h + self.m1(q), h + self.m2(q)


@pytest.mark.parametrize("own", [False, True])
def test_a_gradient_summed_from_cancelling_uses_is_no_false_alarm(tmp_path, own):
    """Float64 against float32: the output weights are undone through ``p`` and ``m1``, so
    the partial sum's gradient is three terms that cancel; its relative error is theirs,
    amplified, and B sums them within rounding: not an error, and a 3 % change of it is."""
    torch.manual_seed(0)
    d, n = 32, 8
    base = _PartialSum(d, own).double()
    x, w, r = (torch.randn(n, d, dtype=torch.float64) for _ in range(3))
    w = 3 * w
    project = torch.linalg.pinv(w) @ w
    eye = torch.eye(d, dtype=torch.float64)
    rest = (eye - project) @ (3 * torch.randn(d, d, dtype=torch.float64) / d ** 0.5) @ (
        eye - project)
    with torch.no_grad():
        base.lin.weight.copy_(eye - eye if own else eye)  # p passes h on, either way
        base.lin.bias.zero_()
        base.m1.weight.copy_((rest - project).T)
        base.m1.bias.zero_()

    def run(name, dtype, scale=1.0):
        model = copy.deepcopy(base).to(dtype)
        handle = perturb(model, "attn", where="grad_output", scale=scale) if scale != 1 else None
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            o1, o2 = model(x.to(dtype))
            ((o1 * w.to(dtype)).sum() + (o2 * r.to(dtype)).sum()).backward()
        if handle is not None:
            handle.remove()
        return tmp_path / name

    a = run("a", torch.float64)
    healthy = compare_dumps(a, run("healthy", torch.float32))
    attn = healthy[(healthy["module"] == "attn") & (healthy["kind"] == "grad_output")].iloc[0]
    assert attn["transit_from"].count(" + ") == 2  # p's grad_input and the two outputs'
    assert attn["transit_rel_diff"] <= torch.finfo(torch.float32).eps / 2
    assert summarize(healthy).ok, summarize(healthy).verdict()
    first = summarize(compare_dumps(a, run("b", torch.float32, 1.03))).first
    assert (first.row["module"], first.row["kind"]) == ("attn", "grad_output")
    assert first.row["reason"].startswith("B changed its values by")


class _SumOfBranches(nn.Module):
    """Returns ``a(x) + b(x)``, made by its own code; ``broadcast``: ``a``'s output is one row,
    added to every row of ``b``'s; ``twice``: ``b(x) + b(x)``."""

    def __init__(self, terms: str):
        super().__init__()
        self.terms = terms
        self.a, self.b = nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x):
        if self.terms == "twice":
            y = self.b(x)
            return y + y
        return self.a(x[:1] if self.terms == "broadcast" else x) + self.b(x)


@pytest.mark.parametrize("terms, named", [("plain", [("a", 0), ("b", 0)]),
                                          ("broadcast", [("b", 0)]), ("twice", [])])
def test_an_output_that_sums_its_childrens_names_them_once_each(tmp_path, terms, named):
    """A call whose own code adds its children's outputs names them on its output row; a term
    of another shape (broadcast: its gradient is the sum's, summed) is not one, nor one added
    twice (its gradient is twice the sum's)."""
    torch.manual_seed(0)
    model = _SumOfBranches(terms)
    with HookerAndDumper(tmp_path / "a").hooks(model, 0, 0):
        model(torch.randn(4, 16)).pow(2).sum().backward()
    index = _index(tmp_path / "a")
    calls = dict(zip(index["call"], index["module"]))
    out = index[(index["module"] == "") & (index["kind"] == "output")]
    assert [(calls[c], i) for _, c, i in fmt.parse_addends(out["addends"].iloc[0])] == named
    assert (index.loc[index["kind"] != "output", "addends"] == "").all()


@pytest.mark.slow
def test_a_later_step_says_what_two_dumps_cannot_tell_and_the_rerun_names_it(tmp_path):
    """Three AdamW steps in float32 and in bfloat16 autocast, then a 3 % error in one
    BatchNorm's output in the fourth: the drifted weights could hide it, and the verdict says
    so (the error that could hide, where, the suspects, the re-run that settles it), exit 0;
    the re-run on A's values names the BatchNorm, exit 1."""
    common = dict(steps=4, optimizer="adamw", plant_last_only=True)
    plant = {"include": ["layer1.1.bn1"], "where": "output", "scale": 1.03}
    run_step("resnet", "float32", tmp_path / "a", dumper_options={"params": True}, **common)
    run_step("resnet", "bfloat16", tmp_path / "b", plant=plant, **common)
    run_step("resnet", "bfloat16", tmp_path / "c", plant=plant,
             dumper_options={"inject": tmp_path / "a"}, **common)
    summary = summarize(compare_dumps(tmp_path / "a", tmp_path / "b"))
    assert summary.ok and summary.cannot_tell
    out = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert out.exit_code == 0
    assert "A's param_grad records of step 0:3 are not compared" in out.stderr  # params=True
    line = out.stdout.splitlines()[0]
    assert "two dumps can" in line and "could hide" in line
    assert "cannot tell: in " in out.output and "up to" in out.output
    assert "re-run B on A's values to settle it: HookerAndDumper(..., inject=A)" in out.output
    rerun = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b"),
                                       "--injected", str(tmp_path / "c")])
    assert rerun.exit_code == 1
    assert "origin: step 0:3 forward layer1.1.bn1.BatchNorm2d#0 output[0]" in rerun.output
    # the plant (a hook scaling the output) scales the gradient sent back too: recomputed, the
    # BatchNorm's backward is wrong as well
    assert " 2 origin" in rerun.output
    assert "origin: step 0:3 backward layer1.1.bn1.BatchNorm2d#0 grad_input[0]" in rerun.output


def test_a_bias_no_gradient_reaches_hides_nothing_at_its_scale(tmp_path):
    """A ViT key projection's bias gets no gradient (softmax ignores a shift of every key), so
    after three AdamW steps it is rounding noise that differs between float64 and float32 by
    ~1e8 times itself, at 1e-13 of the keys' scale. A 3 % error planted in the keys is found
    there, not hidden behind that bias (before: "classifier input", far downstream)."""
    common = dict(seed=1, steps=4, optimizer="adamw", plant_last_only=True)
    plant = {"include": ["vit.layers.0.attention.k_proj"], "where": "output", "scale": 1.03}
    run_step("vit", "float64", tmp_path / "a", dumper_options={"params": True}, **common)
    run_step("vit", "float32", tmp_path / "b", plant=plant, **common)
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    bias = result[(result["module"] == "vit.layers.0.attention.k_proj")
                  & (result["kind"] == fmt.PARAM) & (result["index"] == 1)]
    assert float(bias["rel_error"].iloc[0]) > 1e3  # what the bias is
    first = summarize(result).first
    assert first is not None and first.row["module"] == "vit.layers.0.attention.k_proj", first
    assert first.row["kind"] == fmt.OUTPUT


def test_a_gradient_through_attention_code_carries_its_values_error(tmp_path):
    """A 10 % error in GPT-2's position embeddings at the fourth AdamW step (bfloat16
    autocast): two dumps cannot tell it from the drifted embedding, and every attention
    value, key and query carries it. The gradient attention's code sends back to ``c_attn``
    is a product of those values and the incoming gradient, so it carries both errors; it was
    named the first divergence (a wrong place, exit 1). Now the verdict says it cannot tell."""
    require_runnable("gpt2", "bfloat16")
    common = dict(seed=1, steps=4, optimizer="adamw", plant_last_only=True)
    plant = {"include": ["transformer.wpe"], "where": "output", "scale": 1.1}
    run_step("gpt2", "float32", tmp_path / "a", dumper_options={"params": True}, **common)
    run_step("gpt2", "bfloat16", tmp_path / "b", plant=plant, **common)
    summary = summarize(compare_dumps(tmp_path / "a", tmp_path / "b"))
    named = None if summary.first is None else summary.first.row["module"]
    assert named in (None, "transformer.wpe"), summary.verdict()
    assert summary.first is not None or summary.cannot_tell


def test_an_embedding_error_that_attention_code_amplifies_is_named_at_the_embedding(tmp_path):
    """A 10 % error in Llama's token embeddings at the fourth AdamW step (bfloat16 autocast):
    the gradient it leaves in ``o_proj``'s grad_input comes back to ``v_proj`` through
    attention's sums over positions, amplified 2-3x, beyond the gain allowed there. It was
    named the first divergence (a wrong place), then, judged against other records, a
    "cannot tell" with the embedding among the suspects (its drifted weights had no bound).
    Bounded by its lookup (its most repeated id), the embedding is named by the two dumps,
    and by the re-run."""
    common = dict(seed=1, steps=4, optimizer="adamw", plant_last_only=True)
    plant = {"include": ["model.embed_tokens"], "where": "output", "scale": 1.1}
    run_step("llama", "float32", tmp_path / "a", dumper_options={"params": True}, **common)
    run_step("llama", "bfloat16", tmp_path / "b", plant=plant, **common)
    run_step("llama", "bfloat16", tmp_path / "c", plant=plant,
             dumper_options={"inject": tmp_path / "a"}, **common)
    out = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert out.exit_code == 1, out.output
    assert ("B diverges from A: first at step 0:3 forward in model.embed_tokens (output[0])"
            in out.output), out.output
    rerun = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b"),
                                       "--injected", str(tmp_path / "c")])
    assert "origin: step 0:3 forward model.embed_tokens.Embedding#0 output[0]" in rerun.output


class TopOneRouter(nn.Module):
    """Logits and the chosen expert per token. Expert 1's weight row is expert 0's (``tilt``:
    plus 1e-12 on the first feature, in the model's dtype): in float64 a token with a positive
    first feature goes to expert 1; in float32 the addition rounds away, the logits tie and
    ``argmax`` takes 0."""

    def __init__(self, features: int):
        super().__init__()
        self.gate = nn.Linear(features, 2, bias=False)
        with torch.no_grad():
            self.gate.weight[1] = self.gate.weight[0]

    @torch.no_grad()
    def tilt(self) -> None:
        self.gate.weight[1, 0] += 1e-12

    def forward(self, x):
        logits = self.gate(x)
        return logits, logits.argmax(-1)


class RoutedExperts(nn.Module):
    """Each expert runs on the tokens routed to it (its own code selects them)."""

    def __init__(self, features: int):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(features, features) for _ in range(2))
        self.act = nn.Tanh()

    def forward(self, x, chosen):
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out[chosen == e] = self.act(expert(x[chosen == e]))
        return out


class TopOneMoE(nn.Module):
    """Routed experts and a shared one that sees every token (``lost``: but the last few, a
    bug)."""

    def __init__(self, features: int = 8, lost: int = 0):
        super().__init__()
        self.router, self.experts = TopOneRouter(features), RoutedExperts(features)
        self.shared, self.lost = nn.Linear(features, 1), lost
        self.head = nn.Linear(features, 1)

    def forward(self, x):
        logits, chosen = self.router(x)
        routed = self.experts(x, chosen) * logits.softmax(-1).max(-1).values[:, None]
        return self.head(routed) + self.shared(x[:len(x) - self.lost]).mean()


def test_shapes_that_follow_a_routing_that_differs_are_inherited(tmp_path):
    """float64 and float32 route the tokens whose first feature is positive to different
    experts (rounding makes the logits tie in float32): the experts' records then differ in
    shape. The routing indices are integers with an error, which two dumps cannot bound, and
    the shapes follow them, the tokens moved between the experts: ``inherited``, with the
    reason, not a first divergence. A shared expert that loses a token is one."""

    def run(name, dtype, lost=0):
        torch.manual_seed(0)
        model = TopOneMoE(lost=lost).to(dtype)
        model.router.tilt()
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
        x[:3, 0] = x[:3, 0].abs()  # three tokens change experts
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            model(x).pow(2).mean().backward()
        return tmp_path / name

    result = compare_dumps(run("a", torch.float64), run("b", torch.float32))
    chosen = result[(result["module"] == "router") & (result["kind"] == fmt.OUTPUT)
                    & (result["index"] == 1)]
    assert float(chosen["rel_error"].iloc[0]) > 0  # the routing differs
    reshaped = result[result["reason"].str.startswith("its shape follows", na=False)]
    assert set(reshaped["module"]) >= {"experts.experts.0", "experts.experts.1", "experts.act"}
    assert set(reshaped["kind"]) >= {fmt.INPUT, fmt.OUTPUT, fmt.GRAD_OUTPUT, fmt.GRAD_INPUT}
    assert (reshaped["status"] == INHERITED).all()
    assert not result["status"].isin(FAILING).any(), result[result["status"].isin(FAILING)]
    assert summarize(result).first is None
    # a shared expert that loses a token in B: rows lost, not moved, whatever routing does
    first = summarize(compare_dumps(tmp_path / "a", run("lost", torch.float32, lost=1))).first
    assert first is not None and first.row["module"] == "shared", first
    assert first.row["status"] == st.SHAPE_MISMATCH


class CancellingResidual(torch.nn.Module):
    """A residual block ``h + lin(h)`` with ``lin`` close to ``-h``: the block's output is a
    few percent of either term, and so is the gradient it sends back, so both carry their
    terms' rounding many times over (healthy, ~30x the float32 rounding of either term)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        with torch.no_grad():
            self.lin.weight.mul_(0.05).sub_(0.97 * torch.eye(32))

    def forward(self, h):
        return h + self.lin(h)


class WithCancellingResidual(torch.nn.Module):
    def __init__(self, norm: bool = False):
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.norm = torch.nn.BatchNorm1d(32) if norm else torch.nn.Identity()
        self.block = CancellingResidual()
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.out(torch.tanh(self.block(self.norm(torch.tanh(self.inp(x))))))


@pytest.mark.parametrize("seed", range(4))
def test_a_residual_that_cancels_is_judged_by_its_terms_errors(tmp_path, seed):
    """The block's own code adds its input and ``lin``'s output, which nearly cancel:
    forward, its output keeps the terms' absolute errors; backward, its grad_input is its
    incoming gradient plus ``lin``'s grad_input, which nearly cancel too. Judged as such sums,
    the healthy float64/float32 pair passes (before, the block's output was blamed), and a
    3 % error in the gradient arriving at ``lin`` is still found there."""

    def run(name, dtype, plant=False):
        torch.manual_seed(seed)
        model = WithCancellingResidual().to(dtype)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
        if plant:
            perturb(model, "block.lin", where="grad_output", scale=1.03)
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            model(x).pow(2).mean().backward()
        return tmp_path / name

    a = run("a", torch.float64)
    healthy = compare_dumps(a, run("b", torch.float32))
    assert not healthy["status"].isin(FAILING).any(), healthy[healthy["status"].isin(FAILING)]
    block = healthy[healthy["module"] == "block"].set_index("kind")["rel_error"]
    assert block["output"] > 4 * block["input"]  # what the cancellation does
    first = summarize(compare_dumps(a, run("planted", torch.float32, plant=True))).first
    assert first is not None and first.row["module"] == "block.lin", first
    assert first.direction == "backward"


def test_an_attention_is_not_the_sum_of_its_input_and_children(tmp_path):
    """A ViT attention's output is its output projection's; its input (rms 1) is 200 times
    larger and cannot be one of its terms. A 3 % error planted in the attention's output
    (float16 autocast, which leaves 3e-4 in the input) is found there, not passed off as the
    input's error at the sum's scale (before the triangle test, the first divergence was a
    record of the next layer)."""
    require_runnable("vit", "float16")
    plant = {"include": ["vit.layers.0.attention"], "where": "output", "scale": 1.03}
    run_step("vit", "float32", tmp_path / "a", seed=3, dumper_options={"params": True})
    run_step("vit", "float16", tmp_path / "b", seed=3, plant=plant)
    first = summarize(compare_dumps(tmp_path / "a", tmp_path / "b")).first
    assert first is not None and first.row["module"] == "vit.layers.0.attention", first


@pytest.mark.parametrize("seed", range(6))
def test_parameter_gradients_that_cancel_over_the_batch(tmp_path, seed):
    """After a BatchNorm over a batch of four, the gradients of the four samples nearly
    cancel in a Linear's weight gradient (a sum over the batch): it carries the terms'
    rounding many times over. Judged by the gain that sum gives a random error
    (``rms(gy) rms(x) sqrt(P) / rms(dW)``, :mod:`compare.gains`), the healthy
    float64/float32 pair, both dumped with parameters, has no failing record (before, the
    weight gradient of ``block.lin`` failed in every seed); a 3 % error in the gradient
    arriving at ``block.lin`` is found there."""

    def run(name, dtype, plant=False):
        torch.manual_seed(seed)
        model = WithCancellingResidual(norm=True).to(dtype)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
        if plant:
            perturb(model, "block.lin", where="grad_output", scale=1.03)
        with HookerAndDumper(tmp_path / name, params=True).hooks(model, 0, 0):
            model(x).pow(2).mean().backward()
        return tmp_path / name

    a = run("a", torch.float64)
    healthy = compare_dumps(a, run("b", torch.float32))
    assert not healthy["status"].isin(FAILING).any(), healthy[healthy["status"].isin(FAILING)]
    assert (healthy["kind"] == "param_grad").sum() == 8  # compared on both sides
    first = summarize(compare_dumps(a, run("planted", torch.float32, plant=True))).first
    assert first is not None and first.row["module"] == "block.lin", first


class RecursiveLinear(nn.Module):
    """``x @ weight.T`` added up one product at a time, as a naive kernel would: its sums of
    K products round about ``sqrt(K / 3)`` times more than a blocked matrix product's."""

    def __init__(self, fan_in: int, out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out, fan_in) / fan_in ** 0.5)

    def forward(self, x):
        total = torch.zeros(*x.shape[:-1], self.weight.shape[0], dtype=x.dtype)
        for k in range(x.shape[-1]):
            total = total + x[..., k:k + 1] * self.weight[:, k]
        return total


@pytest.mark.parametrize("seed", range(3))
def test_long_sums_are_judged_by_their_length(tmp_path, seed):
    """A module that sums 2048 products one at a time, after five Linears summing 32: in
    float32 against float64 its output carries 6e-7 to 1.3e-6, 10-22x what the Linears add
    (a false DIFF in every seed before, the way a GPU's 1x1 convolution of fan-out 1280 was
    a false origin against its smaller peers). Judged against the rounding of sums of 2048
    products (``sqrt(2048 / 3)`` float32 roundings) it passes; an error of 1e-4 planted
    there is still found there."""

    def run(name, dtype, plant=False):
        torch.manual_seed(seed)
        layers = []
        for _ in range(5):
            layers += [nn.Linear(32, 32), nn.Tanh()]
        model = nn.Sequential(*layers, nn.Linear(32, 2048), RecursiveLinear(2048, 8)).to(dtype)
        if plant:
            perturb(model, "11", where="output", scale=1 + 1e-4)
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            model(torch.randn(4, 32).to(dtype)).pow(2).mean().backward()
        return tmp_path / name

    a = run("a", torch.float64)
    healthy = compare_dumps(a, run("b", torch.float32))
    assert not healthy["status"].isin(FAILING).any(), healthy[healthy["status"].isin(FAILING)]
    sums = healthy[(healthy["module"] == "11") & (healthy["kind"] == "output")].iloc[0]
    assert sums["expected_rel_error"] == pytest.approx(2.0 ** -24 * math.sqrt(2048 / 3))
    first = summarize(compare_dumps(a, run("planted", torch.float32, plant=True))).first
    assert first is not None and (first.row["module"], first.row["kind"]) == ("11", "output")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_normalizations_over_two_elements_are_no_false_alarm(tmp_path, seed):
    """A Hugging Face MobileNetV2 on a batch of two 16x16 images: its last BatchNorms see
    1x1 maps, two elements per channel, whose backward returns the gradient less its mean and
    its projection on the normalized input, little of it. Judged by the incoming gradient's
    error after centering, and by the gain its own forward pass shows, the healthy
    float64/float32 pair has no failing record (before: a BatchNorm's or a block's
    grad_input, 11-14x the typical float32 error, in each seed)."""
    require_runnable("mobilenet_v2", "float64", "float32")
    run_step("mobilenet_v2", "float64", tmp_path / "a", seed=seed,
             dumper_options={"params": True})
    run_step("mobilenet_v2", "float32", tmp_path / "b", seed=seed)
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert not result["status"].isin(FAILING).any(), result[result["status"].isin(FAILING)]
    grads = result[(result["kind"] == "grad_output") & result["centered_rel_err"].notna()]
    assert len(grads) and (grads["centered_rel_err"] > grads["rel_error"]).any()


def test_a_batchnorm_over_two_elements_passes_on_none_of_its_inputs_rounding(tmp_path):
    """MobileNetV2's late BatchNorms normalize two elements per channel (a batch of two 1x1
    maps): each channel's pair becomes (-1, 1) times its weight, whatever rounding its input
    carries. Judged by twice its input's centered error (~7 % there), a localizing re-run on
    A's values in bfloat16 let a 10 % error in one of them pass (no origin); by the error of
    the normalized values at the module's recorded eps, it is the origin, and the healthy
    re-run has none. Fourth AdamW step, as drifted weights are injected too."""
    require_runnable("mobilenet_v2", "float32", "bfloat16")
    bn = "mobilenet_v2.layer.13.expand_1x1.normalization"
    common = dict(seed=1, steps=4, optimizer="adamw", plant_last_only=True)
    plant = {"include": [bn], "where": "output", "scale": 1.1}
    inject = {"inject": tmp_path / "a"}
    run_step("mobilenet_v2", "float32", tmp_path / "a", dumper_options={"params": True},
             **common)
    for name, options in (("b", {}), ("c", {"plant": plant})):
        run_step("mobilenet_v2", "bfloat16", tmp_path / name, **common, **options)
        run_step("mobilenet_v2", "bfloat16", tmp_path / f"{name}-inj", dumper_options=inject,
                 **common, **options)
    eps = [r for r in _index(tmp_path / "a").itertuples()
           if r.module == bn and r.kind == fmt.PARAM and r.path == fmt.EPS_PATH]
    assert [r.value for r in eps] == ["0.001"]  # Hugging Face MobileNetV2's
    healthy = localize(tmp_path / "a", tmp_path / "b", tmp_path / "b-inj")
    assert not (healthy["verdict"] == ORIGIN).any(), healthy[healthy["verdict"] == ORIGIN]
    table = localize(tmp_path / "a", tmp_path / "c", tmp_path / "c-inj")
    origins = table[table["verdict"] == ORIGIN]
    assert len(origins) and origins.iloc[0]["module"] == bn, origins
    assert origins.iloc[0]["kind"] == fmt.OUTPUT


class _AddLayerNorm(nn.Module):
    """A fused residual norm, as in flash-attn or vLLM: normalizes ``x + residual``."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.weight, self.bias = self.norm.weight, self.norm.bias

    def forward(self, x, residual):
        return self.norm(x + residual)


class _Scaled(nn.Module):
    """Linear, a BatchNorm1d and an add-norm, B's hidden values scaled in the parent's code
    (a 1 % error along them, which a normalization of them alone divides out)."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        self.fc, self.bn, self.add_norm = nn.Linear(8, 8), nn.BatchNorm1d(8), _AddLayerNorm(8)

    def forward(self, x):
        h = self.fc(x) * self.scale
        return self.add_norm(self.bn(h), x)


def test_an_error_along_its_input_passes_where_a_norm_does_not_divide_it_out(tmp_path):
    """An error along a norm's input is divided out only where the norm normalizes that input
    by its own statistics: a BatchNorm in eval mode (its running ones) passes it on, as does
    a norm fed a residual besides (it normalizes the sum). Neither is a false alarm; in
    training the BatchNorm's eps is recorded and its output carries next to nothing of it."""
    for name, scale in (("a", 1.0), ("b", 1.01)):
        torch.manual_seed(0)
        model, d = _Scaled(scale), HookerAndDumper(tmp_path / name)
        for step, training in ((0, True), (1, False)):
            model.train(training)
            with d.hooks(model, 0, step):
                model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
                      ).pow(2).sum().backward()
        d.close()
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    failing = result[result["status"].isin(FAILING)]
    assert set(failing["module"]) <= {"bn"}, failing  # (B's input to it: parent code's error)
    assert (failing["kind"] == fmt.INPUT).all(), failing
    out = result[result["kind"] == fmt.OUTPUT].set_index(["step", "module"])["rel_error"]
    assert out[(1, "bn")] > 0.5e-2 and out[(0, "bn")] < 1e-4  # eval passes it, training not
    # the sum's normalization keeps part of it, which normalizing its first input alone
    # would have divided out
    inputs = result[result["kind"] == fmt.INPUT].set_index(["step", "module", "index"])
    assert out[(1, "add_norm")] > 1e-3 > inputs.loc[(1, "add_norm", 0), "normalized_rel_err"]


def test_a_gradient_at_a_residual_fork_is_judged_against_the_whole_block(tmp_path):
    """ConvNeXt's first block adds ``1e-6 * branch(x)`` to ``x``: in float16 its branch's
    gradient underflows to zero (relative error 1), a negligible part of what the block sends
    back to ``x``. A 3 % error in the gradient arriving at the embeddings' LayerNorm was judged
    against that branch's error and passed, from two dumps and from the localizing re-run
    alike; judged against the block's own grad_input (which holds its branch's share), it is
    the first divergence and the origin."""
    require_runnable("convnext", "float32", "float16")
    norm = "convnext.embeddings.layernorm"
    plant = {"include": [norm], "where": "grad_output", "scale": 1.03}
    run_step("convnext", "float32", tmp_path / "a", seed=2, dumper_options={"params": True})
    run_step("convnext", "float16", tmp_path / "b", seed=2, plant=plant)
    run_step("convnext", "float16", tmp_path / "c", seed=2, plant=plant,
             dumper_options={"inject": tmp_path / "a"})
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    first = summarize(result).first
    assert _named(first, norm) and first.row["kind"] == fmt.GRAD_OUTPUT, first
    assert "convnext.encoder" in first.row["source"]
    table = localize(tmp_path / "a", tmp_path / "b", tmp_path / "c", free_result=result)
    origins = table[table["verdict"] == ORIGIN]
    assert len(origins) and origins.iloc[0]["module"] in (norm, "convnext.embeddings"), origins


def test_integers_beside_an_attention_leave_its_projections_bounded(tmp_path):
    """At the fourth AdamW step (bfloat16 autocast) a Llama attention gets integer position
    ids beside its hidden states, and its projections' weights drifted. Weights are looked up
    by integers only where their own module gets them, as the embedding does (bounded by its
    lookup); the attention's output projection had no bound (a plant there: "cannot tell",
    no size given). Now it has one, and a 30 % error there is found."""
    require_runnable("llama", "bfloat16")
    common = dict(seed=1, steps=4, optimizer="adamw", plant_last_only=True)
    o_proj = "model.layers.0.self_attn.o_proj"
    run_step("llama", "float32", tmp_path / "a", dumper_options={"params": True}, **common)
    run_step("llama", "bfloat16", tmp_path / "b", **common)
    run_step("llama", "bfloat16", tmp_path / "c", **common,
             plant={"include": [o_proj], "where": "output", "scale": 1.3})
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    outputs = result[result["kind"] == fmt.OUTPUT].set_index("module")["hidden_rel_error"]
    ids = result[(result["module"] == "model.layers.0.self_attn")
                 & (result["dtype_b"] == "int64")]
    assert len(ids)  # the integers beside it
    assert np.isfinite(outputs[o_proj]) and outputs[o_proj] < 0.3
    assert np.isfinite(outputs["model.embed_tokens"])  # an Embedding: its lookup's bound
    first = summarize(compare_dumps(tmp_path / "a", tmp_path / "c")).first
    assert _named(first, o_proj) and first.row["kind"] == fmt.OUTPUT, first


class _Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4)

    def forward(self, x):
        return self.gate(x).argmax(-1)


class _Experts(nn.Module):
    """Expert weights held by the parent and chosen per token by a child router's integers;
    a projection after them uses all of its own."""

    def __init__(self):
        super().__init__()
        self.router, self.out = _Router(), nn.Linear(8, 8)
        self.experts = nn.Parameter(torch.randn(4, 8, 8) / 3)

    def forward(self, x):
        chosen = self.router(x)
        return 2 * self.out(torch.einsum("td,tde->te", x, self.experts[chosen]))


def test_integers_that_choose_a_modules_weights_leave_it_unbounded(tmp_path):
    """Weights that drifted (B's 2 % off, in float32 against float64) and that the module's
    code picks by integers its child returned (a router's choice of experts): how much of the
    drift the picked ones carry is unknown, so the module's output has no bound; the
    projection after them, whose weights are all used, has one."""
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    for name, dtype, drift in (("a", torch.float64, 1.0), ("b", torch.float32, 1.02)):
        torch.manual_seed(0)
        model = _Experts().to(dtype)
        with torch.no_grad():
            model.experts.mul_(drift)
            model.out.weight.mul_(drift)
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            model(x.to(dtype)).pow(2).sum().backward()
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    outputs = result[result["kind"] == fmt.OUTPUT].set_index("module")["hidden_rel_error"]
    assert np.isinf(outputs[""]) and np.isfinite(outputs["out"]), outputs


def test_a_dropout_that_draws_other_masks_is_named_with_the_reason(tmp_path):
    """Two runs whose generators differ (another device, say) draw different dropout masks:
    the first divergence is the dropout, and the text says why and what to do."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    x = torch.randn(16, 8)
    for name, seed in (("a", 1), ("b", 2)):
        torch.manual_seed(seed)
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            model(x).sum().backward()
        model.zero_grad()
    first = summarize(compare_dumps(tmp_path / "a", tmp_path / "b")).first
    assert (first.row["module"], first.row["kind"]) == ("1", "output")
    assert "compare with dropout off (p=0) in both runs" in first.describe()


class ConvExpertsHead(nn.Module):
    """A convolution (cuDNN on CUDA), a normalization, experts with a 3-D weight (cuBLAS's
    batched matmuls) and a linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)
        self.norm = nn.LayerNorm(6)
        self.experts = Experts()
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.experts(self.norm(self.conv(x))))


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6, 6) / 3)

    def forward(self, x):  # x: (batch, 4 experts, 6)
        return torch.einsum("bei,eio->beo", x, self.weight)


@pytest.mark.parametrize("matmul, cudnn", [(False, True), (True, False), (True, True)])
def test_tf32_lowers_what_each_flag_governs_and_no_gradient_it_did_not_make(
        tmp_path, matmul, cudnn):
    """Under cuDNN's TF32 flag a convolution computes in TF32, not batched experts (cuBLAS's
    matmul flag governs those), and the gradient arriving at the convolution's output is made
    by the normalization's backward: float32. An enclosing module's own code lowers the
    gradients it sends back only under the matmul flag (its matmuls), not for its children's
    convolutions."""
    from compare.precision import computed_in
    model = ConvExpertsHead()
    x = torch.randn(3, 4, 6)
    for name in ("a", "b"):
        with HookerAndDumper(tmp_path / name, params=True).hooks(model, 0, 0):
            model(x).sum().backward()
    frame = compare_dumps(tmp_path / "a", tmp_path / "b")
    _, b = computed_in(frame, ((False, False), (matmul, cudnn)))
    of = {(m, k): d for m, k, d in zip(frame["module"], frame["kind"], b)}
    tf32, f32 = "tensorfloat32", "float32"
    assert of[("conv", "output")] == (tf32 if cudnn else f32)
    assert of[("experts", "output")] == of[("head", "output")] == (tf32 if matmul else f32)
    # made by the consumers' backward (the experts' for the norm's), and perhaps by matmuls in
    # the model's own code under the matmul flag: never TF32 under cuDNN's alone
    for module in ("conv", "norm", "head"):
        assert of[(module, "grad_output")] == (tf32 if matmul else f32), module


def _two_runs(tmp_path, model_a, model_b, x, params=True):
    for name, model in (("a", model_a), ("b", model_b)):
        with HookerAndDumper(tmp_path / name, params=params).hooks(model, 0, 0):
            model(x).pow(2).sum().backward()
    return summarize(compare_dumps(tmp_path / "a", tmp_path / "b"))


class TransposesBetween(nn.Module):
    """Its own code transposes a square activation before its child (``bug``), or not."""

    def __init__(self, bug: bool):
        super().__init__()
        self.bug = bug
        self.inner = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        h = self.inner(x)
        return self.out(h.T if self.bug else h)


def test_reordering_excuses_neither_weights_nor_a_transpose(tmp_path):
    """Values that are A's in another order are only excused row for row: transposed
    weights are weights that differ, and a transpose in a module's own code is a difference
    between its two children, not one of the child that gets it."""
    x = torch.randn(16, 16)
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    b = copy.deepcopy(a)
    with torch.no_grad():
        b[0].weight.copy_(a[0].weight.T)
    for params in (True, False):  # values; statistics and a sketch (the same statistics)
        first = _two_runs(tmp_path / f"weights-{params}", a, b, x, params).first
        assert (first.row["module"], first.row["kind"]) == ("0", "param")
    torch.manual_seed(0)
    a = TransposesBetween(False)
    b = copy.deepcopy(a)
    b.bug = True
    first = _two_runs(tmp_path / "transpose", a, b, x).first
    assert (first.row["module"], first.row["kind"]) == ("out", "input")


class EmptyAside(nn.Module):
    def __init__(self):
        super().__init__()
        self.relu = Takes2()

    def forward(self, x):
        return self.relu(x, torch.zeros(0))


class Takes2(nn.Module):
    def forward(self, x, empty):
        return torch.relu(x) + empty.sum()


def test_a_call_with_an_empty_input_beside_flipped_signs_is_judged(tmp_path):
    """The gradient a call's sign flips explain, where another of its inputs is empty."""
    x = torch.randn(64, 8)
    b_x = x + 1e-3 * torch.randn(64, 8)   # tips some signs
    model = EmptyAside()
    for name, batch in (("a", x), ("b", b_x)):
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            model(batch.requires_grad_()).pow(2).sum().backward()
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert len(result) and result["status"].notna().all()


class _CastBetween(nn.Module):
    """Two layers, the second in ``dtype``, and the parent's own code between them: a cast to
    ``dtype`` (none where the first layer's output has it already), and a factor (none where
    it is 1)."""

    def __init__(self, dtype: torch.dtype, factor: float = 1.0):
        super().__init__()
        self.first, self.second = nn.Linear(16, 32), nn.Linear(32, 4).to(dtype)
        self.dtype, self.factor = dtype, factor

    def forward(self, x):
        h = self.first(x).to(self.dtype)
        if self.factor != 1.0:
            h = h * self.factor
        return self.second(h).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cast_between_modules_is_no_transit_error_and_a_factor_is(tmp_path, dtype):
    """A hands ``first``'s output to ``second`` unchanged (the cast is a no-op in float32);
    B, whose second layer computes in ``dtype``, casts it on the way: that rounding is no
    error, nor the gradient's way back. B's code that also scales it by 1.05 changed it in
    transit: an error between the modules, however the low precision hides it otherwise."""
    batch = torch.randn(8, 16)

    def run(name, cast, factor=1.0):
        torch.manual_seed(0)
        model = _CastBetween(cast, factor)
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            model(batch).pow(2).mean().backward()
        return tmp_path / name

    a = run("a", torch.float32)
    healthy = compare_dumps(a, run("cast", dtype))
    moved = healthy[healthy["transit_rel_diff"] > 0]
    assert list(zip(moved["module"], moved["kind"])) == [("second", "input")]
    assert (moved["transit_rel_diff"] <= torch.finfo(dtype).eps / 2).all()
    assert healthy["transit_rel_diff"].notna().sum() == 2  # and the gradient, unchanged
    assert summarize(healthy).ok, summarize(healthy).verdict()
    scaled = compare_dumps(a, run("scaled", dtype, 1.05))
    first = summarize(scaled).first
    assert first.row["module"] == "second" and first.row["kind"] == "input"
    assert first.row["transit_from"] == "first.Linear#0 output[0]"
    assert first.row["status"] == st.DIFF and 0.04 < first.row["transit_rel_diff"] < 0.06


class _HandsBack(nn.Module):
    """``x.to(dtype)``: in float32 it hands its input back (the dumper then records the whole
    gradient of that tensor as its grad_input); in another dtype it makes a new tensor."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


class _ResidualCast(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.inp, self.cast = nn.Linear(16, 32), _HandsBack(dtype)
        self.block, self.out = nn.Linear(32, 32).to(dtype), nn.Linear(32, 4)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.block(self.cast(h)).float())


def test_a_module_that_hands_its_input_back_sends_no_transit_link(tmp_path):
    """In A ``cast`` hands ``h`` back, so its grad_input is all of ``h``'s gradient, the
    residual's share included, the same bits as ``inp``'s grad_output; in B it casts, and
    sends back its share only. That is no link: the gradient did not pass through it alone."""
    batch = torch.randn(8, 16)

    def run(name, dtype):
        torch.manual_seed(0)
        model = _ResidualCast(dtype)
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            model(batch).pow(2).mean().backward()
        return tmp_path / name

    result = compare_dumps(run("a", torch.float32), run("b", torch.bfloat16))
    linked = result[result["transit_rel_diff"].notna()]
    assert ("inp", "grad_output") not in set(zip(linked["module"], linked["kind"]))
    assert ("cast", "input") in set(zip(linked["module"], linked["kind"]))  # forward: a link


class _PassedResidual(nn.Module):
    """``x + drop(lin(x))`` with ``drop`` an eval-mode Dropout: it hands ``lin``'s output back,
    so that one tensor is ``lin``'s output, ``drop``'s input and output, and an addend."""

    def __init__(self):
        super().__init__()
        self.lin, self.drop, self.out = nn.Linear(16, 16), nn.Dropout(0.5).eval(), nn.Linear(16, 4)

    def forward(self, x):
        return self.out(x + self.drop(self.lin(x)))


def test_a_gradient_changed_where_one_link_cannot_see_it_is_found_by_another(tmp_path):
    """The gradient arriving at ``lin``'s output scaled by 1.03 in B: ``drop`` sends back what
    arrives (its grad_input, the same tensor's gradient, is changed too: that link shows no
    change), but the residual sum's gradient, which A hands on unchanged to its addend, shows
    it: a change on any link of a record is a change (as a T5 cross-attention layer's
    planted gradient went unseen, its dropout handing its output back)."""
    batch = torch.randn(8, 16)

    def run(name, plant=None):
        torch.manual_seed(0)
        model = _PassedResidual()
        planted = perturb(model, "lin", where="grad_output", scale=1.03) if plant else None
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            model(batch).pow(2).mean().backward()
        if planted is not None:
            planted.remove()
        return tmp_path / name

    a = run("a")
    assert summarize(compare_dumps(a, run("b"))).ok
    result = compare_dumps(a, run("p", plant=True))
    first = summarize(result).first
    assert (first.row["module"], first.row["kind"]) == ("lin", "grad_output")
    assert first.row["transit_rel_diff"] == pytest.approx(0.03, rel=1e-3)
    assert first.row["reason"].startswith(f"{IN_TRANSIT} 0.03 (rel) since out.Linear#0 grad_input[0]")


def _sparse_relu(directory, dtype: torch.dtype, plant: dict = None):
    """A Linear of large outputs, mostly negative, and a ReLU that keeps the few small ones:
    the ReLU's output carries its input's absolute error, large against what is left."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[0].weight.mul_(30)
        model[0].bias.fill_(-60.0)
    model = model.to(dtype)
    batch = torch.randn(16, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    planted = perturb(model, **plant) if plant else None
    with HookerAndDumper(directory, params=True).hooks(model, 0, 0):
        model(batch).pow(2).mean().backward()
    if planted:
        planted.remove()
    return directory


def test_an_error_amplified_by_a_call_computed_within_rounding_is_its_inputs(tmp_path):
    """Float64 A, float32 B: the ReLU's output carries 50x its input's relative error, more
    than any gain allows, but recomputed from its own records B's ReLU added nothing: its
    inputs' error, no false alarm. A 1 % error in that ReLU's forward is still its own, and
    one in the Linear before it is still the Linear's."""
    a = _sparse_relu(tmp_path / "a", torch.float64)
    result = compare_dumps(a, _sparse_relu(tmp_path / "b", torch.float32))
    relu = result[(result["module"] == "1") & (result["kind"] == fmt.OUTPUT)].iloc[0]
    assert relu["rel_error"] > 20 * relu["input_rel_error"]
    assert relu["status"] == st.CLOSE and relu["added_rel_error"] == relu["recomputed_rel_err"]
    assert "amplified by its call, which B computed within rounding" in relu["reason"]
    assert summarize(result).ok, summarize(result).verdict()
    for module in ("1", "0"):
        planted = _sparse_relu(tmp_path / module, torch.float32,
                               plant={"include": [module], "where": "output", "scale": 1.01})
        first = summarize(compare_dumps(a, planted)).first
        assert (first.row["module"], first.row["kind"]) == (module, fmt.OUTPUT)


class _Float32Activation(nn.Module):
    """A Linear (bfloat16 under autocast), then a SiLU on its float32 cast, shifted where SiLU
    is nearly the identity: the SiLU computes in float32 on both sides of a bfloat16 pair."""

    def __init__(self):
        super().__init__()
        self.fc, self.act, self.out = nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 4)

    def forward(self, x):
        return self.out(self.act(self.fc(x).float() + 4.0))


def test_a_call_recomputed_within_rounding_adds_what_its_recomputation_measured(tmp_path):
    """Float32 A, B under bfloat16 autocast: the SiLU's float32 output carries its input's
    bfloat16 error, a little more than a gain of one gives (1.6e-4 beyond it, 2677x a float32
    rounding). Recomputed from its own records, B's SiLU added 4e-8: what it adds is that,
    and a call so settled is no suspect: the pair agrees (before: "may diverge; two dumps
    cannot tell", naming the SiLU)."""
    for name, autocast in (("a", False), ("b", True)):
        torch.manual_seed(0)
        model = _Float32Activation()
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
        with HookerAndDumper(tmp_path / name, params=True).hooks(model, 0, 0):
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                y = model(x)
            y.float().pow(2).sum().backward()
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    act = result[(result["module"] == "act") & (result["kind"] == fmt.OUTPUT)].iloc[0]
    assert act["dtype_b"] == "float32" and act["rel_error"] > act["input_rel_error"]
    assert act["status"] == st.CLOSE
    assert act["added_rel_error"] == act["recomputed_rel_err"] < act["expected_rel_error"]
    summary = summarize(result)
    assert summary.ok and not summary.cannot_tell, summary.verdict()
    # where its bound leaves room for an outlier, its recomputation settles it; measured on
    # a sample only, or measured above an outlier's error, it settles nothing
    row, room = act.name, 10 * act["expected_rel_error"]
    roomy = result.copy()
    roomy.loc[row, "hidden_rel_error"] = room
    assert not summarize(roomy).cannot_tell, summarize(roomy).verdict()
    for column, value in (("recomputed_stride", 2.0),
                          ("recomputed_rel_err", 7 * act["expected_rel_error"])):
        loose = roomy.copy()
        loose.loc[row, column] = value
        assert summarize(loose).cannot_tell, (column, summarize(loose).verdict())


class Classifier(nn.Module):
    """A loss computed by its own code from its head's logits."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(self.body(x)), y)


def test_a_loss_from_logits_off_by_their_size_is_no_new_divergence(tmp_path):
    """Gains are first-order: from logits 150 % off (weights that differ), a loss A nearly
    fits and B does not is off by 40x its size, which no gain bounds: inherited, while the
    weights are named."""
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    a = Classifier()
    with torch.no_grad():
        a.head.weight.mul_(30)
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.head.weight.copy_(torch.randn_like(b.head.weight) * a.head.weight.std())
    y = a.head(a.body(x)).argmax(-1)
    for name, model in (("a", a), ("b", b)):
        with HookerAndDumper(tmp_path / name, params=True).hooks(model, 0, 0):
            model(x, y).backward()
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    loss = result[(result["module"] == "") & (result["kind"] == fmt.OUTPUT)].iloc[0]
    assert loss["rel_error"] > 10 and loss["input_rel_error"] > 1
    assert loss["status"] == INHERITED
    assert result[result["status"] == st.DIFF][["module", "kind"]].values.tolist() == [
        ["head", fmt.PARAM]]


class _LinearRouter(nn.Module):
    """Logits from its own weight, in its own code, and their argmax, both returned (Hugging
    Face's ``Qwen2MoeTopKRouter`` computes ``F.linear`` and ``topk`` so)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        logits = nn.functional.linear(x, self.weight)
        return logits, logits.argmax(-1)


class _RoutedExperts(_Experts):
    def __init__(self):
        super().__init__()
        self.router = _LinearRouter()

    def forward(self, x):
        logits, chosen = self.router(x)
        picked = torch.einsum("td,tde->te", x, self.experts[chosen].to(x.dtype))
        return self.out(picked * logits.max(-1, keepdim=True).values.sigmoid())


def _with_near_tie(make: type) -> nn.Module:
    """``make()`` (seeded) whose ``router`` rows for experts 0 and 1 differ by less than a
    bfloat16 rounding (the others far below): under bf16 autocast they tie."""
    torch.manual_seed(0)
    model = make()
    with torch.no_grad():
        w = model.router.weight
        w[2:] *= 0.01
        w[1] = w[0] * (1 + 1e-4 * torch.randn(8).sign())
    return model


def _dump_runs(model: nn.Module, directory, runs: dict) -> None:
    """One step of ``model`` per run ``name: (dumper options, precision context, plant or
    None)``, dumped into ``directory / name``, on the same batch."""
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(2))
    for name, (options, precision, plant) in runs.items():
        planted = perturb(model, **plant) if plant else None
        with HookerAndDumper(directory / name, **options).hooks(model, 0, 0):
            with precision:
                out = model(x)
            out.float().pow(2).sum().backward()
        model.zero_grad()
        if planted:
            planted.remove()


def test_a_router_that_rounds_is_no_origin_where_a_near_tie_flips(tmp_path):
    """Two experts whose router rows differ by less than a bfloat16 rounding: under bf16
    autocast they tie, so a re-run on A's inputs and weights routes tokens otherwise. A
    decision of a call that rounds has no bound: the re-run names no origin, and the tokens
    routed otherwise are really there."""
    model = _with_near_tie(_RoutedExperts)
    bf16 = torch.autocast("cpu", torch.bfloat16)
    # "ao", "bo": outputs alone dumped (no inputs to tell which calls get floating values)
    _dump_runs(model, tmp_path, {
        "a": ({"params": True}, contextlib.nullcontext(), None), "b": ({}, bf16, None),
        "i": ({"inject": tmp_path / "a"}, bf16, None),
        "ao": ({"kinds": ["output"]}, contextlib.nullcontext(), None),
        "bo": ({"kinds": ["output"]}, bf16, None)})
    for a, b in (("a", "i"), ("ao", "bo")):
        result = compare_dumps(tmp_path / a, tmp_path / b)
        chosen = result[(result["module"] == "router") & (result["kind"] == fmt.OUTPUT)].iloc[1]
        assert chosen["rel_error"] > 0 and chosen["status"] != st.DIFF
    table = localize(tmp_path / "a", tmp_path / "b", tmp_path / "i")
    assert (table["verdict"] != ORIGIN).all(), table[table["verdict"] == ORIGIN]


class _ExpertsOfChosen(nn.Module):
    """Experts that get the router's choice as an input (Hugging Face's ``Qwen2MoeExperts``
    does) and pick their weights by it in their own code, an activation between."""

    def __init__(self):
        super().__init__()
        self.act = nn.SiLU()
        self.w_in = nn.Parameter(torch.randn(4, 8, 8) / 3)
        self.w_out = nn.Parameter(torch.randn(4, 8, 8) / 3)

    def forward(self, x, chosen):
        hidden = self.act(torch.einsum("td,tde->te", x, self.w_in[chosen].to(x.dtype)))
        return torch.einsum("te,ted->td", hidden, self.w_out[chosen].to(x.dtype))


class _MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.experts = _LinearRouter(), _ExpertsOfChosen()

    def forward(self, x):
        _, chosen = self.router(x)
        return self.experts(x, chosen)


def test_a_choice_b_ran_on_as_a_is_bounded_in_a_rerun(tmp_path):
    """A router whose near-tie flips under bfloat16 chooses other experts in B, but the re-run
    on A's values gives the experts A's choice: what their code makes of it has a bound again,
    and a 10 % error planted in the gradient their code sends to the activation is named
    (before: the choice's error, which B did not run on, left it without one)."""
    model = _with_near_tie(_MoE)
    bf16 = torch.autocast("cpu", torch.bfloat16)
    plant = {"include": ["experts.act"], "where": fmt.GRAD_OUTPUT, "scale": 1.1}
    _dump_runs(model, tmp_path, {"a": ({"params": True}, contextlib.nullcontext(), None),
                                 "b": ({}, bf16, plant),
                                 "i": ({"inject": tmp_path / "a"}, bf16, plant)})
    result = compare_dumps(tmp_path / "a", tmp_path / "i")
    chosen = result[(result["module"] == "experts") & (result["kind"] == fmt.INPUT)
                    & (result["index"] == 1)].iloc[0]
    assert chosen["injected"] == 1 and chosen["rel_error"] > 0  # B's own choice differed
    table = localize(tmp_path / "a", tmp_path / "b", tmp_path / "i")
    origins = table[table["verdict"] == ORIGIN]
    assert list(zip(origins["module"], origins["kind"])) == [("experts.act", fmt.GRAD_OUTPUT)]


class _Positions(nn.Module):
    """Token and position embeddings summed; ``shift`` moves the positions its code makes."""

    def __init__(self):
        super().__init__()
        self.emb, self.pemb, self.lin = nn.Embedding(50, 8), nn.Embedding(50, 8), nn.Linear(8, 8)
        self.shift = 0

    def forward(self, ids):
        pos = torch.arange(ids.shape[0]) + self.shift
        return self.lin(self.emb(ids) + self.pemb(pos))


@pytest.mark.parametrize("wrong", ["ids", "positions"])
def test_wrong_integers_nothing_rounded_are_named_under_autocast(tmp_path, wrong):
    """Integers nothing computed with rounding (token ids, positions from ``arange``) that
    differ are a difference, also where B runs under bfloat16 autocast: only integers a call
    decides from floating values it gets may flip with rounding."""
    torch.manual_seed(0)
    model, ids = _Positions(), torch.randint(0, 50, (32,))
    for name, bf16 in (("a", False), ("b", True)):
        if bf16 and wrong == "positions":
            model.shift = 5
        given = (ids + 1) % 50 if bf16 and wrong == "ids" else ids
        with HookerAndDumper(tmp_path / name, params=True).hooks(model, 0, 0):
            with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                out = model(given)
            out.float().pow(2).sum().backward()
        model.zero_grad()
    first = summarize(compare_dumps(tmp_path / "a", tmp_path / "b")).first
    assert (first.row["module"], first.row["kind"]) == (
        ("", fmt.INPUT) if wrong == "ids" else ("pemb", fmt.INPUT))


def test_an_embeddings_drift_is_bounded_by_its_most_repeated_id(tmp_path):
    """At a later step an Embedding's weights drifted (B float32 against A float64, B's
    weights known by their sketch): a row its ids name c times holds c times its drift in
    the output, so the output's error is at most sqrt(c) times the weights' at the output's
    scale, with c the most times one id occurs. The drift alone agrees; a 10 % error planted
    in the lookup is named there."""
    from helpers import dump_embedded, read_tensors
    from compare.statistics import sketch_bound
    a = dump_embedded(tmp_path / "a", torch.float64, params=True)
    healthy = summarize(compare_dumps(a, dump_embedded(tmp_path / "b", torch.float32,
                                                       drift=1e-3)))
    assert healthy.ok and healthy.first is None, healthy.verdict()
    planted = compare_dumps(a, dump_embedded(tmp_path / "p", torch.float32, drift=1e-3,
                                             plant=1.1))
    first = summarize(planted).first
    assert first is not None and (first.row["module"], first.row["kind"]) == ("emb", "output")
    ids = read_tensors(tmp_path / "a")[("emb", 0, "input", 0)]
    count = int(torch.bincount(ids.flatten()).max())
    assert count > 1
    weight = planted[(planted["module"] == "emb") & (planted["kind"] == "param")].iloc[0]
    estimate = weight["rel_error"] * sketch_bound(int(weight["sketched"]))
    by_hand = math.sqrt(count) * estimate * weight["rms_a"] * math.sqrt(
        weight["numel"] / first.row["numel"]) / first.row["rms_a"]
    assert first.row["input_rel_error"] == pytest.approx(by_hand, rel=1e-9)
    assert first.row["unbounded"] == ""


class _LookedUpTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(64, 16), nn.Linear(16, 4)

    def forward(self, ids):
        return self.out(self.emb(ids) + self.emb(ids.flip(-1) // 2))


def test_every_call_of_an_embedding_gets_its_lookups_bound(tmp_path):
    """Weights are recorded at a module's first call: its second call's lookup is bounded by
    them too."""
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(1))
    for name, dtype, drift, options in (("a", torch.float64, 0.0, {"params": True}),
                                        ("b", torch.float32, 1e-3, {})):
        torch.manual_seed(0)
        model = _LookedUpTwice()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + drift * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
        model = model.to(dtype)
        with HookerAndDumper(tmp_path / name, **options).hooks(model, 0, 3):
            model(ids).pow(2).mean().backward()
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    lookups = result[(result["module"] == "emb") & (result["kind"] == fmt.OUTPUT)]
    assert list(lookups["call_idx"]) == [0, 1]
    assert (lookups["unbounded"] == "").all(), lookups["unbounded"]
    assert (lookups["input_rel_error"] > 0).all() and np.isfinite(lookups["input_rel_error"]).all()


def test_an_outlier_two_dumps_cannot_bound_is_never_agreement(tmp_path):
    """At a later step the weights of a lookup of a module's own code (``weight[ids]``)
    drifted (B float32 against A float64, B's weights known by statistics only): which rows
    its ids pick, and how far those drifted, two dumps cannot say (of an ``Embedding``
    they can), so its output has no bound. A 10 % error planted there is still
    no agreement: it adds 10^5 times what comparable records do, so the verdict says two
    dumps cannot tell and names it (exit 0); where a later record fails (code between the
    Linears scales their tensor), the first divergence is that record, and the verdict says
    it may begin at the embedding instead (exit 1). The drift alone stays agreement."""
    from helpers import dump_embedded
    a = dump_embedded(tmp_path / "a", torch.float64, params=True, indexed=True)
    healthy = summarize(compare_dumps(a, dump_embedded(tmp_path / "b", torch.float32,
                                                       drift=1e-3, indexed=True)))
    assert healthy.ok and "emb" not in set(healthy.undecided["module"]), healthy.verdict()
    label = "emb.Indexed#0 output[0]"
    planted = dump_embedded(tmp_path / "p", torch.float32, drift=1e-3, plant=1.1,
                            indexed=True)
    summary = summarize(compare_dumps(a, planted))
    assert summary.ok and summary.cannot_tell
    worst = summary.undecided.iloc[0]
    assert worst["label"] == label and worst["added_rel_error"] == pytest.approx(0.1, rel=0.01)
    assert summary.verdict().startswith(f"B may diverge from A; two dumps cannot tell: {label} "
                                        f"adds {worst['added_rel_error']:.3g}"), summary.verdict()
    assert worst["unbounded"] == "drifted weights it gets are looked up by indices"
    assert "which two dumps cannot bound: drifted weights it gets are looked up by indices (its " \
        "inputs carry" in summary.verdict(), summary.verdict()
    out = CliRunner().invoke(h5cmp, [str(a), str(planted)])
    assert out.exit_code == 0 and f"forward  {label} (added" in out.output, out.output
    assert "any error could hide" in out.output
    later = dump_embedded(tmp_path / "q", torch.float32, drift=1e-3, plant=1.1, between=1.1,
                          indexed=True)
    summary = summarize(compare_dumps(a, later))
    assert (summary.first.row["module"], summary.first.row["kind"]) == ("lin2", "input")
    assert summary.cannot_tell and summary.undecided.iloc[0]["label"] == label
    assert (f"; two dumps cannot tell whether it begins earlier: {label} (forward) adds "
            f"{summary.undecided.iloc[0]['added_rel_error']:.3g}" in summary.verdict()), \
        summary.verdict()
    out = CliRunner().invoke(h5cmp, [str(a), str(later)])
    assert out.exit_code == 1 and "cannot tell: before the first divergence, in " in out.output, out.output


def test_an_earlier_outlier_is_one_that_ran_before(tmp_path):
    """The lookup's 10 % error planted at step 3, code between the Linears wrong at step 4
    (both after drift): the first divergence is step 4's; where it may begin instead is the
    outlier of step 3, named with its step. Within one step, an outlier on another rank did
    not run before the failure: not named (the result's ranks relabelled as a two-rank run's
    would be)."""
    from helpers import dump_embedded
    for step in (3, 4):
        a = dump_embedded(tmp_path / "a", torch.float64, params=True, step=step,
                          indexed=True)
    dump_embedded(tmp_path / "b", torch.float32, drift=1e-3, plant=1.1, step=3, indexed=True)
    b = dump_embedded(tmp_path / "b", torch.float32, drift=1e-3, between=1.1, step=4,
                      indexed=True)
    summary = summarize(compare_dumps(a, b))
    assert summary.verdict().startswith(
        "B diverges from A: first at step 0:4 forward in lin2 (input[0]); two dumps cannot tell "
        "whether it begins earlier: step 0:3 emb.Indexed#0 output[0] (forward) adds "), \
        summary.verdict()
    one_step = compare_dumps(tmp_path / "a", dump_embedded(
        tmp_path / "c", torch.float32, drift=1e-3, plant=1.1, between=1.1, indexed=True))
    one_step = one_step[one_step["step"] == 3]
    assert "emb" in set(summarize(one_step).undecided["module"])
    ranks = summarize(one_step.assign(rank=[1.0 if m == "emb" else 0.0
                                            for m in one_step["module"]]))
    assert ranks.first.row["module"] == "lin2" and "emb" not in set(ranks.undecided["module"])
    assert "begins earlier: emb" not in ranks.verdict(), ranks.verdict()
    # a weight's gradient is taken after the ranks sum theirs: every record of its step, on
    # any rank, came before it (the failing row relabelled as one)
    first = ranks.first.row.name
    summed = one_step.assign(rank=[1.0 if m == "emb" else 0.0 for m in one_step["module"]],
                             kind=[fmt.PARAM_GRAD if i == first else k
                                   for i, k in zip(one_step.index, one_step["kind"])])
    assert "emb" in set(summarize(summed).undecided["module"])


def test_a_failure_found_where_planted_is_not_said_to_begin_at_a_smaller_outlier(tmp_path):
    """At a later step (drifted weights, float64 against float32) lin2's own backward off by
    10 %: found there; earlier records that stand out by drift alone could not hide as much,
    so the verdict does not say it may begin at one of them."""
    from helpers import dump_embedded
    a = dump_embedded(tmp_path / "a", torch.float64, params=True)
    original = perturb

    def planted(model, *args, **kwargs):
        return original(model, "lin2", where="grad_input", scale=1.1)
    import helpers
    b = tmp_path / "b"
    handle = None
    try:
        torch.manual_seed(0)
        model = helpers.Embedded()
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=gen))
        handle = planted(model)
        ids = torch.randint(0, 12, (4, 6), generator=torch.Generator().manual_seed(1)) * 5
        with HookerAndDumper(b).hooks(model, 0, 3):
            model(ids).pow(2).mean().backward()
    finally:
        if handle is not None:
            handle.remove()
    summary = summarize(compare_dumps(a, b))
    assert (summary.first.row["module"], summary.first.row["kind"]) == ("lin2", "grad_input")
    assert not summary.cannot_tell and "begins earlier" not in summary.verdict(), \
        summary.verdict()


def test_an_outlier_whose_bound_is_large_is_not_said_to_have_none(tmp_path):
    """Weights 30 % off (float64 against float32, B's drifted) count four times their error
    as input error, so the bound of what a record adds can be finite yet 1 or more: such an
    outlier is named for its inputs' error, never with an empty reason for having no bound."""
    import torch.nn.functional as F

    class Proj(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(16, 16) / 4)

        def forward(self, x):
            return F.linear(x, self.weight)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.p, self.out = nn.Linear(16, 16), Proj(), nn.Linear(16, 4)

        def forward(self, x):
            return self.out(torch.relu(self.p(self.inp(x))))

    def dump(directory, dtype, drift, scale):
        torch.manual_seed(0)
        model = Model()
        with torch.no_grad():
            model.p.weight.mul_(1 + drift * torch.randn(
                16, 16, generator=torch.Generator().manual_seed(7)))
        model = model.to(dtype)
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        planted = perturb(model, "p", where="output", scale=scale) if scale != 1 else None
        with HookerAndDumper(directory, params=True).hooks(model, 0, 3):
            model(x).pow(2).mean().backward()
        if planted is not None:
            planted.remove()
        return directory

    result = compare_dumps(dump(tmp_path / "a", torch.float64, 0.0, 1.0),
                           dump(tmp_path / "b", torch.float32, 0.3, 1.8))
    summary = summarize(result)
    worst = summary.undecided.iloc[0]
    assert 1 <= worst["hidden_rel_error"] < math.inf and worst["unbounded"] == ""
    assert (f"which its inputs' error ({worst['input_rel_error']:.3g}), amplified, could hide "
            f"any of it" in summary.verdict()), summary.verdict()
    assert (result["unbounded"] != "").eq(result["hidden_rel_error"] == math.inf).all()


def test_a_gradient_handed_on_through_identity_calls_is_judged_as_the_sums(tmp_path):
    """A SegFormer layer adds its attention's output to the residual stream through an
    ``Identity`` drop path and a dropout of rate 0, and the next norm consumes the sum: the
    gradient arriving at the attention's output is what the sum's two uses send back. Those
    calls hand the output back bit for bit, so they are no use of their own; before, they
    kept that link from being made, and a 3 % error planted in that gradient (float16
    autocast) passed, judged against the 11 % relative error of the norm's input gradient,
    2000x smaller in scale."""
    attention = "segformer.stages.1.blocks.0.attention"
    a, planted, planted_inj = _segformer_pairs(tmp_path, {
        "include": [attention], "where": "grad_output", "scale": 1.03})
    result = CliRunner().invoke(h5cmp, [str(a), str(planted)])
    assert result.exit_code == 1, result.output
    assert (f"first divergence: step 0:0, backward, module {attention}.o_proj (Linear) call 0, "
            "grad_output[0]") in result.output
    assert f"{attention}.SegformerAttention#0 grad_output[0]" in result.output  # the same tensor
    # re-run on A's values, the block's output gradient (a term of the sum) is A's: it found
    # no origin while that term's record (what arrived) stood for what B summed
    result = CliRunner().invoke(h5cmp, [str(a), str(planted), "--injected", str(planted_inj)])
    assert f"origin: step 0:0 backward {attention}.o_proj.Linear#0 grad_output[0]" in \
        result.output, result.output


def _segformer_pairs(tmp_path, plant: dict) -> tuple:
    """A SegFormer step (seed 1) in float32 with its weights (A), in float16 autocast with
    ``plant`` (``dumper.perturb``), and re-run so on A's values: ``(a, planted, planted
    re-run)``, after checking that the healthy float16 pair and its re-run find nothing."""
    require_runnable("segformer", "float32", "float16")
    a = tmp_path / "a"
    run_step("segformer", "float32", a, seed=1, dumper_options={"params": True})
    inject = {"dumper_options": {"inject": a}}
    for name, options in [("b", {}), ("b-inj", inject), ("planted", {"plant": plant}),
                          ("planted-inj", {"plant": plant, **inject})]:
        run_step("segformer", "float16", tmp_path / name, seed=1, **options)
    healthy = compare_dumps(a, tmp_path / "b")
    assert not healthy["status"].isin(FAILING).any(), healthy[healthy["status"].isin(FAILING)]
    table = localize(a, tmp_path / "b", tmp_path / "b-inj", free_result=healthy)
    assert (table["verdict"] != ORIGIN).all(), table[table["verdict"] == ORIGIN]
    return a, tmp_path / "planted", tmp_path / "planted-inj"


def test_a_gradient_that_several_calls_send_back_is_judged_as_their_sum(tmp_path):
    """SegFormer computes its attention's keys and values from one norm's output: the gradient
    arriving at that norm is the sum of what the two Linears send back. No link held that sum,
    and a 3 % error planted in it (float16 autocast) passed the two-dump verdict and had no
    origin in the re-run on A's values: the norm's gradient was judged against the largest
    error among its sources (the keys' gradient, all noise)."""
    norm = "segformer.stages.0.blocks.0.attention.sequence_reduction.layer_norm"
    a, planted, planted_inj = _segformer_pairs(tmp_path, {
        "include": [norm], "where": "grad_output", "scale": 1.03})
    result = CliRunner().invoke(h5cmp, [str(a), str(planted)])
    assert result.exit_code == 1, result.output
    assert (f"first divergence: step 0:0, backward, module {norm} (LayerNorm) call 0, "
            "grad_output[0]") in result.output
    attention = "segformer.stages.0.blocks.0.attention"
    assert (f"{attention}.k_proj.Linear#0 grad_input[0] + {attention}.v_proj.Linear#0 "
            f"grad_input[0]") in result.output
    table = localize(a, planted, planted_inj)
    assert table.loc[table["verdict"] == ORIGIN, "module"].iloc[0] == norm


class ManyHeads(nn.Module):
    """One tensor that 32 Linears of positive weights consume: the gradient arriving at it is a
    bfloat16 sum of 32 terms of one sign, which rounds 31 times."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.heads = nn.ModuleList(nn.Linear(64, 8) for _ in range(32))
        with torch.no_grad():
            for head in self.heads:
                head.weight.abs_()

    def forward(self, x):
        h = self.inp(x)
        return torch.stack([head(h) for head in self.heads]).sum()


def _many_heads_step(directory, dtype, plant=None):
    torch.manual_seed(0)
    model = ManyHeads().to(dtype)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    planted = perturb(model, **plant) if plant else None
    with HookerAndDumper(directory).hooks(model, 0, 0):
        model(x).float().backward()
    if planted is not None:
        planted.remove()
    return directory


def test_a_sum_of_many_gradients_is_allowed_a_rounding_per_addition(tmp_path):
    """bfloat16 sums the 32 gradients with 1.3 units of rounding relative to their magnitude:
    one rounding allowed for the whole sum called that a change between modules in a healthy
    float64-vs-bfloat16 pair. Each addition rounds, the roundings add in quadrature; a 3 %
    error in that gradient is still found there."""
    a = _many_heads_step(tmp_path / "a", torch.float64)
    b = _many_heads_step(tmp_path / "b", torch.bfloat16)
    rows = compare_dumps(a, b)
    summed = rows[(rows["module"] == "inp") & (rows["kind"] == "grad_output")].iloc[0]
    assert summed["transit_from"].count(" + ") == 31
    assert summed["transit_rel_diff"] > 2 ** -8  # beyond one rounding of bfloat16
    assert not rows["status"].isin(FAILING).any()
    planted = _many_heads_step(tmp_path / "planted", torch.bfloat16, {
        "include": "inp", "where": "grad_output", "scale": 1.03})
    result = CliRunner().invoke(h5cmp, [str(a), str(planted)])
    assert result.exit_code == 1, result.output
    assert ("first divergence: step 0:0, backward, module inp (Linear) call 0, grad_output[0]"
            in result.output)


def _xlnet_step(directory, precision: str, **options) -> None:
    """One training step of a tiny XLNet (random weights, seed 0) at ``precision``, dumped;
    ``plant`` (in ``options``) goes to ``dumper.perturb``, the rest to the dumper."""
    import transformers
    plant = options.pop("plant", None)
    torch.manual_seed(0)
    model = transformers.XLNetLMHeadModel(transformers.XLNetConfig(
        vocab_size=96, d_model=48, n_layer=2, n_head=4, d_inner=64, dropout=0.0)).train()
    if precision == "float64":
        model = model.double()
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    planted = perturb(model, **plant) if plant else None
    dumper = HookerAndDumper(directory, steps=[0], **options)
    with dumper.hooks(model, 0, 0):
        model(input_ids=ids, labels=ids).loss.backward()
    dumper.close()
    if planted is not None:
        planted.remove()


def test_a_norm_backward_whose_terms_cancel_is_judged_by_its_recomputed_rounding(tmp_path):
    """XLNet's last feed-forward LayerNorm gets a gradient mostly along its mean and its
    normalized input, which its backward removes: float32 rounding of the terms comes out 35x
    what grad_input records typically add, relative to what is left. Recomputed from the
    call's own records it is within rounding, so a float64-vs-float32 re-run on A's values
    finds no origin (it found that norm); a 1 % error planted in that backward is still one."""
    norm = "transformer.layer.1.ff.layer_norm"
    a, b, c, planted = (tmp_path / name for name in ("a", "b", "c", "planted"))
    _xlnet_step(a, "float64", params=True)
    _xlnet_step(b, "float32")
    _xlnet_step(c, "float32", inject=Injector(a, LOCALIZING))
    table = localize(a, b, c)
    assert len(table) > 100 and (table["verdict"] != ORIGIN).all(), \
        table[table["verdict"] == ORIGIN][["module", "kind", "local_reason"]]
    row = table[(table["module"] == norm) & (table["kind"] == fmt.GRAD_INPUT)].iloc[0]
    assert row["local_added_ratio"] > 10  # far beyond the typical: not passed for that
    _xlnet_step(planted, "float32", inject=Injector(a, LOCALIZING),
                plant={"include": norm, "where": fmt.GRAD_INPUT, "scale": 1.01})
    found = localize(a, b, planted)
    origins = found[found["verdict"] == ORIGIN]
    assert list(zip(origins["module"], origins["kind"])) == [(norm, fmt.GRAD_INPUT)], origins


_TRIAL_MODELS = {  # tiny random-weight models a trial found these misses on
    "modernbert": ("ModernBertConfig", "ModernBertForMaskedLM", dict(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, sep_token_id=2, cls_token_id=1, global_attn_every_n_layers=2,
        local_attention=8, attn_implementation="eager")),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=64,
        sliding_window=4)),
}


def _trial_steps(arch: str, precision: str, directory, plant=None, **options) -> None:
    """Four AdamW steps of a ``_TRIAL_MODELS`` model (seed 0, no dropout), float32 or under
    bfloat16 autocast; the last dumped, with ``plant`` (``dumper.perturb``'s arguments) in it."""
    import transformers
    config, model_class, sizes = _TRIAL_MODELS[arch]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config)(**sizes)).train()
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dumper = HookerAndDumper(directory, steps=[3], **options)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bfloat16" \
        else contextlib.nullcontext()
    for step in range(4):
        planted = perturb(model, **plant) if plant and step == 3 else None
        with dumper.hooks(model, 0, step):
            with autocast:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        if planted is not None:
            planted.remove()
        opt.step()
        opt.zero_grad()
    dumper.close()


@pytest.mark.parametrize("arch,module", [("modernbert", "head.act"),
                                         ("gemma3", "model.layers.0.self_attn.q_norm")])
def test_a_rerun_at_a_later_step_names_a_backward_error_after_a_replaced_gradient(
        tmp_path, arch, module):
    """A 10 % error in one module's backward at the fourth step, float32 against bfloat16
    autocast, re-run on A's values: the module is the origin. Two rules had hidden it behind
    what the re-run replaced: the signs of a GELU's input flipping between A and what arrived
    (B ran on A's, whose signs it keeps), and an RMSNorm's incoming gradient judged by its
    mean-removed error (an RMSNorm removes no mean), 90x the cast's rounding. The healthy
    re-run names no origin."""
    require_runnable("llama", "bfloat16")
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    plant = {"include": module, "where": fmt.GRAD_INPUT, "scale": 1.1}
    _trial_steps(arch, "float32", a, params=True)
    _trial_steps(arch, "bfloat16", b, plant=plant)
    _trial_steps(arch, "bfloat16", c, plant=plant, inject=Injector(a, LOCALIZING))
    table = localize(a, b, c)
    origins = table[table["verdict"] == ORIGIN]
    assert (module, fmt.GRAD_INPUT) in set(zip(origins["module"], origins["kind"])), \
        table[table["module"] == module][["kind", "local_status", "local_reason"]]
    _trial_steps(arch, "bfloat16", tmp_path / "free")
    _trial_steps(arch, "bfloat16", tmp_path / "healthy", inject=Injector(a, LOCALIZING))
    healthy = localize(a, tmp_path / "free", tmp_path / "healthy")
    assert (healthy["verdict"] != ORIGIN).all(), healthy[healthy["verdict"] == ORIGIN]


def _resnet_with_weights(directory, precision: str, bias_grad_scale: float = 1.0) -> None:
    """One AdamW step of the benchmark's ResNet at seed 3, both runs dumped with
    ``params=True``, the stem BatchNorm's bias gradient scaled by ``bias_grad_scale``."""
    import architectures
    model, batch = architectures.build("resnet", precision, seed=3)
    if bias_grad_scale != 1.0:
        model.bn1.bias.register_hook(lambda g: g * bias_grad_scale)
    with HookerAndDumper(directory, params=True).hooks(model, 0, 0):
        with architectures.precision_context(precision):
            loss = architectures.ARCHITECTURES["resnet"].loss(model, batch)
        loss.backward()


def test_a_bias_gradient_whose_positions_cancel_amplifies_its_incoming_error(tmp_path):
    """A BatchNorm's bias gradient sums its incoming gradient over 1024 positions per channel,
    which cancel to a third of a random walk's size: float16's 7 % error there became 16 %,
    a false alarm (9x the typical added error of parameter gradients). Its gain is now the
    sum's, ``rms(gy) sqrt(P) / rms(db)`` (3.4), as a Linear's bias's; and recomputed from
    its incoming gradient, a 20 % error planted in it (which that gain hid: "cannot tell") is
    the first divergence, found exactly (5 % lies within the rounding of float16 partial sums,
    which a kernel given float16 may keep)."""
    _resnet_with_weights(tmp_path / "a", "float32")
    _resnet_with_weights(tmp_path / "b", "float16")
    healthy = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert summarize(healthy).ok, summarize(healthy).verdict()
    bias = healthy[(healthy["module"] == "bn1") & (healthy["kind"] == fmt.PARAM_GRAD)
                   & (healthy["index"] == 1)].iloc[0]
    assert bias["rel_error"] > 2 * bias["input_rel_error"], bias
    _resnet_with_weights(tmp_path / "planted", "float16", bias_grad_scale=1.2)
    first = summarize(compare_dumps(tmp_path / "a", tmp_path / "planted")).first
    assert first is not None and (first.row["module"], first.row["kind"], first.row["index"]) \
        == ("bn1", fmt.PARAM_GRAD, 1), first
    assert first.row["recomputed_rel_err"] == pytest.approx(0.2, rel=0.05)
    assert "summed over positions" in first.row["reason"]


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_bias_gradient_summed_in_16_bits_is_allowed_that_rounding(tmp_path, precision):
    """torch's CPU LayerNorm backward of a 16-bit input holds its bias gradient's partial sums
    in that dtype (9 units of bfloat16 over 2048 positions, where float32 partial sums round
    0.4): recomputed, a healthy SegFormer's LayerNorm bias gradients are within the partial
    sums' rounding at the lowest dtype the call is given (both runs dumped with params=True,
    as a recomputation needs; they were "miscomputed" at float32's)."""
    require_runnable("segformer", precision)
    for name, run in (("a", "float32"), ("b", precision)):
        run_step("segformer", run, tmp_path / name, seed=3, dumper_options={"params": True})
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    biases = result[(result["kind"] == fmt.PARAM_GRAD) & result["recomputed_rel_err"].notna()]
    assert len(biases) > 10
    assert (biases["recomputed_rel_err"] <= biases["recomputed_allowance"]).all(), biases[
        ["module", "recomputed_rel_err", "recomputed_allowance"]]
    assert summarize(result).ok, summarize(result).verdict()

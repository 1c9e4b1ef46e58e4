"""Weights that differ: their sketch tells by how much, so a later step's module errors are
still found, and their drift is not blamed on the modules they feed."""
from __future__ import annotations

import math
import tracemalloc
import zlib

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from compare import compare_dumps, load_dump, summarize
from compare import format as fmt
from compare import status as st
from compare.status import FAILING
from compare.cli import main
from compare.statistics import (SKETCH_MISS, SKETCH_SIZE, _chi_square_cdf, sketch_bound,
                                sketch_of_chunks, sketch_rel_error, sketch_sums)
from compare import localize
from compare.errors import DumpError
from dumper import HookerAndDumper, Injector
from dumper.stats import tensor_sketch

from helpers import Planted


@pytest.mark.parametrize("shape, dtype", [((3,), torch.float32), ((1021,), torch.float32),
                                          ((64, 1024), torch.float32), ((7, 3, 500), torch.float64),
                                          ((2048,), torch.bfloat16), ((300,), torch.complex64)])
def test_the_dumper_and_the_reader_draw_the_same_sketch(shape, dtype):
    t = torch.randn(*shape).to(dtype)
    values = (t.abs() if t.is_complex() else t).double().numpy().reshape(-1)
    np.testing.assert_allclose(tensor_sketch(t), sketch_of_chunks([values[:700], values[700:]]),
                               rtol=1e-12, atol=1e-12)


def test_the_readers_sketch_is_the_same_however_the_values_are_chunked():
    """Chunks cut rows of P elements anywhere (empty ones too); NaN propagates."""
    values = np.random.default_rng(5).standard_normal(5 * 1021 + 17)
    whole = sketch_of_chunks([values])
    for cuts in ([1], [700, 700], [1020, 1021, 2043], [3000, 3000, 5122]):
        pieces = np.split(values, np.cumsum(cuts))
        np.testing.assert_allclose(sketch_of_chunks(pieces), whole, rtol=1e-12, atol=1e-12)
    values[4000] = np.nan
    assert all(math.isnan(v) for v in sketch_of_chunks(np.split(values, [3000])))


def test_the_readers_sketch_needs_scratch_of_a_few_chunk_copies():
    """A chunk of 2^20 values (what the reader reads at a time): the sketch's scratch stays
    within four float64 copies of it, not SKETCH_SIZE of them."""
    chunk = np.random.default_rng(6).standard_normal(1 << 20).astype(np.float32)
    sketch_of_chunks([chunk[:10]])  # the sign tables, built once and kept
    tracemalloc.start()
    try:
        sketch_of_chunks([chunk, chunk])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 8 * chunk.size, f"{peak / 2**20:.0f} MiB of scratch"


@pytest.mark.parametrize("kind", ["random", "rank-1", "scale"])
def test_the_sketch_estimates_a_drift_within_a_factor_of_three(kind):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(256, 512, generator=gen, dtype=torch.float64)
    if kind == "random":
        drift = torch.randn(w.shape, generator=gen, dtype=torch.float64)
    elif kind == "rank-1":
        drift = torch.randn(256, 1, generator=gen, dtype=torch.float64) @ \
            torch.randn(1, 512, generator=gen, dtype=torch.float64)
    else:
        drift = w.clone()
    drift *= 1e-4 * w.norm() / drift.norm()
    estimate = sketch_rel_error(tensor_sketch(w), tensor_sketch(w + drift), float(w.norm()))
    assert 1e-4 / 3 < estimate < 1e-4 * 3


def test_the_sketch_falls_short_of_a_drift_as_a_chi_square_says():
    """How far below ``||b - a||`` a sketch's estimate falls is a chi-square of as many degrees
    as it has sums: the CDF agrees with the tables (8 degrees: 1.646 at 1 %, 0.857 at 0.1 %;
    32: 16.362 at 1 %), 4000 random drifts of a 48 x 48 weight fall short that far about 1 %
    of the time, with 8 sums and with 32, and ``sketch_bound`` is the SKETCH_MISS quantile's
    factor. Eight sums underestimate a drift by 2x one time in 50 (the CDF at 8 / 4 = 2)."""
    for x, degrees, p in ((1.646, 8, 0.01), (0.857, 8, 0.001), (16.362, 32, 0.01)):
        assert _chi_square_cdf(x, degrees) == pytest.approx(p, rel=2e-3)
    for degrees in (8, SKETCH_SIZE):
        assert _chi_square_cdf(degrees / sketch_bound(degrees) ** 2, degrees) == \
            pytest.approx(SKETCH_MISS, rel=1e-6)
    assert SKETCH_SIZE == 32 and sketch_bound(8) > 4 > 1.8 > sketch_bound(32)
    gen = torch.Generator().manual_seed(5)
    zero = tensor_sketch(torch.zeros(48 * 48, dtype=torch.float64))
    ratios = {8: [], 32: []}
    for drift in torch.randn(4000, 48 * 48, generator=gen, dtype=torch.float64):
        sketch = tensor_sketch(drift)
        for sums in ratios:
            ratios[sums].append(sketch_rel_error(zero[:sums], sketch[:sums], float(drift.norm())))
    for sums, one_percent in ((8, 1.646), (32, 16.362)):
        short = np.mean(np.array(ratios[sums]) < np.sqrt(one_percent / sums))
        assert 0.005 < short < 0.02, (sums, short)


def test_a_sketch_with_nan_among_its_known_sums_knows_none():
    """+Inf and -Inf elements cancel to NaN in the sums where their signs differ, so a
    sketch may hold NaN among known sums: it knows none (a file of versions 2 to 11 knows
    its first 8, the rest NaN)."""
    t = torch.zeros(3000, dtype=torch.float64)
    t[5], t[2000] = math.inf, -math.inf
    sketch = tensor_sketch(t)
    assert 0 < sum(map(math.isnan, sketch)) < len(sketch)
    assert sketch_sums(sketch) == 0
    assert sketch_sums(tensor_sketch(torch.ones(3000))[:8] + (math.nan,) * 24) == 8


def _train(directory, lr, plant_at=None, params=False, steps=2):
    """Planted, trained with SGD; ``mid``'s output doubled at step ``plant_at``."""
    torch.manual_seed(0)
    model, gen = Planted(), torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    step_now = {"step": -1}
    model.mid.register_forward_hook(
        lambda m, args, out: out * 2 if step_now["step"] == plant_at else out)
    dumper = HookerAndDumper(directory, steps=[steps - 1], params=params)
    for step in range(steps):
        step_now["step"] = step
        with dumper.hooks(model, 0, step):
            model(torch.randn(8, 6, generator=gen)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return directory


@pytest.mark.parametrize("params", [False, True])
def test_drifted_weights_neither_hide_nor_fake_an_error(tmp_path, params):
    """B trained with a learning rate 1e-6 larger: at step 1 every weight differs a little.
    In one precision on the same kernels that is a divergence at an earlier step, and the
    weights are named; nothing they feed is blamed; with mid's output doubled at step 1, mid
    is a suspect of its own."""
    a = _train(tmp_path / "a", 0.05, params=params)
    healthy = compare_dumps(a, _train(tmp_path / "b", 0.05 * (1 + 1e-6), params=params))
    summary = summarize(healthy)
    assert summary.first.row["kind"] == "param" and "earlier step" in summary.first.row["reason"]
    failing = healthy[healthy["status"].isin(FAILING)]
    assert (failing["kind"] == "param").all()
    planted = compare_dumps(a, _train(tmp_path / "p", 0.05 * (1 + 1e-6), plant_at=1,
                                      params=params))
    failing = planted[planted["status"].isin(FAILING) & (planted["kind"] != "param")]
    assert failing[["module", "kind"]].values.tolist()[0] == ["mid", "output"]


def _as_version(directory, version: int) -> None:
    """Rewrite every step file of ``directory`` as format ``version`` wrote it: without the
    index columns added since (sketches in 2, checksums in 4, micro_batch in 5), and before
    version 4 without the root attributes ``index_crc32`` and ``incomplete``."""
    for path in directory.glob("*.hdf5"):
        with h5py.File(path, "r+") as f:
            group = f[f"{f.attrs['epoch']}-epoch_{f.attrs['step']}-step"]
            table = group[fmt.INDEX_DATASET][()]
            names = [n for n in table.dtype.names if fmt.COLUMN_SINCE.get(n, 1) <= version]
            old = np.empty(len(table), dtype=[(n, table.dtype[n]) for n in names])
            for n in names:
                old[n] = table[n]
            del group[fmt.INDEX_DATASET]
            group[fmt.INDEX_DATASET] = old
            f.attrs[fmt.ATTR_FORMAT_VERSION] = version
            if version < 4:
                del f.attrs[fmt.ATTR_INDEX_CRC]
                del f.attrs[fmt.ATTR_INCOMPLETE]
            else:
                f.attrs[fmt.ATTR_INDEX_CRC] = zlib.crc32(old.tobytes())


def test_version_1_dumps_are_read_and_their_weights_not_overtrusted(tmp_path):
    """Format version 1 has no sketches: weights known by five statistics cannot say how much
    they differ, so what they feed is not blamed on them (inherited), and the dump reads."""
    a = _train(tmp_path / "a", 0.05)
    b = _train(tmp_path / "b", 0.05 * 1.01)
    _as_version(a, 1)
    _as_version(b, 1)
    result = compare_dumps(a, b)
    assert result["sketched"].fillna(0).eq(0).all()
    assert (result[result["status"].isin(FAILING)]["kind"] == "param").all()  # see above
    assert (result[result["kind"] != "param"]["status"] != "DIFF").all()


def test_version_11_dumps_have_8_sketch_sums_and_their_weights_count_more(tmp_path):
    """A file of format versions 2 to 11 has 8 sketch sums, today's 32 (the first 8 the same):
    weights of such a file against a new one are estimated from 8 sums (``sketched`` 8), which
    can fall short of the truth by ``sketch_bound(8)``, and count that much more; both figures
    are within their bounds of the drift the weights' values give, and nothing they feed fails."""
    a = _train(tmp_path / "a", 0.05, params=True)
    truth = compare_dumps(a, _train(tmp_path / "t", 0.05 * 1.01, params=True))
    b = _train(tmp_path / "b", 0.05 * 1.01)
    new = compare_dumps(a, b)
    _as_version(b, 11)
    old = compare_dumps(a, b)
    key = ["module", "path"]
    drift = truth[truth["kind"] == "param"].set_index(key)["rel_l2_err"]
    for result, sums in ((new, SKETCH_SIZE), (old, 8)):
        params = result[result["kind"] == "param"].set_index(key)
        assert (params["sketched"] == sums).all()
        ratio = params["rel_err_from_stats"] / drift.loc[params.index]
        assert ((1 / sketch_bound(sums) < ratio) & (ratio < sketch_bound(sums))).all(), ratio
        assert not result[result["kind"] != "param"]["status"].isin(FAILING).any()
    # both known by their statistics: the sums both have
    both_old = compare_dumps(_train(tmp_path / "s", 0.05), b)
    assert (both_old.loc[both_old["kind"] == "param", "sketched"] == 8).all()
    run = CliRunner().invoke(main, [str(a), str(b)])  # one precision: weights must be equal
    assert run.exit_code == 1 and "first at step 0:1 forward in inp (param[0])" in run.output


def test_version_4_dumps_are_read_without_micro_batches(tmp_path):
    a = _train(tmp_path / "a", 0.05)
    b = _train(tmp_path / "b", 0.05)
    _as_version(a, 4)
    assert (load_dump(a).index["micro_batch"] == fmt.NO_MICRO_BATCH).all()
    assert (load_dump(b).index["micro_batch"] >= 0).any()
    result = compare_dumps(a, b)
    assert (result["status"] == "equal").all()
    assert CliRunner().invoke(main, [str(a), str(b)]).exit_code == 0


def test_version_7_dumps_are_read_as_not_sharded(tmp_path):
    a = _train(tmp_path / "a", 0.05)
    b = _train(tmp_path / "b", 0.05)
    _as_version(a, 7)
    index = load_dump(a).index
    assert (index["placements"] == "").all() and set(index["offsets"]) == {()}
    assert set(load_dump(b).index.columns) == set(index.columns)
    assert (compare_dumps(a, b)["status"] == "equal").all()


class OddNames(torch.nn.Module):
    """Module names with spaces, slashes, colons and non-ASCII letters."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleDict({"enc/0: proj": torch.nn.Linear(6, 16),
                                           "dé cod": torch.nn.Linear(16, 3)})

    def forward(self, x):
        return self.blocks["dé cod"](torch.tanh(self.blocks["enc/0: proj"](x)))


@pytest.mark.parametrize("make, wrong", [(Planted, "mid"), (OddNames, "blocks.dé cod")])
def test_wrong_weights_in_a_same_precision_pair_are_a_divergence(tmp_path, make, wrong):
    """B starts from A's weights but one layer's are 1 % off (a checkpoint-conversion bug),
    both float32 on the same kernels: exit 1, the parameter named."""
    x = torch.randn(8, 6)

    def run(name, scale):
        torch.manual_seed(0)
        model = make()
        with torch.no_grad():
            model.get_submodule(wrong).weight.mul_(scale)
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            model(x).pow(2).mean().backward()
        return str(tmp_path / name)

    a, b = run("a", 1.0), run("b", 1.01)
    first = summarize(compare_dumps(a, b)).first
    assert (first.row["module"], first.row["kind"], first.row["path"]) == (wrong, "param", "weight")
    result = CliRunner().invoke(main, [a, b])
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"B diverges from A: first at step 0:0 forward in {wrong} "
                                    f"(param[0])")
    assert ("where both runs compute bit-identically: the runs did not start from the same "
            "weights, or diverged at an earlier step") in result.output
    assert "this module's weights differ before the step" in result.output


@pytest.mark.parametrize("arch, precision, wrong", [
    ("bert", "bfloat16", "bert.encoder.layer.1.intermediate.dense"),
    ("gpt2", "float16", "transformer.h.0.attn.c_proj")])
def test_wrong_weights_at_the_first_step_are_a_divergence_across_precisions(
        tmp_path, arch, precision, wrong):
    """Mixed precision, first step: nothing before it can have moved B's (float32 master)
    weights from A's, so one layer's weights 1 % off are the first divergence (a trial on
    five architectures found them all reported as drift, exit 0); the healthy pair passes."""
    pytest.importorskip("transformers")
    from architectures import build, precision_context, ARCHITECTURES

    def run(name, at, scale=1.0):
        model, batch = build(arch, at)
        with torch.no_grad():
            model.get_submodule(wrong).weight.mul_(scale)
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            with precision_context(at):
                loss = ARCHITECTURES[arch].loss(model, batch)
            loss.backward()
        return str(tmp_path / name)

    a = run("a", "float32")
    healthy = CliRunner().invoke(main, [a, run("b", precision)])
    assert healthy.exit_code == 0, healthy.output
    wrong_run = CliRunner().invoke(main, [a, run("c", precision, 1.01)])
    assert wrong_run.exit_code == 1, wrong_run.output
    assert wrong_run.output.startswith(f"B diverges from A: first at step 0:0 forward in {wrong} "
                                       f"(param[0])"), wrong_run.output
    assert "at the first step, more than a cast between the runs' dtypes" in wrong_run.output


class TableUser(torch.nn.Module):
    def forward(self, x, table):
        return x @ table.T


class HandsOnATable(torch.nn.Module):
    """Its code hands a parameter to a call, as DeBERTa hands its relative position
    embeddings to every layer (the Embedding that holds it is never called)."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(4, 6)
        self.consumer = TableUser()

    def forward(self, x):
        return self.consumer(x, self.table.weight)


def _hands_on(directory, scale: float, **options) -> str:
    torch.manual_seed(0)
    model = HandsOnATable()
    with torch.no_grad():
        model.table.weight.mul_(scale)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    with HookerAndDumper(directory, **options).hooks(model, 0, 0):
        model(x).pow(2).mean().backward()
    return str(directory)


def test_a_parameter_handed_on_as_an_input_is_judged_as_a_weight(tmp_path):
    """An input that is a parameter of the model (its ``producer`` says so) differs because
    the weights do: at the first step of a same-precision pair, 1 % off is a divergence
    named as wrong weights, not error made by the code before the call; a re-run on A's
    values must replace it to give local errors."""
    a, b = _hands_on(tmp_path / "a", 1.0), _hands_on(tmp_path / "b", 1.01)
    index = load_dump(a).index
    table = index[(index["module"] == "consumer") & (index["kind"] == "input")]
    assert table["producer"].tolist() == [fmt.NO_PRODUCER, fmt.PRODUCER_PARAMETER]
    first = summarize(compare_dumps(a, b)).first
    assert (first.row["module"], first.row["kind"], first.row["index"]) == ("consumer", "input", 1)
    result = CliRunner().invoke(main, [a, b])
    assert result.exit_code == 1, result.output
    assert ("where both runs compute bit-identically: the runs did not start from the same "
            "weights, or diverged at an earlier step") in result.output
    assert "a parameter of the model handed to this call differs before the step" in result.output
    assert "arose outside any hooked submodule" not in result.output
    assert first.verdict == st.WEIGHTS and first.row["source"] == ""
    no_inputs = _hands_on(tmp_path / "c", 1.01, inject=Injector(a, kinds=["grad_output"]))
    with pytest.raises(DumpError, match="did not inject that input"):
        localize(a, b, no_inputs)
    with pytest.warns(RuntimeWarning, match="holds no parameter values"):  # (none it needs)
        rerun = _hands_on(tmp_path / "d", 1.01, inject=a)
    assert not localize(a, b, rerun)["verdict"].eq(st.ORIGIN).any()  # accepted, no origin


def test_a_parameter_handed_on_drifts_as_weights_do_at_a_later_step(tmp_path):
    """DeBERTa-v2 hands its relative position embeddings (a parameter) to every layer: after
    three AdamW steps in float16 autocast against float32 they differ by 3 %, as the other
    weights do. That was the first divergence of a healthy pair ('64x the float16
    rounding'), and the origin of the re-run on A's values; now it is weights drifted."""
    pytest.importorskip("transformers")
    from architectures import run_step
    for name, precision in (("a", "float32"), ("b", "float16")):
        run_step("deberta_v2", precision, tmp_path / name, seed=1, steps=4, optimizer="adamw",
                 dropout=False, dumper_options={"params": True})
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    handed = result[(result["kind"] == "input") & (result["producer"] == fmt.PRODUCER_PARAMETER)]
    assert "deberta.encoder.layer.0" in set(handed["module"])
    assert (handed["status"] == "inherited").all()
    assert handed["reason"].str.startswith(("weights differ by", "the same values as")).all()
    assert not result["status"].isin(FAILING).any(), summarize(result).verdict()


def test_runs_on_other_numbers_of_processes_are_not_expected_bit_identical():
    """Collectives add up in another order over another number of processes: the world size
    is one of the attributes that decide whether two runs compute bit-identically."""
    attrs = {"torch_version": "2.13.0", "device": "cpu", "tf32_matmul": False,
             "tf32_cudnn": False, "float32_matmul_precision": "highest", "world_size": 1}
    assert fmt.same_kernels(attrs, dict(attrs))
    assert not fmt.same_kernels(attrs, {**attrs, "world_size": 2})


def test_a_small_parameter_beside_a_large_output_gets_no_summation_allowance(tmp_path):
    """A scalar gate scaling an 8-element output, its module also returning an unrelated
    8x4096 one: its gradient sums 8 terms, not 32776; float64 against float32, a 2e-5 error
    in it is found (a review found it hidden by a floor counted from every output)."""
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.g = torch.nn.Parameter(torch.tensor(0.7))

        def forward(self, h, x):
            return self.g * h.sum(-1), x * 2

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2, self.gate = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), Gate()

        def forward(self, x, big):
            small, bigger = self.gate(self.l2(torch.tanh(self.l1(x))), big)
            return small.sum() + bigger.pow(2).mean()

    def run(name, dtype, plant=1.0):
        torch.manual_seed(0)
        model = Net().to(dtype)
        if plant != 1.0:
            model.gate.g.register_hook(lambda g: g * plant)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(8, 16, generator=gen).to(dtype)
        big = torch.randn(8, 4096, generator=gen).to(dtype).requires_grad_()
        with HookerAndDumper(tmp_path / name, params=True).hooks(model, 0, 0):
            model(x, big).backward()
        return str(tmp_path / name)

    a = run("a", torch.float64)
    assert CliRunner().invoke(main, [a, run("b", torch.float32)]).exit_code == 0
    result = CliRunner().invoke(main, [a, run("c", torch.float32, 1 + 2e-5)])
    assert result.exit_code == 1, result.output
    assert result.stdout.startswith("B diverges from A: first at step 0:0 backward in gate "
                                    "(param_grad[0])"), result.output


class _Classifier(torch.nn.Module):
    """Token ids -> Embedding -> Linear -> tanh -> a vocabulary head; returns the mean
    cross-entropy (times ``plant``) beside the logits, as a Hugging Face model given labels;
    with ``criterion``, computed by a ``CrossEntropyLoss`` module."""

    def __init__(self, plant: float = 1.0, criterion: bool = False):
        super().__init__()
        self.emb = torch.nn.Embedding(96, 32)
        self.body = torch.nn.Linear(32, 32)
        self.lm_head = torch.nn.Linear(32, 96)
        self.criterion = torch.nn.CrossEntropyLoss() if criterion else None
        self.plant = plant

    def forward(self, ids, labels):
        logits = self.lm_head(torch.tanh(self.body(self.emb(ids))))
        loss = (self.criterion or torch.nn.functional.cross_entropy)(logits.view(-1, 96),
                                                                       labels.view(-1))
        return {"loss": loss * self.plant, "logits": logits}


def _drifted_along_the_gradient(directory, dtype, drift: float, plant: float = 1.0,
                                criterion: bool = False):
    """A step-1 dump of ``_Classifier`` in ``dtype`` whose head's weight moved ``drift``
    times its float64 gradient (what training does), confident logits (rms ~5)."""
    torch.manual_seed(0)
    model = _Classifier(plant, criterion).to(dtype)
    gen = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, 96, (4, 6), generator=gen) for _ in range(2))
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    exact = _Classifier().double()
    exact.load_state_dict(model.state_dict())
    exact(ids, labels)["loss"].backward()
    with torch.no_grad():
        model.lm_head.weight.sub_((drift * exact.lm_head.weight.grad).to(dtype))
    dumper = HookerAndDumper(directory, steps=[1])
    with dumper.hooks(model, 0, 1):
        model(ids, labels)["loss"].backward()
    dumper.close()
    return directory


@pytest.mark.parametrize("criterion", [False, True], ids=["by-the-root", "by-a-module"])
def test_a_loss_moved_by_its_logits_drift_is_not_blamed_and_an_error_in_it_is_found(
        tmp_path, criterion):
    """Weights drift along the gradient, so the logits' error moves their cross-entropy more
    than its relative share: 2e-6 of logits moves the loss by 5e-6. The loss moves by at most
    twice the logits' largest error, and is not blamed for that (it was a false alarm), be it
    computed by the root's own code or by a ``CrossEntropyLoss``; a 1e-3 error in the loss
    itself is found."""
    a = _drifted_along_the_gradient(tmp_path / "a", torch.float64, 0.0, criterion=criterion)
    b = _drifted_along_the_gradient(tmp_path / "b", torch.float32, 1e-4, criterion=criterion)
    result = compare_dumps(a, b)
    loss, logits = (result[(result["module"] == "") & (result["path"] == f"output['{name}']")]
                    .iloc[0] for name in ("loss", "logits"))
    losses = result[(result["kind"] == "output") & (result["numel"] == 1)]
    assert len(losses) == 1 + criterion and (losses["status"] == st.INHERITED).all()
    assert loss["rel_error"] > 2 * logits["rel_error"]
    computed = losses.iloc[0]  # by the code that computes it (the root's is then the same)
    assert computed["input_rel_error"] >= 2 * logits["max_abs_err"] / loss["rms_a"]
    run = CliRunner().invoke(main, [str(a), str(b)])
    assert run.exit_code == 0 and "B agrees with A within float32 rounding" in run.output
    planted = _drifted_along_the_gradient(tmp_path / "p", torch.float32, 1e-4, plant=1.001,
                                          criterion=criterion)
    run = CliRunner().invoke(main, [str(a), str(planted)])
    assert run.exit_code == 1 and "first at step 0:1 forward in <root> (output[0])" in run.output


def test_tf32_flags_choose_no_kernel_on_the_cpu():
    """cuDNN's TF32 flag is on by default and only a CUDA run uses it: two CPU runs, one with
    it turned off, still compute bit-identically (a benchmark's reference ran with torch's
    default and its B with TF32 off, so a 1e-3 plant in a Whisper gradient after 3 AdamW
    steps hid in a calibrated level); two CUDA runs that differ in it do not."""
    cpu = {"torch_version": "2.13.0", "device": "cpu", "tf32_matmul": False,
           "tf32_cudnn": True, "float32_matmul_precision": "highest", "world_size": 1}
    assert fmt.same_kernels(cpu, {**cpu, "tf32_cudnn": False})
    assert fmt.same_kernels(cpu, {**cpu, "tf32_matmul": True})
    cuda = {**cpu, "device": "cuda:0", "deterministic_algorithms": True}
    assert fmt.same_kernels(cuda, {**cuda, "device": "cuda:1"})
    assert not fmt.same_kernels(cuda, {**cuda, "tf32_cudnn": False})
    assert not fmt.same_kernels(cuda, {**cuda, "tf32_matmul": True})

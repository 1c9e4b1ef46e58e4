"""The localizing re-run: ``HookerAndDumper(inject=A)`` runs every module on A's inputs,
weights and incoming gradients, records what arrived, and ``compare.localize`` names the
module (or the code between modules) that is wrong by itself, in every precision pair, forward
and backward in one re-run, at the first step and after optimizer steps."""
from __future__ import annotations

import warnings

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from compare import compare_dumps, format as fmt, load_dump, localize, origin_aliases, summarize
from compare.cli import main as h5cmp
from compare.errors import DumpError
from compare.status import ORIGIN
from compare.verdict import SPREAD
from dumper import HookerAndDumper, Injector, perturb

from architectures import run_step
from helpers import dump_embedded, read_tensors, require_runnable

pytest.importorskip("transformers")
warnings.filterwarnings("ignore", module="transformers")

# (A, B) precision pairs and the planted error's relative size
PAIRS = {
    "same": ("float32", "float32", 1e-3),
    "fp64": ("float64", "float32", 1e-3),
    "bf16": ("float32", "bfloat16", 0.1),
    "fp16": ("float32", "float16", 3e-2),
}
# per architecture: a module planted in forward (its output), one in backward (the gradient
# arriving at its output)
PLANTS = {
    "gpt2": ("transformer.h.0.mlp.c_proj", "transformer.h.1.attn.c_attn"),
    "resnet": ("layer2.0.bn1", "layer1.0.conv1"),
    "lstm": ("lstm", "embed"),
}


def _origins(table) -> set[tuple[str, str]]:
    """(module, kind) of each origin (an LSTM's three outputs are one)."""
    return {(m, k) for m, k in table[table["verdict"] == ORIGIN][["module", "kind"]].values}


# every precision pair at the first step and after 3 AdamW steps, each architecture at both
# and in two or three pairs (the full product, on 23 architectures and three seeds, is
# scripts/bench_localize.py's; an LSTM under float16 autocast does not run on most CPUs)
CASES = [("same", "gpt2", 1), ("same", "resnet", 4), ("fp64", "lstm", 1), ("fp64", "gpt2", 4),
         ("bf16", "resnet", 1), ("bf16", "lstm", 4), ("fp16", "gpt2", 1), ("fp16", "resnet", 4)]


@pytest.mark.slow
@pytest.mark.parametrize("pair, arch, steps", CASES,
                         ids=[f"{p}-{a}-{'first-step' if s == 1 else 'after-3-adamw-steps'}"
                              for p, a, s in CASES])
def test_a_localizing_rerun_names_the_planted_module(tmp_path, pair, arch, steps):
    prec_a, prec_b, size = PAIRS[pair]
    require_runnable(arch, prec_a, prec_b)
    common = dict(steps=steps, optimizer="adamw", plant_last_only=True)
    a = tmp_path / "a"
    run_step(arch, prec_a, a, dumper_options={"params": True}, **common)
    inject = {"inject": a}
    healthy = tmp_path / "healthy"
    run_step(arch, prec_b, healthy, dumper_options=inject, **common)
    assert _origins(localize(a, healthy, healthy)) == set()
    for module, where in zip(PLANTS[arch], ("output", "grad_output")):
        plant = {"include": [module], "where": where, "scale": 1 + size}
        free, injected = tmp_path / f"free-{where}", tmp_path / f"injected-{where}"
        run_step(arch, prec_b, free, plant=plant, **common)
        run_step(arch, prec_b, injected, plant=plant, dumper_options=inject, **common)
        table = localize(a, free, injected)
        # a forward plant (a hook scaling the output) scales the gradient the module sends
        # back as well: recomputed from its records, its backward is wrong too
        origins = _origins(table)
        assert (module, where) in origins and {m for m, _ in origins} == {module}, table[
            table["verdict"] == ORIGIN]


def test_attention_codes_gradients_are_calibrated_on_their_peers_in_a_rerun(tmp_path,
                                                                          one_thread):
    """Whisper (a held-out trial, seed 22, float64 against float32): the gradients its
    attention code sends its query, key and value projections are calibrated on each other.
    Counting every value that code multiplies as a factor of a product bounded nearly all of
    them, the query gradients were judged against too few others, and the healthy re-run on
    A's values named two of them origins (10x and 8x)."""
    a, free, injected = tmp_path / "a", tmp_path / "free", tmp_path / "injected"
    run_step("whisper", "float64", a, dumper_options={"params": True}, seed=22)
    run_step("whisper", "float32", free, seed=22)
    run_step("whisper", "float32", injected, dumper_options={"inject": a}, seed=22)
    assert _origins(localize(a, free, injected)) == set()


def test_injecting_a_run_into_its_own_configuration_reproduces_it(tmp_path):
    """A run fed its own reference values, weights included, computes every record of the
    reference bit for bit; what arrived is flagged injected. The gradients of a dropout(p=0),
    which returns its (injected) input as it is, are not recorded: the reference's record of
    that tensor sums uses the re-run's cannot see."""
    run_step("gpt2", "float32", tmp_path / "a", dumper_options={"params": True})
    run_step("gpt2", "float32", tmp_path / "b", dumper_options={"inject": tmp_path / "a",
                                                              "params": True})
    a, b = read_tensors(tmp_path / "a"), read_tensors(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in b)
    unrecorded = a.keys() - b.keys()
    assert not b.keys() - a.keys() and unrecorded
    assert {k[2] for k in unrecorded} == {"grad_input", "grad_output"}
    dropouts = ("drop", "attn_dropout", "resid_dropout", "dropout")
    assert {k[0] for k in unrecorded if k[2] == "grad_input"} == {
        m for m, *_ in unrecorded if m.rsplit(".", 1)[-1] in dropouts}
    index = load_dump(tmp_path / "b").index
    assert set(index[index["injected"] == 1]["kind"]) == {"input", "param", "grad_output"}
    step = load_dump(tmp_path / "b").steps[0]
    assert step.injected_from == f"{tmp_path / 'a'} (input, grad_output, param)"
    assert step.attrs["format_version"] == fmt.FORMAT_VERSION


def test_wrong_weights_are_replaced_and_put_back(tmp_path):
    """B's weights differ (a checkpoint-conversion bug): injected, B computes A's values from
    A's weights; its own parameters are the same objects with the same values afterwards, and
    their gradients still accumulate."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LSTM(16, 16, batch_first=True))
    x = torch.randn(2, 5, 8)

    def step(directory, **options):
        with HookerAndDumper(directory, params=True, **options).hooks(model, 0, 0):
            model(x)[0].sum().backward()

    step(tmp_path / "a")
    params = [p for p in model.parameters()]
    with torch.no_grad():
        model[0].weight.mul_(1.01)
        model[1].weight_hh_l0.mul_(1.01)
    before = [p.detach().clone() for p in params]
    model.zero_grad()
    step(tmp_path / "b", inject=tmp_path / "a")
    assert list(model.parameters()) == params and all(p.grad is not None for p in params)
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    a, b = read_tensors(tmp_path / "a"), read_tensors(tmp_path / "b")
    assert torch.equal(a[("1", 0, "output", 0)], b[("1", 0, "output", 0)])  # the LSTM too
    assert not torch.equal(a[("0", 0, "param", 0)], b[("0", 0, "param", 0)])  # what arrived


def test_parameters_are_put_back_when_the_forward_raises(tmp_path):
    class Fails(nn.Linear):
        def forward(self, x):
            super().forward(x)
            raise RuntimeError("boom")

    x = torch.randn(2, 4)
    reference = nn.Linear(4, 4)
    with HookerAndDumper(tmp_path / "a", params=True).hooks(reference, 0, 0):
        reference(x)
    model = Fails(4, 4)
    weight = model.weight
    with pytest.raises(RuntimeError, match="boom"):
        with HookerAndDumper(tmp_path / "b", inject=tmp_path / "a").hooks(model, 0, 0):
            model(x)
    assert model.weight is weight and model._parameters["weight"] is weight


def test_a_reference_without_weights_is_injected_without_them(tmp_path):
    run_step("mlp", "float32", tmp_path / "a")  # parameter statistics only
    with pytest.warns(RuntimeWarning, match="holds no parameter values in step 0:0 "
                                            r"\(dump it with params=True\)"):
        run_step("mlp", "float32", tmp_path / "b", dumper_options={"inject": tmp_path / "a"})
    index = load_dump(tmp_path / "b").index
    assert set(index[index["injected"] == 1]["kind"]) == {"input", "grad_output"}


def test_a_rerun_that_cannot_localize_is_refused_before_any_report(tmp_path):
    """What is passed as the re-run must be one that gives local errors: a re-run of B on A's
    values, with A's weights where the weights have drifted. Anything else used to read as
    "0 origin", exit 0: a false all-clear. Each is refused (exit 2) before any report."""
    later = dict(steps=2, optimizer="adamw", plant_last_only=True)
    plant = {"include": ["1.down"], "where": "output", "scale": 1.05}
    run_step("mlp", "float32", tmp_path / "a", dumper_options={"params": True}, **later)
    run_step("mlp", "float32", tmp_path / "a_stats", **later)  # no weight values
    run_step("mlp", "bfloat16", tmp_path / "b", plant=plant, **later)
    run_step("mlp", "bfloat16", tmp_path / "c", plant=plant,
             dumper_options={"inject": tmp_path / "a"}, **later)
    with pytest.warns(RuntimeWarning, match="holds no parameter values"):
        run_step("mlp", "bfloat16", tmp_path / "c_stats", plant=plant,
                 dumper_options={"inject": tmp_path / "a_stats"}, **later)
    run_step("resnet", "float32", tmp_path / "other_model")
    refused = {  # (A, re-run) -> what the error says
        ("a", "b"): "no module call in it ran on A's",
        ("a", "c_stats"): r"a re-run on the values of .*a_stats, not of A",
        ("a_stats", "c_stats"): r"its modules ran on their own weights, which differ from A's "
                                r"at step 0:1 .* holds no values of them there",
        ("a", "other_model"): "the dumps record different models",
    }
    for (a, rerun), message in refused.items():
        with pytest.raises(DumpError, match=message):
            localize(tmp_path / a, tmp_path / "b", tmp_path / rerun)
        out = CliRunner().invoke(h5cmp, [str(tmp_path / a), str(tmp_path / "b"),
                                         "--injected", str(tmp_path / rerun)])
        assert out.exit_code == 2, out.output
        assert "tensor pairs" not in out.output and "Traceback" not in out.output
    out = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b"),
                                     "--injected", str(tmp_path / "c")])
    assert out.exit_code == 1 and "origin: step 0:1 forward 1.down" in out.output, out.output


def test_a_rerun_on_as_weights_is_accepted_however_a_is_named_or_recorded(tmp_path, monkeypatch):
    """What the refusals must not catch: A named as ``.`` or through a link (by the comparison
    or by the re-run, compared from another directory); A recording fewer
    modules than the re-run (``include=``); a bfloat16 model at the first step, whose weights
    are A's cast to bfloat16 (what injecting them would give) though A holds no values."""
    dump_embedded(tmp_path / "a", torch.float32, step=0, params=True, include=["lin1"])
    (tmp_path / "latest").symlink_to(tmp_path / "a")
    dump_embedded(tmp_path / "b", torch.float32, step=0, plant=1.01)
    dump_embedded(tmp_path / "c", torch.float32, step=0, plant=1.01, inject=tmp_path / "latest")
    monkeypatch.chdir(tmp_path / "a")
    dump_embedded(tmp_path / "c_dot", torch.float32, step=0, plant=1.01, inject=".")
    for ref in (tmp_path / "a", tmp_path / "latest", "."):
        origins = localize(ref, tmp_path / "b", tmp_path / "c")
        assert origins[origins["verdict"] == ORIGIN][["module", "kind"]].values.tolist() == [
            ["lin1", "input"]]
    monkeypatch.chdir(tmp_path)  # the re-run on "." is compared from elsewhere
    origins = localize(tmp_path / "a", tmp_path / "b", tmp_path / "c_dot")
    assert origins[origins["verdict"] == ORIGIN][["module", "kind"]].values.tolist() == [
        ["lin1", "input"]]
    dump_embedded(tmp_path / "a32", torch.float32, step=0)  # no weight values
    dump_embedded(tmp_path / "b16", torch.bfloat16, step=0)
    with pytest.warns(RuntimeWarning, match="holds no parameter values"):
        dump_embedded(tmp_path / "c16", torch.bfloat16, step=0, inject=tmp_path / "a32")
    assert (localize(tmp_path / "a32", tmp_path / "b16", tmp_path / "c16")["verdict"]
            != ORIGIN).all()


def test_an_injector_chooses_kinds_and_modules(tmp_path):
    run_step("mlp", "float32", tmp_path / "a", dumper_options={"params": True})
    injector = Injector(tmp_path / "a", kinds=["grad_output"], include=["1.*"])
    run_step("mlp", "float32", tmp_path / "b", dumper_options={"inject": injector})
    index = load_dump(tmp_path / "b").index
    injected = index[index["injected"] == 1]
    assert set(injected["kind"]) == {"grad_output"}
    # "1.*" matches the block itself by its key, 1.ResidualMLPBlock
    assert set(injected["module"]) == {"1", "1.norm", "1.up", "1.act", "1.down"}
    assert injector.injected == len(injected)


def test_the_cli_reports_origins_from_the_injected_rerun(tmp_path):
    """A bfloat16 backward error under a later step's drifted weights: the injected re-run names
    it; the exit status follows the re-run."""
    plant = {"include": ["transformer.h.1.mlp.c_fc"], "where": "grad_output", "scale": 1.1}
    common = dict(steps=3, optimizer="adamw", plant_last_only=True)
    run_step("gpt2", "float32", tmp_path / "a", dumper_options={"params": True}, **common)
    run_step("gpt2", "bfloat16", tmp_path / "b", plant=plant, **common)
    run_step("gpt2", "bfloat16", tmp_path / "c", plant=plant,
             dumper_options={"inject": tmp_path / "a"}, **common)
    out = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b"),
                                     "--injected", str(tmp_path / "c")])
    assert out.exit_code == 1, out.output
    assert ("origin: step 0:2 backward transformer.h.1.mlp.c_fc.Conv1D#0 grad_output[0] (as it "
            "arrived: sent back by the code after this module)") in out.output
    assert "to settle it" not in out.output  # the re-run is given: no advice to make one
    run_step("gpt2", "bfloat16", tmp_path / "healthy", dumper_options={"inject": tmp_path / "a"},
             **common)
    ok = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b"),
                                    "--injected", str(tmp_path / "healthy")])
    assert " 0 origin" in ok.output


def test_a_failed_swap_leaves_every_parameter_in_place(tmp_path):
    """The reference's bias has another shape: the injection fails with the reason, before
    any parameter of the module was swapped."""
    x = torch.randn(2, 4)
    reference = nn.Linear(4, 3)
    with HookerAndDumper(tmp_path / "r", params=True).hooks(reference, 0, 0):
        reference(x)
    model = nn.Linear(4, 3)
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match="reference shape"):
        with Injector(tmp_path / "r", kinds=["param"]).injecting(model, 0, 0):
            model.bias = nn.Parameter(torch.zeros(5))  # the run's bias now differs in shape
            model(x)
    assert model._parameters["weight"] is params["weight"]


def test_a_dumper_refuses_kinds_it_cannot_record_first(tmp_path):
    run_step("mlp", "float32", tmp_path / "a", dumper_options={"params": True})
    with pytest.raises(ValueError, match="is for Injector.register, without a dumper"):
        HookerAndDumper(tmp_path / "b", inject=Injector(tmp_path / "a", kinds=["output"]))


class MaskedScores(nn.Module):
    """Scores plus an additive mask filled, as Hugging Face models fill theirs, with the
    minimum of the dtype the model runs in."""

    def forward(self, scores, mask):
        return torch.softmax(scores + mask, dim=-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.attend = MaskedScores()

    def forward(self, x, mask):
        return self.attend(self.proj(x), mask)


class WithMask(nn.Module):
    """The mask is made once and handed down through a block, as in a decoder."""

    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        mask = torch.zeros(x.shape[0], 8, dtype=x.dtype).masked_fill(
            torch.ones(x.shape[0], 8, dtype=torch.bool).triu(1), torch.finfo(x.dtype).min)
        return self.block(x, mask)


def test_an_injected_value_beyond_the_runs_range_saturates(tmp_path):
    """float64's minimum, cast to float32, overflows to -inf: injected as is, the mask made
    the re-run differ from A in its NaN/Inf pattern and the masked module a false origin (a
    Bloom attention in float64 against float32). Saturated at float32's minimum, the mask is
    what the run makes itself, and the healthy re-run names no origin."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))

    def run(name, dtype, **options):
        torch.manual_seed(0)
        model = WithMask().to(dtype)
        with HookerAndDumper(tmp_path / name, **options).hooks(model, 0, 0):
            model(x.to(dtype)).pow(2).sum().backward()
        return tmp_path / name

    a = run("a", torch.float64, params=True)
    injected = run("injected", torch.float32, inject=a)
    assert _origins(localize(a, run("free", torch.float32), injected)) == set()


class GroupedExperts(nn.Module):
    """Rows grouped by expert before the activation and put back after it, in an order that
    depends on how the run sorts (``order``): as Hugging Face's grouped-matmul experts do with
    an unstable sort, whose order among rows of one expert differs between CPU and CUDA."""

    def __init__(self, order: int):
        super().__init__()
        self.order = order
        self.up = nn.Linear(8, 16)
        self.act_fn = nn.SiLU()
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        h = self.up(x)
        perm = torch.randperm(len(h), generator=torch.Generator().manual_seed(self.order))
        grouped = self.act_fn(h[perm])
        return self.down(torch.empty_like(grouped).index_copy(0, perm, grouped))


def _grouped_run(directory, order, plant=None, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), GroupedExperts(order), nn.Linear(8, 2))
    x = torch.randn(24, 8)
    planted = perturb(model, ["1.down"], scale=1 + plant) if plant is not None else None
    d = HookerAndDumper(directory, **options)
    with d.hooks(model, 0, 0):
        model(x).pow(2).mean().backward()
    d.close()
    if planted is not None:
        planted.remove()
    return directory


def test_rows_in_another_order_are_no_divergence_and_are_not_injected(tmp_path):
    """B's code orders rows otherwise (another sort order): its records inside hold A's
    rows in another order. Two dumps judge them with the rows paired and say so; a localizing re-run
    does not inject A's values there (they would land in the wrong rows) and finds no origin;
    a real error after the reordering is still found by both."""
    a = _grouped_run(tmp_path / "a", order=1, params=True)
    b = _grouped_run(tmp_path / "b", order=2)
    result = compare_dumps(a, b)
    act = result[(result["module"] == "1.act_fn") & (result["kind"] == "input")].iloc[0]
    assert act["rel_l2_err"] > 1 and act["reordered_rel_err"] < 1e-6
    assert act["status"] == "close" and "in another order" in act["reason"]
    assert summarize(result).ok, summarize(result).verdict()
    with pytest.warns(RuntimeWarning, match="another order"):
        injected = _grouped_run(tmp_path / "b-inj", order=2, inject=a)
    index = load_dump(injected).index
    act_input = index[(index["module"] == "1.act_fn") & (index["kind"] == "input")]
    assert act_input["injected"].tolist() == [0]  # what arrived was kept, and says so
    table = localize(a, b, injected)
    assert (table["verdict"] != ORIGIN).all(), table[table["verdict"] == ORIGIN]
    planted = _grouped_run(tmp_path / "p", order=2, plant=1e-3)
    first = summarize(compare_dumps(a, planted)).first
    assert (first.row["module"], first.row["kind"]) == ("1.down", "output")
    with pytest.warns(RuntimeWarning, match="another order"):
        planted_inj = _grouped_run(tmp_path / "p-inj", order=2, plant=1e-3, inject=a)
    origins = localize(a, planted, planted_inj)
    assert origins[origins["verdict"] == ORIGIN]["module"].iloc[0] == "1.down"


def test_a_gradient_changed_between_modules_is_an_origin_under_the_rounding_of_its_consumer(
        tmp_path):
    """A 2 % change of the gradient between two bfloat16 Linears (the consumer's grad_input
    and the producer's grad_output, one tensor in A) is within what comparable records add
    in the re-run (bfloat16 backward rounding); what arrived at the producer is linked to what
    the consumer sent, which B computed, so the change is found exactly and named. Nothing is
    named in a healthy re-run."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16))

    def run(name, plant=False, **options):
        planted = perturb(model, "0", where="grad_output", scale=1.02) if plant else None
        with HookerAndDumper(tmp_path / name, **options).hooks(model, 0, 0):
            with torch.autocast("cpu", torch.bfloat16):
                out = model(x)
            out.float().pow(2).sum().backward()
        model.zero_grad()
        if planted is not None:
            planted.remove()
    with HookerAndDumper(tmp_path / "a", params=True).hooks(model, 0, 0):
        model(x).pow(2).sum().backward()
    model.zero_grad()
    run("b", plant=True)
    run("i", plant=True, inject=tmp_path / "a")
    run("h", inject=tmp_path / "a")
    table = localize(tmp_path / "a", tmp_path / "b", tmp_path / "i")
    origins = table[table["verdict"] == ORIGIN]
    assert origins[["module", "kind"]].values.tolist() == [["0", fmt.GRAD_OUTPUT]], origins
    assert origins.iloc[0]["local_added_ratio"] < SPREAD  # the error model alone passes it
    assert "B changed its values by" in origins.iloc[0]["local_reason"]
    healthy = localize(tmp_path / "a", tmp_path / "b", tmp_path / "h")
    assert (healthy["verdict"] != ORIGIN).all()


class _Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(64, 16)

    def forward(self, x):
        return self.inner(x)


def test_a_value_replaced_on_its_way_is_not_linked_to_what_was_sent(tmp_path):
    """A planted first Linear's output reaches the next one through an enclosing call whose
    input the bfloat16 re-run replaces with A's: the inner Linear gets A's value (rounded to
    bfloat16), so what arrived there is not what the planted Linear sent, and only that
    Linear is an origin."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), _Wrapped())
    with HookerAndDumper(tmp_path / "a", params=True).hooks(model, 0, 0):
        model(x).pow(2).sum().backward()
    model.zero_grad()
    planted = perturb(model, "0", scale=1.1)
    for name, options in (("b", {}), ("i", {"inject": tmp_path / "a"})):
        with HookerAndDumper(tmp_path / name, **options).hooks(model, 0, 0):
            with torch.autocast("cpu", torch.bfloat16):
                out = model(x)
            out.float().pow(2).sum().backward()
        model.zero_grad()
    planted.remove()
    table = localize(tmp_path / "a", tmp_path / "b", tmp_path / "i")
    origins = table[table["verdict"] == ORIGIN]
    assert origins[["module", "kind"]].values.tolist() == [["0", fmt.OUTPUT]], origins


class _Casts(nn.Module):
    """A Mamba mixer's casts: its input to its own dtype (``x`` itself, which records nothing,
    but of a re-run's injected copy, a copy: an op of the re-run alone), then its table's."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.table = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=dtype))

    def forward(self, x):
        return x.to(x.dtype) * self.table.to(torch.float16).to(x.dtype)


def test_an_op_of_a_rerun_takes_the_values_of_the_reference_op_it_is(tmp_path):
    """The re-run's first cast is its input's, which records nothing in the float64 reference
    (it returns the input), so the reference's ``to#0`` is the table's: paired by name and
    number, the re-run was given the table's (4,) values for its (2, 4) input and stopped.
    Paired by the shapes each op was given, the input's cast has no counterpart, gets no
    value and records nothing, as in the reference; the table's casts take the reference's
    values, and the re-run agrees with the reference."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, dtype=torch.float64)
    for name, dtype in (("a", torch.float64), ("b", torch.float32), ("c", torch.float32)):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(4, 4), _Casts(torch.float32)).to(dtype)
        options = {"ops": ["1"], "params": name == "a"}
        if name == "c":
            options["inject"] = tmp_path / "a"
        with HookerAndDumper(tmp_path / name, **options).hooks(model, 0, 0):
            model(x.to(dtype).requires_grad_()).pow(2).sum().backward()
    casts = {}
    for name in ("a", "c"):
        index = load_dump(tmp_path / name).index
        casts[name] = index[index["module"].str.startswith("1/to#")
                            & (index["kind"] == fmt.INPUT) & (index["index"] == 0)]
    assert list(zip(casts["c"]["module"], casts["c"]["shape"])) == list(zip(
        casts["a"]["module"], casts["a"]["shape"])) == [("1/to#0", (4,)), ("1/to#1", (4,))]
    assert casts["c"]["injected"].all()
    found = localize(tmp_path / "a", tmp_path / "b", tmp_path / "c")
    assert not (found["verdict"] == ORIGIN).any(), found[found["verdict"] == ORIGIN]


def test_an_injected_gradient_carries_its_casts_underflow(tmp_path, one_thread):
    """After 3 AdamW steps, ConvNeXt's float16 gradient arriving at a LayerNorm has rms 2e-7:
    A's value cast to float16 for the re-run rounds to subnormals, 8 % off, and the LayerNorm
    sends that back. Counted as one unit roundoff, it made the healthy re-run's LayerNorm an
    origin at 60x; at the cast's underflow, none, and a 3 % error in its output or in what it
    sends back is still its own."""
    require_runnable("convnext", "float16")
    module = "convnext.encoder.stages.1.layers.0.layernorm"
    common = dict(seed=6, steps=4, optimizer="adamw", plant_last_only=True)
    a = tmp_path / "a"
    run_step("convnext", "float32", a, dumper_options={"params": True}, **common)
    inject = {"inject": a}
    healthy, healthy_rerun = tmp_path / "healthy", tmp_path / "healthy-rerun"
    run_step("convnext", "float16", healthy, **common)
    run_step("convnext", "float16", healthy_rerun, dumper_options=inject, **common)
    table = localize(a, healthy, healthy_rerun)
    arriving = table[(table["module"] == module) & (table["kind"] == "grad_output")]
    assert len(arriving) and (arriving["local_rel_error"] > 0.05).all(), "no underflow"
    assert _origins(table) == set(), table[table["verdict"] == ORIGIN]
    for where in ("output", "grad_input"):
        plant = {"include": [module], "where": where, "scale": 1.03}
        free, rerun = tmp_path / f"free-{where}", tmp_path / f"rerun-{where}"
        run_step("convnext", "float16", free, plant=plant, **common)
        run_step("convnext", "float16", rerun, plant=plant, dumper_options=inject, **common)
        assert _origins(localize(a, free, rerun)) == {(module, where)}


def test_an_origin_names_the_later_records_of_its_tensor(tmp_path, one_thread):
    """Mamba's logits are its head's output: the gradient arriving at them is the model's
    grad_output and ``lm_head``'s at once, recorded in either order (float64 against float32
    at this seed: the model's first). An error planted there makes the first of them the
    first origin of the re-run; the table (``local_same_as``), :func:`compare.origin_aliases`
    and the CLI's text name the other as the same values."""
    require_runnable("mamba", "float32")
    common = dict(seed=11, steps=1)
    plant = {"plant": {"include": ["lm_head"], "where": "grad_output", "scale": 1 + 1e-3}}
    run_step("mamba", "float64", tmp_path / "a", dumper_options={"params": True}, **common)
    run_step("mamba", "float32", tmp_path / "b", **plant, **common)
    run_step("mamba", "float32", tmp_path / "c", **plant, **common,
             dumper_options={"inject": tmp_path / "a"})
    table = localize(tmp_path / "a", tmp_path / "b", tmp_path / "c")
    origins = table[table["verdict"] == ORIGIN]
    assert len(origins), "no origin"
    first = origins.iloc[0]
    later = origin_aliases(table, first)
    named = {(first["module"], first["kind"]),
             *later[["module", "kind"]].itertuples(index=False, name=None)}
    assert named == {("", "grad_output"), ("lm_head", "grad_output")}, (first, later)
    out = CliRunner().invoke(h5cmp, [str(tmp_path / "a"), str(tmp_path / "b"),
                                     "--injected", str(tmp_path / "c")])
    assert out.exit_code == 1, out.output
    origin_line = next(line for line in out.output.splitlines() if "origin: " in line)
    other = "lm_head.Linear#0" if first["module"] == "" else "MambaForCausalLM#0"
    assert f"(the same values as {other} grad_output[" in origin_line, out.output

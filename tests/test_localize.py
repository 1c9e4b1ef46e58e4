"""Finding the origin: module keys and shapes, reference injection, localization, perturbation,
dataflow, the call graph, and the pictures."""
from __future__ import annotations

import os
import shutil

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from compare import compare_dumps, load_dump, summarize
from compare.cli import main as h5cmp
from compare.dataflow import addend_edges, edges, to_dot
from compare.injection import localize
from compare.status import INHERITED, ORIGIN
from dumper import HookerAndDumper, Injector, io_shapes, module_keys, perturb

from helpers import Planted, plant_error, read_tensors
from zoo import OuterResidual, SharedTwice


def test_module_keys_in_definition_order_with_shared_modules_once():
    model = nn.Sequential(SharedTwice(), nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    assert module_keys(model) == ["Sequential", "0.SharedTwice", "0.shared.Linear",
                                  "0.out.Linear", "1.Sequential", "1.0.Linear", "1.1.ReLU"]
    with pytest.raises(TypeError, match="nn.Module"):
        module_keys(object())


def test_io_shapes_per_call_without_grad_or_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = SharedTwice()
    table = io_shapes(model, torch.randn(3, 8, requires_grad=True))
    shared = table[table["module"] == "shared"]
    assert shared["call_idx"].tolist() == [0, 0, 1, 1]
    assert shared["kind"].tolist() == ["input", "output", "input", "output"]
    assert set(shared["shape"]) == {(3, 8)} and set(table["dtype"]) == {"float32"}
    assert table[table["module"] == "out"]["shape"].tolist() == [(3, 8), (3, 2)]
    assert os.listdir(tmp_path) == [] and all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert "shared.Linear" in table.to_string()


class CheckpointedShared(nn.Module):
    """A module called twice per forward, once inside activation checkpointing (so called again
    in backward, which is no call of its own)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.shared, x, use_reentrant=False)
        return self.out(self.shared(torch.tanh(h)))


def _two_micro_batches(model, directory, batches, injector=None):
    if injector is not None:
        injector.register(model, 0, 0)
    with HookerAndDumper(directory).hooks(model, 0, 0):
        for batch in batches:
            model(batch).pow(2).mean().backward()
    if injector is not None:
        injector.remove()


def test_io_shapes_the_dump_and_injection_number_calls_alike(tmp_path):
    """The three hook installers share one call numbering: io_shapes' calls are the dump's, and
    an Injector replaces each call's output with the reference's of the same call, also after
    a backward pass that re-ran checkpointed calls (which are no calls of their own)."""
    torch.manual_seed(0)
    model = CheckpointedShared()
    batches = [torch.randn(3, 4) for _ in range(2)]
    table = io_shapes(model, batches[0])
    outputs = table[table["kind"] == "output"]
    assert list(zip(outputs["module"], outputs["call_idx"])) == [
        ("", 0), ("shared", 0), ("shared", 1), ("out", 0)]  # in the order the calls started
    _two_micro_batches(model, tmp_path / "ref", batches)
    reference = read_tensors(tmp_path / "ref")
    recorded = {(m, c) for m, c, kind, *_ in reference if kind == "output"}
    assert recorded == {("shared", c) for c in range(4)} | {("out", 0), ("out", 1), ("", 0), ("", 1)}
    wrong = CheckpointedShared()
    wrong.load_state_dict(model.state_dict())
    with torch.no_grad():
        wrong.shared.weight.mul_(1.1)
    injector = Injector(tmp_path / "ref", kinds="output", include="shared")
    _two_micro_batches(wrong, tmp_path / "fixed", batches, injector)
    assert injector.injected == 4
    fixed = read_tensors(tmp_path / "fixed")
    for call in range(2):
        key = ("out", call, "output", 0)
        assert torch.equal(fixed[key], reference[key]), key


def _run(directory, *, plant="", injector=None, dtype=torch.float32, batch=None):
    torch.manual_seed(0)
    model = Planted().to(dtype)
    if plant:
        plant_error(model, plant)
    dumper = HookerAndDumper(directory)
    x = (batch if batch is not None else torch.randn(8, 6)).to(dtype).requires_grad_()
    hooks_before = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    if injector is not None:
        injector.register(model, 0, 0)
    with dumper.hooks(model, 0, 0):
        model(x).float().pow(2).mean().backward()
    if injector is not None:
        injector.remove()
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] \
        == hooks_before
    return directory


def test_injected_inputs_are_the_reference_bit_for_bit_after_the_cast(tmp_path):
    batch = torch.randn(8, 6)
    ref = _run(tmp_path / "ref", batch=batch)
    injector = Injector(ref, kinds=["input"], include=["mid", "out"])
    _run(tmp_path / "bf16", injector=injector, dtype=torch.bfloat16, batch=batch)
    assert injector.injected == 2
    ref_t, got = read_tensors(ref), read_tensors(tmp_path / "bf16")
    for module in ("mid", "out"):
        injected = got[(module, 0, "input", 0)]
        assert injected.dtype == torch.bfloat16
        assert torch.equal(injected, ref_t[(module, 0, "input", 0)].to(torch.bfloat16))
    # a module not selected keeps its own (bf16-computed) input
    assert not torch.equal(got[("relu", 0, "input", 0)].float(), ref_t[("relu", 0, "input", 0)])


@pytest.mark.parametrize("where, kinds, origin_kind, inheritors", [
    ("forward", ["input"], "output", {"relu", "out", ""}),
    ("backward", ["grad_output"], "grad_input", {"act", "inp", ""}),
])
def test_injection_names_the_origin_and_the_inheritors(tmp_path, where, kinds, origin_kind,
                                                       inheritors):
    batch = torch.randn(8, 6)
    ref = _run(tmp_path / "ref", batch=batch)
    free = _run(tmp_path / "free", plant=where, batch=batch)
    injected = _run(tmp_path / "injected", plant=where, batch=batch,
                    injector=Injector(ref, kinds=kinds))
    table = localize(ref, free, injected)
    origins = table[table["verdict"] == ORIGIN]
    assert origins[["module", "kind"]].values.tolist() == [["mid", origin_kind]]
    inherited = table[(table["verdict"] == INHERITED) & (table["kind"] == origin_kind)]
    assert set(inherited["module"]) == inheritors
    cli = CliRunner().invoke(h5cmp, [str(ref), str(free), "--injected", str(injected)])
    assert cli.exit_code == 1
    assert f"origin: step 0:0 {where} mid.Linear#0 {origin_kind}[0]" in cli.output


def test_injection_errors_are_clear(tmp_path):
    ref = _run(tmp_path / "ref")
    with pytest.raises(ValueError, match="kinds must be"):
        Injector(ref, kinds=["param_grad"])
    with pytest.raises(KeyError, match="no step 0:5"):
        Injector(ref).register(Planted(), 0, 5)
    with pytest.raises(KeyError, match="no step 0:5"):
        HookerAndDumper(tmp_path / "b", inject=ref).register_hooks(Planted(), 0, 5)
    model = Planted()
    with Injector(ref).injecting(model, 0, 0):  # the reference's batch had 8 rows
        with pytest.raises(ValueError, match=r"reference shape \(8, 6\) != run shape \(3, 6\)"
                                             r"; the runs must have the same model and batch"):
            model(torch.randn(3, 6))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_perturbation_scales_outputs_and_gradients(tmp_path):
    torch.manual_seed(0)
    model = Planted()
    x = torch.randn(4, 6)
    clean = model(x).detach()
    mid = model.mid(model.act(model.inp(x))).detach()
    handle = perturb(model, "mid", scale=2.0)
    assert torch.allclose(model(x), model.out(model.relu(2 * mid)))
    handle.remove()
    assert torch.equal(model(x), clean)
    model(x).sum().backward()
    clean_grad = model.inp.weight.grad.clone()
    model.zero_grad()
    handle = perturb(model, ["act"], where="grad_output", scale=3.0)
    model(x).sum().backward()
    handle.remove()
    # the gradient reaching act's output is tripled, and so is everything upstream of it
    assert torch.allclose(model.inp.weight.grad, 3 * clean_grad)
    with pytest.raises(ValueError, match="no module matches"):
        perturb(model, "nothing*")
    noisy = perturb(model, "mid", noise=0.1, seed=1)
    assert not torch.equal(model(x), clean)
    noisy.remove()


def test_perturbation_of_what_a_module_sends_back(tmp_path):
    """``where="grad_input"``: the module's own backward is wrong. Its forward, its own weight
    gradient and the gradient arriving at it are untouched; what it sends back for its input,
    as the dump records it, and everything upstream, are scaled; removal leaves no trace."""
    torch.manual_seed(0)
    model, x = Planted(), torch.randn(4, 6)

    def run(name, **plant):
        model.zero_grad()
        handle = perturb(model, "mid", where="grad_input", **plant) if plant else None
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            out = model(x)
            out.sum().backward()
        if handle is not None:
            handle.remove()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, \
            read_tensors(tmp_path / name)

    out, grads, clean = run("clean")
    planted_out, planted_grads, planted = run("planted", scale=3.0)
    assert torch.equal(planted_out, out)
    assert "forward" not in vars(model.mid)
    for name in ("mid.weight", "mid.bias", "out.weight"):
        assert torch.equal(planted_grads[name], grads[name])
    assert torch.allclose(planted_grads["inp.weight"], 3 * grads["inp.weight"])
    key = ("mid", 0, "grad_input", 0)
    assert torch.equal(planted[("mid", 0, "grad_output", 0)], clean[("mid", 0, "grad_output", 0)])
    assert torch.allclose(planted[key], 3 * clean[key])
    assert torch.equal(planted[("act", 0, "grad_output", 0)], planted[key])  # handed on
    with pytest.raises(ValueError, match="where must be one of 'output', 'grad_output', "
                                         "'grad_input', got 'input'"):
        perturb(model, "mid", where="input")


def test_dataflow_edges_on_a_residual_network(tmp_path):
    model = OuterResidual()
    dumper = HookerAndDumper(tmp_path)
    with dumper.hooks(model, 0, 0):
        model(torch.randn(4, 16)).sum().backward()
    index = load_dump(tmp_path).index
    calls = index.drop_duplicates("call").set_index("call")["module"].to_dict()
    named = {(calls[e.producer], calls[e.call]) for e in edges(index).itertuples()}
    # h = inner(x) + x; h = blocks(h) + h: the sums are functional, so `blocks` input comes
    # from no module. In a block, y = lin(x); y += x; act_(y): act's input was modified by the
    # functional += after lin output it (no producer), and the block's output is act's
    # in-place result: the innermost call that output that value.
    assert named == {("blocks.0.act", "blocks.1"), ("blocks.0.act", "blocks.1.lin")}
    act_input = index[(index["kind"] == "input") & (index["module"] == "blocks.0.act")]
    assert act_input["producer"].tolist() == [-1]
    block_input = index[(index["kind"] == "input") & (index["module"] == "blocks.1")]
    assert calls[int(block_input["producer"].iloc[0])] == "blocks.0.act"
    # the sums, named where first consumed: inner's output into h (blocks' input); each
    # block's lin output and its input into act's; blocks' output and h into head's input. h,
    # a partial sum blocks consumed, is named as blocks' input: a walk stops there
    added = {(e.addend_kind, calls[e.addend], calls[e.call])
             for e in addend_edges(index).itertuples()}
    inner = calls[min(c for c, m in calls.items() if m.startswith("inner"))]
    assert added == {
        ("output", inner, "blocks"), ("output", "blocks.0.lin", "blocks.0.act"),
        ("input", "blocks", "blocks.0.act"), ("output", "blocks.1.lin", "blocks.1.act"),
        ("output", "blocks.0.act", "blocks.1.act"), ("output", "blocks.1.act", "head"),
        ("input", "blocks", "head")}
    dot = to_dot(load_dump(tmp_path))
    assert dot.startswith('digraph "0-epoch_0-step"') and "blocks.0.ResidualBlock#0" in dot
    assert dot.count("->") == len(edges(index)) + len(added)
    assert dot.count("style=dashed") == len(added)


def _changed_between_blocks(tmp_path) -> pd.DataFrame:
    """Compare result of two residual runs, the second with a functional change in the parent
    between blocks.0 and blocks.1."""
    torch.manual_seed(0)
    base = OuterResidual()
    for name, scale in (("a", 1.0), ("b", 1.001)):
        model = OuterResidual()
        model.load_state_dict(base.state_dict())
        if scale != 1.0:
            model.blocks[1].register_forward_pre_hook(lambda m, args: (args[0] * 1.001,))
        with HookerAndDumper(tmp_path / name).hooks(model, 0, 0):
            model(torch.ones(4, 16))
    return compare_dumps(tmp_path / "a", tmp_path / "b")


def test_first_divergence_names_the_producer_of_a_changed_input(tmp_path):
    first = summarize(_changed_between_blocks(tmp_path)).first
    text = first.describe()
    assert first.row["module"] == "blocks.1" and first.row["kind"] == "input"
    assert "came from blocks.0.act.ReLU (call" in text and "which matched" in text


def test_the_producer_is_looked_up_in_the_same_rank(tmp_path):
    """Two ranks in one result: the first divergence's producer is read from its own rank, not
    from another rank where that producer's output differs."""
    rank0 = _changed_between_blocks(tmp_path).assign(rank=0)
    rank1 = rank0.assign(rank=1, status=rank0["status"].where(rank0["kind"] != "output", "DIFF"))
    first = summarize(pd.concat([rank0, rank1], ignore_index=True)).first
    assert first.row["rank"] == 0 and first.row["module"] == "blocks.1"
    assert "which matched" in first.describe() and "step 0:0 rank 0" in first.describe()


def test_cli_pictures_graph_and_html_report(tmp_path):
    pytest.importorskip("matplotlib")
    ref = _run(tmp_path / "ref")
    free = _run(tmp_path / "free", plant="forward")
    heat, graph, page = tmp_path / "heat.png", tmp_path / "graph.dot", tmp_path / "report.html"
    result = CliRunner().invoke(h5cmp, [str(ref), str(free), "-q", "--heatmap", str(heat),
                                        "--dot", str(graph), "-o", str(page)])
    assert result.exit_code == 1, result.output
    assert heat.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mid.Linear#0" in graph.read_text() and "#f4a6a6" in graph.read_text()
    html = page.read_text()
    assert html.count("data:image/png;base64,") == 2 and "first divergence" in html
    if shutil.which("dot"):
        png = tmp_path / "graph.png"
        assert CliRunner().invoke(h5cmp, [str(ref), str(free), "-q", "--dot", str(png)]).exit_code == 1
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_tracks_one_tensor_over_steps(tmp_path):
    pytest.importorskip("matplotlib")
    from helpers import dump_run
    run = dump_run(tmp_path / "run", steps=3)
    target = tmp_path / "mid.png"
    result = CliRunner().invoke(h5cmp, [str(run), "--track", "mid:output:0", "--plot", str(target)])
    assert result.exit_code == 0, result.output
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = CliRunner().invoke(h5cmp, [str(run), "--track", "nothing:output:0", "--plot", str(target)])
    assert bad.exit_code == 2 and "no output[0] of module 'nothing'" in bad.output
    usage = CliRunner().invoke(h5cmp, [str(run), "--track", "mid"])
    assert usage.exit_code == 2 and "MODULE:KIND:INDEX" in usage.output


def test_injected_outputs_replace_a_wrong_module(tmp_path):
    """Injecting the reference output of the planted module repairs everything downstream."""
    batch = torch.randn(8, 6)
    ref = _run(tmp_path / "ref", batch=batch)
    injector = Injector(ref, kinds="output", include="mid")
    fixed = _run(tmp_path / "fixed", plant="forward", batch=batch, injector=injector)
    assert injector.injected == 1
    rec, ref_t = read_tensors(fixed), read_tensors(ref)
    assert torch.equal(rec[("mid", 0, "output", 0)], ref_t[("mid", 0, "output", 0)])
    result = compare_dumps(ref, fixed, kinds=["output"])
    downstream = result[result["module"].isin(["relu", "out", ""])]
    assert (downstream["status"] == "equal").all()


class HandsToChild(nn.Module):
    """A wrapper whose child gets its input tensor itself."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(16, 16)

    def forward(self, x):
        return self.child(x)


class WrappedAfterLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.wrap, self.out = nn.Linear(16, 16), HandsToChild(), nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.relu(self.wrap(self.first(x))))


def test_a_child_given_a_replaced_value_through_its_parent_is_no_origin(tmp_path):
    """An injector limited by ``include=`` to a parent replaces the parent's input; the child,
    which gets that tensor, is not injected, so its row is not marked replaced, yet it holds
    A's value: what B's ``first`` sent (3 % wrong, planted) did not arrive there, and the
    row is not linked to it, so the code between them is no origin."""
    batch = torch.randn(32, 16)

    def run(directory, dtype, inject=None):
        torch.manual_seed(0)
        model = WrappedAfterLinear().to(dtype)
        if dtype != torch.float32:
            model.first.register_forward_hook(lambda m, args, out: out * 1.03)
        with HookerAndDumper(directory, inject=inject).hooks(model, 0, 0):
            model(batch.to(dtype)).float().pow(2).mean().backward()
        return directory

    ref = run(tmp_path / "ref", torch.float32)
    free = run(tmp_path / "free", torch.bfloat16)
    rerun = run(tmp_path / "rerun", torch.bfloat16, Injector(ref, include=["wrap"]))
    rows = compare_dumps(ref, rerun).set_index(["module", "kind"])
    assert rows.loc[("wrap", "input"), "injected"] == 1
    assert rows.loc[("wrap.child", "input"), "injected"] == 0
    assert pd.isna(rows.loc[("wrap.child", "input"), "transit_rel_diff"])
    table = localize(ref, free, rerun)
    assert not table["module"][table["verdict"] == ORIGIN].str.startswith("wrap").any()


def test_perturbations_of_what_modules_send_back_undo_in_any_order():
    """Two such perturbations of one module multiply, each removal takes its own away
    whatever the order; a module that hands its input back gets it, not a copy (nothing of
    its own to perturb); ``forward`` keeps its signature."""
    import inspect
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(3, 3), nn.Identity()), torch.randn(2, 3)

    def gradient():
        leaf = x.clone().requires_grad_()
        model(leaf).sum().backward()
        return leaf.grad

    clean = gradient()
    signature = inspect.signature(model[0].forward)
    twice = perturb(model, "0", where="grad_input", scale=2.0)
    thrice = perturb(model, "0", where="grad_input", scale=3.0)
    assert inspect.signature(model[0].forward) == signature
    assert torch.allclose(gradient(), 6 * clean)
    twice.remove()
    assert torch.allclose(gradient(), 3 * clean)
    thrice.remove()
    assert torch.equal(gradient(), clean)
    handed = perturb(model, "1", where="grad_input", scale=5.0)
    h = model[0](x)
    assert model[1](h) is h
    handed.remove()


def test_addend_edges_are_typed_merge_keys_even_when_there_are_none(tmp_path):
    """A step without sums gives an empty frame whose keys keep their kinds, so the transit
    links merge it with rows whose call numbers are floats (pairs where a side lacks a record);
    an untyped empty frame made pandas refuse the merge (found by bench_localize)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    with HookerAndDumper(tmp_path).hooks(model, 0, 0):
        model(torch.randn(4, 8)).sum().backward()
    index = load_dump(tmp_path).index.astype({"call": "float64"})
    none = addend_edges(index)
    assert none.empty and none["call"].dtype == "float64"
    assert none["addend"].dtype == none["addend_index"].dtype == "int64"
    calls = index[["call"]].rename(columns={"call": "addend"})
    assert none.merge(calls, on="addend").empty


def test_a_perturbation_that_plants_nothing_says_so_and_no_glob_chooses_nothing(tmp_path):
    """A Llama's token embedding gets ids, no floating input: a perturbation of what it sends
    back plants nothing, and says so when removed; one of its output plants, silently. An
    empty ``include`` is refused (it used to choose every module)."""
    import warnings
    from architectures import ARCHITECTURES, build
    pytest.importorskip("transformers")
    model, batch = build("llama", "float32")
    for where, plants in (("grad_input", False), ("output", True)):
        planted = perturb(model, "model.embed_tokens", where=where, scale=1.5)
        ARCHITECTURES["llama"].loss(model, batch).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            planted.remove()
        said = [str(w.message) for w in caught if "planted nothing" in str(w.message)]
        assert (planted.planted > 0) == plants and bool(said) != plants, said
        assert all("model.embed_tokens" in text and where in text for text in said)
    for make in (lambda: perturb(model, []), lambda: HookerAndDumper(tmp_path, include=[]),
                 lambda: Injector(tmp_path, include=[])):
        with pytest.raises(ValueError, match=r"include=\[\] chooses no module"):
            make()

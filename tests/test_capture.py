"""What the dumper records: exact gradients, snapshots, structure, selection."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from compare import format as fmt
from compare.dump import load_dump
from dumper import HookerAndDumper

from helpers import read_tensors
from zoo import SharedTwice, UsesInputTwice, loss_of


class ResidualNoInplace(nn.Module):
    """Inputs consumed inside and outside modules; no in-place ops, so autograd.grad w.r.t. an
    output is a valid reference."""

    def __init__(self):
        super().__init__()
        self.inner = UsesInputTwice(16)
        self.blocks = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.inner(x) + x
        h = self.blocks(h) + h
        return self.head(h)


def _dump_one_step(model, batch, tmp_path, **kwargs):
    dumper = HookerAndDumper(tmp_path, **kwargs)
    dumper.register_hooks(model, 0, 0)
    out = model(batch)
    loss = loss_of(out)
    loss.backward()
    dumper.remove_hooks()
    return out, loss


@pytest.mark.parametrize("factory", [ResidualNoInplace, SharedTwice])
def test_gradients_match_autograd_references(factory, tmp_path):
    """grad_output against torch.autograd.grad of the loss; grad_input against the module's VJP."""
    model = factory()
    batch = torch.randn(6, 16 if factory is ResidualNoInplace else 8, requires_grad=True)
    outputs = {}  # (module, call_idx) -> output tensor, kept by the test's own forward hooks
    seen = {}
    handles = []
    for name, m in model.named_modules():
        def keep(mod, args, out, name=name):
            i = seen.get(name, 0)
            seen[name] = i + 1
            outputs[(name, i)] = out
        handles.append(m.register_forward_hook(keep))
    dumper = HookerAndDumper(tmp_path)
    dumper.register_hooks(model, 0, 0)
    loss = loss_of(model(batch))
    refs = torch.autograd.grad(loss, list(outputs.values()) + [batch])[:-1]
    dumper.remove_hooks()
    for h in handles:
        h.remove()
    ref_grad_out = dict(zip(outputs, refs))
    rec = read_tensors(tmp_path)
    modules = dict(model.named_modules())
    checked = 0
    for (name, call), grad_out in ref_grad_out.items():
        assert torch.equal(rec[(name, call, "grad_output", 0)], grad_out), (name, call)
        # VJP of the module alone, at the recorded input, with the reference grad_output
        x = rec[(name, call, "input", 0)].clone().requires_grad_()
        (ref_in,) = torch.autograd.grad(modules[name](x), x, grad_out)
        assert torch.equal(rec[(name, call, "grad_input", 0)], ref_in), (name, call)
        checked += 1
    assert checked == len(outputs) >= 4


def test_inplace_relu_does_not_alter_snapshots(tmp_path):
    torch.manual_seed(0)
    lin, relu = nn.Linear(4, 4), nn.ReLU(inplace=True)
    model = nn.Sequential(lin, relu)
    x = torch.randn(8, 4)
    expected_lin_out = lin(x).detach().clone()
    assert (expected_lin_out < 0).any()
    _dump_one_step(model, x, tmp_path)
    rec = read_tensors(tmp_path)
    assert torch.equal(rec[("0", 0, "output", 0)], expected_lin_out)        # before the ReLU
    assert torch.equal(rec[("1", 0, "input", 0)], expected_lin_out)         # pre-hook snapshot
    assert torch.equal(rec[("1", 0, "output", 0)], expected_lin_out.relu())
    # gradients: the linear output's gradient is taken before the in-place ReLU modified it
    g_relu_out = rec[("1", 0, "grad_output", 0)]
    assert torch.equal(rec[("0", 0, "grad_output", 0)], g_relu_out * (expected_lin_out > 0))
    assert torch.equal(rec[("1", 0, "grad_input", 0)], g_relu_out * (expected_lin_out > 0))


def test_repeated_backward_records_each_pass(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    dumper = HookerAndDumper(tmp_path)
    dumper.register_hooks(model, 0, 0)
    loss = loss_of(model(torch.randn(3, 4, requires_grad=True)))
    loss.backward(retain_graph=True)
    (loss * 2).backward()
    dumper.remove_hooks()
    rec = read_tensors(tmp_path)
    for kind in ("grad_output", "grad_input"):
        first = rec[("1", 0, kind, 0)]
        assert torch.equal(rec[("1", 0, kind, 0, 1)], first * 2)


def test_shared_module_calls_are_numbered_and_paired(tmp_path):
    model = SharedTwice()
    _dump_one_step(model, torch.randn(4, 8, requires_grad=True), tmp_path)
    index = load_dump(tmp_path).index
    shared = index[index["module"] == "shared"]
    assert sorted(shared["call_idx"].unique()) == [0, 1]
    for call_idx, rows in shared.groupby("call_idx"):
        weights = {"param"} if call_idx == 0 else set()  # statistics of the weights, once
        assert set(rows["kind"]) == {"input", "output", "grad_input", "grad_output"} | weights
        assert rows["group"].nunique() == 1
    # the second call's backward runs first
    back = shared[shared["kind"] == "grad_output"].sort_values("seq")
    assert back["call_idx"].tolist() == [1, 0]
    groups = shared.drop_duplicates("call")["group"].tolist()
    assert groups == ["0001_shared.Linear", "0002_shared.Linear"]


@pytest.mark.parametrize("include", [None, ["shared"]])
def test_micro_batches_are_numbered_whatever_is_selected(tmp_path, include):
    """Three forward/backward passes in one step (gradient accumulation): every record says its
    pass in ``micro_batch``, also for a module called twice per pass and when only it is
    selected (the root, not recorded, still opens the passes); parameter gradients, accumulated
    over the passes, say none."""
    model = SharedTwice()
    dumper = HookerAndDumper(tmp_path, include=include, params=True)
    dumper.register_hooks(model, 0, 0)
    for _ in range(3):
        loss_of(model(torch.randn(4, 8))).backward()
    dumper.remove_hooks()
    index = load_dump(tmp_path).index
    shared = index[(index["module"] == "shared") & (index["kind"] != "param_grad")]
    assert (shared["micro_batch"] == shared["call_idx"] // 2).all()  # two calls per pass
    assert sorted(shared["micro_batch"].unique()) == [0, 1, 2]
    assert set(shared["kind"]) >= {"input", "output", "grad_input", "grad_output"}
    assert (index[index["kind"] == "param_grad"]["micro_batch"] == fmt.NO_MICRO_BATCH).all()
    if include is None:
        root = index[(index["module"] == "") & (index["kind"] == "output")]
        assert root["micro_batch"].tolist() == root["call_idx"].tolist() == [0, 1, 2]


def test_micro_batches_survive_a_forward_that_raises(tmp_path):
    """A forward that raises (the loop skips it, no backward) leaves no call open for the
    counting: it belongs to the next micro-batch's work, and later ones are numbered on."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    dumper = HookerAndDumper(tmp_path)
    dumper.register_hooks(model, 0, 0)
    for i in range(4):
        x = torch.randn(4, 8 if i != 1 else 7)  # micro-batch 1: wrong width, forward raises
        try:
            model(x).square().sum().backward()
        except RuntimeError:
            continue
    with pytest.warns(RuntimeWarning, match="incomplete"):  # the failed calls never returned
        dumper.remove_hooks()
    out = load_dump(tmp_path).index.query("kind == 'output' and module == ''")
    assert out["micro_batch"].tolist() == [0, 1, 2], out


@pytest.mark.parametrize("reentrant", [False, True])
def test_micro_batches_under_activation_checkpointing(tmp_path, reentrant):
    """The recomputation in backward opens no micro-batch and takes no number."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(checkpoint(self.block, x, use_reentrant=reentrant))

    model = Checkpointed()
    dumper = HookerAndDumper(tmp_path)
    dumper.register_hooks(model, 0, 0)
    for _ in range(3):
        model(torch.randn(4, 8, requires_grad=True)).square().sum().backward()
    dumper.remove_hooks()
    index = load_dump(tmp_path).index
    forward = index[index["kind"].isin(["input", "output"])]
    assert (forward["micro_batch"] == forward["call_idx"]).all()
    assert sorted(index["micro_batch"].unique()) == [0, 1, 2]
    grads = index[index["kind"] == "grad_output"]
    assert (grads["micro_batch"] == grads["call_idx"]).all()


class ModelAndLoss(nn.Module):
    """Like a LightningModule: training code calls its model, then its loss module."""

    def __init__(self):
        super().__init__()
        self.model, self.criterion = nn.Linear(8, 2), nn.MSELoss()


def test_micro_batches_with_a_loss_module_called_after_the_model(tmp_path):
    holder = ModelAndLoss()
    dumper = HookerAndDumper(tmp_path)
    dumper.register_hooks(holder, 0, 0)
    for _ in range(2):
        holder.criterion(holder.model(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
    dumper.remove_hooks()
    out = load_dump(tmp_path).index.query("kind == 'output'")
    assert list(zip(out["module"], out["micro_batch"])) == [
        ("model", 0), ("criterion", 0), ("model", 1), ("criterion", 1)]


def test_structured_leaves_and_non_tensors_are_indexed(tmp_path):
    from zoo import StructuredModel
    _dump_one_step(StructuredModel(), torch.randn(4, 8), tmp_path)
    index = load_dump(tmp_path).index
    dt = index[(index["module"] == "dt") & (index["kind"] == "output")]
    assert dt["path"].tolist() == ["output['logits']", "output['aux'][0]", "output['aux'][1]",
                                   "output['aux'][2]", "output['pair'].left", "output['pair'].right"]
    assert dt["index"].tolist() == [0, 1, -1, -1, 2, -1]
    assert dt[dt["index"] == -1]["value"].tolist() == ["3", "None", "'tag'"]
    n = index[(index["module"] == "int") & (index["kind"] == "output")]
    assert n["dtype"].tolist() == ["int"] and n["value"].tolist() == ["4"]
    none_out = index[(index["module"] == "none") & (index["kind"] == "output")]
    assert none_out["value"].tolist() == ["None"]
    dc = index[(index["module"] == "dc") & (index["kind"] == "output")]
    assert dc["path"].tolist() == ["output.main", "output.extra['scale']", "output.extra['t']"]


def test_kwargs_are_captured(tmp_path):
    from zoo import KwargsModel
    _dump_one_step(KwargsModel(), torch.randn(4, 8, requires_grad=True), tmp_path)
    index = load_dump(tmp_path).index
    inner = index[(index["module"] == "inner") & (index["kind"].isin(["input", "grad_input"]))]
    assert set(inner["path"]) == {"kwargs['x']", "kwargs['scale']", "kwargs['mask']"}
    assert inner[inner["kind"] == "grad_input"]["path"].tolist() == ["kwargs['x']"]


def test_selection_filters_modules_and_kinds(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 1))
    _dump_one_step(model, torch.randn(3, 4), tmp_path / "a", include=["1*"], exclude=["*Tanh"],
                   kinds=["output", "grad_output"])
    index = load_dump(tmp_path / "a").index
    assert set(index["module"]) == {"1", "1.0"}
    assert set(index["kind"]) == {"output", "grad_output"}
    _dump_one_step(model, torch.randn(3, 4), tmp_path / "b", module_types=["Tanh", nn.Sequential])
    assert set(load_dump(tmp_path / "b").index["cls"]) == {"Tanh", "Sequential"}


def test_params_and_param_grads(tmp_path):
    model = nn.Sequential(nn.Linear(3, 2))
    weight_before = model[0].weight.detach().clone()
    _dump_one_step(model, torch.randn(5, 3), tmp_path, params=True)
    rec = read_tensors(tmp_path)
    assert torch.equal(rec[("0", 0, "param", 0)], weight_before)
    assert torch.equal(rec[("0", 0, "param_grad", 0)], model[0].weight.grad)
    assert torch.equal(rec[("0", 0, "param_grad", 1)], model[0].bias.grad)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_param_grads_are_those_the_optimizer_steps_with(tmp_path, set_to_none):
    """The README's loop (step, zero_grad, then remove_hooks): the gradients recorded are
    those the optimizer step began with (here clipped after backward), not the zeros or Nones
    the step ends with; a parameter no optimizer steps keeps its gradient as accumulated."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)  # model[2]: frozen by hand
    dumper = HookerAndDumper(tmp_path, params=True)
    dumper.register_hooks(model, 0, 0)
    model(torch.randn(5, 3)).pow(2).sum().backward()
    last = model[2].weight.grad.clone()
    torch.nn.utils.clip_grad_norm_(model[0].parameters(), 1e-3)
    stepped = [p.grad.clone() for p in model[0].parameters()]
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    dumper.remove_hooks()
    rec = read_tensors(tmp_path)
    assert torch.equal(rec[("0", 0, "param_grad", 0)], stepped[0]) and stepped[0].norm() < 1e-3
    assert torch.equal(rec[("0", 0, "param_grad", 1)], stepped[1])
    assert torch.equal(rec[("2", 0, "param_grad", 0)], last)


@pytest.mark.parametrize("device_path", [False, True])
def test_param_grads_are_those_the_step_ends_with(tmp_path, monkeypatch, device_path):
    """No optimizer step before remove_hooks: a gradient changed in place after its
    accumulation (clipped, as DDP's all-reduce averages it) is recorded as changed; one set
    to None as accumulated; the training's own values stay untouched. Also on the
    accelerator path (forced here: its per-step arenas, which the gradient taken again
    joins)."""
    if device_path:
        import dumper.record
        monkeypatch.setattr(dumper.record, "on_device", lambda t: True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    dumper = HookerAndDumper(tmp_path, params=True)
    with dumper.hooks(model, 0, 0):
        model(x).pow(2).sum().backward()
        accumulated = model[2].weight.grad.clone()
        unclipped = model[0].weight.grad.clone()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        clipped = [p.grad.clone() for p in model[0].parameters()]
        model[2].weight.grad = None
    rec = read_tensors(tmp_path)
    assert torch.equal(rec[("0", 0, "param_grad", 0)], clipped[0])
    assert torch.equal(rec[("0", 0, "param_grad", 1)], clipped[1])
    assert not torch.equal(clipped[0], unclipped) and clipped[0].norm() < 1e-3
    assert torch.equal(rec[("2", 0, "param_grad", 0)], accumulated)
    assert model[2].weight.grad is None and torch.equal(model[0].weight.grad, clipped[0])


def test_run_metadata(tmp_path):
    _dump_one_step(nn.Linear(2, 2), torch.randn(1, 2), tmp_path)
    step = load_dump(tmp_path).steps[0]
    assert step.attrs["format_version"] == fmt.FORMAT_VERSION
    assert step.attrs["torch_version"] == str(torch.__version__)
    assert step.attrs["device"] == "cpu" and step.attrs["default_dtype"] == "float32"
    assert {"tf32_matmul", "tf32_cudnn", "deterministic_algorithms"} <= set(step.attrs)
    import h5py  # the HDF5 types format.md names: str as variable-length UTF-8, int, bool
    with h5py.File(step.path) as f:
        string = h5py.check_string_dtype(f.attrs.get_id("torch_version").dtype)
        assert string.encoding == "utf-8" and string.length is None
        assert f.attrs.get_id("step").dtype.kind == "i"
        assert isinstance(f.attrs["tf32_matmul"], np.bool_)


def test_read_h5py_data_prints_tree(tmp_path, capsys):
    dumper = HookerAndDumper(tmp_path)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with dumper.hooks(model, 0, 0):
        model(torch.randn(3, 2)).sum().backward()
    dumper.read_h5py_data()
    text = capsys.readouterr().out
    assert "0-epoch_0-step_dump.hdf5" in text and "/0-epoch_0-step" in text
    assert "0001_0.Linear" in text and "0002_1.ReLU" in text
    assert "grad_input_0" in text and "float32" in text and "[3, 2]" in text


@pytest.mark.parametrize("context", [torch.inference_mode, torch.no_grad])
@pytest.mark.parametrize("mode", ["tensors", "stats"])
def test_inference_and_no_grad_steps_are_dumped(tmp_path, context, mode):
    """An evaluation pass under inference_mode (tensors without version counters) or no_grad:
    same output as without the dumper, values as they were at each call (in-place ReLU), no
    gradient rows. Under inference_mode producers are unknown (-1): in-place changes of
    inference tensors cannot be detected."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with context():
        expected = model(x)
        before_relu = model[0](x).clone()
        with HookerAndDumper(tmp_path, mode=mode).hooks(model, 0, 0):
            out = model(x)
    assert torch.equal(out, expected)
    index = load_dump(tmp_path).index
    assert set(index["kind"]) == {"input", "output", "param"}
    if mode == "tensors":
        assert torch.equal(read_tensors(tmp_path)[("0", 0, "output", 0)], before_relu)
    else:
        row = index[(index["module"] == "0") & (index["kind"] == "output")].iloc[0]
        assert row.stat_min == pytest.approx(before_relu.min().item())
    linear_input = index[(index["module"] == "2") & (index["kind"] == "input")]["producer"]
    relu_call = 2  # root 0, Linear 1, ReLU 2: the in-place ReLU made its current value
    assert list(linear_input) == ([-1] if context is torch.inference_mode else [relu_call])


@pytest.mark.slow  # torch._dynamo import and compilation: a few seconds
def test_compiled_model_is_dumped_when_run_eagerly(tmp_path):
    """A torch.compile wrapper is hooked through the module it holds, so names match an
    uncompiled run. Without force_eager only the model's boundary is recorded, and the user is
    told so; with it the dump is complete and equal to an eager run's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(3, 4)
    compiled(x)  # compile outside the window, as in a training loop
    with pytest.warns(RuntimeWarning, match="<root> runs as compiled code"):
        with HookerAndDumper(tmp_path / "compiled").hooks(compiled, 0, 0):
            compiled(x).sum().backward()
    assert set(load_dump(tmp_path / "compiled").index["module"]) == {""}
    with torch.compiler.set_stance("force_eager"):
        with HookerAndDumper(tmp_path / "forced").hooks(compiled, 0, 0):
            compiled(x).sum().backward()
    with HookerAndDumper(tmp_path / "eager").hooks(model, 0, 0):
        model(x).sum().backward()
    forced, eager = load_dump(tmp_path / "forced").index, load_dump(tmp_path / "eager").index
    assert list(forced["module"]) == list(eager["module"]) and len(forced) > 10
    from compare import compare_dumps
    assert (compare_dumps(tmp_path / "forced", tmp_path / "eager")["status"] == "equal").all()
    # the localization tools see the same modules under the same names
    from dumper import Injector, io_shapes, module_keys
    assert module_keys(compiled) == module_keys(model)
    assert io_shapes(compiled, x).equals(io_shapes(model, x))
    injector = Injector(tmp_path / "eager")
    with torch.compiler.set_stance("force_eager"), injector.injecting(compiled, 0, 0):
        compiled(x)
    assert injector.injected == len(eager[eager["kind"] == "input"])


class _TakesAnything(nn.Module):
    def forward(self, x, extra):
        return x * 2


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
@pytest.mark.parametrize("mode", ["tensors", "stats"])
def test_tensors_without_readable_values_are_recorded_as_unsupported(tmp_path, mode):
    """Sparse and nested tensors get an `unsupported` row saying why; the step is written."""
    model = _TakesAnything()
    sparse = torch.eye(3).to_sparse()
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    with HookerAndDumper(tmp_path, mode=mode).hooks(model, 0, 0):
        model(torch.ones(2), extra=[sparse, nested])
    rows = load_dump(tmp_path).index.set_index("path")
    assert rows.loc["kwargs['extra'][0]", "status"] == "unsupported"
    assert "sparse" in rows.loc["kwargs['extra'][0]", "value"]
    assert rows.loc["kwargs['extra'][1]", "value"] == "nested tensors are not stored"
    assert rows.loc["args[0]", "status"] == "ok"
    # a nested tensor with a gradient, passed from call to call and summed: no shape to read
    model = nn.Sequential(_ScalesNested(), _ScalesNested())
    with HookerAndDumper(tmp_path / "grads", mode=mode).hooks(model, 0, 0):
        model(nested)
    rows = load_dump(tmp_path / "grads").index
    assert set(rows.loc[rows["kind"] == "output", "status"]) == {"unsupported"}
    assert (rows["addends"] == "").all()


class _ScalesNested(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(2.0))

    def forward(self, nt):
        return nt * self.w + nt


@pytest.mark.parametrize("mode", ["tensors", "stats"])
def test_torch_func_transforms_run_unchanged_with_the_dumper(tmp_path, mode):
    """Inside vmap/grad, hooks see functorch wrappers whose values cannot be read: the rows say
    so, and the transformed computation is unchanged (it used to fail: in the hook in
    statistics mode, in the writer, losing the step, in tensors mode)."""
    from torch.func import functional_call, grad, vmap
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def per_sample_grads(x):
        return vmap(grad(lambda p, xi: functional_call(model, p, (xi,)).sum()),
                    in_dims=(None, 0))(params, x)
    x = torch.randn(5, 4)
    expected = per_sample_grads(x)
    with HookerAndDumper(tmp_path, mode=mode).hooks(model, 0, 0):
        got = per_sample_grads(x)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    index = load_dump(tmp_path).index
    tensors = index[index["index"] >= 0]
    assert len(tensors) and (tensors["status"] == "unsupported").all()
    assert tensors["value"].str.contains("torch.func transform").all()


@pytest.mark.parametrize("batched", [False, True])
def test_a_tensor_that_cannot_be_read_loses_only_its_own_row(tmp_path, monkeypatch, batched):
    """Safety nets for tensor types nobody foresaw: a failure to take statistics (in the hook,
    or into the step's batch) or to read a snapshot (in the writer) makes that row
    `unsupported`; training goes on and the rest of the step is written."""
    import dumper.stores
    import dumper.record
    import dumper.writer

    def fails_on_width_3(original):
        def wrapped(t):
            if t.shape[-1:] == (3,):
                raise RuntimeError("Cannot access data pointer\nsecond line")
            return original(t)
        return wrapped
    if batched:  # CPU tensors taken as an accelerator's, into the step's batch
        monkeypatch.setattr(dumper.record, "on_device", lambda t: True)
    for arena in (dumper.stores.DeviceArena, dumper.stores.HostArena):  # small CPU tensors' numbers
        monkeypatch.setattr(arena, "add", lambda self, t, *args, add=arena.add: add(
            self, fails_on_width_3(lambda x: x)(t), *args))
    monkeypatch.setattr(dumper.record, "tensor_stats", fails_on_width_3(dumper.record.tensor_stats))
    monkeypatch.setattr(dumper.writer, "encode", fails_on_width_3(dumper.writer.encode))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    for mode in ("tensors", "stats"):
        with HookerAndDumper(tmp_path / mode, mode=mode).hooks(model, 0, 0):
            model(torch.randn(4, 2)).sum().backward()
        index = load_dump(tmp_path / mode).index
        bad = index[index["shape"].map(lambda s: s[-1:] == (3,))]
        good = index.drop(bad.index)
        assert len(bad) and (bad["status"] == "unsupported").all() and (bad["dataset"] == "").all()
        reason = "values not readable: RuntimeError: Cannot access data pointer"  # 1st line
        assert set(bad["value"]) == {reason}
        assert len(good) and (good["status"] == "ok").all()


def test_a_batch_that_cannot_be_reduced_loses_only_its_rows(tmp_path, monkeypatch):
    """A failure to reduce the step's batch (at the seal) leaves its records `unsupported`;
    training goes on, the records that did not go through it are written whole."""
    import dumper.stores
    import dumper.record

    def fails(self):
        raise RuntimeError("segmented reduction failed\nsecond line")
    monkeypatch.setattr(dumper.record, "on_device", lambda t: True)
    for arena in (dumper.stores.DeviceArena, dumper.stores.HostArena):
        monkeypatch.setattr(arena, "_numbers", fails)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 70_000))  # its output: no arena's
    with HookerAndDumper(tmp_path, mode="stats", full_tensors=["1"]).hooks(model, 0, 0):
        model(torch.randn(4, 2)).sum().backward()
    index = load_dump(tmp_path).index
    batched = index[index["module"] == "0"]
    assert len(batched) and (batched["status"] == "unsupported").all()
    assert set(batched["value"]) == {
        "values not readable: RuntimeError: segmented reduction failed"}
    whole = index[(index["module"] == "1") & (index["kind"] == "output")]
    assert len(whole) == 1 and (whole["status"] == "ok").all() and (whole["dataset"] != "").all()


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_modules(tmp_path):
    """A TorchScript model is refused with a one-line reason (it runs no Python hooks); a
    scripted submodule is left out with a warning while the rest of the model is recorded."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    dumper = HookerAndDumper(tmp_path)
    with pytest.raises(TypeError, match="TorchScript module .* pass the original nn.Module"):
        dumper.register_hooks(torch.jit.script(model), 0, 0)
    outer = nn.Sequential(torch.jit.script(nn.Linear(4, 4)), nn.ReLU())
    with pytest.warns(RuntimeWarning, match="TorchScript submodules .* not recorded: 0$"):
        with dumper.hooks(outer, 0, 0):
            outer(torch.randn(2, 4)).sum().backward()
    assert set(load_dump(tmp_path).index["module"]) == {"", "1"}


class _Core:
    """A C++ autograd node, as torch sees it: a sequence number and the nodes it feeds."""

    def __init__(self, seq, inputs=()):
        self.seq, self.inputs, self.wrapper = seq, list(inputs), None


class _Wrapper:
    """Its Python wrapper as torch 2.11 makes them: cached only while someone holds it, so a
    freed wrapper's id is soon reused by the next node's."""

    def __init__(self, core):
        self.core = core

    @staticmethod
    def of(core):
        wrapper = core.wrapper() if core.wrapper is not None else None
        if wrapper is None:
            import weakref
            wrapper = _Wrapper(core)
            core.wrapper = weakref.ref(wrapper)
        return wrapper

    def _sequence_nr(self):
        return self.core.seq

    @property
    def next_functions(self):
        return tuple((_Wrapper.of(c), 0) for c in self.core.inputs)


def test_input_consumers_are_found_when_node_wrappers_are_not_cached():
    """A module's grad_input is read from the nodes of its call that consume the input. Walking
    the graph must not take a freed wrapper's reused id for a node already seen (torch 2.11
    lost the root's grad_input that way)."""
    from dumper.grads import GradInputCollector
    leaf = _Core(2 ** 64 - 1)
    chain = _Core(1, [leaf])
    for seq in range(2, 40):  # a long chain of nodes the call made, the first consuming x
        chain = _Core(seq, [chain])
    edge = _Wrapper.of(leaf)  # the input's edge, held as the collector holds it
    collector = GradInputCollector({(id(edge), 0): 0}, [edge], lambda *a: None)
    found = collector._find_consumers([_Wrapper.of(chain)], 1, 40)
    assert [node.core.seq for node in found] == [1]


def test_marked_shards_get_sharding_columns_in_one_process(tmp_path):
    """mark_sharded outside torch.distributed: one rank, the shard is the whole tensor; only
    the marked module, kind and index get the columns."""
    model = SharedTwice()
    dumper = HookerAndDumper(tmp_path)
    dumper.mark_sharded("shared", "output", dim=-1)
    dumper.mark_sharded(["out"], "input", dim=0, index=1)  # it has one input: no row matches
    with pytest.raises(ValueError, match="kind must be one of"):
        dumper.mark_sharded("shared", "outputs", dim=0)
    with pytest.raises(ValueError, match="at least one module glob"):
        dumper.mark_sharded([], "output", dim=0)
    with dumper.hooks(model, 0, 0):
        loss_of(model(torch.randn(3, 8))).backward()
    index = load_dump(tmp_path).index
    marked = index["placements"] != ""
    assert set(zip(index[marked]["module"], index[marked]["kind"])) == {("shared", "output")}
    row = index[marked].iloc[0]
    assert (row["mesh_shape"], row["placements"], row["global_shape"], row["offsets"]) == (
        (1,), "S(1)", (3, 8), (0, 0))


def test_wrapped_models_pair_with_the_plain_one(tmp_path):
    """Activation checkpointing's wrapper (like FSDP1's, tests/test_sharded.py) is left out of
    module paths: the wrapped model dumps under the plain model's names, and the two dumps pair
    record for record (and agree bit for bit: recomputation changes no value)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing)
    from compare import compare_dumps
    from dumper import module_keys
    from sharded_child import Block, Transformer
    x = torch.randn(2, 5, 8)

    def run(directory, wrap: bool) -> nn.Module:
        torch.manual_seed(0)
        model = Transformer()
        if wrap:
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        with HookerAndDumper(directory).hooks(model, 0, 0):
            loss_of(model(x)).backward()
        return model

    plain, wrapped = run(tmp_path / "plain", False), run(tmp_path / "wrapped", True)
    assert any("_checkpoint_wrapped_module" in path for path, _ in wrapped.named_modules())
    assert module_keys(wrapped) == module_keys(plain)
    result = compare_dumps(tmp_path / "plain", tmp_path / "wrapped")
    assert len(result) > 50 and set(result["status"]) == {"equal"}


class _RMSNorm(nn.Module):
    """A Hugging Face-style RMSNorm: its eps is ``variance_epsilon``."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                             + self.variance_epsilon)


def test_a_normalizations_eps_is_recorded_with_its_parameters_and_never_compared(tmp_path):
    """Each normalization's eps (``eps`` or ``variance_epsilon``) is a non-tensor ``param`` row
    at its first call; a module without one has none, nor a BatchNorm in eval mode (it
    normalizes by its running statistics); a comparison pairs no such row."""
    from compare import compare_dumps
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8, eps=1e-6), nn.BatchNorm1d(8),
                          _RMSNorm(8))
    for run in ("a", "b"):
        _dump_one_step(model, torch.randn(3, 4), tmp_path / run)
    index = load_dump(tmp_path / "a").index
    eps = index[(index["kind"] == fmt.PARAM) & (index["path"] == fmt.EPS_PATH)]
    assert dict(zip(eps["module"], eps["value"])) == {"1": "1e-06", "2": "1e-05", "3": "1e-06"}
    assert (eps["index"] == -1).all() and (eps["dataset"] == "").all()
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert not ((result["kind"] == fmt.PARAM) & (result["index"] < 0)).any()
    _dump_one_step(model.eval(), torch.randn(3, 4), tmp_path / "eval")
    index = load_dump(tmp_path / "eval").index
    assert set(index[index["path"] == fmt.EPS_PATH]["module"]) == {"1", "3"}

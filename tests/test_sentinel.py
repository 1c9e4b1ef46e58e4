"""The NaN/Inf sentinel (``on_nonfinite``) on GPT-2 (transformers, tiny config): NaN planted in
randomly chosen modules, in forward or in backward only; the report must name that module
and the direction, and say nothing on a healthy run, whose numerics it must not change.

Tests taking ``reading`` run twice: checks read at once (CPU tensors) and checks kept on the
device and read in batches (what CUDA tensors get), the latter forced here on CPU tensors."""
from __future__ import annotations

import random

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from compare import load_dump
from compare.cli import main
from dumper import HookerAndDumper, NonFiniteError, sentinel
from tests.architectures import build, precision_context

pytest.importorskip("transformers")


@pytest.fixture(params=["at once", "on device"])
def reading(request, monkeypatch):
    """Where the sentinel's checks wait to be read; yields the list of reads' sizes (on device)."""
    reads: list[int] = []
    if request.param == "on device":
        monkeypatch.setattr(sentinel, "checks_on_device", lambda t: True)
        read = sentinel.NonFiniteSentinel._read

        def counted(self, pending, action):
            reads.append(len(pending))
            return read(self, pending, action)
        monkeypatch.setattr(sentinel.NonFiniteSentinel, "_read", counted)
    yield reads


class NaNInBackward(torch.autograd.Function):
    """Identity forward; its backward sends NaN."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def plant(model: nn.Module, path: str, direction: str) -> None:
    """Make module ``path`` produce NaN in ``direction`` (its forward hook, registered before the
    dumper's, rewrites its output)."""
    def forward_nan(module, args, out):
        out = out.clone()
        out.view(-1)[0] = float("nan")
        return out

    def backward_nan(module, args, out):
        return NaNInBackward.apply(out)
    model.get_submodule(path).register_forward_hook(
        forward_nan if direction == "forward" else backward_nan)


def leaf_modules(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules() if type(m).__name__ in ("Conv1D", "LayerNorm")]


def step(model, batch, dumper, window_step=0):
    with dumper.hooks(model, 0, window_step):
        loss = model(**batch).loss
        loss.backward()
    return loss


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_the_report_names_the_planted_module_and_direction(tmp_path, seed, direction, reading,
                                                           device="cpu"):
    model, batch = build("gpt2", "float32", seed=seed, device=device)
    path = random.Random(seed).choice(leaf_modules(model))
    plant(model, path, direction)
    dumper = HookerAndDumper(tmp_path, steps=[5], on_nonfinite="raise")  # step 0: not dumped
    with pytest.raises(NonFiniteError) as caught:
        step(model, batch, dumper)
    first = str(caught.value).splitlines()[0]
    assert first.startswith(f"h5cmp: first non-finite value: {direction}:"), first
    if direction == "forward":
        assert f"of {path} (" in first and "this call made it" in first, first
    else:
        assert f"the backward of {path} made it" in first, first
    assert "events before it" in str(caught.value)
    assert dumper.nonfinite_report == str(caught.value)
    left = [h for m in model.modules() for h in (*m._forward_hooks, *m._forward_pre_hooks)]
    assert len(left) == 1, "the sentinel left hooks behind"  # only the planted one
    assert not list(tmp_path.iterdir()) or all(p.suffix == ".lock" or p.name.startswith(".")
                                               for p in tmp_path.iterdir())


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])  # bfloat16: autocast, mixed dtypes
def test_a_healthy_run_reports_nothing_and_keeps_its_numerics(tmp_path, reading, precision):
    def run(on_nonfinite):
        model, batch = build("gpt2", precision, seed=1)
        dumper = HookerAndDumper(tmp_path / str(on_nonfinite), steps=[], on_nonfinite=on_nonfinite)
        with precision_context(precision):
            losses = [step(model, batch, dumper, s).detach() for s in range(2)]
        assert dumper.nonfinite_report is None
        return losses, [p.grad.clone() for p in model.parameters()]
    (losses, grads), (plain_losses, plain_grads) = run("raise"), run(None)
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses))
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    # on the device: one read when the forward returns and one at the end of the backward
    assert len(reading) in (0, 4) and all(n >= 20 for n in reading), reading


def test_warn_lets_training_go_on(tmp_path, reading):
    model, batch = build("gpt2", "float32", seed=0)
    plant(model, "transformer.h.1.mlp.c_fc", "forward")
    dumper = HookerAndDumper(tmp_path, steps=[], on_nonfinite="warn")
    with pytest.warns(RuntimeWarning, match="transformer.h.1.mlp.c_fc"):
        loss = step(model, batch, dumper)
    assert torch.isnan(loss)
    assert "transformer.h.1.mlp.c_fc" in dumper.nonfinite_report


def test_in_a_dumped_step_the_records_so_far_are_published(tmp_path):
    model, batch = build("gpt2", "float32", seed=0)
    plant(model, "transformer.h.0.attn.c_proj", "forward")
    dumper = HookerAndDumper(tmp_path, on_nonfinite="raise")
    with pytest.warns(RuntimeWarning, match="incomplete"), pytest.raises(NonFiniteError):
        step(model, batch, dumper)
    index = load_dump(tmp_path).index
    outputs = index[(index["module"] == "transformer.h.0.attn.c_proj")
                    & (index["kind"] == "output")]
    assert len(outputs) == 1  # the failing call's output is recorded
    assert "transformer.h.1.attn" not in set(index["module"])  # nothing after it
    listing = CliRunner().invoke(main, [str(tmp_path)])
    assert listing.exit_code == 0 and "INCOMPLETE: the step ended while NonFiniteError" in \
        listing.output


def test_nan_made_outside_modules_is_said_to_come_from_before_the_call(tmp_path, reading):
    class Outside(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(torch.log(self.a(x) - 100))  # log of negatives: NaN, in no module

    model = Outside()
    dumper = HookerAndDumper(tmp_path, steps=[], on_nonfinite="raise")
    with pytest.raises(NonFiniteError, match=r"output of b \(Linear\).*already non-finite"):
        with dumper.hooks(model, 0, 0):
            model(torch.randn(2, 4))


def test_on_nonfinite_is_checked(tmp_path):
    with pytest.raises(ValueError, match="on_nonfinite"):
        HookerAndDumper(tmp_path, on_nonfinite="ignore")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_sum_that_overflows_is_no_alarm(tmp_path, reading, dtype):
    big = torch.finfo(dtype).max / 2  # finite elements whose sum overflows the dtype
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).to(dtype)
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(big)
    dumper = HookerAndDumper(tmp_path, steps=[], on_nonfinite="raise")
    with dumper.hooks(model, 0, 0):
        out = model(torch.randn(64, 4, dtype=dtype))
    assert torch.isfinite(out).all() and dumper.nonfinite_report is None


def test_on_device_a_failure_is_raised_at_the_read_and_names_the_first_call(tmp_path, reading):
    """Checks on the device are read when the outermost call returns: the step goes on to
    there, and the report still names the first call. An output changed in place before the
    read is reported by its signature."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
            self.ran = []

        def forward(self, x):
            h = self.a(x)
            self.ran.append("a")
            out = self.c(self.b(h))
            self.ran.append("c")
            h.zero_()  # the failing output is changed before the checks are read
            return out

    model = Net()
    model.a.register_forward_hook(lambda m, args, out: out * float("inf"))
    dumper = HookerAndDumper(tmp_path, steps=[], on_nonfinite="raise")
    with pytest.raises(NonFiniteError) as caught, dumper.hooks(model, 0, 0):
        model(torch.randn(2, 4))
    first = str(caught.value).splitlines()[0]
    assert "output of a (Linear), call 1" in first and "this call made it" in first, first
    if reading:  # read at the root's return, after c ran and h changed
        assert model.ran == ["a", "c"] and sentinel.GONE in first and len(reading) == 1
    else:  # raised in a's hook
        assert model.ran == [] and "with 0 NaN, 8 Inf of 8" in first


@pytest.mark.cuda
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_cuda_checks_stay_on_the_device(tmp_path, direction, monkeypatch):
    reads: list[int] = []
    read = sentinel.NonFiniteSentinel._read
    monkeypatch.setattr(sentinel.NonFiniteSentinel, "_read",
                        lambda self, pending, action: reads.append(len(pending))
                        or read(self, pending, action))
    test_the_report_names_the_planted_module_and_direction(tmp_path, 0, direction, reads,
                                                           device="cuda")
    assert 1 <= len(reads) <= 2 and sum(reads) >= 20, reads


def test_a_forward_that_raises_leaves_the_sentinel_armed(tmp_path, reading):
    """A forward that fails (the loop catches it) must not leave the sentinel counting a call
    as open: a later NaN still raises at once (read at the outermost return on the device)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    dumper = HookerAndDumper(tmp_path, steps=[], on_nonfinite="raise")
    dumper.register_hooks(model, 0, 0)
    with pytest.raises(RuntimeError, match="shapes"):
        model(torch.randn(2, 3))
    with pytest.raises(NonFiniteError, match=r"output of 0 \(Linear\)"):
        model(torch.full((2, 4), float("inf")))
    dumper.remove_hooks()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_inference_tensors_are_described(tmp_path, reading):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    dumper = HookerAndDumper(tmp_path, steps=[], on_nonfinite="raise")
    with pytest.raises(NonFiniteError) as caught, torch.inference_mode(), \
            dumper.hooks(model, 0, 0):
        model(torch.full((2, 4), float("nan")))
    first = str(caught.value).splitlines()[0]
    assert "already non-finite" in first and "with 8 NaN" in first, first


def test_a_read_that_fails_at_the_end_leaves_no_hook_behind(tmp_path, monkeypatch):
    """Checks left on the device when a forward raised are read at remove_hooks; if that read
    fails (a device error), it is a warning, and every hook is gone, the step published."""
    monkeypatch.setattr(sentinel, "checks_on_device", lambda t: True)

    def device_error(self, pending, action):
        raise RuntimeError("CUDA error: device-side assert triggered")
    monkeypatch.setattr(sentinel.NonFiniteSentinel, "_read", device_error)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(3, 3))  # the second call raises
    dumper = HookerAndDumper(tmp_path, on_nonfinite="raise")
    dumper.register_hooks(model, 0, 0)
    with pytest.raises(RuntimeError, match="shapes"):
        model(torch.randn(2, 4))
    with pytest.warns(RuntimeWarning, match="could not read its last 1 checks"), \
            pytest.warns(RuntimeWarning, match="incomplete"):
        path = dumper.remove_hooks()
    assert path is not None and path.exists()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())

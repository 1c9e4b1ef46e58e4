"""Capture hardening: dumpers that share a directory, threads that share a model, steps that
fail half-way, names UTF-8 cannot hold, and memory given back after a dump."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from compare import compare_dumps, format as fmt
from compare.cli import main
from compare.dump import load_dump
from dumper import HookerAndDumper
from dumper.claim import StepConflictError

from helpers import Planted, read_tensors

ROOT = Path(__file__).resolve().parents[1]


def one_step(dumper: HookerAndDumper, model: nn.Module, step: int = 0, seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(8, 6)
    dumper.register_hooks(model, 0, step)
    model(x).pow(2).mean().backward()
    return dumper.remove_hooks()


def test_two_dumpers_of_one_process_cannot_write_one_step(tmp_path):
    first, second = HookerAndDumper(tmp_path), HookerAndDumper(tmp_path)
    model_a, model_b = Planted(), Planted()
    first.register_hooks(model_a, 0, 0)
    with pytest.raises(StepConflictError, match="another dumper in this process is writing"):
        second.register_hooks(model_b, 0, 0)
    model_a(torch.randn(8, 6)).sum().backward()
    assert first.remove_hooks() == tmp_path / fmt.step_file_name(0, 0)
    assert second.remove_hooks() is None  # nothing was registered
    # published by the first since the second started: not replaced, with a clear error
    with pytest.raises(StepConflictError, match="published this step after this one started"):
        one_step(second, model_b)
    assert len(read_tensors(tmp_path)) > 0
    # with on_error="warn" the step is skipped with a warning, training goes on
    lenient = HookerAndDumper(tmp_path, on_error="warn")
    first.register_hooks(model_a, 0, 1)
    with pytest.warns(RuntimeWarning, match="another dumper in this process"):
        assert lenient.register_hooks(model_b, 0, 1) is False
    assert lenient.remove_hooks() is None
    model_a(torch.randn(8, 6)).sum().backward()
    first.remove_hooks()


def test_a_dumper_replaces_its_own_steps_and_those_of_earlier_runs(tmp_path):
    model = Planted()
    one_step(HookerAndDumper(tmp_path), model)
    again = HookerAndDumper(tmp_path)  # a new run into the same directory
    assert one_step(again, model) is not None
    assert one_step(again, model) is not None  # the same step twice by one dumper


_HOLDER = textwrap.dedent("""
    import sys, torch
    sys.path[:0] = [{root!r}, {tests!r}]
    from dumper import HookerAndDumper
    from helpers import Planted
    model = Planted()
    d = HookerAndDumper(sys.argv[1])
    d.register_hooks(model, 0, 0)
    model(torch.randn(8, 6)).sum().backward()
    print("WRITING", flush=True)
    sys.stdin.readline()
    d.remove_hooks()
    print("PUBLISHED", flush=True)
""")


def test_two_processes_cannot_write_one_step(tmp_path):
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER.format(root=str(ROOT), tests=str(ROOT / "tests")))
    directory = tmp_path / "dump"
    directory.mkdir()
    # a lock file a crashed writer left, holding a longer pid than the holder's: reused
    (directory / fmt.lock_file_name(fmt.step_file_name(0, 0))).write_text("4194303999999")
    dumper = HookerAndDumper(directory)  # started before the other process publishes
    holder = subprocess.Popen([sys.executable, str(script), str(directory)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "WRITING"
        with pytest.raises(StepConflictError, match=rf"another process \(pid {holder.pid}\)"):
            one_step(dumper, Planted())
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "PUBLISHED"
        assert holder.wait(timeout=60) == 0
    finally:
        holder.kill()
    theirs = (directory / fmt.step_file_name(0, 0)).read_bytes()
    with pytest.raises(StepConflictError, match="published this step after this one started"):
        one_step(dumper, Planted())
    assert (directory / fmt.step_file_name(0, 0)).read_bytes() == theirs
    assert one_step(dumper, Planted(), step=1) is not None  # other steps are free
    assert not list(directory.glob(".*"))  # no lock or temporary file is left


class SlowLinear(nn.Linear):
    """Gives the GIL away inside the call, so calls of several threads interleave."""

    def forward(self, x):
        time.sleep(0.001)
        return super().forward(x)


def test_threads_sharing_a_hooked_model_record_their_own_calls(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(SlowLinear(6, 16), nn.Tanh(), SlowLinear(16, 4))
    dumper = HookerAndDumper(tmp_path)
    dumper.register_hooks(model, 0, 0)
    start = threading.Barrier(4)

    def train(seed):
        gen = torch.Generator().manual_seed(seed)
        start.wait(timeout=30)
        for _ in range(10):
            model(torch.randn(5, 6, generator=gen)).pow(2).sum().backward()
    threads = [threading.Thread(target=train, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    dumper.remove_hooks()
    tensors = read_tensors(tmp_path)
    for module in ("0", "2"):
        layer = model.get_submodule(module)
        for call in range(40):
            x, y = tensors[(module, call, "input", 0)], tensors[(module, call, "output", 0)]
            assert torch.equal(y, nn.functional.linear(x, layer.weight, layer.bias)), (module,
                                                                                         call)
            g_out = tensors[(module, call, "grad_output", 0)]
            assert torch.equal(g_out, 2 * y) if module == "2" else g_out.shape == y.shape


class FailsOnce(nn.Module):
    def forward(self, x):
        raise ValueError("bad batch")


def test_a_step_that_raised_is_published_marked_incomplete(tmp_path):
    model = Planted()
    one_step(HookerAndDumper(tmp_path / "a"), model)
    broken = Planted()
    broken.load_state_dict(model.state_dict())
    broken.relu = FailsOnce()
    dumper = HookerAndDumper(tmp_path / "b")
    with pytest.warns(RuntimeWarning, match="marked incomplete: the step ended while ValueError"):
        with pytest.raises(ValueError):
            try:
                dumper.register_hooks(broken, 0, 0)
                torch.manual_seed(0)
                broken(torch.randn(8, 6))
            finally:
                dumper.remove_hooks()
    step = load_dump(tmp_path / "b").steps[0]
    assert "ValueError" in step.incomplete and "module call(s) never returned" in step.incomplete
    result = CliRunner().invoke(main, [str(tmp_path / "a"), str(tmp_path / "b")])
    assert result.exit_code == 1, result.output
    assert "incomplete: B's step 0:0 (the step ended while ValueError was raised" in result.output
    listing = CliRunner().invoke(main, [str(tmp_path / "b")])
    assert listing.exit_code == 0 and "INCOMPLETE: the step ended while" in listing.output
    assert compare_dumps(tmp_path / "a", tmp_path / "b").attrs["incomplete_steps"]
    # caught inside the step, the exception leaves the calls it interrupted open
    dumper.register_hooks(broken, 0, 1)
    with pytest.raises(ValueError):
        broken(torch.randn(8, 6))
    with pytest.warns(RuntimeWarning, match="2 module call"):
        dumper.remove_hooks()
    # `with d.hooks(...)` discards a step that raises
    with pytest.raises(ValueError), dumper.hooks(broken, 0, 2):
        broken(torch.randn(8, 6))
    assert not (tmp_path / "b" / fmt.step_file_name(0, 2)).exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert one_step(dumper, model, step=3) is not None  # a healthy step is not marked
    assert not load_dump(tmp_path / "b" / fmt.step_file_name(0, 3)).steps[0].incomplete


def test_names_utf8_cannot_hold_are_escaped(tmp_path):
    name = "layer\udc80"  # e.g. a name built from a file name decoded with surrogateescape
    for side in ("a", "b"):
        torch.manual_seed(0)
        model = nn.Sequential()
        model.add_module(name, nn.Linear(6, 4))
        one_step(HookerAndDumper(tmp_path / side), model)
    result = CliRunner().invoke(main, [str(tmp_path / "a"), str(tmp_path / "b"), "--all"])
    assert result.exit_code == 0, result.output
    assert "layer\\udc80" in result.output
    assert "layer\\udc80" in set(load_dump(tmp_path / "a").index["module"])


_MEMORY = textwrap.dedent("""
    import ctypes, gc, sys, tempfile, torch
    sys.path[:0] = [{root!r}]
    from dumper import HookerAndDumper

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024

    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    x = torch.randn(2048, 1024, requires_grad=True)
    def step():
        model(x).sum().backward()
        model.zero_grad(set_to_none=False)
    step(); step()
    ctypes.CDLL(None).malloc_trim(0)  # the baseline: training alone, its free pages given back
    before = rss_mb()
    with tempfile.TemporaryDirectory() as tmp:
        d = HookerAndDumper(tmp)
        for s in range(2):  # ~280 MB of snapshots per step
            d.register_hooks(model, 0, s); step(); d.remove_hooks()
        d.close()
        del d
        gc.collect()
        print(round(rss_mb() - before))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, glibc heap")
def test_a_closed_dumper_gives_its_memory_back(tmp_path):
    script = tmp_path / "memory.py"
    script.write_text(_MEMORY.format(root=str(ROOT)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) < 40, out.stdout  # of ~560 MB snapshotted

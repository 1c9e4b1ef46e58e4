"""The garbage collector's pause during dumped steps (``pause_gc``, dumper.collector)."""
from __future__ import annotations

import gc
import os

import pytest
import torch
from torch import nn

from dumper import HookerAndDumper, collector


class Probe(nn.Module):
    """Notes whether automatic collection is on each time it runs (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[bool] = []

    def forward(self, x):
        self.seen.append(gc.isenabled())
        y = self.lin(x)
        y.register_hook(lambda g: self.seen.append(gc.isenabled()))
        return y


@pytest.fixture(autouse=True)
def collector_restored():
    was = gc.isenabled()
    gc.enable()
    yield
    assert collector._pauses == 0, "a test left a pause behind"
    (gc.enable if was else gc.disable)()


def run_step(model: Probe) -> None:
    model(torch.randn(2, 4)).sum().backward()


def test_the_collector_is_paused_only_while_a_dumped_step_runs(tmp_path):
    model = Probe()
    d = HookerAndDumper(tmp_path, steps=[1], mode="stats")
    for step in range(3):
        d.register_hooks(model, 0, step)
        run_step(model)
        d.remove_hooks()
        assert gc.isenabled()
    assert model.seen == [True, True, False, False, True, True]
    assert [p.name for p in d.written_files] == ["0-epoch_1-step_dump.hdf5"]


def test_pause_gc_false_leaves_the_collector_alone(tmp_path):
    model = Probe()
    d = HookerAndDumper(tmp_path, pause_gc=False)
    d.register_hooks(model, 0, 0)
    run_step(model)
    d.remove_hooks()
    assert model.seen == [True, True] and gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off(tmp_path):
    gc.disable()
    d = HookerAndDumper(tmp_path)
    model = Probe()
    with d.hooks(model, 0, 0):
        run_step(model)
    assert model.seen == [False, False] and not gc.isenabled()


def test_every_way_a_step_ends_turns_the_collector_back_on(tmp_path):
    d = HookerAndDumper(tmp_path)
    with pytest.raises(ZeroDivisionError):
        with d.hooks(Probe(), 0, 0):  # discarded by abort_step
            assert not gc.isenabled()
            1 / 0
    assert gc.isenabled()
    d.register_hooks(Probe(), 0, 1)  # left open, then discarded by close()
    assert not gc.isenabled()
    d.close()
    assert gc.isenabled()


@pytest.mark.parametrize("failing", ["StepWriter", "StepCapture", "NonFiniteSentinel"])
def test_a_step_that_cannot_start_leaves_nothing_behind(tmp_path, monkeypatch, failing):
    """Whatever fails in register_hooks after the step is claimed: the collector is on, no
    hook, lock or temporary file is left, and the same step can be registered again."""
    d = HookerAndDumper(tmp_path, on_nonfinite="raise")
    model = Probe()

    def broken(*args, **kwargs):
        raise RuntimeError(f"no {failing}")

    with monkeypatch.context() as patched:
        patched.setattr(f"dumper.hooker.{failing}", broken)
        with pytest.raises(RuntimeError, match=f"no {failing}"):
            d.register_hooks(model, 0, 0)
    assert gc.isenabled() and os.listdir(tmp_path) == []
    assert not model._forward_hooks and not model._forward_pre_hooks
    with d.hooks(model, 0, 0):
        run_step(model)
    assert [p.name for p in d.written_files] == ["0-epoch_0-step_dump.hdf5"]


def test_a_dumper_dropped_mid_step_turns_the_collector_back_on(tmp_path):
    """A notebook cell that raised mid-step and a new dumper made in its place: the old
    dumper's pause ends with it."""
    d = HookerAndDumper(tmp_path / "old")
    d.register_hooks(Probe(), 0, 0)
    assert not gc.isenabled()
    del d
    assert gc.isenabled()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_mid_step_collects(tmp_path):
    """A worker forked during a dumped step (a DataLoader's) is not left without a
    collector: the parent's pause is not the child's to end."""
    d = HookerAndDumper(tmp_path)
    model = Probe()
    d.register_hooks(model, 0, 0)
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once
        os._exit(0 if gc.isenabled() and collector._pauses == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert not gc.isenabled()  # the parent's step goes on
    run_step(model)
    d.remove_hooks()
    assert os.waitstatus_to_exitcode(status) == 0 and gc.isenabled()


def test_pauses_of_several_dumpers_nest(tmp_path):
    first, second = HookerAndDumper(tmp_path / "a"), HookerAndDumper(tmp_path / "b")
    model_a, model_b = Probe(), Probe()
    first.register_hooks(model_a, 0, 0)
    second.register_hooks(model_b, 0, 0)
    run_step(model_a)
    run_step(model_b)
    first.remove_hooks()
    assert not gc.isenabled()  # the second dumper's step still runs
    second.remove_hooks()
    assert gc.isenabled()

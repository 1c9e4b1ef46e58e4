"""The garbage collector's pause during dumped steps (``pause_gc``, dumper.collector)."""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from dumper import HookerAndDumper


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


def test_a_step_that_cannot_start_leaves_the_collector_on(tmp_path, monkeypatch):
    d = HookerAndDumper(tmp_path)

    def broken(*args, **kwargs):
        raise RuntimeError("no writer")

    monkeypatch.setattr("dumper.hooker.StepWriter", broken)
    with pytest.raises(RuntimeError, match="no writer"):
        d.register_hooks(Probe(), 0, 0)
    assert gc.isenabled()


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

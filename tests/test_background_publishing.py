"""Publishing in the background (``publish=``): remove_hooks returns while the writer publishes
the step; errors come at the next call, naming the step; wait() and close() wait; the byte
budget still bounds what is held. (A crash while publishing: tests/test_crash_safety.py.)"""
from __future__ import annotations

import os
import threading

import pytest
import torch
from torch import nn

from compare import compare_dumps
from compare import format as fmt
from dumper import DumpWriteError, HookerAndDumper
from dumper import writer

from helpers import read_tensors


class Gate:
    """Holds every writer thread before it writes the index of a step, until opened."""

    def __init__(self, monkeypatch):
        self.opened = threading.Event()
        self.reached = threading.Event()
        write_index = writer.StepWriter._write_index

        def held(writer_self, datasets):
            self.reached.set()
            assert self.opened.wait(timeout=60), "the gate was never opened"
            return write_index(writer_self, datasets)
        monkeypatch.setattr(writer.StepWriter, "_write_index", held)


def _step(model: nn.Module, seed: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 2))


def test_remove_hooks_returns_while_the_step_is_published(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    model = _model()
    dumper = HookerAndDumper(tmp_path / "bg", publish="background")
    dumper.register_hooks(model, 0, 0)
    _step(model, 0)
    path = dumper.remove_hooks()
    assert path == tmp_path / "bg" / fmt.step_file_name(0, 0)
    assert gate.reached.wait(timeout=60)
    assert not path.exists() and dumper.written_files == []  # still being written
    _step(model, 1)  # training goes on meanwhile
    gate.opened.set()
    assert dumper.wait() == [path] and path.exists()
    # the same step, published synchronously, holds the same records and values
    model = _model()
    with HookerAndDumper(tmp_path / "sync", publish="wait").hooks(model, 0, 0):
        _step(model, 0)
    background, synchronous = read_tensors(path), read_tensors(tmp_path / "sync")
    assert background.keys() == synchronous.keys() and len(background) > 10
    assert all(torch.equal(background[k], synchronous[k]) for k in background)
    assert (compare_dumps(tmp_path / "bg", tmp_path / "sync")["status"] == "equal").all()


def test_a_cpu_step_is_published_before_remove_hooks_returns_by_default(tmp_path):
    model = _model()
    dumper = HookerAndDumper(tmp_path)
    dumper.register_hooks(model, 0, 0)
    _step(model, 0)
    path = dumper.remove_hooks()
    assert path.exists() and dumper.written_files == [path]


def test_at_most_two_steps_are_published_at_once(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    model = _model()
    dumper = HookerAndDumper(tmp_path, publish="background")
    for step in range(2):
        with dumper.hooks(model, 0, step):
            _step(model, step)
    assert len(dumper._publishing) == 2
    opener = threading.Timer(0.5, gate.opened.set)
    opener.start()
    with dumper.hooks(model, 0, 2):  # waits for step 0's file before it starts
        assert (tmp_path / fmt.step_file_name(0, 0)).exists()
        _step(model, 2)
    dumper.close()
    opener.join()
    assert sorted(os.listdir(tmp_path)) == [fmt.step_file_name(0, s) for s in range(3)]


def test_close_waits_for_the_steps_being_published(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    model = _model()
    dumper = HookerAndDumper(tmp_path, publish="background")
    with dumper.hooks(model, 0, 0):
        _step(model, 0)
    opener = threading.Timer(0.3, gate.opened.set)
    opener.start()
    dumper.close()
    opener.join()
    assert dumper.written_files == [tmp_path / fmt.step_file_name(0, 0)]
    assert os.listdir(tmp_path) == [fmt.step_file_name(0, 0)]  # no temporary or lock file


def _fail_writes_of_step(monkeypatch, step: int) -> None:
    write = writer.LowLevelGroup.write

    def failing(self, *args, **kwargs):
        if f"_{step}-step" in threading.current_thread().name:
            raise OSError(28, "No space left on device")
        return write(self, *args, **kwargs)
    monkeypatch.setattr(writer.LowLevelGroup, "write", failing)


def test_a_background_write_error_is_raised_at_the_next_call_naming_the_step(tmp_path,
                                                                             monkeypatch):
    _fail_writes_of_step(monkeypatch, 1)
    model = _model()
    dumper = HookerAndDumper(tmp_path, publish="background")
    for step in range(2):
        with dumper.hooks(model, 0, step):
            _step(model, step)
    for step_writer in dumper._publishing:  # step 0 is published, step 1 has failed by now
        step_writer._thread.join()
    with pytest.raises(DumpWriteError, match=f"{fmt.step_file_name(0, 1)} failed .*No space "
                                             f"left on device.*earlier steps are intact"):
        dumper.register_hooks(model, 0, 2)
    assert dumper.written_files == [tmp_path / fmt.step_file_name(0, 0)]
    assert os.listdir(tmp_path) == [fmt.step_file_name(0, 0)]  # nothing of step 1 left
    with dumper.hooks(model, 0, 2):  # the dumper goes on with the next step
        _step(model, 2)
    dumper.close()
    assert sorted(os.listdir(tmp_path)) == [fmt.step_file_name(0, s) for s in (0, 2)]


def test_a_background_write_error_can_warn(tmp_path, monkeypatch):
    _fail_writes_of_step(monkeypatch, 0)
    model = _model()
    dumper = HookerAndDumper(tmp_path, publish="background", on_error="warn")
    with dumper.hooks(model, 0, 0):
        _step(model, 0)
    with pytest.warns(RuntimeWarning, match=f"{fmt.step_file_name(0, 0)} failed"):
        assert dumper.wait() == []
    dumper.close()
    assert os.listdir(tmp_path) == []


def test_the_byte_budget_bounds_steps_published_in_the_background(tmp_path):
    """Snapshots of the step being published count against max_bytes_in_flight: with a budget
    of a few tensors the steps still finish, every value stored."""
    model = _model()
    dumper = HookerAndDumper(tmp_path / "small", publish="background", max_bytes_in_flight=600)
    reference = HookerAndDumper(tmp_path / "reference")
    for step in range(4):
        for d in (dumper, reference):
            torch.manual_seed(step)
            with d.hooks(model, 0, step):
                _step(model, step)
    dumper.close()
    assert (compare_dumps(tmp_path / "small", tmp_path / "reference")["status"] == "equal").all()
    for step in range(4):
        name = fmt.step_file_name(0, step)
        small, whole = read_tensors(tmp_path / "small" / name), read_tensors(
            tmp_path / "reference" / name)
        assert small.keys() == whole.keys()


def test_publish_must_be_known(tmp_path):
    with pytest.raises(ValueError, match="publish must be one of"):
        HookerAndDumper(tmp_path, publish="later")

"""Live consumers (``HookerAndDumper.add_consumer``): records arrive on the writer's thread with
the values the step file holds; a raising consumer does not stop training or the dump."""
from __future__ import annotations

import threading

import pytest
import torch

from dumper import HookerAndDumper
from tests.architectures import build
from tests.helpers import read_tensors

pytest.importorskip("transformers")


def train(model, batch, dumper, steps=2):
    for step in range(steps):
        with dumper.hooks(model, 0, step):
            model(**batch).loss.backward()


def test_records_arrive_off_the_training_thread_with_the_dumped_values(tmp_path):
    model, batch = build("gpt2", "float32", seed=0)
    dumper = HookerAndDumper(tmp_path, steps=[1])
    seen, threads = {}, set()

    def keep(record):
        threads.add(threading.get_ident())
        seen[(record.step, record.module, record.call_idx, record.kind, record.index)] = \
            record.values.clone()
    dumper.add_consumer(keep, kinds=["output", "grad_input"], modules="transformer.h.*")
    train(model, batch, dumper)
    assert threading.get_ident() not in threads
    assert {k[0] for k in seen} == {1}  # only the dumped step
    assert {k[3] for k in seen} == {"output", "grad_input"}
    assert all(k[1].startswith("transformer.h.") for k in seen)
    stored = read_tensors(tmp_path)
    assert len(seen) > 20
    for (step, module, call_idx, kind, index), values in seen.items():
        assert torch.equal(values, stored[(module, call_idx, kind, index)]), (module, kind)


def test_statistics_records_carry_statistics(tmp_path):
    model, batch = build("gpt2", "float32", seed=0)
    dumper = HookerAndDumper(tmp_path, steps=[0], mode="stats")
    got = []
    dumper.add_consumer(got.append, kinds=["output"])
    train(model, batch, dumper, steps=1)
    assert got and all(r.values is None and set(r.stats) >= {"stat_min", "stat_max", "stat_norm"}
                       for r in got)
    root = [r for r in got if r.module == "transformer.ln_f"][0]
    assert root.stats["stat_nan"] == 0


def test_a_raising_consumer_does_not_stop_training(tmp_path):
    model, batch = build("gpt2", "float32", seed=0)
    plain, _ = build("gpt2", "float32", seed=0)
    dumper = HookerAndDumper(tmp_path, steps=[0, 1])
    calls = []

    def broken(record):
        calls.append(record.kind)
        raise ValueError("no TensorBoard here")
    handle = dumper.add_consumer(broken)
    with pytest.warns(RuntimeWarning, match="consumer .*broken raised ValueError"):
        train(model, batch, dumper)
    assert len(calls) == 2  # once per step, then left out for that step
    assert len(dumper.written_files) == 2
    plain(**batch).loss.backward()
    plain(**batch).loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()))
    handle.remove()
    dumper2 = HookerAndDumper(tmp_path / "again", steps=[0])
    train(model, batch, dumper2, steps=1)
    assert len(calls) == 2


def test_bad_consumer_arguments(tmp_path):
    dumper = HookerAndDumper(tmp_path)
    with pytest.raises(TypeError):
        dumper.add_consumer("print")
    with pytest.raises(ValueError, match="unknown record kind"):
        dumper.add_consumer(print, kinds=["outputs"])

"""Benchmark: the cost of dumping a training step, per model and mode, measured side by side.

    python scripts/bench_dump.py [--repeat 7] [--models mlp,cnn,deep,transformer,llama]
                                 [--device cpu]

For each model, one run interleaves (so all see the same machine load) a plain step, a step with
the dumper attached outside its window, a full-tensor dump, a statistics dump, a naive
reference written here after the original design (synchronous .cpu().numpy() and an HDF5 file
open/create_dataset/close per tensor inside module hooks), and the floors below. Medians over
--repeat rounds.

Columns: step time; ratio to plain; bytes dumped per step; extra µs per captured tensor; the
I/O limit = a plain step followed by writing the same bytes (same pieces) to a new file with
plain buffered writes, timed in the same interleaved rounds (so it meets the same page-cache
writeback as the dumps); and the full-tensor step over that limit.

Floors, all timed in the same rounds, in a real step (a hook's work costs more there than in a
loop of its own, presumably as the step's code and data evict it from the caches): no-op hooks
(module and gradient hooks that only keep references: what any hook-based dumper pays before it
does anything); copying hooks (the same hooks taking the dumper's snapshots into reused
buffers); statistics hooks (computing the dumper's statistics of each tensor); digest hooks
(the same with hash mode's digest); copying hooks +
batched statistics (snapshots, then statistics reduced group-wise after the step); the HDF5
floor (a plain step, then the same datasets written with the dumper's own dataset code and
nothing else; the line shows the writing part); the step file (one file with the step's index
and no datasets, written by the dumper's writer). A last table sets issue 4's targets (on a
CUDA device issue 23's too) against them.

Hash mode (issue 21): ``mode="hash"``, a digest per tensor, against plain (targets <= 1.15x
on MLP and CNN, <= 15 us per tensor on the deep model).

Op-level capture (issue 21): ``ops="*"`` with full tensors and with statistics, in the same
rounds; its rows count the op records of a step and give their cost each (over the same mode
without ops); the targets table sets that against a module record's cost in the same mode
(``llama``: a tiny Hugging Face Llama, whose attention and norms are functional code; needs
``transformers``).

Accelerator path (issue 23): per model and mode, the kernels (ATen ops that are not views)
one dumped step launches beyond a plain step's, per captured tensor, and the host syncs of the
step (seals the writer waited for): on a CUDA device as it runs, on the CPU with every tensor
forced through the device path (``dumper.arena``), which counts the same ops. Background
publishing (issue 23): ten steps, every one dumped, with ``publish="wait"`` and
``"background"``, per step over a plain step.

The NaN/Inf sentinel (issue 12, target <= 1.1x plain) is also timed finer than one row in the
interleaved rounds allows: --paired-rounds rounds of four steps (plain, sentinel, sentinel,
plain), the median and quartiles of the rounds' ratios, and the same for no-op hooks.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import h5py
import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from compare.dump import load_dump  # noqa: E402
from compare.statistics import stats_from_sums  # noqa: E402
from dumper import HookerAndDumper  # noqa: E402
from dumper.claim import StepClaim  # noqa: E402
from dumper.record import CallInfo, Record  # noqa: E402
from dumper.run_info import run_attrs  # noqa: E402
from dumper.snapshot import Snapshot, SnapshotPool  # noqa: E402
from dumper.digest import tensor_digest  # noqa: E402
from dumper.stats import tensor_stats  # noqa: E402
from dumper.hdf5 import LowLevelGroup  # noqa: E402
from dumper.writer import FILE_OPTIONS, StepWriter  # noqa: E402


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.act(self.lin(x))


def models(device: str) -> dict:
    def mlp():
        return (nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.LayerNorm(1024), nn.Linear(1024, 10)), torch.randn(256, 512))

    def cnn():
        return (nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                              nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(512, 10)),
                torch.randn(64, 3, 32, 32))

    def deep():
        model = nn.Sequential(*[Residual() for _ in range(50)])
        for module in model.modules():  # small init: with the default one the residual sum
            if isinstance(module, nn.Linear):  # reaches 1e5 and the first step makes it NaN,
                nn.init.normal_(module.weight, std=0.02)  # which would time NaN paths
                nn.init.zeros_(module.bias)
        return model, torch.randn(32, 64)

    def transformer():
        layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
        return (nn.TransformerEncoder(layer, 3, enable_nested_tensor=False),
                torch.randn(16, 32, 128))

    def llama():  # a tiny Hugging Face Llama: functional code inside modules, for ops="*"
        import transformers
        transformers.logging.set_verbosity_error()
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                          num_hidden_layers=4, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=64)
        return Logits(transformers.LlamaForCausalLM(config)), torch.randint(0, 256, (8, 64))

    return {"mlp": mlp, "cnn": cnn, "deep": deep, "transformer": transformer, "llama": llama}


class Logits(nn.Module):
    """A Hugging Face causal LM as a module from token ids to logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


class NaiveDumper:
    """The original design: synchronous copies, one HDF5 open/create/close per tensor, full
    backward hooks."""

    def __init__(self, path: Path):
        self.path, self.handles, self.counter = path, [], 0

    def _save(self, name: str, tensors) -> None:
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor):
                with h5py.File(self.path, "a") as f:
                    f.create_dataset(f"{self.counter:05d}_{name}_{i}", data=t.detach().cpu().numpy())
                self.counter += 1

    def register(self, model: nn.Module) -> None:
        self.path.unlink(missing_ok=True)
        for name, m in model.named_modules():
            def fwd(mod, args, out, name=name):
                self._save(name + ".input", args)
                self._save(name + ".output", out if isinstance(out, tuple) else (out,))

            def bwd(mod, grad_input, grad_output, name=name):
                self._save(name + ".grad_input", grad_input)
                self._save(name + ".grad_output", grad_output)
            self.handles.append(m.register_forward_hook(fwd))
            self.handles.append(m.register_full_backward_hook(bwd))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class FloorHooks:
    """The least a hook-based dumper pays: on every module a forward pre-hook and a forward hook
    that pass each tensor of the call to ``take``, and a hook on each input that requires grad
    and on each output's grad_fn that passes each gradient to ``take``; what ``take`` returns
    is kept until :meth:`remove`. No records, index or file. ``take`` keeps a reference by
    default (no-op hooks); the floors pass the dumper's own snapshot or statistics function."""

    def __init__(self, take=None):
        self.take = take or (lambda t: t)
        self.handles, self.kept = [], []

    def _keep(self, t: torch.Tensor) -> None:
        self.kept.append(self.take(t))

    def _keep_gradient(self, t: torch.Tensor) -> None:
        def keep_all(grad_inputs, grad_outputs):
            for g in grad_outputs:
                if g is not None:
                    self._keep(g)
        if t.grad_fn is not None:
            self.handles.append(t.grad_fn.register_hook(keep_all))
        elif t.requires_grad:
            self.handles.append(t.register_hook(self._keep))

    def _keep_call(self, values) -> None:
        for t in values:
            if isinstance(t, torch.Tensor):
                self._keep(t)
                self._keep_gradient(t)

    def register(self, model: nn.Module) -> None:
        def pre(module, args, kwargs):
            self._keep_call((*args, *kwargs.values()))

        def post(module, args, kwargs, out):
            self._keep_call(out if isinstance(out, (tuple, list)) else (out,))
        for m in model.modules():
            self.handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(post, with_kwargs=True))

    def remove(self) -> list:
        """Remove the hooks; returns what was kept."""
        for h in self.handles:
            h.remove()
        kept, self.handles, self.kept = self.kept, [], []
        return kept


def batched_statistics(snapshots: list[Snapshot]) -> list[tuple]:
    """The dumper's statistics (min, max, float64 sum and sum of squares, zero count) of
    snapshots of finite float tensors, computed per group of equal size as 2-D numpy
    reductions: the cheapest eager way to reduce many small tensors (a floor, not the
    dumper's code: no NaN/Inf counts, float32/float64 only)."""
    groups: dict[tuple, list[np.ndarray]] = {}
    for snapshot in snapshots:
        a = snapshot.wait().numpy().reshape(-1)  # CUDA: once the copy has landed
        groups.setdefault((a.dtype, a.size), []).append(a)
    out = []
    for (_, size), arrays in groups.items():
        x = np.stack(arrays)
        lo, hi, zeros = x.min(1), x.max(1), size - np.count_nonzero(x, axis=1)
        wide = x.astype(np.float64)
        total = wide.sum(1)
        sumsq = np.multiply(wide, wide, out=wide).sum(1)
        for row in zip(lo.tolist(), hi.tolist(), total.tolist(), sumsq.tolist(), zeros.tolist()):
            out.append(stats_from_sums(*row[:4], size, 0.0, 0.0, float(row[4])))
    return out


def step_fn(model, batch, opt):
    def step():
        out = model(batch)
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return step


def plain_writer(pieces: list[int], path: Path):
    """A function writing pieces of these sizes to ``path`` with plain buffered writes (a new
    file each time, as a dump step is)."""
    blobs = [np.random.bytes(n) for n in pieces]

    def write() -> None:
        with open(path, "wb") as f:
            for blob in blobs:
                f.write(blob)
    return write


def hdf5_writer(shapes: list[tuple], path: Path):
    """A function writing datasets of these shapes to ``path`` with the dumper's own dataset
    path (file options, low-level group), four per call group, and nothing else: no hooks,
    records or index."""
    arrays = [np.ones(s, np.float32) for s in shapes]  # touched pages: zeros would fault lazily

    def write() -> None:
        with h5py.File(path, "w", **FILE_OPTIONS) as f:
            datasets = LowLevelGroup(f)
            for i, a in enumerate(arrays):
                datasets.write(f"{i // 4:05d}", f"d{i % 4}", a)
            datasets.close()
    return write


def step_file_writer(model: nn.Module, n_rows: int, directory: Path):
    """A function writing a step file as the dumper does (its writer thread, root attributes,
    an index of ``n_rows`` statistics rows, atomic publication) without datasets: the cost of
    one file per step, which every mode pays."""
    attrs = run_attrs(model, 0, 0, "stats")
    call = CallInfo(0, "0.lin", "Linear", 0, mode="stats")
    names = iter(range(10 ** 9))

    def write() -> None:
        writer = StepWriter(StepClaim(directory / f"file-{next(names)}.hdf5"), "step", attrs,
                            lambda r: None)
        for i in range(n_rows):
            writer.submit(Record(i, call, "output", 0, "output", torch.float32, (32, 64),
                                 torch.device("cpu"), True, "ok", stats=(0.0,) * 8))
        writer.finish().unlink()
    return write


SENTINEL = "NaN/Inf sentinel (not dumped)"  # on_nonfinite="raise", outside the dump window
FULL_OPS, STATS_OPS = "full tensors + ops", "statistics + ops"  # ops="*" (issue 21)
HASH = "hash"  # mode="hash" (issue 21)


def paired_ratios(timed, plain, other, rounds: int) -> list[float]:
    """``other`` over ``plain``, one ratio per round of four steps run plain, other, other,
    plain (each side sees the same load and the same position in the round)."""
    ratios = []
    for _ in range(rounds):
        a, b, c, d = timed(plain), timed(other), timed(other), timed(plain)
        ratios.append((b + c) / (a + d))
    return ratios


def bench_model(name: str, factory, repeat: int, device: str, tmp: Path,
                paired_rounds: int) -> list[dict]:
    torch.manual_seed(0)
    model, batch = factory()
    model, batch = model.to(device), batch.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    step = step_fn(model, batch, opt)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    dumpers = {
        "outside window": HookerAndDumper(tmp / "outside", steps=[10 ** 9]),
        "full tensors": HookerAndDumper(tmp / "full"),
        "statistics": HookerAndDumper(tmp / "stats", mode="stats"),
        HASH: HookerAndDumper(tmp / "hash", mode="hash"),
        SENTINEL: HookerAndDumper(tmp / "sentinel", steps=[10 ** 9], on_nonfinite="raise"),
        FULL_OPS: HookerAndDumper(tmp / "full_ops", ops="*"),
        STATS_OPS: HookerAndDumper(tmp / "stats_ops", mode="stats", ops="*"),
    }
    naive = NaiveDumper(tmp / "naive.hdf5")

    def timed(run) -> float:
        sync()
        start = time.perf_counter()
        run()
        sync()
        return time.perf_counter() - start

    steps = iter(range(10 ** 9))

    def with_dumper(d):
        def run():
            d.register_hooks(model, 0, next(steps))
            step()
            d.remove_hooks()
        return run

    def clean() -> None:
        """Between timed runs: remove earlier step files. A step file is always a new name in
        real use; replacing an existing one makes ext4 flush it (auto_da_alloc), which a
        benchmark reusing names would measure instead of the dumper."""
        for d in dumpers.values():
            d.wait()  # a step published in the background must not overlap the next timed run
            for path in d.written_files:
                path.unlink(missing_ok=True)
            d.written_files.clear()
        for path in (tmp / "naive.hdf5", tmp / "plain.bin", tmp / "floor.hdf5"):
            path.unlink(missing_ok=True)

    pool = SnapshotPool(1 << 32)
    floors = {"no-op hooks": (FloorHooks(), None),
              "copying hooks": (FloorHooks(pool.take), None),
              "statistics hooks": (FloorHooks(tensor_stats), None),
              "digest hooks": (FloorHooks(tensor_digest), None),
              "copying hooks + batched statistics": (FloorHooks(pool.take), batched_statistics)}

    def with_hooks(hooks, after=None):
        """A step with ``hooks`` (the naive reference or floor hooks) registered; ``after``
        gets what the floor hooks kept."""
        def run():
            hooks.register(model)
            step()
            kept = hooks.remove() or []
            if after is not None:
                after(kept)
            for snapshot in kept:
                if isinstance(snapshot, Snapshot):
                    snapshot.release()
        return run

    runs = {"plain": step, **{k: with_dumper(d) for k, d in dumpers.items()},
            "naive reference": with_hooks(naive),
            **{k: with_hooks(*hooks) for k, hooks in floors.items()}}
    for run in runs.values():  # warm-up (allocator, pools, files)
        timed(run)
    for d in dumpers.values():  # steps published in the background (on an accelerator)
        d.wait()
    full = load_dump(dumpers["full tensors"].written_files[-1]).index
    stored = full[full["dataset"] != ""]
    sizes = [int(np.prod(s)) * 4 for s in stored["shape"]]  # float32 models
    n_tensors = len(stored)
    n_stats = int(load_dump(dumpers["statistics"].written_files[-1]).index["stat_nan"].notna().sum())
    with_ops = load_dump(dumpers[FULL_OPS].written_files[-1]).index
    n_ops = int(((with_ops["dataset"] != "") & with_ops["module"].str.contains("/")).sum())
    clean()
    write_plain = plain_writer(sizes, tmp / "plain.bin")
    write_hdf5 = hdf5_writer(list(stored["shape"]), tmp / "floor.hdf5")
    runs["I/O limit"] = lambda: (step(), write_plain())
    runs["HDF5 limit"] = lambda: (step(), write_hdf5())
    runs["step file"] = step_file_writer(model, len(full), tmp)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeat):  # interleaved: every mode sees the same load and page-cache state
        for key, run in runs.items():
            times[key].append(timed(run))
            clean()
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = med["HDF5 limit"] - med["plain"]
    idle = dumpers["outside window"]
    start = time.perf_counter()
    for i in range(1000):  # the window check alone, far below the step-time noise
        idle.register_hooks(model, 0, i)
        idle.remove_hooks()
    idle_cost = (time.perf_counter() - start) / 1000
    limit = med["I/O limit"]
    rows = []
    for key in [k for k in runs if k not in ("I/O limit", "HDF5 limit", "step file")]:
        n = {"plain": None, "outside window": None, SENTINEL: None, "statistics": n_stats,
             HASH: n_stats,
             "statistics hooks": n_stats, "copying hooks + batched statistics": n_stats,
             "digest hooks": n_stats,
             FULL_OPS: n_ops, STATS_OPS: n_ops}.get(key, n_tensors)
        # an ops row's cost per tensor is per op record: over the same mode without ops
        base = {FULL_OPS: "full tensors", STATS_OPS: "statistics"}.get(key, "plain")
        rows.append({
            "model": name, "mode": key, "n": n, "ms": med[key] * 1e3,
            "ratio": med[key] / med["plain"],
            "bytes": {"full tensors": sum(sizes), "naive reference": sum(sizes)}.get(key, 0),
            "us_per_tensor": (med[key] - med[base]) / n * 1e6 if n else float("nan"),
            "vs_io_limit": med[key] / limit if key == "full tensors" else float("nan"),
        })
    rows.append({"model": name, "mode": f"I/O limit ({n_tensors} tensors)", "ms": limit * 1e3,
                 "ratio": limit / med["plain"], "bytes": sum(sizes),
                 "us_per_tensor": (limit - med["plain"]) / n_tensors * 1e6, "vs_io_limit": 1.0})
    rows.append({"model": name, "mode": "HDF5 floor (datasets only)", "ms": floor * 1e3,
                 "ratio": float("nan"), "bytes": sum(sizes),
                 "us_per_tensor": floor / n_tensors * 1e6, "vs_io_limit": float("nan")})
    rows.append({"model": name, "mode": "outside window, direct (us/call)", "ms": idle_cost * 1e3,
                 "ratio": (med["plain"] + idle_cost) / med["plain"], "bytes": 0,
                 "us_per_tensor": idle_cost * 1e6, "vs_io_limit": float("nan")})
    rows.append({"model": name, "mode": f"step file (index of {len(full)} rows)",
                 "ms": med["step file"] * 1e3, "ratio": float("nan"), "bytes": 0,
                 "us_per_tensor": med["step file"] / n_tensors * 1e6, "vs_io_limit": float("nan")})
    for key in (SENTINEL, "no-op hooks"):  # a <= 1.1x target needs a finer measurement
        ratios = sorted(paired_ratios(timed, step, runs[key], paired_rounds))
        rows.append({"model": name, "mode": f"{key}, paired", "ms": float("nan"),
                     "ratio": statistics.median(ratios), "bytes": 0,
                     "us_per_tensor": float("nan"), "vs_io_limit": float("nan"),
                     "quartiles": (ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4])})
        clean()
    speedup = med["naive reference"] / med["full tensors"]
    rows.append({"model": name, "mode": f"full vs naive: {speedup:.1f}x faster", "ms": float("nan"),
                 "ratio": float("nan"), "bytes": 0, "us_per_tensor": float("nan"),
                 "vs_io_limit": float("nan")})
    return rows


class KernelCount(TorchDispatchMode):
    """Counts the ATen ops that launch work (not views, not detach) dispatched while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func in (torch.ops.aten.detach.default,
                                         torch.ops.aten.lift_fresh.default)):
            self.count += 1
        return func(*args, **(kwargs or {}))


def device_path_counts(name: str, factory, device: str, tmp: Path) -> list[str]:
    """Kernels per captured tensor and host syncs of one dumped step, per mode (see the module
    docstring); on the CPU every tensor is forced through the device path."""
    import dumper.arena
    import dumper.hooker
    import dumper.record
    batches = []

    class Counted(dumper.arena.StepBatch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            batches.append(self)
    patched = {(dumper.hooker, "StepBatch"): Counted}
    if device == "cpu":
        patched[(dumper.record, "on_device")] = lambda t: True
    saved = {key: getattr(*key) for key in patched}
    for (module, attr), value in patched.items():
        setattr(module, attr, value)
    torch.manual_seed(0)
    model, batch = factory()
    model, batch = model.to(device), batch.to(device)
    step = step_fn(model, batch, torch.optim.SGD(model.parameters(), lr=1e-4))
    lines = []
    try:
        step()
        with KernelCount() as plain:
            step()
        for mode in ("tensors", "stats", "hash"):
            d = HookerAndDumper(tmp / f"device-{mode}", mode=mode)
            with d.hooks(model, 0, 0):  # warm-up (allocator, sign tables)
                step()
            with KernelCount() as counted:
                d.register_hooks(model, 0, 1)
                step()
                d.remove_hooks()
            d.close()
            index = load_dump(d.written_files[-1]).index
            captured = int(((index["dataset"] != "") | index["stat_norm"].notna()
                            | (index["digest"] != -1)).sum())
            lines.append(f"  {name:<12} {mode:<8} {captured:5d} tensors  "
                         f"{(counted.count - plain.count) / captured:5.2f} kernels per tensor  "
                         f"{batches[-1].host_syncs} host sync(s) per step")
    finally:
        for (module, attr), value in saved.items():
            setattr(module, attr, value)
    return lines


def publishing_lines(name: str, factory, device: str, tmp: Path, steps: int = 10) -> list[str]:
    """Every step dumped, ``steps`` steps, publish="wait" against "background", over plain."""
    torch.manual_seed(0)
    model, batch = factory()
    model, batch = model.to(device), batch.to(device)
    step = step_fn(model, batch, torch.optim.SGD(model.parameters(), lr=1e-4))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    counter = iter(range(10 ** 9))

    def run(publish: Optional[str]) -> float:
        d = HookerAndDumper(tmp / f"publish-{next(counter)}", mode="stats",
                            publish=publish or "wait")
        sync()
        start = time.perf_counter()
        for i in range(steps):
            if publish:
                d.register_hooks(model, 0, i)
            step()
            if publish:
                d.remove_hooks()
        d.close()
        sync()
        return (time.perf_counter() - start) / steps
    times: dict[Optional[str], list[float]] = {None: [], "wait": [], "background": []}
    for _ in range(3):
        for publish in times:
            times[publish].append(run(publish))
    med = {k: statistics.median(v) for k, v in times.items()}
    return [f"  {name:<12} statistics every step: wait {med['wait'] / med[None]:.2f}x plain, "
            f"background {med['background'] / med[None]:.2f}x plain"]


def target_lines(rows: list[dict], device: str) -> list[str]:
    """Issue 4's targets with this run's figures, the floor each has on this machine and the
    verdict. A floor adds up, from the same run, the work any dumper must do here to keep its
    promises (see docs/benchmarks.md): hooks on every call, snapshots taken at hook time
    (copying hooks: the dumper's reused buffers) or the statistics (the cheaper of computing
    them in the hooks and batching them over snapshots) or the digests (hash mode), the datasets
    through HDF5, one step file with its index. The parts are timed one after another; a target whose floor already
    misses it is out of reach here."""
    row = {(r["model"], r["mode"].split(" (")[0]): r for r in rows}
    lines = []

    def add(model: str, what: str, value: float, floor: float, target: float, unit: str,
            at_least: bool = False) -> None:
        meets = (lambda v: v >= target) if at_least else (lambda v: v <= target)
        verdict = ("met" if meets(value) else "not met" if meets(floor)
                   else "out of reach here (the floor misses it)")
        goal = f"{'>=' if at_least else '<='} {target:g}{unit}"
        lines.append(f"{model:<12} {what:<25} {f'{value:.2f}{unit}':>12} {goal:>12} "
                     f"{f'{floor:.2f}{unit}':>12}  {verdict}")

    for model in dict.fromkeys(r["model"] for r in rows):
        ms = {mode: r["ms"] for (m, mode), r in row.items() if m == model}
        n_tensors, n_stats = row[(model, "full tensors")]["n"], row[(model, "statistics")]["n"]
        plain, limit, file = ms["plain"], ms["I/O limit"], ms["step file"]
        full_floor = ms["copying hooks"] + ms["HDF5 floor"] + file
        stats_floor = min(ms["statistics hooks"],
                          ms["copying hooks + batched statistics"]) + file
        add(model, "outside window", row[(model, "outside window, direct")]["ratio"], 1.0, 1.02,
            "x")
        for mode, base in ((FULL_OPS, "full tensors"), (STATS_OPS, "statistics")):
            if row[(model, mode)]["n"]:  # issue 21: an op record costs no more than a module's
                add(model, f"{base}: op record", row[(model, mode)]["us_per_tensor"], 0.0,
                    row[(model, base)]["us_per_tensor"], " us")
        add(model, "full vs naive", ms["naive reference"] / ms["full tensors"],
            ms["naive reference"] / max(limit, full_floor), 5, "x", at_least=True)
        hash_floor = ms["digest hooks"] + file
        if model in ("mlp", "cnn"):  # issue 21: hash mode <= 1.15x plain
            add(model, "hash", ms[HASH] / plain, hash_floor / plain, 1.15, "x")
        elif model == "deep":  # and <= 15 us per tensor
            add(model, "hash", row[(model, HASH)]["us_per_tensor"],
                (hash_floor - plain) / n_stats * 1e3, 15, " us")
        if model in ("mlp", "cnn"):  # the issue's ratio targets
            add(model, "full tensors / I/O limit", ms["full tensors"] / limit,
                full_floor / limit, 1.15, "")
            add(model, "statistics", ms["statistics"] / plain, stats_floor / plain, 1.25, "x")
        elif model == "deep":  # the issue's per-tensor targets
            add(model, "full tensors", row[(model, "full tensors")]["us_per_tensor"],
                (full_floor - plain) / n_tensors * 1e3, 60, " us")
            add(model, "statistics", row[(model, "statistics")]["us_per_tensor"],
                (stats_floor - plain) / n_stats * 1e3, 30, " us")
        if device.startswith("cuda"):  # issue 23's accelerator targets
            add(model, "GPU: full / copies floor", ms["full tensors"] / ms["copying hooks"],
                1.0, 1.3, "x")
            if model == "deep":
                add(model, "GPU: statistics", row[(model, "statistics")]["us_per_tensor"],
                    (stats_floor - plain) / n_stats * 1e3, 20, " us")
            elif model in ("mlp", "cnn", "transformer"):
                add(model, "GPU: statistics", ms["statistics"] / plain, stats_floor / plain,
                    1.3, "x")
    return lines


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def memory_child(limit_mb: int, steps: int, trim: bool) -> None:
    """One long CNN dump; prints the peak RSS growth over a plain step's peak, and how much
    larger the process stays after the last step (dumper still open) and after ``close()``.
    ``trim=False`` measures what the process would keep without giving freed memory back;
    ``limit_mb=0`` runs the same steps without a dumper (the control)."""
    import gc
    import json
    import dumper.hooker
    import dumper.writer
    if not trim:
        dumper.hooker.trim_heap = dumper.writer.trim_heap = lambda: False
    torch.manual_seed(0)
    model, batch = models("cpu")["cnn"]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    step = step_fn(model, batch, opt)
    step()
    base_peak, base = rss_mb("VmHWM"), rss_mb("VmRSS")
    with tempfile.TemporaryDirectory(prefix="bench_dump_mem_") as tmp:
        d = HookerAndDumper(tmp, max_bytes_in_flight=max(limit_mb, 1) << 20, steps=range(steps))
        for i in range(steps + 1):  # the last step is outside the window
            if limit_mb:
                d.register_hooks(model, 0, i)
            step()
            if limit_mb:
                d.remove_hooks()
                for path in d.written_files:
                    path.unlink()
                d.written_files.clear()
            if i == steps - 1:
                peak, open_after = rss_mb("VmHWM") - base_peak, rss_mb("VmRSS") - base
        between = rss_mb("VmRSS") - base
        d.close()
        del d
        gc.collect()
    print(json.dumps({"limit_mb": limit_mb, "trim": trim, "peak_mb": peak,
                      "open_mb": open_after, "between_mb": between,
                      "closed_mb": rss_mb("VmRSS") - base}))


def memory_table(steps: int) -> None:
    import json
    import subprocess
    print(f"\nRSS during and after a {steps}-step CNN dump (~154 MB per step), over a plain "
          f"step's (peak: VmHWM; the rest: VmRSS):")
    print(f"  {'max_bytes_in_flight':<20} {'give back':<10} {'peak +MB':>9} "
          f"{'after last step':>16} {'after next step':>16} {'after close':>12}")
    for limit, trim in ((0, True), (32, True), (128, True), (512, True), (128, False),
                        (512, False)):
        out = subprocess.run([sys.executable, __file__, "--memory-child", str(limit), str(steps),
                              str(int(trim))], check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        limit_text = f"{r['limit_mb']} MiB" if r["limit_mb"] else "no dumper"
        print(f"  {limit_text:<20} {'yes' if r['trim'] else 'no':<10} "
              f"{r['peak_mb']:9.0f} {r['open_mb']:16.0f} {r['between_mb']:16.0f} "
              f"{r['closed_mb']:12.0f}")


def main() -> None:
    # the naive reference's full backward hooks warn on the first module (its input needs no grad)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--models", default="mlp,cnn,deep,transformer,llama")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--paired-rounds", type=lambda v: max(1, int(v)), default=40,
                        help="rounds of the paired sentinel and no-op-hooks measurement (>= 1)")
    parser.add_argument("--memory-steps", type=int, default=20)
    parser.add_argument("--memory-child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        limit, steps, trim = args.memory_child
        memory_child(limit, steps, bool(trim))
        return
    factories = models(args.device)
    all_rows = []
    print(f"device {args.device}, torch {torch.__version__}, median of {args.repeat} rounds")
    print(f"{'model':<12} {'mode':<36} {'step ms':>9} {'x plain':>8} {'MB/step':>8} "
          f"{'us/tensor':>10} {'x I/O limit':>12}")
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bench_dump_{name}_") as tmp:
            for r in bench_model(name, factories[name], args.repeat, args.device, Path(tmp),
                                 args.paired_rounds):
                all_rows.append(r)
                fmt = lambda v, spec: "-" if v != v else format(v, spec)  # noqa: E731
                print(f"{r['model']:<12} {r['mode']:<36} {fmt(r['ms'], '9.3f')} "
                      f"{fmt(r['ratio'], '8.4f')} {r['bytes'] / 1e6:8.1f} "
                      f"{fmt(r['us_per_tensor'], '10.1f')} {fmt(r['vs_io_limit'], '12.2f')}",
                      flush=True)
    print("\ntargets (issues 4 and 23; deep model against another checkout: "
          "scripts/bench_dump_ab.py); floor: the least this machine allows, from this run's floor rows "
          "(for 'full vs naive': the best speed-up it allows)")
    print(f"{'model':<12} {'target':<25} {'measured':>12} {'target':>12} {'floor':>12}  verdict")
    print("\n".join(target_lines(all_rows, args.device)))
    print(f"\nNaN/Inf sentinel on every step (issue 12; target <= 1.1x plain on mlp, cnn), "
          f"paired rounds (plain, other, other, plain) x {args.paired_rounds}: median "
          f"(quartiles) of the rounds' ratios; no-op hooks: what any hooks cost")
    paired = {(r["model"], r["mode"]): r for r in all_rows if "quartiles" in r}
    for name in args.models.split(","):
        sentinel, noop = paired[name, f"{SENTINEL}, paired"], paired[name, "no-op hooks, paired"]
        print(f"  {name:<12} sentinel {sentinel['ratio']:.3f}x plain "
              f"({sentinel['quartiles'][0]:.3f}-{sentinel['quartiles'][1]:.3f}), no-op hooks "
              f"{noop['ratio']:.3f}x ({noop['quartiles'][0]:.3f}-{noop['quartiles'][1]:.3f})")
    print(f"\naccelerator path (issue 23) on {args.device}"
          f"{' (every tensor forced through it)' if args.device == 'cpu' else ''}:")
    with tempfile.TemporaryDirectory(prefix="bench_dump_device_") as tmp:
        for name in args.models.split(","):
            print("\n".join(device_path_counts(name, factories[name], args.device, Path(tmp))))
    print("\npublishing (issue 23): every step dumped, per step over a plain one")
    with tempfile.TemporaryDirectory(prefix="bench_dump_publish_") as tmp:
        for name in args.models.split(","):
            print("\n".join(publishing_lines(name, factories[name], args.device, Path(tmp))))
    if args.memory_steps:
        memory_table(args.memory_steps)


if __name__ == "__main__":
    main()

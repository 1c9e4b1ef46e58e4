"""Benchmark: compare_dumps throughput against simply reading every dataset with h5py.

    python scripts/bench_compare.py [--size-mb 512] [--repeat 3] [--jobs 1] [--no-sharded]
                                    [--no-dask]

Builds two one-step dumps per layout (many small tensors; a few large ones) of about --size-mb
each, B = A with noise, then times, side by side in the same run, (1) reading every dataset of
both files with h5py and (2) compare_dumps on them; each measurement in a fresh subprocess, which
reports its peak resident memory. Prints throughput, the ratio compare/read (target >= 0.5) and
peak RSS (target: independent of tensor size).

Issue 22, also in the same rounds: (3) a 4-rank dump of the same tensors, each rank holding a
quarter of each (dim 0, marked with mark_sharded; written by 4 gloo processes), against the
one-process B: sharded tensors put together (target: within 1.3x of (2)'s time, the same memory
bound); (4) compare_dumps on a Dask LocalCluster of 1 and of 2 worker processes (one thread
each) on the many-small layout, the cluster started and warmed up before the clock (target: 2
workers >= 1.6x faster than 1 on this 2-core machine).

Issue 20, also in the same rounds: (5) the pass that recomputes calls from their own records
(``compare.recompute``) on a real model's dumps of about --size-mb: two Linears, a ReLU and
a LayerNorm on a (batch, 512, 1024) input; two 3x3 convolutions (one grouped), a ReLU and a
BatchNorm2d on a (batch, 64, 56, 56) input; A float32 with ``params=True``, B under bfloat16
autocast; compare_dumps with the pass and without it (target: time within 1.5x, peak memory
unchanged: a large call is recomputed on a sample of its rows).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def peak_rss_mb() -> float:
    """This process's peak resident memory, or its largest finished child's (a process
    pool's worker) where more."""
    import resource
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return max(int(line.split()[1]) / 1024, children)
    return float("nan")


def build(directory: Path, n_tensors: int, elements: int, noise: float) -> None:
    import torch
    from dumper import HookerAndDumper

    class Emit(torch.nn.Module):
        def forward(self, i):
            g = torch.Generator().manual_seed(int(i))
            t = torch.randn(elements, generator=g)
            return t + noise * torch.randn(elements) if noise else t

    model = torch.nn.ModuleList([Emit() for _ in range(n_tensors)])
    dumper = HookerAndDumper(directory, kinds=["output"])
    with dumper.hooks(model, 0, 0):
        for i, m in enumerate(model):
            m(i)


# (5)'s models: name, (model, one sample's shape), built with torch imported
RECOMPUTED_MODELS = {
    "Linear, ReLU, Linear, LayerNorm": lambda nn: (nn.Sequential(
        nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.LayerNorm(1024)),
        (512, 1024)),
    "3x3 Conv2d, ReLU, grouped 3x3 Conv2d, BatchNorm2d": lambda nn: (nn.Sequential(
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1, groups=4),
        nn.BatchNorm2d(64)), (64, 56, 56)),
}


def build_model_pair(directory: Path, size_mb: int, name: str) -> None:
    """(5): A (float32, weights' values) and B (bfloat16 autocast) of one training step of a
    model whose calls the recomputation pass knows (``RECOMPUTED_MODELS``), about ``size_mb``
    per side."""
    import math
    import torch
    from torch import nn
    from dumper import HookerAndDumper

    torch.manual_seed(0)
    model, sample = RECOMPUTED_MODELS[name](nn)
    batch = max(1, size_mb * (1 << 20) // (20 * 4 * math.prod(sample)))  # ~20 records a side
    x = torch.randn(batch, *sample)
    for side, autocast in (("a", False), ("b", True)):
        with HookerAndDumper(directory / side, params=not autocast).hooks(model, 0, 0):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = model(x)
            y.float().pow(2).mean().backward()
        model.zero_grad()


def build_rank(directory: Path, n_tensors: int, elements: int) -> None:
    """One rank of the sharded dump: a quarter (dim 0) of each tensor ``build`` makes."""
    import datetime
    import torch
    import torch.distributed as dist
    from dumper import HookerAndDumper
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()

    class Emit(torch.nn.Module):
        def forward(self, i):
            t = torch.randn(elements, generator=torch.Generator().manual_seed(int(i)))
            return t.chunk(world)[rank].clone()

    model = torch.nn.ModuleList([Emit() for _ in range(n_tensors)])
    dumper = HookerAndDumper(directory, kinds=["output"])
    dumper.mark_sharded("*", "output", dim=0)
    with dumper.hooks(model, 0, 0):
        for i, m in enumerate(model):
            m(i)
    dist.destroy_process_group()


def build_sharded(directory: Path, n_tensors: int, elements: int, world: int = 4) -> None:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--build-rank", str(directory),
                               str(n_tensors), str(elements)], env=dict(env, RANK=str(r)))
             for r in range(world)]
    try:
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError("a rank of the sharded dump failed")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def child(mode: str, a: str, b: str, jobs: int) -> None:
    """Time one measurement; imports happen before the clock starts."""
    import h5py
    from compare import compare_dumps
    compare_dumps.__doc__  # resolve the lazy import now
    import pandas  # noqa: F401  (loaded before the clock starts, as h5py and compare are)
    client = None
    if mode.startswith("dask"):
        import logging
        from distributed import Client, LocalCluster
        cluster = LocalCluster(n_workers=int(mode[4:]), threads_per_worker=1, processes=True,
                               dashboard_address=None, silence_logs=logging.ERROR)
        client = Client(cluster)
        compare_dumps(a, b, client=client, steps=["0"])  # warm up: workers import compare
    if mode == "without-recompute":  # (5): the same comparison, the recomputation pass left out
        import compare.comparison
        compare.comparison.measure_recomputed = lambda *args: {}
    start = time.perf_counter()
    nbytes = 0
    if mode == "read":
        for path in (a, b):
            for name in sorted(os.listdir(path)):
                with h5py.File(os.path.join(path, name), "r") as f:
                    def visit(_, obj):
                        nonlocal nbytes
                        if isinstance(obj, h5py.Dataset) and obj.name.rsplit("/", 1)[-1] != "index":
                            nbytes += obj[()].nbytes
                    f.visititems(visit)
    else:
        result = compare_dumps(a, b, jobs=jobs, client=client)
        nbytes = int(sum(result["numel"].fillna(0)) * 4 * 2)
    print(json.dumps({"seconds": time.perf_counter() - start, "bytes": nbytes,
                      "peak_rss_mb": peak_rss_mb()}))


def measure(mode: str, a: Path, b: Path, jobs: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(a), str(b), str(jobs)],
                         check=True, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--no-sharded", action="store_true", help="skip (3)")
    parser.add_argument("--no-dask", action="store_true", help="skip (4)")
    parser.add_argument("--no-recompute", action="store_true", help="skip (5)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--build-rank", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, a, b, jobs = args.child
        child(mode, a, b, int(jobs))
        return
    if args.build_rank:
        directory, n, elements = args.build_rank
        build_rank(Path(directory), int(n), int(elements))
        return
    sys.path.insert(0, str(ROOT))
    total = args.size_mb * (1 << 20) // 4
    layouts = {"many small (2048 tensors)": (2048, total // 2048),
               "few large (4 tensors)": (4, total // 4)}
    print(f"dumps of ~{args.size_mb} MiB per side, float32, median of {args.repeat}, "
          f"jobs={args.jobs}")
    print(f"{'layout':<28} {'read MB/s':>10} {'compare MB/s':>13} {'ratio':>6} "
          f"{'read RSS MB':>12} {'compare RSS MB':>15}")
    extra = []  # the lines of (3) and (4), printed after the table
    with tempfile.TemporaryDirectory(prefix="bench_compare_") as tmp:
        for name, (n, elements) in layouts.items():
            a, b = Path(tmp, name[:4], "a"), Path(tmp, name[:4], "b")
            build(a, n, elements, 0.0)
            build(b, n, elements, 1e-6)
            sharded = Path(tmp, name[:4], "sharded")
            modes = ["read", "compare"]
            if not args.no_sharded:
                build_sharded(sharded, n, elements)
                modes.append("sharded")
            if not args.no_dask and n > 4:
                modes += ["dask1", "dask2"]
            runs: dict[str, list] = {mode: [] for mode in modes}
            for _ in range(args.repeat):  # interleaved, so all see the same machine load
                for mode in modes:
                    runs[mode].append(measure(mode, sharded if mode == "sharded" else a, b,
                                              args.jobs))
            mbs = {mode: statistics.median(r["bytes"] / r["seconds"] for r in rs) / 1e6
                   for mode, rs in runs.items()}
            rss = {mode: max(r["peak_rss_mb"] for r in rs) for mode, rs in runs.items()}
            print(f"{name:<28} {mbs['read']:>10.0f} {mbs['compare']:>13.0f} "
                  f"{mbs['compare'] / mbs['read']:>6.2f} {rss['read']:>12.0f} "
                  f"{rss['compare']:>15.0f}")
            if "sharded" in mbs:
                extra.append(f"{name}: 4-rank sharded vs one process {mbs['sharded']:.0f} MB/s, "
                             f"time {mbs['compare'] / mbs['sharded']:.2f}x the unsharded "
                             f"compare's (target <= 1.3x), peak RSS {rss['sharded']:.0f} MB "
                             f"(unsharded {rss['compare']:.0f} MB)")
            if "dask2" in mbs:
                extra.append(f"{name}: Dask LocalCluster 1 worker {mbs['dask1']:.0f} MB/s, 2 "
                             f"workers {mbs['dask2']:.0f} MB/s: speed-up "
                             f"{mbs['dask2'] / mbs['dask1']:.2f}x (target >= 1.6x); local "
                             f"jobs={args.jobs} {mbs['compare']:.0f} MB/s")
        if not args.no_recompute:
            for number, name in enumerate(RECOMPUTED_MODELS):
                recompute_line(Path(tmp, f"model{number}"), name, args)
    for line in extra:
        print(line)


def recompute_line(directory: Path, name: str, args) -> None:
    """(5): compare_dumps with the recomputation pass and without it, interleaved."""
    build_model_pair(directory, args.size_mb, name)
    runs: dict[str, list] = {"compare": [], "without-recompute": []}
    for _ in range(args.repeat):
        for mode in runs:
            runs[mode].append(measure(mode, directory / "a", directory / "b", args.jobs))
    seconds = {mode: statistics.median(r["seconds"] for r in rs) for mode, rs in runs.items()}
    rss = {mode: max(r["peak_rss_mb"] for r in rs) for mode, rs in runs.items()}
    print(f"model dumps ({name}; float32 vs bfloat16 autocast): "
          f"with the recomputation pass {seconds['compare']:.1f} s, peak RSS "
          f"{rss['compare']:.0f} MB; without {seconds['without-recompute']:.1f} s, "
          f"{rss['without-recompute']:.0f} MB: time "
          f"{seconds['compare'] / seconds['without-recompute']:.2f}x (target <= 1.5x)")


if __name__ == "__main__":
    main()

"""Benchmark: compare_dumps throughput against simply reading every dataset with h5py.

    python scripts/bench_compare.py [--size-mb 512] [--repeat 3] [--jobs 1]

Builds two one-step dumps per layout (many small tensors; a few large ones) of about --size-mb
each, B = A with noise, then times, side by side in the same run, (1) reading every dataset of
both files with h5py and (2) compare_dumps on them; each measurement in a fresh subprocess, which
reports its peak resident memory. Prints throughput, the ratio compare/read (target >= 0.5) and
peak RSS (target: independent of tensor size).
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
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
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


def child(mode: str, a: str, b: str, jobs: int) -> None:
    """Time one measurement; imports happen before the clock starts."""
    import h5py
    from compare import compare_dumps
    compare_dumps.__doc__  # resolve the lazy import now
    import pandas  # noqa: F401  (loaded before the clock starts, as h5py and compare are)
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
        result = compare_dumps(a, b, jobs=jobs)
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
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, a, b, jobs = args.child
        child(mode, a, b, int(jobs))
        return
    sys.path.insert(0, str(ROOT))
    total = args.size_mb * (1 << 20) // 4
    layouts = {"many small (2048 tensors)": (2048, total // 2048),
               "few large (4 tensors)": (4, total // 4)}
    print(f"dumps of ~{args.size_mb} MiB per side, float32, median of {args.repeat}, "
          f"jobs={args.jobs}")
    print(f"{'layout':<28} {'read MB/s':>10} {'compare MB/s':>13} {'ratio':>6} "
          f"{'read RSS MB':>12} {'compare RSS MB':>15}")
    with tempfile.TemporaryDirectory(prefix="bench_compare_") as tmp:
        for name, (n, elements) in layouts.items():
            a, b = Path(tmp, name[:4], "a"), Path(tmp, name[:4], "b")
            build(a, n, elements, 0.0)
            build(b, n, elements, 1e-6)
            reads, compares = [], []
            for _ in range(args.repeat):  # interleaved, so both see the same machine load
                reads.append(measure("read", a, b, args.jobs))
                compares.append(measure("compare", a, b, args.jobs))
            read_mbs = statistics.median(r["bytes"] / r["seconds"] for r in reads) / 1e6
            cmp_mbs = statistics.median(r["bytes"] / r["seconds"] for r in compares) / 1e6
            print(f"{name:<28} {read_mbs:>10.0f} {cmp_mbs:>13.0f} {cmp_mbs / read_mbs:>6.2f} "
                  f"{max(r['peak_rss_mb'] for r in reads):>12.0f} "
                  f"{max(r['peak_rss_mb'] for r in compares):>15.0f}")


if __name__ == "__main__":
    main()

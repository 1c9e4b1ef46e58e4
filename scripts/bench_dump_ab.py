"""Benchmark: a dumped step's cost, this checkout against another, measured side by side.

    python scripts/bench_dump_ab.py OTHER [--models deep,mlp,cnn,transformer] [--modes tensors,stats,hash]
                                          [--rounds 3] [--steps 25]

OTHER is another checkout of h5cmp (e.g. ``git worktree add /tmp/base main``). For each round,
model and mode, one fresh process per checkout (alternating, so both see the same machine
load) trains ``--steps`` steps of ``scripts/bench_dump.py``'s model, each a plain step and then
a dumped one (``register_hooks``, the step, ``remove_hooks`` and, where the checkout has it,
``wait()`` for the file: everything the training thread waits for). Prints, per model and mode,
the extra milliseconds of a dumped step over a plain one and per captured tensor, for both
checkouts (median over rounds of each round's median), and their ratio; then the same from each
round's *mean* step, which counts what a median leaves out: the full garbage collections that
come every few dumped steps (what a training run's throughput sees).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHILD = r"""
import json, os, statistics, sys, tempfile, time
tree, name, mode, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, tree)
import dumper  # the checkout under test, before bench_dump puts its own first on the path
sys.path.insert(0, sys.argv[5])
import torch
from bench_dump import models, step_fn
from compare.dump import load_dump
torch.manual_seed(0)
model, batch = models("cpu")[name]()
step = step_fn(model, batch, torch.optim.SGD(model.parameters(), lr=1e-4))
with tempfile.TemporaryDirectory() as tmp:
    d = dumper.HookerAndDumper(tmp, mode=mode)
    wait = getattr(d, "wait", lambda: None)
    plain, dumped = [], []
    for i in range(steps):
        start = time.perf_counter(); step(); plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        d.register_hooks(model, 0, i); step(); path = d.remove_hooks(); wait()
        dumped.append(time.perf_counter() - start)
        if i < steps - 1:
            os.unlink(path)
    index = load_dump(path).index
    captured = int(((index["dataset"] != "") | index["stat_norm"].notna()
                    | (index.get("digest", 0) != 0)).sum())
skip = steps // 5  # warm-up
print(json.dumps({"plain": statistics.median(plain[skip:]),
                  "dumped": statistics.median(dumped[skip:]),
                  "plain_mean": statistics.fmean(plain[skip:]),
                  "dumped_mean": statistics.fmean(dumped[skip:]), "captured": captured}))
"""


def measure(tree: Path, model: str, mode: str, steps: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree), model, mode, str(steps),
                          str(HERE)], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{tree}: {model} {mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("other", type=Path, help="another checkout of h5cmp")
    parser.add_argument("--models", default="deep,mlp,cnn,transformer")
    parser.add_argument("--modes", default="tensors,stats,hash")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args()
    trees = {"this": HERE.parent, "other": args.other.resolve()}
    runs: dict[tuple, list[dict]] = {}
    for _ in range(args.rounds):
        for model in args.models.split(","):
            for mode in args.modes.split(","):
                for label, tree in trees.items():
                    runs.setdefault((model, mode, label), []).append(
                        measure(tree, model, mode, args.steps))
    for average in ("median", "mean"):
        print(f"this checkout ({trees['this']}) against {trees['other']}: extra ms of a dumped "
              f"step over a plain one (median over {args.rounds} rounds of each round's "
              f"{average} of {args.steps} steps), and per captured tensor")
        print(f"{'model':<12} {'mode':<8} {'tensors':>7} {'plain ms':>9} {'this ms':>8} "
              f"{'other ms':>9} {'this us/t':>10} {'other us/t':>11} {'this/other':>11}")
        suffix = "" if average == "median" else "_mean"
        for model in args.models.split(","):
            for mode in args.modes.split(","):
                extra = {label: statistics.median(r["dumped" + suffix] - r["plain" + suffix]
                                                  for r in runs[(model, mode, label)]) * 1e3
                         for label in trees}
                plain = statistics.median(r["plain" + suffix] for label in trees
                                          for r in runs[(model, mode, label)]) * 1e3
                n = runs[(model, mode, "this")][0]["captured"]
                print(f"{model:<12} {mode:<8} {n:>7} {plain:9.2f} {extra['this']:8.2f} "
                      f"{extra['other']:9.2f} {extra['this'] / n * 1e3:10.1f} "
                      f"{extra['other'] / n * 1e3:11.1f} {extra['this'] / extra['other']:11.2f}")


if __name__ == "__main__":
    main()
